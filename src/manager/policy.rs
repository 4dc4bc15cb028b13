//! What differs between the eviction policies, behind one interface: [`EvictionPolicy`],
//! implemented by [`LruPolicy`] (`lru.rs`, vLLM 0.24's LRU), [`RankedLruPolicy`]
//! (`lru_ranked.rs`, vLLM 0.33's LRU) and [`ArcPolicy`] (`arc.rs`, both releases' ARC).
//!
//! The manager owns the slots (their reference counts, protection stamps and entries), the key
//! table and the slot pool; a policy keeps its own order of the slots (and, for ARC, the keys
//! it remembers after their eviction) and is told of every change of a slot's state. The
//! manager holds its policy inline as a [`PolicyImpl`] (no box): each of its methods dispatches
//! once, and a method given many keys loops inside the policy, monomorphic.

use super::arc::ArcPolicy;
use super::keys::KeyTable;
use super::lru::LruPolicy;
use super::lru_ranked::RankedLruPolicy;
use super::pool::SlotPool;
use super::record::NO_POS;
use super::{NO_ID, SlotState, key_at};
use crate::error::Result;
use crate::manager::{Policy, Semantics};

/// A key `prepare_store` stores: its fresh slot, what `resolve` found for it (its manager id
/// and hash), its bytes, and its position in the storing request ([`NO_POS`]: none).
#[derive(Debug, Clone, Copy)]
pub(super) struct NewKey<'k> {
    pub slot: u32,
    pub id: u32,
    pub hash: u64,
    pub key: &'k [u8],
    pub position: u64,
}

/// The keys a `prepare_store` stores: `indices` into its `keys` (`key_len` bytes each), whose
/// hashes and manager ids `resolve` found, and the keys' positions (empty: none).
#[derive(Debug, Clone, Copy)]
pub(super) struct NewKeys<'k> {
    pub indices: &'k [u32],
    pub keys: &'k [u8],
    pub key_len: usize,
    pub hashes: &'k [u64],
    pub ids: &'k [u32],
    pub positions: &'k [u64],
}

/// One eviction policy's side of the manager: the calls a policy answers and the changes of
/// slot state it is told of. Slots are `0..num_slots`; a manager id is a slot, an id beyond the
/// slots that the policy names (ARC's ghosts), or [`NO_ID`].
pub(super) trait EvictionPolicy: Sized {
    /// The most slots the policy can manage (every manager id it hands out stays below
    /// [`NO_ID`]).
    const MAX_SLOTS: usize;

    /// A policy over slots `0..num_slots` with no key; reserves in `keys` the room for the keys
    /// the policy names besides the stored ones. Fails with [`crate::Error::OutOfMemory`].
    fn new(num_slots: usize, keys: &mut KeyTable) -> Result<Self>;

    /// The manager id of key-table entry `e`.
    fn id_of_entry(&self, e: u32) -> u32;

    /// Adds a key to the key table (or takes it back from the policy's memory) for its new,
    /// in-flight slot; returns the key's entry. `rank` is the storing request's rank in the
    /// policy ([`NO_ID`]: none yet), which the policy may take.
    fn insert(&mut self, new: NewKey<'_>, keys: &mut KeyTable, rank: &mut u32) -> u32;

    /// Stores every key of `new` in order, each in a slot from `pool` written to `out`: the
    /// slot records the key's entry and has its store in flight.
    #[inline(always)]
    fn insert_all(
        &mut self,
        new: NewKeys<'_>,
        pool: &mut SlotPool,
        slots: &mut [SlotState],
        keys: &mut KeyTable,
        out: &mut [u32],
        rank: &mut u32,
    ) {
        let kl = new.key_len;
        for (out, &i) in out.iter_mut().zip(new.indices) {
            let slot = pool.alloc();
            let k = NewKey {
                slot,
                id: new.ids[i as usize],
                hash: new.hashes[i as usize],
                key: key_at(new.keys, kl, i),
                position: new.positions.get(i as usize).copied().unwrap_or(NO_POS),
            };
            let entry = self.insert(k, keys, rank);
            slots[slot as usize].start_store(entry);
            *out = slot;
        }
    }

    /// Ready slot `slot` was idle and is now pinned by a load.
    fn on_pinned(&mut self, slot: u32);

    /// Slot `slot` became ready and idle: its store ended, or its last load pin was released.
    fn on_ready(&mut self, slot: u32);

    /// Marks the keys of manager ids `ids` as used, walking them last first (the first ends
    /// most recent); [`NO_ID`] entries are skipped.
    fn touch(&mut self, ids: &[u32], slots: &[SlotState]);

    /// Whether [`Self::on_store_miss`] does anything (its callers collect the misses only
    /// then).
    const OBSERVES_STORE_MISSES: bool = false;

    /// vLLM 0.33 `on_request_access`: a request observes keys for the first time; `ids` are
    /// those of them that are stored and have a position (the manager ids, with their
    /// `positions`: vLLM's access hook changes no other key); `rank` as for [`Self::insert`].
    fn on_request_access(
        &mut self,
        _ids: &[u32],
        _positions: &[u64],
        _rank: &mut u32,
        _keys: &KeyTable,
    ) {
    }

    /// vLLM 0.33 `on_store_miss`: a request offers, for the first time, the absent keys of
    /// manager ids `ids` (a ghost or [`NO_ID`] each) to a store, before that store's eviction.
    fn on_store_miss(&mut self, _ids: &[u32]) {}

    /// vLLM 0.33 `on_request_finished`: the commit of a finished request's keys, `ids` head
    /// to tail with their record flags (`record::INSERTED`, `record::REUSED`); `rank` is the
    /// request's rank ([`NO_ID`]: none), which ends here.
    fn on_request_finished(
        &mut self,
        _ids: &[u32],
        _flags: &[u8],
        _slots: &[SlotState],
        _rank: u32,
    ) {
    }

    /// [`Self::on_request_finished`] of a request whose `keys` recorded keys all have distinct
    /// positions, if the policy can commit it without them (see the 0.33 LRU); false (the
    /// default): nothing changed, call `on_request_finished`.
    fn commit_in_anchor_order(&mut self, _rank: u32, _keys: usize) -> bool {
        false
    }

    /// A count of the changes of the policy's order so far, not 0 once a key was inserted; 0
    /// always if the policy keeps none (it has no [`Self::commit_inserted_tail`]).
    fn order_version(&self) -> u64 {
        0
    }

    /// The first step of [`Self::on_request_finished`] for a request whose last `keys`
    /// recorded keys (the tail of its commit order) are the keys its last store inserted, in
    /// that store's order, none of them reused, when [`Self::order_version`] is still
    /// `version`, the one it had right after that store: commits those keys (the caller
    /// commits the others after) and returns true. False (the default): nothing changed.
    fn commit_inserted_tail(&mut self, _version: u64, _keys: usize) -> bool {
        false
    }

    /// Appends to `out` `n` slots to evict by the policy's rule, among the ready, idle slots not
    /// protected in `epoch`, changing nothing; false when there are fewer.
    fn pick_victims(&self, n: usize, slots: &[SlotState], epoch: u32, out: &mut Vec<u32>) -> bool;

    /// Evicts the picked `victims`: drops or remembers their keys; their slots are then free.
    fn evict(&mut self, victims: &[u32], slots: &mut [SlotState], keys: &mut KeyTable);

    /// Drops occupied slot `slot`'s key (no memory of it kept); the slot is then free.
    fn remove(&mut self, slot: u32, slots: &mut [SlotState], keys: &mut KeyTable);

    /// Forgets every key (the manager clears the key table); every slot is then free.
    fn clear(&mut self, slots: &mut [SlotState]);

    /// Keys the policy remembers beyond the stored ones (entries of the key table).
    fn num_remembered(&self) -> usize;

    /// Checks the policy's lists against the slots: `occupied[s]` for the slots holding a key,
    /// `used` of them, `idle` of them ready and not pinned.
    fn check(
        &self,
        slots: &[SlotState],
        occupied: &[bool],
        used: usize,
        idle: u64,
    ) -> std::result::Result<(), String>;
}

/// The manager's policy, inline (not boxed: every key's step reads it, and there is one per
/// manager).
pub(super) enum PolicyImpl {
    Lru(LruPolicy),
    RankedLru(RankedLruPolicy),
    Arc(ArcPolicy),
}

/// [`EvictionPolicy::OBSERVES_STORE_MISSES`] of `P`.
fn observes_store_misses<P: EvictionPolicy>(_: &P) -> bool {
    P::OBSERVES_STORE_MISSES
}

/// Runs `$body` with `$p` bound to the policy inside `$policy` (compiled once per policy).
macro_rules! dispatch {
    ($policy:expr, $p:ident => $body:expr) => {
        match $policy {
            PolicyImpl::Lru($p) => $body,
            PolicyImpl::RankedLru($p) => $body,
            PolicyImpl::Arc($p) => $body,
        }
    };
}

impl PolicyImpl {
    /// The most slots `policy` can manage in `semantics`.
    pub fn max_slots(policy: Policy, semantics: Semantics) -> usize {
        match (policy, semantics) {
            (Policy::Lru, Semantics::Vllm024) => LruPolicy::MAX_SLOTS,
            (Policy::Lru, Semantics::Vllm033) => RankedLruPolicy::MAX_SLOTS,
            (Policy::Arc, _) => ArcPolicy::MAX_SLOTS,
        }
    }

    /// See [`EvictionPolicy::new`]; ARC of 0.33 falls back to T1 when T2 has no candidate.
    pub fn new(
        policy: Policy,
        semantics: Semantics,
        num_slots: usize,
        keys: &mut KeyTable,
    ) -> Result<Self> {
        Ok(match (policy, semantics) {
            (Policy::Lru, Semantics::Vllm024) => PolicyImpl::Lru(LruPolicy::new(num_slots, keys)?),
            (Policy::Lru, Semantics::Vllm033) => {
                PolicyImpl::RankedLru(RankedLruPolicy::new(num_slots, keys)?)
            }
            (Policy::Arc, s) => {
                let mut arc = ArcPolicy::new(num_slots, keys)?;
                arc.fallback_to_t1 = s == Semantics::Vllm033;
                PolicyImpl::Arc(arc)
            }
        })
    }

    /// See [`EvictionPolicy::id_of_entry`].
    #[inline]
    pub fn id_of_entry(&self, e: u32) -> u32 {
        dispatch!(self, p => p.id_of_entry(e))
    }

    /// Finds every key of `keys` (back to back, with their `hashes`) and appends the manager
    /// id of each, or [`NO_ID`], to `ids`. See [`KeyTable::find_all_hashed`].
    #[inline]
    pub fn find_all(&self, table: &KeyTable, keys: &[u8], hashes: &[u64], ids: &mut Vec<u32>) {
        dispatch!(self, p => table.find_all_hashed(keys, hashes, ids, |e| {
            e.map_or(NO_ID, |e| p.id_of_entry(e))
        }))
    }

    /// See [`EvictionPolicy::insert_all`].
    #[inline(always)]
    pub fn insert_all(
        &mut self,
        new: NewKeys<'_>,
        pool: &mut SlotPool,
        slots: &mut [SlotState],
        keys: &mut KeyTable,
        out: &mut [u32],
        rank: &mut u32,
    ) {
        dispatch!(self, p => p.insert_all(new, pool, slots, keys, out, rank))
    }

    /// See [`EvictionPolicy::on_pinned`].
    #[inline]
    pub fn on_pinned(&mut self, slot: u32) {
        dispatch!(self, p => p.on_pinned(slot))
    }

    /// See [`EvictionPolicy::on_ready`].
    #[inline]
    pub fn on_ready(&mut self, slot: u32) {
        dispatch!(self, p => p.on_ready(slot))
    }

    /// See [`EvictionPolicy::touch`].
    #[inline]
    pub fn touch(&mut self, ids: &[u32], slots: &[SlotState]) {
        dispatch!(self, p => p.touch(ids, slots))
    }

    /// See [`EvictionPolicy::on_request_access`].
    #[inline]
    pub fn on_request_access(
        &mut self,
        ids: &[u32],
        positions: &[u64],
        rank: &mut u32,
        keys: &KeyTable,
    ) {
        dispatch!(self, p => p.on_request_access(ids, positions, rank, keys))
    }

    /// See [`EvictionPolicy::OBSERVES_STORE_MISSES`].
    #[inline]
    pub fn observes_store_misses(&self) -> bool {
        dispatch!(self, _p => observes_store_misses(_p))
    }

    /// See [`EvictionPolicy::on_store_miss`].
    #[inline]
    pub fn on_store_miss(&mut self, ids: &[u32]) {
        dispatch!(self, p => p.on_store_miss(ids))
    }

    /// See [`EvictionPolicy::on_request_finished`].
    pub fn on_request_finished(
        &mut self,
        ids: &[u32],
        flags: &[u8],
        slots: &[SlotState],
        rank: u32,
    ) {
        dispatch!(self, p => p.on_request_finished(ids, flags, slots, rank))
    }

    /// See [`EvictionPolicy::commit_in_anchor_order`].
    #[inline]
    pub fn commit_in_anchor_order(&mut self, rank: u32, keys: usize) -> bool {
        dispatch!(self, p => p.commit_in_anchor_order(rank, keys))
    }

    /// See [`EvictionPolicy::order_version`].
    #[inline]
    pub fn order_version(&self) -> u64 {
        dispatch!(self, p => p.order_version())
    }

    /// See [`EvictionPolicy::commit_inserted_tail`].
    #[inline]
    pub fn commit_inserted_tail(&mut self, version: u64, keys: usize) -> bool {
        dispatch!(self, p => p.commit_inserted_tail(version, keys))
    }

    /// See [`EvictionPolicy::pick_victims`].
    #[inline]
    pub fn pick_victims(
        &self,
        n: usize,
        slots: &[SlotState],
        epoch: u32,
        out: &mut Vec<u32>,
    ) -> bool {
        dispatch!(self, p => p.pick_victims(n, slots, epoch, out))
    }

    /// See [`EvictionPolicy::evict`].
    #[inline]
    pub fn evict(&mut self, victims: &[u32], slots: &mut [SlotState], keys: &mut KeyTable) {
        dispatch!(self, p => p.evict(victims, slots, keys))
    }

    /// See [`EvictionPolicy::remove`].
    #[inline]
    pub fn remove(&mut self, slot: u32, slots: &mut [SlotState], keys: &mut KeyTable) {
        dispatch!(self, p => p.remove(slot, slots, keys))
    }

    /// See [`EvictionPolicy::clear`].
    pub fn clear(&mut self, slots: &mut [SlotState]) {
        dispatch!(self, p => p.clear(slots))
    }

    /// See [`EvictionPolicy::num_remembered`].
    pub fn num_remembered(&self) -> usize {
        dispatch!(self, p => p.num_remembered())
    }

    /// See [`EvictionPolicy::check`].
    pub fn check(
        &self,
        slots: &[SlotState],
        occupied: &[bool],
        used: usize,
        idle: u64,
    ) -> std::result::Result<(), String> {
        dispatch!(self, p => p.check(slots, occupied, used, idle))
    }

    /// The ARC policy, for tests.
    #[cfg(test)]
    pub fn arc_mut(&mut self) -> Option<&mut ArcPolicy> {
        match self {
            PolicyImpl::Arc(a) => Some(a),
            _ => None,
        }
    }

    /// The ARC policy, for tests.
    #[cfg(test)]
    pub fn arc(&self) -> Option<&ArcPolicy> {
        match self {
            PolicyImpl::Arc(a) => Some(a),
            _ => None,
        }
    }

    /// The LRU policy, for tests.
    #[cfg(test)]
    pub fn lru(&self) -> Option<&LruPolicy> {
        match self {
            PolicyImpl::Lru(l) => Some(l),
            _ => None,
        }
    }

    /// The 0.33 LRU policy, for tests.
    #[cfg(test)]
    pub fn ranked_lru(&self) -> Option<&RankedLruPolicy> {
        match self {
            PolicyImpl::RankedLru(l) => Some(l),
            _ => None,
        }
    }
}

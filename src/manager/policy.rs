//! What differs between the eviction policies, behind one interface: [`EvictionPolicy`],
//! implemented by [`LruPolicy`] (`lru.rs`) and [`ArcPolicy`] (`arc.rs`).
//!
//! The manager owns the slots (their reference counts, protection stamps and entries), the key
//! table and the slot pool; a policy keeps its own order of the slots (and, for ARC, the keys
//! it remembers after their eviction) and is told of every change of a slot's state. The
//! manager holds its policy inline as a [`PolicyImpl`] (no box): each of its methods dispatches
//! once, and a method given many keys loops inside the policy, monomorphic.

use super::arc::ArcPolicy;
use super::keys::KeyTable;
use super::lru::LruPolicy;
use super::pool::SlotPool;
use super::{NO_ID, SlotState, key_at};
use crate::error::Result;
use crate::manager::Policy;

/// A key `prepare_store` stores: its fresh slot, what `resolve` found for it (its manager id
/// and hash), and its bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct NewKey<'k> {
    pub slot: u32,
    pub id: u32,
    pub hash: u64,
    pub key: &'k [u8],
}

/// The keys a `prepare_store` stores: `indices` into its `keys` (`key_len` bytes each), whose
/// hashes and manager ids `resolve` found.
#[derive(Debug, Clone, Copy)]
pub(super) struct NewKeys<'k> {
    pub indices: &'k [u32],
    pub keys: &'k [u8],
    pub key_len: usize,
    pub hashes: &'k [u64],
    pub ids: &'k [u32],
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

    /// The key-table entry a free slot records in its [`SlotState::entry`].
    fn free_entry(slot: u32) -> u32;

    /// The manager id of key-table entry `e`.
    fn id_of_entry(&self, e: u32) -> u32;

    /// Adds a key to the key table (or takes it back from the policy's memory) for its new,
    /// in-flight slot; returns the key's entry.
    fn insert(&mut self, new: NewKey<'_>, keys: &mut KeyTable) -> u32;

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
    ) {
        let kl = new.key_len;
        for (out, &i) in out.iter_mut().zip(new.indices) {
            let slot = pool.alloc();
            let k = NewKey {
                slot,
                id: new.ids[i as usize],
                hash: new.hashes[i as usize],
                key: key_at(new.keys, kl, i),
            };
            let entry = self.insert(k, keys);
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
    Arc(ArcPolicy),
}

/// Runs `$body` with `$p` bound to the policy inside `$policy` (compiled once per policy).
macro_rules! dispatch {
    ($policy:expr, $p:ident => $body:expr) => {
        match $policy {
            PolicyImpl::Lru($p) => $body,
            PolicyImpl::Arc($p) => $body,
        }
    };
}

impl PolicyImpl {
    /// The most slots `policy` can manage.
    pub fn max_slots(policy: Policy) -> usize {
        match policy {
            Policy::Lru => LruPolicy::MAX_SLOTS,
            Policy::Arc => ArcPolicy::MAX_SLOTS,
        }
    }

    /// See [`EvictionPolicy::new`].
    pub fn new(policy: Policy, num_slots: usize, keys: &mut KeyTable) -> Result<Self> {
        Ok(match policy {
            Policy::Lru => PolicyImpl::Lru(LruPolicy::new(num_slots, keys)?),
            Policy::Arc => PolicyImpl::Arc(ArcPolicy::new(num_slots, keys)?),
        })
    }

    /// See [`EvictionPolicy::free_entry`].
    #[inline]
    pub fn free_entry(&self, slot: u32) -> u32 {
        match self {
            PolicyImpl::Lru(_) => LruPolicy::free_entry(slot),
            PolicyImpl::Arc(_) => ArcPolicy::free_entry(slot),
        }
    }

    /// See [`EvictionPolicy::id_of_entry`].
    #[inline]
    pub fn id_of_entry(&self, e: u32) -> u32 {
        dispatch!(self, p => p.id_of_entry(e))
    }

    /// Hashes and finds every key of `keys` (back to back) into `hashes` and `ids` (both
    /// replaced): the manager id of each, or [`NO_ID`]. See [`KeyTable::find_all`].
    #[inline]
    pub fn find_all(
        &self,
        table: &KeyTable,
        keys: &[u8],
        hashes: &mut Vec<u64>,
        ids: &mut Vec<u32>,
    ) {
        dispatch!(self, p => table.find_all(keys, hashes, ids, |e| {
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
    ) {
        dispatch!(self, p => p.insert_all(new, pool, slots, keys, out))
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
            PolicyImpl::Lru(_) => None,
        }
    }

    /// The ARC policy, for tests.
    #[cfg(test)]
    pub fn arc(&self) -> Option<&ArcPolicy> {
        match self {
            PolicyImpl::Arc(a) => Some(a),
            PolicyImpl::Lru(_) => None,
        }
    }

    /// The LRU policy, for tests.
    #[cfg(test)]
    pub fn lru(&self) -> Option<&LruPolicy> {
        match self {
            PolicyImpl::Lru(l) => Some(l),
            PolicyImpl::Arc(_) => None,
        }
    }
}

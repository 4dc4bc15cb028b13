//! The offload tier index: which keys are stored in which host slots, their state
//! (store in flight, ready, pinned by loads), and eviction (LRU or ARC).
//!
//! Behaviour follows vLLM's `CPUOffloadingManager` of the release chosen by
//! [`ManagerConfig::semantics`] exactly: 0.24 or 0.33; the same calls give the same answers,
//! slots and evictions. Differences (`docs/design.md` §9): a call that fails with a bad argument
//! changes nothing (vLLM asserts half-way), and duplicate keys in one `prepare_store` are
//! stored once.
//!
//! This file holds the manager, its construction, key resolution, lookups and loads; `store.rs`
//! the stores, evictions and discards; `requests.rs` the request-scoped calls of 0.33 (begin,
//! record, commit at finish) over the records of `record.rs`; `dedupe.rs` the duplicate-key
//! filter of a store; `invariants.rs` the self-check; `policy.rs` the interface behind which
//! `lru.rs` (0.24), `lru_ranked.rs` (0.33) and `arc.rs` hold what differs between the policies.

mod arc;
mod dedupe;
mod events;
mod invariants;
mod keys;
mod list;
mod lru;
mod lru_ranked;
mod policy;
mod pool;
mod record;
mod requests;
mod store;
mod tracker;
mod types;

pub use events::{Event, EventLog, MIN_EVENT_KEYS};
pub use types::{
    ALLOCATION_SIZE_BOUNDS, ALLOCATION_SIZE_BUCKETS, Lookup, ManagerConfig, ManagerStats, Policy,
    PrefixLookup, RequestId, Semantics, StoreCounts, StorePlan,
};

use crate::error::{Error, Result, invalid};
use keys::KeyTable;
use policy::PolicyImpl;
use pool::SlotPool;
use record::Records;
use std::ops::Range;
use tracker::Tracker;

/// Longest supported key, in bytes.
pub const MAX_KEY_LEN: usize = 64;

/// The id of nothing: no key found, no list entry, no slot.
const NO_ID: u32 = u32::MAX;

/// [`SlotState::ref_cnt`] of a slot whose store is in flight.
const IN_FLIGHT: i32 = -1;

/// The offload tier index. Not thread-safe by itself; the C API serializes calls per handle.
pub struct Manager {
    cfg: ManagerConfig,
    keys: KeyTable,
    /// Per slot: reference count and protection stamp.
    slots: Vec<SlotState>,
    pool: SlotPool,
    policy: PolicyImpl,
    tracker: Option<Tracker>,
    events: EventLog,
    stats: ManagerStats,
    // Scratch space reused by every call (no allocation per key once warm).
    /// The resolution of the last keys a call named (`resolved_keys`): the hashes of its first
    /// `scratch_hash.len()` keys, and the manager ids of its first `scratch_ids.len()` keys
    /// (never more than are hashed), valid while the key table's version is
    /// `resolved_version`. A later call on keys sharing a prefix with them reuses what was
    /// resolved of that prefix (a lookup, then the load of its hits, then the store of all).
    scratch_hash: Vec<u64>,
    scratch_ids: Vec<u32>,
    resolved_keys: Vec<u8>,
    resolved_version: u64,
    scratch_victims: Vec<u32>,
    scratch_new: Vec<u32>,
    scratch_pairs: Vec<(u64, u32)>,
    scratch_filter: Vec<u64>,
    /// Of a 0.33 store: the record index of each candidate, the ids reported as store misses,
    /// the absent keys the threshold filtered out.
    scratch_entries: Vec<u32>,
    scratch_misses: Vec<u32>,
    scratch_filtered: Vec<u32>,
    /// Manager ids and positions handed to a 0.33 policy hook, and a commit's order and flags.
    scratch_access_ids: Vec<u32>,
    scratch_access_pos: Vec<u64>,
    scratch_order: Vec<u32>,
    scratch_flags: Vec<u8>,
    /// Tests: commit every request key by key (the general path the policy's shortcut must
    /// match).
    #[cfg(test)]
    commit_general_only: bool,
    /// Tests: the commits a policy's shortcut took (whole or in part).
    #[cfg(test)]
    commit_shortcuts: usize,
    epoch: u32,
    /// The request records of 0.33 semantics, and the cache generation (bumped by `reset`)
    /// that makes older records stale.
    records: Records,
    generation: u64,
}

/// What the manager keeps per slot, side by side (one cache line per slot).
#[derive(Debug, Clone, Copy)]
struct SlotState {
    /// -1 store in flight, 0 ready and idle, n > 0 pinned by n loads.
    ref_cnt: i32,
    /// Equal to the manager's epoch when a `prepare_store` protects the slot from eviction.
    stamp: u32,
    /// The key-table entry of the slot's key (LRU: the slot itself; ARC: any entry), or
    /// [`NO_ID`] exactly while the slot is free.
    entry: u32,
}

impl SlotState {
    /// Whether a `prepare_store` of `epoch` protects the slot from eviction.
    #[inline]
    fn is_protected(&self, epoch: u32) -> bool {
        self.stamp == epoch
    }

    /// Whether eviction in `epoch` may take the slot: ready, not pinned, not protected.
    #[inline]
    fn is_evictable(&self, epoch: u32) -> bool {
        self.ref_cnt == 0 && !self.is_protected(epoch)
    }

    /// The slot gets the key of key-table entry `entry`, whose store is now in flight.
    #[inline]
    fn start_store(&mut self, entry: u32) {
        self.entry = entry;
        self.ref_cnt = IN_FLIGHT;
    }
}

impl Manager {
    /// A manager with `cfg`; fails with [`Error::InvalidArgument`] naming the bad field.
    pub fn new(cfg: ManagerConfig) -> Result<Self> {
        if cfg.key_len == 0 || cfg.key_len > MAX_KEY_LEN {
            return Err(invalid!(
                "key_len: {} is not in 1..={MAX_KEY_LEN}",
                cfg.key_len
            ));
        }
        let max_slots = PolicyImpl::max_slots(cfg.policy, cfg.semantics);
        if cfg.num_slots > max_slots {
            return Err(invalid!(
                "num_slots: {} is above {max_slots} for {:?} in {:?}",
                cfg.num_slots,
                cfg.policy,
                cfg.semantics
            ));
        }
        if cfg.store_threshold >= 2 && cfg.max_tracker_size == 0 {
            return Err(invalid!(
                "max_tracker_size: 0 with store_threshold {}",
                cfg.store_threshold
            ));
        }
        let n = cfg.num_slots;
        let mut keys = KeyTable::new(cfg.key_len, n)?;
        let policy = PolicyImpl::new(cfg.policy, cfg.semantics, n, &mut keys)?;
        let free = SlotState {
            ref_cnt: 0,
            stamp: 0,
            entry: NO_ID,
        };
        let slots = filled(n, free, "slot states")?;
        let tracker = (cfg.store_threshold >= 2)
            .then(|| Tracker::new(cfg.store_threshold, cfg.max_tracker_size, &keys));
        Ok(Self {
            events: EventLog::new(cfg.key_len, event_bound(n)),
            stats: ManagerStats {
                capacity: n as u64,
                ..Default::default()
            },
            keys,
            slots,
            pool: SlotPool::new(n as u32),
            policy,
            tracker,
            scratch_hash: Vec::new(),
            scratch_ids: Vec::new(),
            resolved_keys: Vec::new(),
            resolved_version: u64::MAX,
            scratch_victims: Vec::new(),
            scratch_new: Vec::new(),
            scratch_pairs: Vec::new(),
            scratch_filter: Vec::new(),
            scratch_entries: Vec::new(),
            scratch_misses: Vec::new(),
            scratch_filtered: Vec::new(),
            scratch_access_ids: Vec::new(),
            scratch_access_pos: Vec::new(),
            scratch_order: Vec::new(),
            scratch_flags: Vec::new(),
            #[cfg(test)]
            commit_general_only: false,
            #[cfg(test)]
            commit_shortcuts: 0,
            epoch: 0,
            records: Records::default(),
            generation: 0,
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ManagerConfig {
        &self.cfg
    }

    /// Width of every key in bytes.
    pub fn key_len(&self) -> usize {
        self.cfg.key_len
    }

    /// Whether the manager follows vLLM 0.33 semantics.
    #[inline]
    fn v033(&self) -> bool {
        self.cfg.semantics == Semantics::Vllm033
    }

    fn check_keys(&self, keys: &[u8], name: &str) -> Result<usize> {
        let kl = self.cfg.key_len;
        if !keys.len().is_multiple_of(kl) {
            return Err(invalid!(
                "{name}: {} bytes is not a multiple of key_len {kl}",
                keys.len()
            ));
        }
        Ok(keys.len() / kl)
    }

    /// Whether a manager id is a slot (not [`NO_ID`], not one of ARC's ghosts).
    #[inline]
    fn is_slot(&self, id: u32) -> bool {
        (id as usize) < self.cfg.num_slots
    }

    /// The slot of a manager id, if it is one.
    #[inline]
    fn slot(&self, id: Option<u32>) -> Option<u32> {
        id.filter(|&i| self.is_slot(i))
    }

    /// The key-table entry of slot `s` ([`NO_ID`] for a free slot).
    #[inline]
    fn entry_of_slot(&self, s: u32) -> u32 {
        self.slots[s as usize].entry
    }

    /// The key held by occupied slot `s`.
    #[inline]
    fn slot_key(&self, s: u32) -> &[u8] {
        self.keys.key(self.entry_of_slot(s))
    }

    /// The manager's id of a key (see [`PolicyImpl::id_of_entry`]), if the key table has it.
    #[inline]
    fn find_hashed(&self, hash: u64, key: &[u8]) -> Option<u32> {
        let e = self.keys.find_hashed(hash, key)?;
        Some(self.policy.id_of_entry(e))
    }

    fn find(&self, key: &[u8]) -> Option<u32> {
        self.find_hashed(self.keys.hash(key), key)
    }

    /// The manager id `resolve` found for key `i`, if any.
    #[inline]
    fn resolved_id(&self, i: usize) -> Option<u32> {
        Some(self.scratch_ids[i]).filter(|&s| s != NO_ID)
    }

    /// Resolves every key of `keys` into the first entries of `scratch_hash` / `scratch_ids`
    /// (the manager id: a slot, an ARC ghost, or [`NO_ID`]); returns their number. What the
    /// last resolution holds of a common prefix is reused (see [`Self::rebase`]); the rest is
    /// found with [`KeyTable::find_all_hashed`].
    fn resolve(&mut self, keys: &[u8]) -> usize {
        let n = keys.len() / self.cfg.key_len;
        self.rebase(keys);
        self.resolve_to(n, false);
        n
    }

    /// Resolves the first `n` keys of the resolution (after [`Self::rebase`]) into
    /// `scratch_hash` / `scratch_ids`, as [`Self::resolve`] does all of them; new hashes are
    /// prefetched as by [`Self::hash_to`] with `prefetch`.
    #[inline(always)]
    fn resolve_to(&mut self, n: usize, prefetch: bool) {
        self.hash_to(n, prefetch);
        let (kl, found) = (self.cfg.key_len, self.scratch_ids.len());
        if found < n {
            let (keys, hashes) = (&self.resolved_keys[found * kl..n * kl], &self.scratch_hash);
            let ids = &mut self.scratch_ids;
            self.policy
                .find_all(&self.keys, keys, &hashes[found..n], ids);
        }
    }

    /// Makes the resolution describe `keys`: when they and the last resolved keys agree on the
    /// shorter of the two, the longer is kept with every hash computed, and the manager ids
    /// while the key table is unchanged; otherwise it starts again from `keys`.
    #[inline]
    fn rebase(&mut self, keys: &[u8]) {
        let r = &mut self.resolved_keys;
        let common = r.len().min(keys.len());
        if r[..common] != keys[..common] {
            r.clear();
            self.scratch_hash.clear();
            self.scratch_ids.clear();
        }
        if keys.len() > r.len() {
            r.extend_from_slice(&keys[r.len()..]);
        }
        if self.resolved_version != self.keys.version() {
            self.resolved_version = self.keys.version();
            self.scratch_ids.clear();
        }
    }

    /// Hashes the resolution's keys up to the `n`-th, prefetching the index lines of each new
    /// hash with `prefetch`.
    #[inline(always)]
    fn hash_to(&mut self, n: usize, prefetch: bool) {
        let (kl, from) = (self.cfg.key_len, self.scratch_hash.len());
        if from >= n {
            return;
        }
        let keys = self.resolved_keys[from * kl..n * kl].chunks_exact(kl);
        let table = &self.keys;
        self.scratch_hash.extend(keys.map(|key| {
            let h = table.hash(key);
            if prefetch {
                table.prefetch(h, true);
            }
            h
        }));
    }

    /// Starts loading into the CPU caches the index entries that calls on `keys` will read, so
    /// that the memory accesses of all keys overlap: a hint for large tiers, best given the keys
    /// of several coming calls at once. Changes nothing, counts nothing.
    pub fn prefetch(&self, keys: &[u8]) {
        if !self.keys.prefetches() {
            return;
        }
        for key in keys.chunks_exact(self.cfg.key_len) {
            self.keys.prefetch(self.keys.hash(key), true);
        }
    }

    /// The manager's hash of `key` (`key_len` bytes): fixed for the manager's lifetime, so a
    /// caller may keep it for [`Self::prefetch_hashed`] and [`Self::seed_hashes`].
    pub(crate) fn key_hash(&self, key: &[u8]) -> u64 {
        debug_assert_eq!(key.len(), self.cfg.key_len);
        self.keys.hash(key)
    }

    /// [`Self::prefetch`] of the keys with these [`Self::key_hash`]es.
    pub(crate) fn prefetch_hashed(&self, hashes: &[u64]) {
        if self.keys.prefetches() {
            hashes.iter().for_each(|&h| self.keys.prefetch(h, true));
        }
    }

    /// Makes `hashes` (their [`Self::key_hash`]es) the resolution's hashes of `keys`: the next
    /// call on keys that start with `keys` hashes none of them again.
    pub(crate) fn seed_hashes(&mut self, keys: &[u8], hashes: &[u64]) {
        let kl = self.cfg.key_len;
        debug_assert_eq!(keys.len(), hashes.len() * kl);
        debug_assert!(
            keys.chunks_exact(kl)
                .zip(hashes)
                .all(|(k, &h)| self.keys.hash(k) == h),
            "seeded hashes are the keys' own"
        );
        if self.resolved_keys != keys {
            self.resolved_keys.clear();
            self.resolved_keys.extend_from_slice(keys);
            self.scratch_ids.clear();
        }
        self.scratch_hash.clear();
        self.scratch_hash.extend_from_slice(hashes);
    }

    /// Looks up one key, without changing recency. In 0.24 semantics the lookup counts for the
    /// store threshold and a key whose store is in flight answers [`Lookup::Retry`]; in 0.33
    /// it counts for nothing and such a key answers [`Lookup::HitPending`].
    pub fn lookup(&mut self, key: &[u8]) -> Result<Lookup> {
        if key.len() != self.cfg.key_len {
            return Err(invalid!(
                "key: {} bytes, key_len is {}",
                key.len(),
                self.cfg.key_len
            ));
        }
        Ok(self.lookup_one(key))
    }

    #[inline]
    fn lookup_one(&mut self, key: &[u8]) -> Lookup {
        let h = self.keys.hash(key);
        let id = self.find_hashed(h, key);
        self.count_lookup(self.v033(), h, key, id)
    }

    /// Counts a lookup of `key` (hash `h`, manager id `id`) and answers it (`v033`: the
    /// manager's semantics is 0.33, hoisted out of the callers' loops).
    #[inline]
    fn count_lookup(&mut self, v033: bool, h: u64, key: &[u8], id: Option<u32>) -> Lookup {
        if let Some(t) = &mut self.tracker
            && !v033
        {
            t.record(h, key);
        }
        self.stats.lookups += 1;
        match self.slot(id) {
            None => Lookup::Miss,
            Some(s) if self.slots[s as usize].ref_cnt == IN_FLIGHT && v033 => Lookup::HitPending,
            Some(s) if self.slots[s as usize].ref_cnt == IN_FLIGHT => Lookup::Retry,
            Some(_) => {
                self.stats.hits += 1;
                Lookup::Hit
            }
        }
    }

    /// The maximal-prefix rule: looks keys up in order until the first miss; a key whose store is
    /// in flight counts as a hit while scanning, and then the whole answer must be retried.
    pub fn lookup_prefix(&mut self, keys: &[u8]) -> Result<PrefixLookup> {
        let n = self.check_keys(keys, "keys")?;
        let kl = self.cfg.key_len;
        self.rebase(keys);
        // The keys are resolved in windows that double (the first 8, then up to 24, 56, ...):
        // a lookup that misses early resolves little, and what it resolved stays for the calls
        // that follow (a load of the hits, a store of the keys).
        let (v033, mut out) = (self.v033(), PrefixLookup::default());
        for i in 0..n {
            if i == self.scratch_ids.len() {
                self.resolve_to((2 * i + 8).min(n), true);
            }
            let (h, key, id) = (
                self.scratch_hash[i],
                key_at(keys, kl, i as u32),
                self.resolved_id(i),
            );
            match self.count_lookup(v033, h, key, id) {
                Lookup::Miss => break,
                Lookup::Retry | Lookup::HitPending => out.retry = true,
                Lookup::Hit => {}
            }
            out.hits += 1;
        }
        Ok(out)
    }

    /// Pins every key for a load and writes its slot to `out_slots[i]`, in input order.
    /// Fails, changing nothing, if a key is not stored ([`Error::NotFound`]), its store is in
    /// flight ([`Error::InvalidState`]) or `out_slots` is shorter than the keys. (In 0.33
    /// semantics a load outside a request records nothing; see [`Self::prepare_load_for`].)
    pub fn prepare_load(&mut self, keys: &[u8], out_slots: &mut [u32]) -> Result<usize> {
        let n = self.check_keys(keys, "keys")?;
        if out_slots.len() < n {
            return Err(Error::BufferTooSmall {
                what: "out_slots",
                needed: n,
                got: out_slots.len(),
            });
        }
        self.resolve(keys);
        for (i, &s) in self.scratch_ids[..n].iter().enumerate() {
            if !self.is_slot(s) {
                return Err(Error::NotFound(format!("keys[{i}]: not stored")));
            }
            if self.slots[s as usize].ref_cnt == IN_FLIGHT {
                return Err(Error::InvalidState(format!(
                    "keys[{i}]: its store is in flight"
                )));
            }
        }
        for (i, &s) in self.scratch_ids[..n].iter().enumerate() {
            let r = &mut self.slots[s as usize].ref_cnt;
            if *r == 0 {
                self.stats.evictable -= 1;
                self.stats.pinned += 1;
                self.policy.on_pinned(s);
            }
            *r += 1;
            out_slots[i] = s;
        }
        Ok(n)
    }

    /// Marks keys as used: LRU moves the evictable ones to the most-recent end so that the
    /// first key ends most recent; ARC promotes and adapts its target. Unknown keys are ignored.
    pub fn touch(&mut self, keys: &[u8]) -> Result<()> {
        let n = self.check_keys(keys, "keys")?;
        self.resolve(keys);
        self.touch_resolved(n);
        Ok(())
    }

    /// Touches the first `n` resolved keys, last first.
    fn touch_resolved(&mut self, n: usize) {
        self.policy.touch(&self.scratch_ids[..n], &self.slots);
    }

    /// [`Self::lookup_prefix`] of the keys `lookup` (indices into `keys`), then
    /// [`Self::touch`] of all `keys`, finding each key once: what a scheduler's match does.
    /// Fails with [`Error::InvalidArgument`], changing nothing, if `lookup` is not within `keys`.
    pub fn lookup_prefix_touch(
        &mut self,
        keys: &[u8],
        lookup: Range<usize>,
    ) -> Result<PrefixLookup> {
        let n = self.check_keys(keys, "keys")?;
        if lookup.start > lookup.end || lookup.end > n {
            return Err(invalid!("lookup: {lookup:?} is not within the {n} keys"));
        }
        self.resolve(keys);
        let (kl, v033) = (self.cfg.key_len, self.v033());
        let mut out = PrefixLookup::default();
        for i in lookup {
            let (h, id) = (self.scratch_hash[i], self.resolved_id(i));
            match self.count_lookup(v033, h, key_at(keys, kl, i as u32), id) {
                Lookup::Miss => break,
                Lookup::Retry | Lookup::HitPending => out.retry = true,
                Lookup::Hit => {}
            }
            out.hits += 1;
        }
        self.touch_resolved(n);
        Ok(out)
    }

    /// Releases one load pin of each key (a key listed twice is released twice). Fails, changing
    /// nothing, if a key is not stored ([`Error::NotFound`]) or not pinned ([`Error::InvalidState`]).
    pub fn complete_load(&mut self, keys: &[u8]) -> Result<()> {
        let n = self.check_keys(keys, "keys")?;
        self.resolve(keys);
        // Validate by releasing, undo, then apply in order (exact order of "becomes evictable").
        let mut failed = None;
        for (i, &s) in self.scratch_ids[..n].iter().enumerate() {
            if !self.is_slot(s) {
                failed = Some((i, Error::NotFound(format!("keys[{i}]: not stored"))));
                break;
            }
            if self.slots[s as usize].ref_cnt <= 0 {
                let e = Error::InvalidState(format!("keys[{i}]: not pinned by a load"));
                failed = Some((i, e));
                break;
            }
            self.slots[s as usize].ref_cnt -= 1;
        }
        let done = failed.as_ref().map_or(n, |f| f.0);
        for &s in &self.scratch_ids[..done] {
            self.slots[s as usize].ref_cnt += 1;
        }
        if let Some((_, e)) = failed {
            return Err(e);
        }
        for &s in &self.scratch_ids[..n] {
            let r = &mut self.slots[s as usize].ref_cnt;
            *r -= 1;
            if *r == 0 {
                self.stats.evictable += 1;
                self.stats.pinned -= 1;
                self.policy.on_ready(s);
            }
        }
        Ok(())
    }

    /// The reference count of a stored key (-1: store in flight, 0: ready and idle, n > 0:
    /// pinned by n loads), or `None` if it is not stored. Counts nothing, changes nothing.
    pub fn ref_count(&self, key: &[u8]) -> Option<i32> {
        if key.len() != self.cfg.key_len {
            return None;
        }
        self.slot(self.find(key))
            .map(|s| self.slots[s as usize].ref_cnt)
    }

    /// Takes the buffered events, oldest first. A metadata-only removal (a failed store, 0.33
    /// semantics) keeps only its keys that are absent now: a key stored again since is dropped
    /// from it, and a removal left with no key is dropped whole.
    pub fn take_events(&mut self) -> EventLog {
        let log = self.events().into_owned();
        self.events = EventLog::new(self.cfg.key_len, self.events.max_keys());
        self.stats.events_dropped += log.dropped();
        log
    }

    /// The events [`Self::take_events`] would take now, oldest first (not drained).
    pub fn events(&self) -> std::borrow::Cow<'_, EventLog> {
        if self.events.has_metadata_only() {
            let present = |key: &[u8]| self.slot(self.find(key)).is_some();
            std::borrow::Cow::Owned(self.events.without_present(present))
        } else {
            std::borrow::Cow::Borrowed(&self.events)
        }
    }

    /// Current counters and gauges.
    pub fn stats(&self) -> ManagerStats {
        let mut s = self.stats;
        s.events_dropped += self.events.dropped();
        s.used = self.pool.num_used() as u64;
        s.ready = s.used - s.stores_in_flight;
        s
    }

    /// Drops every key and frees every slot (no events); cumulative counters, buffered events
    /// and the store-threshold counts are kept. Request records of 0.33 semantics become stale:
    /// their next use starts them again empty, and finishing one commits nothing. Only safe
    /// when the caller discards completions of jobs from before the reset (the scheduler does).
    pub fn reset(&mut self) {
        self.generation += 1;
        self.keys.clear();
        self.pool.reset();
        self.slots.iter_mut().for_each(|s| {
            s.ref_cnt = 0;
            s.entry = NO_ID;
        });
        self.policy.clear(&mut self.slots);
        self.stats.evictable = 0;
        self.stats.pinned = 0;
        self.stats.stores_in_flight = 0;
    }
}

/// Keys the event buffer of a tier of `num_slots` slots holds at most.
fn event_bound(num_slots: usize) -> usize {
    num_slots.saturating_mul(4).max(MIN_EVENT_KEYS)
}

/// `n` copies of `value`, or [`Error::OutOfMemory`] (large tiers must not abort the host).
pub(crate) fn filled<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| Error::OutOfMemory(format!("{what} of {n} slots")))?;
    v.resize(n, value);
    Ok(v)
}

#[inline]
fn key_at(keys: &[u8], kl: usize, i: u32) -> &[u8] {
    &keys[i as usize * kl..(i as usize + 1) * kl]
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_vllm033;

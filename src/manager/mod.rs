//! The offload tier index: which keys are stored in which host slots, their state
//! (store in flight, ready, pinned by loads), and eviction (LRU or ARC).
//!
//! Behaviour follows vLLM 0.24 `CPUOffloadingManager` (reference §3) exactly: the same calls give
//! the same answers, slots and evictions. Differences: a call that fails changes nothing (the
//! reference asserts half-way), and duplicate keys in one `prepare_store` are stored once.

mod arc;
mod events;
mod keys;
mod list;
mod lru;
mod pool;
mod tracker;

pub use events::{Event, EventLog, MIN_EVENT_KEYS};

use crate::error::{Error, Result, invalid};
use keys::{KeyTable, key_eq};
use pool::SlotPool;
use std::ops::Range;
use tracker::Tracker;

/// Longest supported key, in bytes.
pub const MAX_KEY_LEN: usize = 64;

/// Eviction policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Least recently used first.
    #[default]
    Lru,
    /// Adaptive replacement cache.
    Arc,
}

/// Manager configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerConfig {
    /// Width of every key in bytes, `1..=64`.
    pub key_len: usize,
    /// Number of host slots (offloaded blocks the tier holds): below `u32::MAX` for LRU, at
    /// most `u32::MAX / 5` for ARC (which also names the evicted keys it remembers).
    pub num_slots: usize,
    /// Eviction policy.
    pub policy: Policy,
    /// When `>= 2`, a key is stored only after it was looked up this many times.
    pub store_threshold: u32,
    /// Keys the store-threshold filter tracks (least recently looked up dropped first); `>= 1`.
    pub max_tracker_size: usize,
    /// Buffer stored / removed events for [`Manager::take_events`]: at most
    /// `max(4 * num_slots, MIN_EVENT_KEYS)` keys, the oldest events dropped beyond that
    /// ([`ManagerStats::events_dropped`]).
    pub enable_events: bool,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            key_len: 32,
            num_slots: 0,
            policy: Policy::Lru,
            store_threshold: 0,
            max_tracker_size: 64_000,
            enable_events: false,
        }
    }
}

/// The answer of a single-key lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Not stored.
    Miss,
    /// Stored and ready to load.
    Hit,
    /// Its store is in flight: ask again later.
    Retry,
}

/// The answer of a prefix lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixLookup {
    /// Leading keys that are stored, counting keys whose store is in flight.
    pub hits: usize,
    /// A key within `hits` has its store in flight: the answer must be retried later.
    pub retry: bool,
}

/// The outcome of [`Manager::prepare_store_into`]: how much of each output was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreCounts {
    /// Keys to store (entries of the index and slot outputs).
    pub stored: usize,
    /// Keys evicted to make room (keys in the evicted output).
    pub evicted: usize,
}

/// Owned outputs of [`Manager::prepare_store`], reusable across calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StorePlan {
    /// Indices (into the call's keys) of the keys to store, in input order.
    pub indices: Vec<u32>,
    /// The slot of each key to store.
    pub slots: Vec<u32>,
    /// Evicted keys, back to back, in eviction order.
    pub evicted: Vec<u8>,
}

/// Counters and gauges of the tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ManagerStats {
    /// Host slots.
    pub capacity: u64,
    /// Slots holding a key (ready or in flight).
    pub used: u64,
    /// Slots whose key is ready (loadable).
    pub ready: u64,
    /// Ready slots not pinned by any load: what eviction may take.
    pub evictable: u64,
    /// Slots pinned by at least one load.
    pub pinned: u64,
    /// Slots whose store is in flight.
    pub stores_in_flight: u64,
    /// Keys looked up (cumulative).
    pub lookups: u64,
    /// Lookups that answered "hit" (cumulative).
    pub hits: u64,
    /// Keys filtered out by the store threshold (cumulative).
    pub stores_skipped: u64,
    /// Keys evicted (cumulative).
    pub evictions: u64,
    /// Events dropped, oldest first, because the buffer was full (cumulative).
    pub events_dropped: u64,
}

/// The policy, inline (not boxed: every key's step reads it, and there is one per manager).
enum PolicyImpl {
    Lru(lru::Lru),
    Arc(arc::Arc),
}

impl PolicyImpl {
    /// The manager id of key-table entry `e`: a slot, or (ARC) a ghost id beyond the slots.
    #[inline]
    fn id_of_entry(&self, e: u32) -> u32 {
        match self {
            PolicyImpl::Lru(_) => e,
            PolicyImpl::Arc(a) => a.id(e),
        }
    }
}

const IN_FLIGHT: i32 = -1;
const ABSENT: u32 = u32::MAX;

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
    /// What `resolve` found: hashes and manager ids of the keys in `resolved_keys`, valid
    /// while the key table's version is `resolved_version` (a later call on the same keys, or on
    /// a prefix of them, reuses them).
    scratch_hash: Vec<u64>,
    scratch_slot: Vec<u32>,
    resolved_keys: Vec<u8>,
    resolved_version: u64,
    scratch_victims: Vec<u32>,
    scratch_new: Vec<u32>,
    scratch_pairs: Vec<(u64, u32)>,
    scratch_filter: Vec<u64>,
    epoch: u32,
}

/// What the manager keeps per slot, side by side (one cache line per slot).
#[derive(Debug, Clone, Copy)]
struct SlotState {
    /// -1 store in flight, 0 ready and idle, n > 0 pinned by n loads.
    ref_cnt: i32,
    /// Equal to the manager's epoch when a `prepare_store` protects the slot from eviction.
    stamp: u32,
    /// The key-table entry of the slot's key: the slot itself for LRU, any entry for ARC
    /// (`list::NIL` while the slot is free).
    entry: u32,
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
        // ARC names up to 4n keys (n stored, 2n ghosts, n just evicted) by ids up to 5n.
        let max_slots = match cfg.policy {
            Policy::Lru => u32::MAX as usize - 1,
            Policy::Arc => u32::MAX as usize / 5,
        };
        if cfg.num_slots > max_slots {
            return Err(invalid!(
                "num_slots: {} is above {max_slots} for {:?}",
                cfg.num_slots,
                cfg.policy
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
        if cfg.policy == Policy::Arc {
            // ARC's ghost entries (two lists of at most n keys) share the key table.
            keys.reserve_more(n.saturating_mul(2))?;
        }
        let policy = match cfg.policy {
            Policy::Lru => PolicyImpl::Lru(lru::Lru::new(n)?),
            Policy::Arc => PolicyImpl::Arc(arc::Arc::new(n)?),
        };
        let free = SlotState {
            ref_cnt: 0,
            stamp: 0,
            entry: list::NIL,
        };
        let mut slots = filled(n, free, "slot states")?;
        if cfg.policy == Policy::Lru {
            slots.iter_mut().zip(0..).for_each(|(st, s)| st.entry = s);
        }
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
            scratch_slot: Vec::new(),
            resolved_keys: Vec::new(),
            resolved_version: u64::MAX,
            scratch_victims: Vec::new(),
            scratch_new: Vec::new(),
            scratch_pairs: Vec::new(),
            scratch_filter: Vec::new(),
            epoch: 0,
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

    /// Whether a manager id is a slot (not ABSENT, not one of ARC's ghosts).
    #[inline]
    fn is_slot(&self, id: u32) -> bool {
        (id as usize) < self.cfg.num_slots
    }

    /// The slot of a manager id, if it is one.
    #[inline]
    fn slot(&self, id: Option<u32>) -> Option<u32> {
        id.filter(|&i| self.is_slot(i))
    }

    /// The key-table entry of occupied slot `s` (`list::NIL` for a free ARC slot).
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
        Some(self.scratch_slot[i]).filter(|&s| s != ABSENT)
    }

    /// Resolves every key of `keys` into the first entries of `scratch_hash` / `scratch_slot`
    /// (the manager id: a slot, an ARC ghost, or ABSENT); returns their number. Reuses the
    /// last resolution when `keys` are its keys or a prefix of them and the key table has not
    /// changed since (a match's lookup then its load, a load then its store). Otherwise finds all
    /// with [`KeyTable::find_all`].
    fn resolve(&mut self, keys: &[u8]) -> usize {
        let n = keys.len() / self.cfg.key_len;
        if self.resolved_version == self.keys.version()
            && self.resolved_keys.get(..keys.len()) == Some(keys)
        {
            return n;
        }
        self.resolved_keys.clear();
        self.resolved_keys.extend_from_slice(keys);
        self.resolved_version = self.keys.version();
        let policy = &self.policy;
        let (hashes, ids) = (&mut self.scratch_hash, &mut self.scratch_slot);
        self.keys.find_all(keys, hashes, ids, |e| {
            e.map_or(ABSENT, |e| policy.id_of_entry(e))
        });
        n
    }

    /// Starts loading into the CPU caches the index entries that calls on `keys` will read, so
    /// that the memory accesses of all keys overlap: a hint for large tiers, best given the keys
    /// of several coming calls at once. Changes nothing, counts nothing.
    pub fn prefetch(&self, keys: &[u8]) {
        for key in keys.chunks_exact(self.cfg.key_len) {
            self.keys.prefetch(self.keys.hash(key), true);
        }
    }

    /// Looks up one key: counts it for the store threshold, and answers without changing recency.
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
        self.count_lookup(h, key, id)
    }

    /// Counts a lookup of `key` (hash `h`, manager id `id`) and answers it.
    #[inline]
    fn count_lookup(&mut self, h: u64, key: &[u8], id: Option<u32>) -> Lookup {
        if let Some(t) = &mut self.tracker {
            t.record(h, key);
        }
        self.stats.lookups += 1;
        match self.slot(id) {
            None => Lookup::Miss,
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
        // Hashes run AHEAD keys in front of the lookups, each prefetched when computed.
        const AHEAD: usize = 8;
        let mut ahead = [0u64; AHEAD];
        let hash_at = |m: &Self, i: usize| {
            let h = m.keys.hash(key_at(keys, kl, i as u32));
            m.keys.prefetch(h, true);
            h
        };
        for (i, h) in ahead.iter_mut().enumerate().take(n) {
            *h = hash_at(self, i);
        }
        let mut out = PrefixLookup::default();
        for i in 0..n {
            let h = ahead[i % AHEAD];
            if i + AHEAD < n {
                ahead[i % AHEAD] = hash_at(self, i + AHEAD);
            }
            let key = key_at(keys, kl, i as u32);
            let id = self.find_hashed(h, key);
            match self.count_lookup(h, key, id) {
                Lookup::Miss => break,
                Lookup::Retry => out.retry = true,
                Lookup::Hit => {}
            }
            out.hits += 1;
        }
        Ok(out)
    }

    /// Pins every key for a load and writes its slot to `out_slots[i]`, in input order.
    /// Fails, changing nothing, if a key is not stored ([`Error::NotFound`]), its store is in
    /// flight ([`Error::InvalidState`]) or `out_slots` is shorter than the keys.
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
        for (i, &s) in self.scratch_slot[..n].iter().enumerate() {
            if !self.is_slot(s) {
                return Err(Error::NotFound(format!("keys[{i}]: not stored")));
            }
            if self.slots[s as usize].ref_cnt == IN_FLIGHT {
                return Err(Error::InvalidState(format!(
                    "keys[{i}]: its store is in flight"
                )));
            }
        }
        for (i, &s) in self.scratch_slot[..n].iter().enumerate() {
            let r = &mut self.slots[s as usize].ref_cnt;
            if *r == 0 {
                self.stats.evictable -= 1;
                self.stats.pinned += 1;
                if let PolicyImpl::Lru(l) = &mut self.policy {
                    l.mark_non_evictable(s);
                }
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
        let ids = self.scratch_slot[..n].iter().rev();
        match &mut self.policy {
            PolicyImpl::Lru(l) => {
                for &s in ids.filter(|&&s| s != ABSENT) {
                    l.touch(s);
                }
            }
            PolicyImpl::Arc(a) => {
                for &id in ids.filter(|&&id| id != ABSENT) {
                    match self.slots.get(id as usize) {
                        Some(st) => a.touch_stored(st.entry, st.ref_cnt),
                        None => a.touch_ghost(id),
                    }
                }
            }
        }
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
        let kl = self.cfg.key_len;
        let mut out = PrefixLookup::default();
        for i in lookup {
            let id = self.resolved_id(i);
            match self.count_lookup(self.scratch_hash[i], key_at(keys, kl, i as u32), id) {
                Lookup::Miss => break,
                Lookup::Retry => out.retry = true,
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
        for (i, &s) in self.scratch_slot[..n].iter().enumerate() {
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
        for &s in &self.scratch_slot[..done] {
            self.slots[s as usize].ref_cnt += 1;
        }
        if let Some((_, e)) = failed {
            return Err(e);
        }
        for &s in &self.scratch_slot[..n] {
            let r = &mut self.slots[s as usize].ref_cnt;
            *r -= 1;
            if *r == 0 {
                self.stats.evictable += 1;
                self.stats.pinned -= 1;
                if let PolicyImpl::Lru(l) = &mut self.policy {
                    l.mark_evictable(s);
                }
            }
        }
        Ok(())
    }

    /// [`Self::prepare_store_into`] with owned, reusable outputs.
    pub fn prepare_store(&mut self, keys: &[u8], plan: &mut StorePlan) -> Result<StoreCounts> {
        let n = self.check_keys(keys, "keys")?;
        plan.indices.resize(n, 0);
        plan.slots.resize(n, 0);
        plan.evicted.resize(n * self.cfg.key_len, 0);
        let r =
            self.prepare_store_into(keys, &mut plan.indices, &mut plan.slots, &mut plan.evicted);
        let c = r.as_ref().copied().unwrap_or_default();
        plan.indices.truncate(c.stored);
        plan.slots.truncate(c.stored);
        plan.evicted.truncate(c.evicted * self.cfg.key_len);
        r
    }

    /// Reserves slots for the keys that are not stored yet (their stores are then in flight).
    ///
    /// Keys filtered by the store threshold and keys already stored (ready or in flight) are
    /// skipped; a key listed twice is stored once. When the free slots do not suffice, evicts
    /// ready, unpinned keys by the policy, never a key named in this call. Writes the input
    /// indices and slots of the keys to store, and the evicted keys (back to back, eviction
    /// order). Each output must hold as many entries as there are keys.
    ///
    /// Fails with [`Error::NoRoom`], changing nothing, when not enough can be evicted now.
    pub fn prepare_store_into(
        &mut self,
        keys: &[u8],
        out_indices: &mut [u32],
        out_slots: &mut [u32],
        out_evicted: &mut [u8],
    ) -> Result<StoreCounts> {
        let n = self.check_keys(keys, "keys")?;
        let kl = self.cfg.key_len;
        if out_indices.len() < n {
            return Err(Error::BufferTooSmall {
                what: "out_indices",
                needed: n,
                got: out_indices.len(),
            });
        }
        if out_slots.len() < n {
            return Err(Error::BufferTooSmall {
                what: "out_slots",
                needed: n,
                got: out_slots.len(),
            });
        }
        if out_evicted.len() < n * kl {
            return Err(Error::BufferTooSmall {
                what: "out_evicted",
                needed: n,
                got: out_evicted.len() / kl,
            });
        }
        self.resolve(keys);
        // Protect every present key named in the call (before the threshold filter: vLLM 0.24
        // protects only the keys that pass it), filter by the threshold, collect the absent
        // keys that pass (deduplicated).
        self.next_epoch();
        self.scratch_new.clear();
        let mut skipped = 0;
        let (ids, hashes, epoch) = (&self.scratch_slot[..n], &self.scratch_hash[..n], self.epoch);
        let (slots, new, num_slots) = (&mut self.slots, &mut self.scratch_new, self.cfg.num_slots);
        for (i, (key, &id)) in keys.chunks_exact(kl).zip(ids).enumerate() {
            let present = (id as usize) < num_slots;
            if present {
                slots[id as usize].stamp = epoch;
            }
            if let Some(t) = &self.tracker
                && !t.passes(hashes[i], key)
            {
                skipped += 1;
                continue;
            }
            if !present {
                new.push(i as u32);
            }
        }
        self.dedupe_new(keys);
        let to_store = self.scratch_new.len();
        if to_store == 0 {
            self.stats.stores_skipped += skipped;
            return Ok(StoreCounts::default());
        }
        let need = to_store.saturating_sub(self.pool.num_free());
        if need > 0 {
            let no_room =
                || Error::NoRoom(format!("need {need} evictable slots for {to_store} keys"));
            if need as u64 > self.stats.evictable {
                return Err(no_room());
            }
            self.scratch_victims.clear();
            let (slots, epoch) = (&self.slots, self.epoch);
            let protected = |s: u32| slots[s as usize].stamp == epoch;
            let ok = match &self.policy {
                PolicyImpl::Lru(l) => l.pick_victims(need, protected, &mut self.scratch_victims),
                PolicyImpl::Arc(a) => {
                    let eligible = |s: u32| slots[s as usize].ref_cnt == 0 && !protected(s);
                    a.pick_victims(need, eligible, &mut self.scratch_victims)
                }
            };
            if !ok {
                return Err(no_room());
            }
            let entries = self
                .scratch_victims
                .iter()
                .map(|&s| slots[s as usize].entry);
            self.keys.prefetch_entries(entries);
            self.evict_victims(&mut out_evicted[..need * kl]);
        }
        self.stats.stores_skipped += skipped;
        out_indices[..to_store].copy_from_slice(&self.scratch_new);
        let (new, hashes, ids) = (
            &self.scratch_new[..],
            &self.scratch_hash,
            &self.scratch_slot,
        );
        let (slots, pool, table) = (&mut self.slots, &mut self.pool, &mut self.keys);
        let out = out_slots[..to_store].iter_mut().zip(new);
        match &mut self.policy {
            PolicyImpl::Lru(_) => {
                for (out, &i) in out {
                    let slot = pool.alloc();
                    table.insert_hashed(hashes[i as usize], slot, key_at(keys, kl, i));
                    slots[slot as usize].ref_cnt = IN_FLIGHT;
                    *out = slot;
                }
            }
            PolicyImpl::Arc(a) => {
                for (out, &i) in out {
                    let slot = pool.alloc();
                    let (hash, id) = (hashes[i as usize], ids[i as usize]);
                    let st = &mut slots[slot as usize];
                    st.entry = a.insert(slot, id, hash, key_at(keys, kl, i), table);
                    st.ref_cnt = IN_FLIGHT;
                    *out = slot;
                }
            }
        }
        self.stats.stores_in_flight += to_store as u64;
        Ok(StoreCounts {
            stored: to_store,
            evicted: need,
        })
    }

    /// Drops repeated keys from `scratch_new` (keeping the first). A filter of at least 64 bits
    /// per key, indexed by hash, passes most keys at once; a key whose bit is already set is
    /// compared with the keys kept before it. After many such clashes (repeated keys en masse),
    /// the rest is sorted by hash instead, so the cost stays `O(n log n)`.
    fn dedupe_new(&mut self, keys: &[u8]) {
        let n = self.scratch_new.len();
        if n < 2 {
            return;
        }
        let words = n.next_power_of_two().max(64);
        let shift = 64 - (words * 64).trailing_zeros();
        self.scratch_filter.clear();
        self.scratch_filter.resize(words, 0);
        let kl = self.cfg.key_len;
        let (filter, new, hashes) = (
            &mut self.scratch_filter[..],
            &mut self.scratch_new[..],
            &self.scratch_hash[..],
        );
        let (mut kept, mut clashes) = (0, 0);
        for j in 0..n {
            let i = new[j];
            let h = hashes[i as usize];
            let bit = (h >> shift) as usize;
            let (word, mask) = (bit / 64, 1u64 << (bit % 64));
            if filter[word] & mask != 0 {
                clashes += 1;
                if clashes > 64 {
                    new.copy_within(j.., kept);
                    self.scratch_new.truncate(kept + n - j);
                    return self.dedupe_sorted(keys);
                }
                let key = key_at(keys, kl, i);
                if new[..kept]
                    .iter()
                    .any(|&k| hashes[k as usize] == h && key_at(keys, kl, k) == key)
                {
                    continue;
                }
            }
            filter[word] |= mask;
            new[kept] = i;
            kept += 1;
        }
        self.scratch_new.truncate(kept);
    }

    /// Drops repeated keys from `scratch_new` (keeping the first) by sorting (hash, position)
    /// pairs and comparing only keys with equal hashes.
    fn dedupe_sorted(&mut self, keys: &[u8]) {
        let n = self.scratch_new.len();
        self.scratch_pairs.clear();
        self.scratch_pairs.extend(
            self.scratch_new
                .iter()
                .enumerate()
                .map(|(j, &i)| (self.scratch_hash[i as usize], j as u32)),
        );
        self.scratch_pairs.sort_unstable();
        let kl = self.cfg.key_len;
        let mut repeats = false;
        let mut run = 0;
        for k in 1..n {
            let (h, j) = self.scratch_pairs[k];
            if h != self.scratch_pairs[run].0 {
                run = k;
                continue;
            }
            // Earlier positions of this hash come first in the run.
            let key = key_at(keys, kl, self.scratch_new[j as usize]);
            if self.scratch_pairs[run..k].iter().any(|&(_, e)| {
                e != u32::MAX && key_at(keys, kl, self.scratch_new[e as usize]) == key
            }) {
                self.scratch_pairs[k].1 = u32::MAX;
                self.scratch_new[j as usize] = u32::MAX;
                repeats = true;
            }
        }
        if repeats {
            self.scratch_new.retain(|&i| i != u32::MAX);
        }
    }

    /// Evicts `scratch_victims`: copies their keys out, frees their slots, records the event.
    fn evict_victims(&mut self, out_evicted: &mut [u8]) {
        let kl = self.cfg.key_len;
        for (out, &s) in out_evicted.chunks_exact_mut(kl).zip(&self.scratch_victims) {
            let key = self.keys.key(self.entry_of_slot(s));
            keys::copy_key(out, key);
            if self.cfg.enable_events {
                self.events.push_key(key);
            }
        }
        if self.cfg.enable_events {
            self.events.end_record(true);
        }
        match &mut self.policy {
            PolicyImpl::Lru(l) => {
                for &s in &self.scratch_victims {
                    l.remove(s);
                    self.keys.remove_id(s);
                }
            }
            PolicyImpl::Arc(a) => {
                let slots = &mut self.slots;
                let entries = self
                    .scratch_victims
                    .iter()
                    .map(|&s| std::mem::replace(&mut slots[s as usize].entry, list::NIL));
                a.evict(entries, &mut self.keys);
            }
        }
        for &s in &self.scratch_victims {
            self.pool.release(s);
        }
        let n = self.scratch_victims.len() as u64;
        self.stats.evictable -= n;
        self.stats.evictions += n;
    }

    /// Drops slot `s`'s key from the policy and the index and frees the slot.
    fn free_slot(&mut self, s: u32) {
        match &mut self.policy {
            PolicyImpl::Lru(l) => {
                l.remove(s);
                self.keys.remove_id(s);
            }
            PolicyImpl::Arc(a) => {
                let e = std::mem::replace(&mut self.slots[s as usize].entry, list::NIL);
                a.remove(e, &mut self.keys);
            }
        }
        self.pool.release(s);
    }

    fn next_epoch(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.slots.iter_mut().for_each(|s| s.stamp = 0);
            self.epoch = 1;
        }
    }

    /// Ends the stores of `keys`. Success makes the in-flight ones ready (one "stored" event);
    /// failure drops the in-flight ones and frees their slots. Keys that are unknown or already
    /// ready are ignored on purpose (as in the reference).
    pub fn complete_store(&mut self, keys: &[u8], success: bool) -> Result<()> {
        self.complete_store_at(keys, &[], success)
    }

    /// [`Self::complete_store`], given the slots `prepare_store` gave the keys (`slots[i]` for
    /// `keys[i]`, or empty): a slot whose store is in flight and holds the key is taken without
    /// a hash lookup; any other slot is only a wrong hint and the key is looked up. Fails with
    /// [`Error::InvalidArgument`], changing nothing, if `slots` is neither empty nor as long as
    /// `keys` or names a slot beyond the tier.
    pub fn complete_store_at(&mut self, keys: &[u8], slots: &[u32], success: bool) -> Result<()> {
        let n = self.check_keys(keys, "keys")?;
        if !slots.is_empty() && slots.len() != n {
            return Err(invalid!("slots: {} slots for {n} keys", slots.len()));
        }
        if let Some(i) = slots.iter().position(|&s| s as usize >= self.cfg.num_slots) {
            return Err(invalid!(
                "slots[{i}]: {} is not below num_slots {}",
                slots[i],
                self.cfg.num_slots
            ));
        }
        let mut ended = 0;
        for (j, key) in keys.chunks_exact(self.cfg.key_len).enumerate() {
            let in_flight = |st: &SlotState| st.ref_cnt == IN_FLIGHT;
            let s = match slots.get(j) {
                Some(&s) if in_flight(&self.slots[s as usize]) && key_eq(self.slot_key(s), key) => {
                    s
                }
                _ => match self.slot(self.find(key)) {
                    Some(s) if in_flight(&self.slots[s as usize]) => s,
                    _ => continue,
                },
            };
            self.slots[s as usize].ref_cnt = 0;
            ended += 1;
            if !success {
                self.free_slot(s);
                continue;
            }
            if let PolicyImpl::Lru(l) = &mut self.policy {
                l.mark_evictable(s);
            }
            if self.cfg.enable_events {
                self.events.push_key(key);
            }
        }
        self.stats.stores_in_flight -= ended;
        if success {
            self.stats.evictable += ended;
        }
        if success && self.cfg.enable_events {
            self.events.end_record(false);
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

    /// Drops `keys` from the tier (their data is known bad, e.g. a failed load): keys that are
    /// ready and not pinned are removed and their slots freed, with one "removed" event. Keys
    /// that are absent, in flight or still pinned by another load are left alone. Returns the
    /// number of keys dropped.
    pub fn discard(&mut self, keys: &[u8]) -> Result<usize> {
        self.check_keys(keys, "keys")?;
        let mut dropped = 0;
        for key in keys.chunks_exact(self.cfg.key_len) {
            let Some(s) = self.slot(self.find(key)) else {
                continue;
            };
            if self.slots[s as usize].ref_cnt != 0 {
                continue;
            }
            if self.cfg.enable_events {
                self.events.push_key(key);
            }
            self.free_slot(s);
            self.stats.evictable -= 1;
            dropped += 1;
        }
        if self.cfg.enable_events {
            self.events.end_record(true);
        }
        Ok(dropped)
    }

    /// Takes the buffered events, oldest first.
    pub fn take_events(&mut self) -> EventLog {
        let fresh = EventLog::new(self.cfg.key_len, self.events.max_keys());
        let log = std::mem::replace(&mut self.events, fresh);
        self.stats.events_dropped += log.dropped();
        log
    }

    /// Buffered events, oldest first (not drained).
    pub fn events(&self) -> &EventLog {
        &self.events
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
    /// and the store-threshold counts are kept. Only safe when the caller discards completions
    /// of jobs from before the reset (the scheduler does).
    pub fn reset(&mut self) {
        self.keys.clear();
        self.pool.reset();
        self.slots.iter_mut().for_each(|s| s.ref_cnt = 0);
        match &mut self.policy {
            PolicyImpl::Lru(l) => l.clear(),
            PolicyImpl::Arc(a) => {
                a.clear();
                self.slots.iter_mut().for_each(|s| s.entry = list::NIL);
            }
        }
        self.stats.evictable = 0;
        self.stats.pinned = 0;
        self.stats.stores_in_flight = 0;
    }

    /// Recounts everything from scratch and compares it with the incremental state.
    pub fn check_invariants(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Internal(m));
        let used = self.pool.num_used();
        let ghosts = match &self.policy {
            PolicyImpl::Lru(_) => 0,
            PolicyImpl::Arc(a) => a.num_ghosts().0 + a.num_ghosts().1,
        };
        if self.keys.len() != used + ghosts {
            return bad(format!(
                "{} keys but {used} used slots and {ghosts} ghosts",
                self.keys.len()
            ));
        }
        let (mut in_flight, mut idle, mut pinned) = (0u64, 0u64, 0u64);
        let mut occupied = vec![false; self.cfg.num_slots];
        for s in self.occupied_slots() {
            occupied[s as usize] = true;
            match self.slots[s as usize].ref_cnt {
                IN_FLIGHT => in_flight += 1,
                0 => idle += 1,
                r if r > 0 => pinned += 1,
                r => return bad(format!("slot {s}: ref count {r}")),
            }
        }
        let st = &self.stats;
        if (in_flight, idle, pinned) != (st.stores_in_flight, st.evictable, st.pinned) {
            return bad(format!(
                "recount (in flight, evictable, pinned) = {:?}, counters {:?}",
                (in_flight, idle, pinned),
                (st.stores_in_flight, st.evictable, st.pinned)
            ));
        }
        match &self.policy {
            PolicyImpl::Lru(l) => {
                let order = l.order();
                if order.len() as u64 != idle
                    || order
                        .iter()
                        .any(|&s| !occupied[s as usize] || self.slots[s as usize].ref_cnt != 0)
                {
                    return bad("LRU list is not the set of evictable slots".into());
                }
            }
            PolicyImpl::Arc(a) => {
                let (b1, b2) = a.num_ghosts();
                if a.listed() != used || b1 > self.cfg.num_slots || b2 > self.cfg.num_slots {
                    return bad(format!(
                        "ARC lists: {} listed, {used} used, ghosts {b1}/{b2}",
                        a.listed()
                    ));
                }
            }
        }
        Ok(())
    }

    fn occupied_slots(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.cfg.num_slots as u32).filter(|&s| {
            let e = self.entry_of_slot(s);
            e != list::NIL && self.find(self.keys.key(e)) == Some(s)
        })
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

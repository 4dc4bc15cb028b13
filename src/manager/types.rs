//! The manager's public types: its configuration, the answers of its calls, and its statistics.

/// Eviction policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Least recently used first.
    #[default]
    Lru,
    /// Adaptive replacement cache.
    Arc,
}

/// Which vLLM release's manager semantics a manager (and a scheduler) follows.
///
/// The differences, in short (`docs/design.md` has the full table): in 0.33 recency is
/// request-scoped (a request's keys are ranked when it begins using them and committed, head
/// newest, when it finishes; no per-step touch), LRU evicts a request's tail before its head,
/// ARC promotes a reused key once per request and falls back to T1 when T2 has no candidate,
/// the store threshold counts offers (stores) instead of lookups, and a lookup of a key whose
/// store is in flight answers [`Lookup::HitPending`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Semantics {
    /// vLLM 0.24 `CPUOffloadingManager`, bit for bit.
    #[default]
    Vllm024,
    /// vLLM 0.33 `CPUOffloadingManager` with its `LRUCachePolicy` and `ARCCachePolicy`.
    Vllm033,
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
    /// When `>= 2`, a key is stored only after it was looked up (0.24) or offered to a store
    /// (0.33) this many times.
    pub store_threshold: u32,
    /// Keys the store-threshold filter tracks (least recently counted dropped first); `>= 1`.
    pub max_tracker_size: usize,
    /// Buffer stored / removed events for
    /// [`Manager::take_events`](super::Manager::take_events): at most
    /// `max(4 * num_slots, MIN_EVENT_KEYS)` keys, the oldest events dropped beyond that
    /// ([`ManagerStats::events_dropped`]).
    pub enable_events: bool,
    /// The vLLM release whose semantics the manager follows.
    pub semantics: Semantics,
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
            semantics: Semantics::Vllm024,
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
    /// Its store is in flight: ask again later (vLLM 0.24 semantics).
    Retry,
    /// Its store is in flight (vLLM 0.33 semantics; 0.24 answers [`Lookup::Retry`]).
    HitPending,
}

/// A request's access record in a manager of vLLM 0.33 semantics (see
/// [`Manager::begin_request`](super::Manager::begin_request)): a handle, valid from
/// `begin_request` until `finish_request`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestId(pub u64);

/// The answer of a prefix lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixLookup {
    /// Leading keys that are stored, counting keys whose store is in flight.
    pub hits: usize,
    /// A key within `hits` has its store in flight: the answer must be retried later.
    pub retry: bool,
}

/// The outcome of [`Manager::prepare_store_into`](super::Manager::prepare_store_into): how
/// much of each output was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreCounts {
    /// Keys to store (entries of the index and slot outputs).
    pub stored: usize,
    /// Keys evicted to make room (keys in the evicted output).
    pub evicted: usize,
}

/// Owned outputs of [`Manager::prepare_store`](super::Manager::prepare_store), reusable across
/// calls.
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
    /// `prepare_store` calls that allocated slots, per number of keys to store (vLLM 0.33's
    /// `kv_offload_cpu_allocation_size` histogram), not cumulative: bucket `i` counts sizes in
    /// `(ALLOCATION_SIZE_BOUNDS[i - 1], ALLOCATION_SIZE_BOUNDS[i]]`, the last one larger sizes.
    /// In 0.33 semantics a call that answered no room counts too (as in vLLM 0.33); in 0.24
    /// semantics only calls that succeeded.
    pub allocation_size_buckets: [u64; ALLOCATION_SIZE_BUCKETS],
    /// Keys of the allocations counted in `allocation_size_buckets` (the histogram's sum).
    pub allocation_keys: u64,
}

/// Upper bounds of the allocation-size buckets, in keys (vLLM 0.33's buckets); one more bucket
/// takes every larger allocation.
pub const ALLOCATION_SIZE_BOUNDS: [u64; 10] = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144];

/// Buckets of [`ManagerStats::allocation_size_buckets`].
pub const ALLOCATION_SIZE_BUCKETS: usize = ALLOCATION_SIZE_BOUNDS.len() + 1;

impl ManagerStats {
    /// Counts one allocation of `keys` slots.
    pub(crate) fn record_allocation(&mut self, keys: usize) {
        let keys = keys as u64;
        self.allocation_size_buckets[ALLOCATION_SIZE_BOUNDS.partition_point(|&b| b < keys)] += 1;
        self.allocation_keys += keys;
    }
}

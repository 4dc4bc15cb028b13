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
    /// Buffer stored / removed events for
    /// [`Manager::take_events`](super::Manager::take_events): at most
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
}

//! The scheduler's configuration, its answers and its stats.

use crate::manager::{ManagerConfig, ManagerStats, Policy, Semantics};

/// Scheduler configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Width of block hashes (= offload keys) in bytes, `1..=64`.
    pub key_len: usize,
    /// Tokens per GPU block (>= 1).
    pub gpu_block_size: u32,
    /// GPU blocks per offloaded chunk (one host slot), >= 1.
    pub block_size_factor: u32,
    /// Host slots of the tier.
    pub num_slots: usize,
    /// Eviction policy of the tier.
    pub policy: Policy,
    /// Worker reports needed to complete a job (one per GPU rank), >= 1.
    pub num_workers: u32,
    /// Offload only prompt tokens (decode tokens are not offloaded).
    pub offload_prompt_only: bool,
    /// See [`ManagerConfig::store_threshold`].
    pub store_threshold: u32,
    /// See [`ManagerConfig::max_tracker_size`].
    pub max_tracker_size: usize,
    /// Buffer stored / removed events.
    pub enable_events: bool,
    /// The vLLM release whose semantics the scheduler and its tier follow.
    pub semantics: Semantics,
}

impl SchedulerConfig {
    /// Tokens per offloaded chunk (`gpu_block_size * block_size_factor`).
    pub(crate) fn chunk_tokens(&self) -> u64 {
        self.gpu_block_size as u64 * self.block_size_factor as u64
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        let m = ManagerConfig::default();
        Self {
            key_len: m.key_len,
            gpu_block_size: 16,
            block_size_factor: 1,
            num_slots: 0,
            policy: m.policy,
            num_workers: 1,
            offload_prompt_only: true,
            store_threshold: m.store_threshold,
            max_tracker_size: m.max_tracker_size,
            enable_events: m.enable_events,
            semantics: m.semantics,
        }
    }
}

/// Why a match was deferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeferReason {
    /// The request has jobs in flight (the fix for vLLM #46014): nothing was looked up.
    JobsInFlight,
    /// A key of the hit has its store in flight.
    StoreInFlight,
    /// A chunk of the hit is being loaded by another request.
    BeingLoaded,
}

/// The answer of [`Scheduler::match_request`](super::Scheduler::match_request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Match {
    /// Ask again on a later step; allocate nothing for the request now.
    Defer(DeferReason),
    /// Nothing to load: compute the request normally.
    Miss,
    /// This many tokens beyond the GPU prefix hit can be loaded (asynchronously).
    Hit(u64),
}

/// One request scheduled in a step, as the host's scheduler output describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScheduledRequest<'a> {
    /// The request.
    pub request_id: u64,
    /// Tokens computed before this step.
    pub num_computed_tokens: u64,
    /// Tokens this step computes.
    pub num_scheduled_tokens: u64,
    /// Tokens of the request now (prompt + generated; may lag by one under async scheduling).
    pub num_tokens: u64,
    /// GPU block ids allocated to the request since the last step (all of them for a request
    /// scheduled for the first time or resumed).
    pub new_block_ids: &'a [u32],
    /// Resumed after preemption: `new_block_ids` replaces the request's block list.
    pub resumed: bool,
}

/// Tokens a request must recompute because its load failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recompute {
    /// First token to recompute.
    pub from_token: u64,
    /// One past the last token the failed load would have filled.
    pub to_token: u64,
}

/// Counters (cumulative) and gauges of the scheduler and its tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedulerStats {
    /// Requests tracked (including finished ones whose jobs are still in flight, or, in 0.33
    /// semantics, whose final store is due in the next step).
    pub requests: u64,
    /// Matches answered.
    pub matches: u64,
    /// Matches deferred because the request had jobs in flight.
    pub deferred_jobs_in_flight: u64,
    /// Matches deferred because a hit key's store was in flight.
    pub deferred_store_in_flight: u64,
    /// Matches deferred because a hit chunk was being loaded for another request.
    pub deferred_being_loaded: u64,
    /// Matches that answered a hit.
    pub hits: u64,
    /// Tokens of those hits.
    pub hit_tokens: u64,
    /// Load jobs made.
    pub load_jobs: u64,
    /// Store jobs made.
    pub store_jobs: u64,
    /// Chunks those store jobs offload.
    pub stored_chunks: u64,
    /// Store attempts answered "no room" (retried on a later step).
    pub store_no_room: u64,
    /// Jobs that completed with a failure.
    pub failed_jobs: u64,
    /// Load jobs in flight now.
    pub loads_in_flight: u64,
    /// Store jobs in flight now.
    pub stores_in_flight: u64,
    /// The tier's stats.
    pub manager: ManagerStats,
}

//! The connector scheduler: per-request offload state, prefix matching with deferral while a
//! request's transfers are in flight, load jobs after allocation, store jobs each step, flushes
//! for preemption and GPU-block reuse, and job completion across workers.
//!
//! Behaviour follows vLLM's `OffloadingConnectorScheduler` for one full-attention KV group, of
//! the release [`SchedulerConfig::semantics`] names: 0.24, or 0.33 (no touch; keys carry their
//! positions; a request's recency committed the step after it finishes, after its final store
//! jobs; every match rewinds the next chunk to store to the first). The differences listed in
//! `docs/design.md` hold in both: failed jobs roll back (a failed load drops its keys and
//! reports what to recompute), `reset` clears in-flight job sets, every pin is released, no GPU
//! block is reused while a job touches it, and a call that fails changes nothing.
//!
//! The files, one rule each: `types` (configuration, answers, stats), `matching` (the
//! deferral rule, lookups, load jobs), `step` (a step's plan: store jobs and the flush set),
//! `completion` (job completion, finishing requests, the reuse fence, reset), `invariants`.

mod completion;
mod invariants;
mod jobs;
mod matching;
mod request;
mod step;
mod types;

pub use jobs::JobReport;
pub use types::{DeferReason, Match, Recompute, ScheduledRequest, SchedulerConfig, SchedulerStats};

use crate::error::{Error, Result, invalid};
use crate::manager::{EventLog, Manager, ManagerConfig, Semantics, StorePlan};
use crate::plan::{Direction, Step};
use hashbrown::HashMap;
use jobs::Job;
use request::{Finishing, Request};

/// The scheduler side of KV offloading. Not thread-safe by itself; the C API serializes calls.
pub struct Scheduler {
    cfg: SchedulerConfig,
    manager: Manager,
    /// Boxed: the map's probes read 16-byte entries, not whole request states.
    requests: HashMap<u64, Box<Request>>,
    jobs: HashMap<u64, Job>,
    next_job_id: u64,
    /// Reports for job ids below this are from before a reset and ignored.
    stale_below: u64,
    /// Load jobs made since the last step.
    pending_loads: Step,
    /// GPU block ids allocated since the last step (inputs of the reuse fence).
    allocated: Vec<u32>,
    /// The reuse fence: GPU block id → in-flight jobs touching it whose request gave the block
    /// back (finished, aborted, re-matched, resumed on other blocks). Allocating a fenced block
    /// puts its jobs in the next step's flush set; a job leaves the fence when it completes.
    fence: HashMap<u32, Vec<u64>>,
    /// Jobs to flush in the next step.
    flush: Vec<u64>,
    stats: SchedulerStats,
    /// Outputs of the store calls; its buffers keep their longest length (see
    /// `build_store_job`).
    plan: StorePlan,
    scratch_slots: Vec<u32>,
    scratch_counts: HashMap<u64, u32>,
    /// `build_step` calls so far (marks of the requests each call schedules).
    build_calls: u64,
    /// Per scheduled request of a step: its offloadable chunks.
    scratch_chunks: Vec<u64>,
    /// Buffers of completed jobs, reused by new ones (no allocation per job once warm).
    spare_keys: Vec<Vec<u8>>,
    spare_blocks: Vec<Vec<u32>>,
    /// States of dropped requests, whose boxes and buffers new requests reuse.
    #[expect(
        clippy::vec_box,
        reason = "the boxes themselves are reused by new requests"
    )]
    spare_requests: Vec<Box<Request>>,
    /// vLLM 0.33: requests finished since the last step, in finish order; the next step builds
    /// their final store jobs, then commits their records.
    finishing: Vec<Finishing>,
    /// Key positions of a load or store (0.33), and the GPU blocks allocated since the last
    /// step, sorted (0.33 final stores leave out chunks on such blocks).
    scratch_positions: Vec<u64>,
    scratch_allocated: Vec<u32>,
}

impl Scheduler {
    /// A scheduler with `cfg`; fails with [`Error::InvalidArgument`] naming the bad field.
    pub fn new(cfg: SchedulerConfig) -> Result<Self> {
        if cfg.gpu_block_size == 0 {
            return Err(invalid!("gpu_block_size: 0"));
        }
        if cfg.block_size_factor == 0 {
            return Err(invalid!("block_size_factor: 0"));
        }
        if cfg
            .gpu_block_size
            .checked_mul(cfg.block_size_factor)
            .is_none()
        {
            return Err(invalid!(
                "block_size_factor: {} chunks of {}-token blocks overflow",
                cfg.block_size_factor,
                cfg.gpu_block_size
            ));
        }
        if cfg.num_workers == 0 {
            return Err(invalid!("num_workers: 0"));
        }
        let manager = Manager::new(ManagerConfig {
            key_len: cfg.key_len,
            num_slots: cfg.num_slots,
            policy: cfg.policy,
            store_threshold: cfg.store_threshold,
            max_tracker_size: cfg.max_tracker_size,
            enable_events: cfg.enable_events,
            semantics: cfg.semantics,
        })?;
        Ok(Self {
            cfg,
            manager,
            requests: HashMap::new(),
            jobs: HashMap::new(),
            next_job_id: 0,
            stale_below: 0,
            pending_loads: Step::new(),
            allocated: Vec::new(),
            fence: HashMap::new(),
            flush: Vec::new(),
            stats: SchedulerStats::default(),
            plan: StorePlan::default(),
            scratch_slots: Vec::new(),
            scratch_counts: HashMap::new(),
            build_calls: 0,
            scratch_chunks: Vec::new(),
            spare_keys: Vec::new(),
            spare_blocks: Vec::new(),
            spare_requests: Vec::new(),
            finishing: Vec::new(),
            scratch_positions: Vec::new(),
            scratch_allocated: Vec::new(),
        })
    }

    /// Whether the scheduler follows vLLM 0.33 semantics.
    #[inline]
    fn v033(&self) -> bool {
        self.cfg.semantics == Semantics::Vllm033
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The tier (read-only).
    pub fn manager(&self) -> &Manager {
        &self.manager
    }

    fn request(&self, id: u64) -> Result<&Request> {
        self.requests
            .get(&id)
            .map(|r| &**r)
            .ok_or_else(|| Error::NotFound(format!("request_id: {id} is not tracked")))
    }

    fn live_request(&self, id: u64) -> Result<&Request> {
        let r = self.request(id)?;
        if r.finished {
            return Err(Error::InvalidState(format!("request_id: {id} is finished")));
        }
        Ok(r)
    }

    /// Starts tracking a request of `prompt_tokens` tokens. `max_offload_tokens` caps the
    /// tokens offloaded for it (0: none). Fails with [`Error::InvalidState`] if `id` is tracked.
    pub fn add_request(
        &mut self,
        id: u64,
        prompt_tokens: u64,
        max_offload_tokens: Option<u64>,
    ) -> Result<()> {
        if self.requests.contains_key(&id) {
            return Err(Error::InvalidState(format!(
                "request_id: {id} is already tracked"
            )));
        }
        let mut r = self.spare_requests.pop().unwrap_or_default();
        let record = self.v033().then(|| self.manager.begin_request());
        let spare = std::mem::take(&mut *r);
        *r = Request {
            record,
            prompt_tokens,
            num_tokens: prompt_tokens,
            max_offload_tokens,
            keys: cleared(spare.keys),
            key_hashes: cleared(spare.key_hashes),
            block_ids: cleared(spare.block_ids),
            jobs: cleared(spare.jobs),
            ..Default::default()
        };
        self.requests.insert(id, r);
        Ok(())
    }

    /// Appends block hashes (one per newly full GPU block, `key_len` bytes each) and sets the
    /// request's token count. The offload key of a chunk is the hash of its last GPU block.
    pub fn append_block_hashes(&mut self, id: u64, hashes: &[u8], num_tokens: u64) -> Result<()> {
        let (kl, f) = (self.cfg.key_len, self.cfg.block_size_factor as u64);
        if !hashes.len().is_multiple_of(kl) {
            return Err(invalid!(
                "hashes: {} bytes is not a multiple of key_len {kl}",
                hashes.len()
            ));
        }
        let r = self.live_request(id)?;
        let total = r.num_hashes + (hashes.len() / kl) as u64;
        if total > num_tokens / self.cfg.gpu_block_size as u64 {
            return Err(invalid!(
                "hashes: {total} full blocks hashed but num_tokens {num_tokens} fills only {}",
                num_tokens / self.cfg.gpu_block_size as u64
            ));
        }
        let r = self.requests.get_mut(&id).expect("checked");
        for h in hashes.chunks_exact(kl) {
            r.num_hashes += 1;
            if r.num_hashes.is_multiple_of(f) {
                r.keys.extend_from_slice(h);
                r.key_hashes.push(self.manager.key_hash(h));
            }
        }
        r.num_tokens = num_tokens;
        Ok(())
    }

    /// The tokens a request must recompute because its load failed, reported until its next
    /// match; `None` if its last load did not fail.
    pub fn load_failure(&self, id: u64) -> Result<Option<Recompute>> {
        let r = self.request(id)?;
        Ok(r.recompute.map(|(from_token, to_token)| Recompute {
            from_token,
            to_token,
        }))
    }

    /// True while the request has jobs in flight.
    pub fn has_jobs_in_flight(&self, id: u64) -> Result<bool> {
        Ok(!self.request(id)?.jobs.is_empty())
    }

    /// Takes the tier's buffered stored / removed events.
    pub fn take_events(&mut self) -> EventLog {
        self.manager.take_events()
    }

    /// Counters and gauges.
    pub fn stats(&self) -> SchedulerStats {
        let loads = self
            .jobs
            .values()
            .filter(|j| j.kind == Direction::Load)
            .count() as u64;
        SchedulerStats {
            requests: self.requests.len() as u64,
            loads_in_flight: loads,
            stores_in_flight: self.jobs.len() as u64 - loads,
            manager: self.manager.stats(),
            ..self.stats
        }
    }
}

/// `v`, emptied.
fn cleared<T>(mut v: Vec<T>) -> Vec<T> {
    v.clear();
    v
}

/// A spare buffer (or a new one), empty.
fn take_cleared<T>(spare: &mut Vec<Vec<T>>) -> Vec<T> {
    cleared(spare.pop().unwrap_or_default())
}

/// A spare buffer (or a new one) holding a copy of `data`.
fn take_filled<T: Copy>(spare: &mut Vec<Vec<T>>, data: &[T]) -> Vec<T> {
    let mut v = take_cleared(spare);
    v.extend_from_slice(data);
    v
}

/// Keeps a finished job's buffer for reuse (a bounded number of them).
fn recycle<T>(spare: &mut Vec<Vec<T>>, v: Vec<T>) {
    if spare.len() < 4096 && v.capacity() > 0 {
        spare.push(v);
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_vllm033;

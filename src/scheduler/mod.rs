//! The connector scheduler: per-request offload state, prefix matching with deferral while a
//! request's transfers are in flight, load jobs after allocation, store jobs each step, flushes
//! for preemption and GPU-block reuse, and job completion across workers.
//!
//! Behaviour follows vLLM 0.24's `OffloadingConnectorScheduler` for one full-attention KV group
//! (reference §4, §5), with the improvements of `DESIGN.md`: failed jobs roll back (a failed load
//! drops its keys and reports what to recompute), `reset` clears in-flight job sets, every pin is
//! released, and a call that fails changes nothing.

mod jobs;
mod request;
mod step;

pub use jobs::JobReport;
pub use step::{FORMAT_VERSION, JobDesc, JobKind, Step};

use crate::error::{Error, Result, invalid};
use crate::manager::{EventLog, Manager, ManagerConfig, ManagerStats, Policy, StorePlan};
use hashbrown::HashMap;
use jobs::Job;
use request::Request;

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

/// The answer of [`Scheduler::match_request`].
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
    /// Requests tracked (including finished ones whose jobs are still in flight).
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

/// The scheduler side of KV offloading. Not thread-safe by itself; the C API serializes calls.
pub struct Scheduler {
    cfg: SchedulerConfig,
    manager: Manager,
    requests: HashMap<u64, Request>,
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
    /// States of dropped requests, whose buffers new requests reuse.
    spare_requests: Vec<Request>,
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
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The tier (read-only).
    pub fn manager(&self) -> &Manager {
        &self.manager
    }

    fn chunk_tokens(&self) -> u64 {
        self.cfg.gpu_block_size as u64 * self.cfg.block_size_factor as u64
    }

    fn request(&self, id: u64) -> Result<&Request> {
        self.requests
            .get(&id)
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
        let spare = self.spare_requests.pop().unwrap_or_default();
        let r = Request {
            prompt_tokens,
            num_tokens: prompt_tokens,
            max_offload_tokens,
            keys: cleared(spare.keys),
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
            }
        }
        r.num_tokens = num_tokens;
        Ok(())
    }

    /// Matches a waiting request against the tier. `num_computed_tokens` are the tokens already
    /// hit in the GPU prefix cache (whole GPU blocks).
    ///
    /// Clears the request's GPU block ids (stale after a preemption). While the request has any
    /// job in flight it answers [`DeferReason::JobsInFlight`] at once, looking nothing up and
    /// touching nothing. Otherwise looks up the complete chunks after the GPU hit (a hit needs
    /// at least one full chunk), then touches all the request's keys.
    ///
    /// Fails with [`Error::InvalidState`], changing nothing, if the request is finished or its
    /// block hashes do not cover its tokens.
    pub fn match_request(&mut self, id: u64, num_computed_tokens: u64) -> Result<Match> {
        let (kl, obs, gbs) = (
            self.cfg.key_len,
            self.chunk_tokens(),
            self.cfg.gpu_block_size as u64,
        );
        let r = self.live_request(id)?;
        let in_flight = !r.jobs.is_empty();
        if !in_flight && r.num_hashes < r.num_tokens / gbs {
            return Err(Error::InvalidState(format!(
                "request_id: {id} has {} block hashes, its {} tokens need {} (append them first)",
                r.num_hashes,
                r.num_tokens,
                r.num_tokens / gbs
            )));
        }
        self.stats.matches += 1;
        if in_flight {
            // A request matched again has no GPU blocks: the ones its jobs touch are given back.
            self.release_blocks(id);
        }
        let r = self.requests.get_mut(&id).expect("checked");
        r.block_ids.clear();
        r.recompute = None;
        r.matched_hit = None;
        if in_flight {
            self.stats.deferred_jobs_in_flight += 1;
            return Ok(Match::Defer(DeferReason::JobsInFlight));
        }
        r.num_local_computed = num_computed_tokens;
        let result = lookup(&mut self.manager, r, num_computed_tokens, obs, kl)?;
        match result {
            Match::Defer(DeferReason::StoreInFlight) => self.stats.deferred_store_in_flight += 1,
            Match::Defer(_) => self.stats.deferred_being_loaded += 1,
            Match::Hit(n) => {
                r.matched_hit = Some(n);
                self.stats.hits += 1;
                self.stats.hit_tokens += n;
            }
            Match::Miss => {}
        }
        Ok(result)
    }

    /// Records the GPU blocks allocated to a request after a match, and with
    /// `num_external_tokens > 0` (the hit to load) makes its load job: pins the keys and queues
    /// the job for the next step. `block_ids` are all the request's GPU blocks. Returns the job
    /// id, or `None` when there is nothing to load.
    ///
    /// Fails, changing nothing: [`Error::InvalidState`] if the request is finished, or (with
    /// `num_external_tokens > 0`) has jobs in flight or its last match was not a hit of at least
    /// that many tokens, or another request's load pinned the hit since (match again);
    /// [`Error::InvalidArgument`] if the tokens exceed the offloaded chunks or
    /// `block_ids` is shorter than the tokens need; [`Error::NotFound`] /
    /// [`Error::InvalidState`] from the tier if a key is no longer ready.
    pub fn on_alloc(
        &mut self,
        id: u64,
        block_ids: &[u32],
        num_external_tokens: u64,
    ) -> Result<Option<u64>> {
        let (kl, obs, gbs) = (
            self.cfg.key_len,
            self.chunk_tokens(),
            self.cfg.gpu_block_size as u64,
        );
        let r = self.live_request(id)?;
        if num_external_tokens == 0 {
            // Recorded even without a load (vLLM #46951): these blocks may be reused ones.
            self.allocated.extend_from_slice(block_ids);
            self.requests.get_mut(&id).expect("checked").matched_hit = None;
            return Ok(None);
        }
        if !r.jobs.is_empty() {
            return Err(Error::InvalidState(format!(
                "request_id: {id} has jobs in flight; match defers it until they complete"
            )));
        }
        if r.matched_hit.is_none_or(|hit| num_external_tokens > hit) {
            return Err(Error::InvalidState(format!(
                "num_external_tokens: {num_external_tokens} for request {id}, whose last match was not a hit of that many tokens ({:?})",
                r.matched_hit
            )));
        }
        let local = r.num_local_computed;
        let total = local
            .checked_add(num_external_tokens)
            .filter(|&t| t <= r.num_keys(kl) * obs)
            .ok_or_else(|| {
                invalid!(
                    "num_external_tokens: {num_external_tokens} after {local} GPU-hit tokens exceeds the {} offloaded chunks",
                    r.num_keys(kl)
                )
            })?;
        let num_gpu = total.div_ceil(gbs);
        if (block_ids.len() as u64) < num_gpu {
            return Err(invalid!(
                "block_ids: {} ids, {num_gpu} needed for {total} tokens",
                block_ids.len()
            ));
        }
        let local_gpu = local / gbs;
        let num_chunks = total.div_ceil(obs);
        let r = &self.requests[&id];
        let keys = r.keys_of(
            kl,
            local_gpu / self.cfg.block_size_factor as u64,
            num_chunks,
        );
        // Another request's load may have pinned these chunks since the match: loading them
        // twice is what `Defer(BeingLoaded)` prevents, so the host must match again.
        if being_loaded(&self.manager, keys, kl) {
            return Err(Error::InvalidState(format!(
                "request_id: {id}: its hit is being loaded by another request; match it again"
            )));
        }
        self.scratch_slots.resize(keys.len() / kl, 0);
        self.manager.prepare_load(keys, &mut self.scratch_slots)?;
        let job_id = self.next_job_id;
        self.next_job_id += 1;
        let dst = &block_ids[local_gpu as usize..num_gpu as usize];
        self.pending_loads.push_job(
            job_id,
            JobKind::Load,
            id,
            local_gpu as u32,
            &self.scratch_slots,
            dst,
        );
        let job = Job {
            request_id: id,
            kind: JobKind::Load,
            pending: self.cfg.num_workers,
            failed: false,
            keys: take_filled(&mut self.spare_keys, keys),
            gpu_blocks: take_filled(&mut self.spare_blocks, dst),
            slots: Vec::new(),
            tokens: (local_gpu * gbs, total),
            first_chunk: local_gpu / self.cfg.block_size_factor as u64,
            released: false,
        };
        self.jobs.insert(job_id, job);
        let r = self.requests.get_mut(&id).expect("checked");
        r.jobs.push(job_id);
        r.next_stored_chunk = num_chunks;
        r.matched_hit = None;
        self.allocated.extend_from_slice(block_ids);
        self.stats.load_jobs += 1;
        Ok(Some(job_id))
    }

    /// Builds the step plan into `step`: the load jobs made since the last step, the store jobs
    /// of the scheduled requests' newly complete chunks, and the flush set: the jobs of the
    /// preempted requests, the fenced jobs touching a GPU block allocated since the last step
    /// (see [`Self::finish_request`]), and the jobs of a reset. A preempted request's load not
    /// yet in a step is withdrawn (it never ships; its keys are unpinned).
    ///
    /// Fails, changing nothing: [`Error::NotFound`] for an unknown request,
    /// [`Error::InvalidState`] for a finished one or one whose load is in flight,
    /// [`Error::InvalidArgument`] for a request scheduled twice, scheduled and preempted at once,
    /// or whose block ids do not cover its computed tokens.
    pub fn build_step(
        &mut self,
        scheduled: &[ScheduledRequest<'_>],
        preempted: &[u64],
        step: &mut Step,
    ) -> Result<()> {
        let gbs = self.cfg.gpu_block_size as u64;
        // Each call marks its requests with a new number: a request met twice is a duplicate.
        self.build_calls += 1;
        let mark = self.build_calls;
        for (i, s) in scheduled.iter().enumerate() {
            let id = s.request_id;
            let r = match self.requests.get_mut(&id) {
                None => return Err(Error::NotFound(format!("request_id: {id} is not tracked"))),
                Some(r) if r.finished => {
                    return Err(Error::InvalidState(format!("request_id: {id} is finished")));
                }
                Some(r) => r,
            };
            if std::mem::replace(&mut r.build_mark, mark) == mark {
                return Err(invalid!(
                    "scheduled[{i}].request_id: {id} is scheduled twice"
                ));
            }
            if r.jobs.iter().any(|j| self.jobs[j].kind == JobKind::Load) {
                return Err(Error::InvalidState(format!(
                    "scheduled[{i}].request_id: {} is still loading; schedule it after its load completes",
                    s.request_id
                )));
            }
            let after = s
                .num_computed_tokens
                .checked_add(s.num_scheduled_tokens)
                .ok_or_else(|| {
                    invalid!("scheduled[{i}]: num_computed_tokens + num_scheduled_tokens overflows")
                })?;
            let blocks = if s.resumed { 0 } else { r.block_ids.len() } + s.new_block_ids.len();
            if (blocks as u64).saturating_mul(gbs) < after.min(s.num_tokens) {
                return Err(invalid!(
                    "scheduled[{i}].new_block_ids: request {} would have {blocks} GPU blocks for {} tokens",
                    s.request_id,
                    after.min(s.num_tokens)
                ));
            }
        }
        for (i, &p) in preempted.iter().enumerate() {
            let r = self.request(p).map_err(|_| {
                Error::NotFound(format!("preempted[{i}]: request {p} is not tracked"))
            })?;
            if r.build_mark == mark {
                return Err(invalid!(
                    "preempted[{i}]: request {p} is also scheduled in this step"
                ));
            }
        }

        for s in scheduled {
            if s.resumed {
                self.release_blocks(s.request_id);
            }
            let r = self.requests.get_mut(&s.request_id).expect("validated");
            r.num_tokens = s.num_tokens;
            if s.resumed {
                r.block_ids.clear();
            }
            r.block_ids.extend_from_slice(s.new_block_ids);
            self.allocated.extend_from_slice(s.new_block_ids);
        }
        for &p in preempted {
            // The flush makes the worker finish these jobs before this step's copies and forward
            // pass, so whatever reuses the blocks from this step on is safe: no fence needed.
            self.withdraw_unshipped_load(p);
            for &j in &self.requests[&p].jobs {
                self.flush.push(j);
                self.jobs.get_mut(&j).expect("in flight").released = true;
            }
        }
        if self.fence.is_empty() {
            self.allocated.clear();
        }
        for b in self.allocated.drain(..) {
            if let Some(jobs) = self.fence.get(&b) {
                self.flush.extend_from_slice(jobs);
            }
        }
        step.clear(self.cfg.block_size_factor);
        for j in self.pending_loads.jobs() {
            if self.jobs.contains_key(&j.id) {
                step.push_from(&self.pending_loads, j);
            }
        }
        self.pending_loads.clear(self.cfg.block_size_factor);
        // Large tiers: start the index misses of every store candidate of the step at once.
        self.scratch_chunks.clear();
        for s in scheduled {
            let n = self.offloadable_chunks(s);
            let r = &self.requests[&s.request_id];
            if n > r.next_stored_chunk {
                let keys = r.keys_of(self.cfg.key_len, r.next_stored_chunk, n);
                self.manager.prefetch(keys);
            }
            self.scratch_chunks.push(n);
        }
        for (i, s) in scheduled.iter().enumerate() {
            // The next storing request touches all its keys: start their misses now. Its store
            // candidates were prefetched above already, but by now they may have left the
            // closer caches; prefetching only the others measured 20 % slower.
            if let Some(next) = scheduled.get(i + 1) {
                let r = &self.requests[&next.request_id];
                if self.scratch_chunks[i + 1] > r.next_stored_chunk {
                    self.manager.prefetch(&r.keys);
                }
            }
            self.build_store_job(s, self.scratch_chunks[i], step)?;
        }
        step.set_flush(self.flush.drain(..));
        Ok(())
    }

    /// Complete chunks the request may offload after this step (limits applied).
    fn offloadable_chunks(&self, s: &ScheduledRequest<'_>) -> u64 {
        let r = &self.requests[&s.request_id];
        let mut offloadable = (s.num_computed_tokens + s.num_scheduled_tokens).min(r.num_tokens);
        if let Some(cap) = r.max_offload_tokens {
            offloadable = offloadable.min(cap);
        }
        if self.cfg.offload_prompt_only {
            offloadable = offloadable.min(r.prompt_tokens);
        }
        (offloadable / self.chunk_tokens()).min(r.num_keys(self.cfg.key_len))
    }

    /// Reference §4.4.2 for one scheduled request.
    /// `n`: the request's offloadable chunks after this step.
    fn build_store_job(&mut self, s: &ScheduledRequest<'_>, n: u64, step: &mut Step) -> Result<()> {
        let (kl, f) = (self.cfg.key_len, self.cfg.block_size_factor as usize);
        let r = self.requests.get_mut(&s.request_id).expect("validated");
        let start = r.next_stored_chunk;
        if n <= start {
            r.next_stored_chunk = n;
            return Ok(());
        }
        let candidates = r.keys_of(kl, start, n);
        match self.manager.prepare_store(candidates, &mut self.plan) {
            Err(Error::NoRoom(_)) => {
                self.stats.store_no_room += 1;
                return Ok(());
            }
            Err(e) => return Err(Error::Internal(format!("prepare_store: {e}"))),
            Ok(c) if c.stored == 0 => {
                r.next_stored_chunk = n;
                return Ok(());
            }
            Ok(_) => {}
        }
        self.manager.touch(&r.keys)?;
        // The stored chunks: usually one run (all but the already stored ones), copied at once.
        let (mut keys, mut blocks) = (
            take_cleared(&mut self.spare_keys),
            take_cleared(&mut self.spare_blocks),
        );
        let ix = &self.plan.indices;
        let (first, last) = (
            start as usize + ix[0] as usize,
            start as usize + ix[ix.len() - 1] as usize,
        );
        if last + 1 - first == ix.len() {
            keys.extend_from_slice(&r.keys[first * kl..(last + 1) * kl]);
            blocks.extend_from_slice(&r.block_ids[first * f..(last + 1) * f]);
        } else {
            for &i in ix {
                let chunk = start as usize + i as usize;
                keys.extend_from_slice(&r.keys[chunk * kl..(chunk + 1) * kl]);
                blocks.extend_from_slice(&r.block_ids[chunk * f..(chunk + 1) * f]);
            }
        }
        let job_id = self.next_job_id;
        self.next_job_id += 1;
        step.push_job(
            job_id,
            JobKind::Store,
            s.request_id,
            (first * f) as u32,
            &blocks,
            &self.plan.slots,
        );
        r.jobs.push(job_id);
        r.next_stored_chunk = n;
        self.stats.store_jobs += 1;
        self.stats.stored_chunks += ix.len() as u64;
        let job = Job {
            request_id: s.request_id,
            kind: JobKind::Store,
            pending: self.cfg.num_workers,
            failed: false,
            keys,
            gpu_blocks: blocks,
            slots: take_filled(&mut self.spare_blocks, &self.plan.slots),
            tokens: (0, 0),
            first_chunk: first as u64,
            released: false,
        };
        self.jobs.insert(job_id, job);
        Ok(())
    }

    /// Counts worker reports. A job completes once `num_workers` reports arrived; it failed if
    /// any report failed. On completion: a store's keys become ready (or are rolled back), a
    /// load's keys are unpinned (and on failure dropped from the tier, the request then reports
    /// the tokens to recompute). Ids from before a reset are ignored.
    ///
    /// Fails, changing nothing: [`Error::NotFound`] for an unknown job id,
    /// [`Error::InvalidState`] for a load not yet in a step, [`Error::InvalidArgument`] for a
    /// zero count or more reports than workers.
    pub fn complete_jobs(&mut self, reports: &[JobReport]) -> Result<()> {
        self.scratch_counts.clear();
        for (i, rep) in reports.iter().enumerate() {
            if rep.count == 0 {
                return Err(invalid!("reports[{i}].count: 0"));
            }
            if rep.job_id < self.stale_below {
                continue;
            }
            let Some(job) = self.jobs.get(&rep.job_id) else {
                return Err(Error::NotFound(format!(
                    "reports[{i}].job_id: {} is not in flight",
                    rep.job_id
                )));
            };
            if self.pending_loads.jobs().iter().any(|j| j.id == rep.job_id) {
                return Err(Error::InvalidState(format!(
                    "reports[{i}].job_id: load {} is not in a step yet",
                    rep.job_id
                )));
            }
            let seen = self.scratch_counts.entry(rep.job_id).or_insert(0);
            *seen = seen.saturating_add(rep.count);
            if *seen > job.pending {
                return Err(invalid!(
                    "reports[{i}].count: job {} has {} reports pending, {} given",
                    rep.job_id,
                    job.pending,
                    *seen
                ));
            }
        }
        for rep in reports {
            if rep.job_id < self.stale_below {
                continue;
            }
            let job = self.jobs.get_mut(&rep.job_id).expect("validated");
            job.pending -= rep.count;
            job.failed |= !rep.success;
            if job.pending == 0 {
                self.finish_job(rep.job_id)?;
            }
        }
        Ok(())
    }

    fn finish_job(&mut self, job_id: u64) -> Result<()> {
        let job = self.jobs.remove(&job_id).expect("in flight");
        let r = self
            .requests
            .get_mut(&job.request_id)
            .expect("a job's request is tracked");
        if job.failed {
            self.stats.failed_jobs += 1;
            // Its chunks are not in the tier (rolled back or dropped): offer them again.
            r.next_stored_chunk = r.next_stored_chunk.min(job.first_chunk);
        }
        match job.kind {
            JobKind::Store => self
                .manager
                .complete_store_at(&job.keys, &job.slots, !job.failed)?,
            JobKind::Load => {
                self.manager.complete_load(&job.keys)?;
                if job.failed {
                    self.manager.discard(&job.keys)?;
                    r.recompute = Some(job.tokens);
                }
            }
        }
        if job.released {
            for b in &job.gpu_blocks {
                if let Some(jobs) = self.fence.get_mut(b) {
                    jobs.retain(|&j| j != job_id);
                    if jobs.is_empty() {
                        self.fence.remove(b);
                    }
                }
            }
        }
        r.jobs.retain(|&j| j != job_id);
        if r.finished && r.jobs.is_empty() {
            self.drop_request(job.request_id);
        }
        recycle(&mut self.spare_keys, job.keys);
        recycle(&mut self.spare_blocks, job.gpu_blocks);
        recycle(&mut self.spare_blocks, job.slots);
        Ok(())
    }

    /// Stops tracking `id`, keeping its buffers for a later request when they are small (at most
    /// 1024 requests of up to 16 KiB each are kept).
    fn drop_request(&mut self, id: u64) {
        let Some(r) = self.requests.remove(&id) else {
            return;
        };
        let bytes = r.keys.capacity() + 4 * r.block_ids.capacity() + 8 * r.jobs.capacity();
        if self.spare_requests.len() < 1024 && bytes <= 16 << 10 {
            self.spare_requests.push(r);
        }
    }

    /// Finishes (or aborts) a request; the host may reuse its GPU blocks at once. A load not yet
    /// in a step is withdrawn (it never ships; its keys are unpinned). Without other jobs in
    /// flight the request's state is dropped now; otherwise when its last job completes, and
    /// until then the GPU blocks those jobs touch (stores read them, loads write them) are
    /// fenced: a step that allocates one of them flushes those jobs, so the worker finishes them
    /// before that step's copies and forward pass.
    ///
    /// Fails with [`Error::NotFound`] for an unknown request and [`Error::InvalidState`] for a
    /// finished one, changing nothing.
    pub fn finish_request(&mut self, id: u64) -> Result<()> {
        self.live_request(id)?;
        self.release_blocks(id);
        let r = self.requests.get_mut(&id).expect("checked");
        if r.jobs.is_empty() {
            self.drop_request(id);
        } else {
            r.finished = true;
        }
        Ok(())
    }

    /// The request gives its GPU blocks back while its jobs may still touch them: its load not
    /// yet in a step is withdrawn, and every shipped job not released yet enters the fence on
    /// the blocks it touches.
    fn release_blocks(&mut self, id: u64) {
        self.withdraw_unshipped_load(id);
        for &j in &self.requests[&id].jobs {
            let job = self.jobs.get_mut(&j).expect("in flight");
            if !std::mem::replace(&mut job.released, true) {
                for &b in &job.gpu_blocks {
                    self.fence.entry(b).or_default().push(j);
                }
            }
        }
    }

    /// Withdraws the request's load job if it is not in a step yet: nothing has touched its
    /// blocks, so it is dropped (keys unpinned, chunks offered again) and never ships.
    fn withdraw_unshipped_load(&mut self, id: u64) {
        let r = &self.requests[&id];
        let Some(&j) = r.jobs.first() else {
            return;
        };
        if self.jobs[&j].kind != JobKind::Load
            || !self.pending_loads.jobs().iter().any(|p| p.id == j)
        {
            return;
        }
        let job = self.jobs.remove(&j).expect("in flight");
        self.manager
            .complete_load(&job.keys)
            .expect("a load's keys are pinned");
        let r = self.requests.get_mut(&id).expect("tracked");
        r.jobs.clear();
        r.next_stored_chunk = r.next_stored_chunk.min(job.first_chunk);
        recycle(&mut self.spare_keys, job.keys);
        recycle(&mut self.spare_blocks, job.gpu_blocks);
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

    /// Drops the whole tier: every in-flight job goes into the next step's flush set and its
    /// later reports are ignored, finished requests are dropped, live requests restart storing
    /// from their first chunk and have no job in flight.
    ///
    /// Fails with [`Error::InvalidState`], changing nothing, while load jobs made since the last
    /// step are not yet in a step (call [`Self::build_step`] first).
    pub fn reset(&mut self) -> Result<()> {
        if self
            .pending_loads
            .jobs()
            .iter()
            .any(|j| self.jobs.contains_key(&j.id))
        {
            return Err(Error::InvalidState(
                "reset: load jobs made since the last step are not in a step yet; build the step first".into(),
            ));
        }
        self.flush.extend(self.jobs.keys().copied());
        self.requests.retain(|_, r| !r.finished);
        self.manager.reset();
        for r in self.requests.values_mut() {
            r.next_stored_chunk = 0;
            r.jobs.clear();
        }
        self.stale_below = self.next_job_id;
        self.jobs.clear();
        self.fence.clear();
        Ok(())
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
            .filter(|j| j.kind == JobKind::Load)
            .count() as u64;
        SchedulerStats {
            requests: self.requests.len() as u64,
            loads_in_flight: loads,
            stores_in_flight: self.jobs.len() as u64 - loads,
            manager: self.manager.stats(),
            ..self.stats
        }
    }

    /// Checks the invariants: jobs and requests agree; a request never has a load and stores in
    /// flight at once; the pinned keys are exactly those of in-flight loads and the in-flight
    /// stores exactly those of store jobs; the fence names only released in-flight jobs, on
    /// blocks they touch; a finished request's jobs are all released.
    pub fn check_invariants(&self) -> Result<()> {
        self.manager.check_invariants()?;
        let bad = |m: String| Err(Error::Internal(m));
        let kl = self.cfg.key_len;
        for (&id, r) in &self.requests {
            let loads = r
                .jobs
                .iter()
                .filter(|&j| self.jobs.get(j).is_some_and(|j| j.kind == JobKind::Load))
                .count();
            if loads > 0 && r.jobs.len() > 1 {
                return bad(format!(
                    "request {id} has a load and other jobs in flight: {:?}",
                    r.jobs
                ));
            }
            if r.finished && r.jobs.is_empty() {
                return bad(format!(
                    "finished request {id} without jobs is still tracked"
                ));
            }
        }
        let mut pinned = hashbrown::HashSet::new();
        let mut storing = hashbrown::HashSet::new();
        for (&jid, j) in &self.jobs {
            if !self
                .requests
                .get(&j.request_id)
                .is_some_and(|r| r.jobs.contains(&jid))
            {
                return bad(format!(
                    "job {jid} is not listed by its request {}",
                    j.request_id
                ));
            }
            for key in j.keys.chunks_exact(kl) {
                let rc = self.manager.ref_count(key);
                let ok = match j.kind {
                    JobKind::Load => rc > Some(0) && pinned.insert(key),
                    JobKind::Store => rc == Some(-1) && storing.insert(key),
                };
                if !ok {
                    return bad(format!(
                        "job {jid} ({:?}) key in state {rc:?} or shared",
                        j.kind
                    ));
                }
            }
        }
        let m = self.manager.stats();
        if (m.pinned, m.stores_in_flight) != (pinned.len() as u64, storing.len() as u64) {
            return bad(format!(
                "tier pins {} and stores {} keys, jobs hold {} and {}",
                m.pinned,
                m.stores_in_flight,
                pinned.len(),
                storing.len()
            ));
        }
        for (b, jobs) in &self.fence {
            for j in jobs {
                let ok = self
                    .jobs
                    .get(j)
                    .is_some_and(|j| j.released && j.gpu_blocks.contains(b));
                if !ok {
                    return bad(format!(
                        "fence on block {b} names job {j}, not a released job touching it"
                    ));
                }
            }
        }
        for (&jid, j) in &self.jobs {
            if self.requests[&j.request_id].finished && !j.released {
                return bad(format!(
                    "job {jid} of finished request {} still holds its blocks",
                    j.request_id
                ));
            }
        }
        Ok(())
    }
}

/// True when a key of `keys` is pinned by a load in flight (only loads pin keys).
fn being_loaded(m: &Manager, keys: &[u8], kl: usize) -> bool {
    m.stats().pinned > 0
        && keys
            .chunks_exact(kl)
            .any(|k| m.ref_count(k).is_some_and(|rc| rc > 0))
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

/// The single-group lookup of reference §4.2.1: the ready chunks after the GPU hit `c` tokens.
/// Then touches all the request's keys (in the same pass over the tier's index).
fn lookup(m: &mut Manager, r: &Request, c: u64, obs: u64, kl: usize) -> Result<Match> {
    let nk = r.num_keys(kl);
    let max_hit = r.num_tokens.min(nk * obs);
    if max_hit < c.saturating_add(obs) {
        m.touch(&r.keys)?;
        return Ok(Match::Miss);
    }
    let (start, end) = (c / obs, max_hit.div_ceil(obs).min(nk));
    let p = m.lookup_prefix_touch(&r.keys, start as usize..end as usize)?;
    if p.hits == 0 {
        return Ok(Match::Miss);
    }
    if p.retry {
        return Ok(Match::Defer(DeferReason::StoreInFlight));
    }
    let hit = max_hit.min(obs * (start + p.hits as u64)) - c;
    if hit < obs {
        return Ok(Match::Miss);
    }
    // Only loads pin keys: with none in flight nothing can be being loaded.
    Ok(
        if being_loaded(m, r.keys_of(kl, c / obs, (c + hit).div_ceil(obs)), kl) {
            Match::Defer(DeferReason::BeingLoaded)
        } else {
            Match::Hit(hit)
        },
    )
}

#[cfg(test)]
mod tests;

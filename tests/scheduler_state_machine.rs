//! Randomized state-machine test of [`Scheduler`]: a simulated asynchronous inference server
//! drives the scheduler through random interleavings of add / append / match / alloc /
//! build_step / job completions (delayed, reordered, split across workers, failed) / preempt /
//! finish / abort / reset, the way a real engine with a batch queue would.
//!
//! The host keeps its own view of everything and checks after every scheduler call:
//! `check_invariants()` passes; `stats()` agrees with a recount (jobs in flight, requests,
//! pinned and storing keys, cumulative counters); `has_jobs_in_flight` agrees with the host;
//! a match answers `Defer(JobsInFlight)` exactly when the request has (non-stale) jobs in flight;
//! no load is made for a request with jobs in flight; no request has a load and stores in flight
//! at once; every flush the host is owed (preempted requests' jobs, stores of finished requests
//! whose GPU blocks were reallocated, everything at a reset) is in the step's flush set.
//!
//! It also models the bytes: each GPU block and host slot holds a content tag (the block hash of
//! the tokens it holds, or garbage), the forward pass writes the GPU blocks of the tokens it
//! computes, workers run the copies of a job at some time between its step and its completion
//! report (flushed jobs before the step's forward pass). A store that reads a GPU block already
//! overwritten, a load that reads a slot not holding its chunk, or a running request whose
//! computed blocks do not hold its tokens is a failure: this checks the reuse fence and the
//! preemption flush end to end, not just the bookkeeping.
//!
//! At the end every outstanding job is run and reported, a step is built, and nothing may stay
//! pinned or in flight, and no waiting request may be deferred.
//!
//! Host rules (those of a real server): match only waiting / preempted requests, with a GPU
//! prefix hit of whole blocks; `on_alloc` only after a hit or a miss (never after a defer); a
//! request with a load runs only after the load's completion; completions of jobs flushed by
//! step N are reported before step N + 2 is built (the async batch-queue window of vLLM #46014:
//! step N + 1 is scheduled before step N's output is processed). Requests are scheduled with
//! chunked prefill and one-token decode steps, the token count sometimes lagging by one (async
//! scheduling); running requests are preempted at random and when GPU blocks run out (their
//! freed blocks going to others in the same step), finished when they reach their length or
//! aborted in any state; jobs fail on a random worker.
//!
//! `random_async_host_keeps_the_scheduler_consistent` calls `on_alloc` right after the match,
//! as vLLM does. `random_host_with_match_and_alloc_apart` lets other calls happen between them
//! (the API does not forbid it): `on_alloc` may then answer that the hit went away, as
//! documented, judged from the tier's state of the hit keys. A coverage test runs fixed cases
//! and fails if any interesting state (window defers, fence flushes, failed loads, ...) was
//! never reached.
//! The deterministic tests replay the #46014 window (asynchronous and synchronous completions)
//! and the minimal reproducer of what the split-host test finds.

use kvoffload::Error;
use kvoffload::manager::Policy;
use kvoffload::scheduler::{
    DeferReason, JobKind, JobReport, Match, Recompute, ScheduledRequest, Scheduler,
    SchedulerConfig, Step,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

const KEY_LEN: usize = 8;
/// Tokens per GPU block.
const GBS: u64 = 4;

type R<T = ()> = Result<T, TestCaseError>;

/// What a GPU block or a host sub-block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Content {
    Garbage,
    /// Part of block `.1` of request `.0`.
    Partial(u64, u64),
    /// A full block with this hash.
    Full(u64),
}

/// splitmix64, for the choices made inside one operation.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    fn pick<T: Copy>(&mut self, v: &[T]) -> Option<T> {
        (!v.is_empty()).then(|| v[self.below(v.len() as u64) as usize])
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// A request's prompt: prompts of one family share their first `diverge` blocks; blocks not
/// entirely made of prompt tokens are unique to the request (its own decode tokens). Hashes
/// are chained in effect: two requests agree on block `i` only if they agree on all before it.
#[derive(Debug, Clone, Copy)]
struct ReqMeta {
    family: u64,
    variant: u64,
    diverge: u64,
    prompt_tokens: u64,
    max_offload: Option<u64>,
}

impl ReqMeta {
    fn hash(&self, id: u64, i: u64) -> u64 {
        if (i + 1) * GBS > self.prompt_tokens {
            (3 << 62) | (id << 32) | i
        } else if i < self.diverge {
            (1 << 62) | (self.family << 40) | i
        } else {
            (2 << 62) | (self.family << 48) | (self.variant << 40) | (self.diverge << 32) | i
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    /// Waiting or preempted: to be matched.
    Waiting,
    /// Matched (GPU-hit tokens, hit tokens; 0 for a miss), `on_alloc` not called yet (only
    /// when `Params::split`).
    Matched(u64, u64),
    /// Its load job is in flight (`WAITING_FOR_REMOTE_KVS`).
    Loading(u64),
    Running,
    /// Aborted while its load was in flight: its GPU blocks are freed once the load completes.
    Aborted(u64),
}

#[derive(Debug)]
struct HReq {
    st: St,
    tokens: u64,
    max_tokens: u64,
    /// Block hashes appended.
    hashed: u64,
    /// GPU blocks held.
    blocks: Vec<u32>,
    /// `blocks[unsent..]` were allocated since the last step that scheduled the request.
    unsent: usize,
    /// Scheduled since it was admitted (or its load completed).
    sent: bool,
    /// Tokens computed.
    nc: u64,
    /// GPU prefix-cache hit tokens, written into its first blocks at its next forward pass.
    gpu_hit: u64,
    /// Preempted before: its first schedule is `resumed`.
    resumed: bool,
    /// Preempted, to be passed in the next step's `preempted`.
    preempt_pending: bool,
}

#[derive(Debug)]
struct HJob {
    kind: JobKind,
    req: u64,
    /// Made before a reset: the scheduler forgot it.
    stale: bool,
    /// The step that carries it.
    step: Option<u64>,
    executed: bool,
    /// The worker that fails it, if any.
    fail_worker: Option<u32>,
    reported: u32,
    flushed_at: Option<u64>,
    src: Vec<u32>,
    dst: Vec<u32>,
    block_index: u32,
    /// Stores: what each source GPU block must hold when the copy runs.
    expected: Vec<Content>,
    /// The offload keys it moves.
    keys: Vec<u64>,
    /// Loads: (GPU-hit tokens, hit tokens).
    range: (u64, u64),
    /// Loads: its request gave the GPU blocks back (aborted or preempted) and no longer waits
    /// for it.
    orphan: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    matches: u64,
    deferred_jobs_in_flight: u64,
    deferred_store_in_flight: u64,
    deferred_being_loaded: u64,
    hits: u64,
    hit_tokens: u64,
    load_jobs: u64,
    store_jobs: u64,
    stored_chunks: u64,
    failed_jobs: u64,
}

/// How often the simulation reached the states worth reaching (see
/// `the_simulation_reaches_the_interesting_states`).
#[derive(Debug, Default, Clone, Copy)]
struct Coverage {
    /// `Defer(JobsInFlight)` while every job of the request was flushed but not yet reported:
    /// the batch-queue window of vLLM #46014.
    window_defers: u64,
    preempt_flushes: u64,
    forced_preemptions: u64,
    fence_flushes: u64,
    resets: u64,
    resets_after_building: u64,
    stale_reports: u64,
    split_reports: u64,
    failed_loads: u64,
    failed_stores: u64,
    aborted_loads: u64,
    /// Loads withdrawn before they shipped (request aborted or preempted first).
    withdrawn_loads: u64,
    /// Loading requests preempted after their load shipped.
    preempted_loads: u64,
    /// Loads of requests that gave their blocks back, flushed because a block was reused.
    load_fence_flushes: u64,
    loads_run: u64,
    partial_first_chunk_loads: u64,
    store_chunks_run: u64,
}

#[derive(Debug, Clone)]
struct Params {
    factor: u32,
    num_slots: usize,
    num_workers: u32,
    arc: bool,
    prompt_only: bool,
    gpu_blocks: u32,
    events: bool,
    store_threshold: u32,
    /// The host may call `on_alloc` some operations after the match instead of right after it.
    split: bool,
    /// The host frees an aborted loading request's GPU blocks at once (as a host that reads
    /// only the header may, relying on the reuse fence), instead of keeping them until the
    /// load is done (as vLLM's core does).
    eager_free: bool,
}

struct Sim {
    cfg: SchedulerConfig,
    f: u64,
    obs: u64,
    split: bool,
    eager_free: bool,
    s: Scheduler,
    step: Step,
    step_no: u64,
    meta: HashMap<u64, ReqMeta>,
    reqs: BTreeMap<u64, HReq>,
    next_id: u64,
    jobs: BTreeMap<u64, HJob>,
    /// One past the largest job id seen.
    job_ids_seen: u64,
    free: Vec<u32>,
    total_blocks: usize,
    gpu: HashMap<u32, Content>,
    slots: HashMap<u32, Vec<Content>>,
    /// GPU blocks given to the scheduler (`on_alloc`, `new_block_ids`) since the last step.
    allocated_since_step: HashSet<u32>,
    preempt_next: Vec<u64>,
    /// Jobs in flight at the last reset: the next step must flush them.
    reset_flush: Vec<u64>,
    exp: Counters,
    cov: Coverage,
    log: Vec<String>,
}

macro_rules! ensure {
    ($sim:expr, $cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err($sim.fail(format!($($fmt)*)));
        }
    };
}

impl Sim {
    fn new(p: &Params) -> R<Self> {
        // Every field is set today; the update keeps this compiling when fields are added.
        #[allow(clippy::needless_update)]
        let cfg = SchedulerConfig {
            key_len: KEY_LEN,
            gpu_block_size: GBS as u32,
            block_size_factor: p.factor,
            num_slots: p.num_slots,
            policy: if p.arc { Policy::Arc } else { Policy::Lru },
            num_workers: p.num_workers,
            offload_prompt_only: p.prompt_only,
            enable_events: p.events,
            store_threshold: p.store_threshold,
            max_tracker_size: 16,
            ..Default::default()
        };
        let s = Scheduler::new(cfg.clone())
            .map_err(|e| TestCaseError::fail(format!("Scheduler::new({cfg:?}): {e}")))?;
        Ok(Self {
            f: p.factor as u64,
            obs: GBS * p.factor as u64,
            split: p.split,
            eager_free: p.eager_free,
            s,
            step: Step::new(),
            step_no: 0,
            meta: HashMap::new(),
            reqs: BTreeMap::new(),
            next_id: 1,
            jobs: BTreeMap::new(),
            job_ids_seen: 0,
            free: (0..p.gpu_blocks).rev().collect(),
            total_blocks: p.gpu_blocks as usize,
            gpu: HashMap::new(),
            slots: HashMap::new(),
            allocated_since_step: HashSet::new(),
            preempt_next: Vec::new(),
            reset_flush: Vec::new(),
            exp: Counters::default(),
            cov: Coverage::default(),
            log: Vec::new(),
            cfg,
        })
    }

    fn fail(&self, msg: String) -> TestCaseError {
        let from = self.log.len().saturating_sub(150);
        TestCaseError::fail(format!(
            "{msg}\nconfig: {:?}\nlast calls ({} of {}):\n  {}",
            self.cfg,
            self.log.len() - from,
            self.log.len(),
            self.log[from..].join("\n  ")
        ))
    }

    fn note(&mut self, s: String) {
        self.log.push(s);
    }

    fn ok<T>(&self, what: &str, r: kvoffload::Result<T>) -> R<T> {
        r.map_err(|e| self.fail(format!("{what} failed on a legal call: {e:?}")))
    }

    fn workers(&self) -> u32 {
        self.cfg.num_workers
    }

    fn live(&self, id: u64) -> bool {
        self.reqs
            .get(&id)
            .is_some_and(|r| !matches!(r.st, St::Aborted(_)))
    }

    /// Jobs of `id` the scheduler still tracks (made since the last reset, not fully reported).
    fn host_jobs(&self, id: u64) -> Vec<u64> {
        self.jobs
            .iter()
            .filter(|(_, j)| !j.stale && j.req == id)
            .map(|(&k, _)| k)
            .collect()
    }

    fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        Some(self.free.split_off(self.free.len() - n))
    }

    fn fail_worker(&self, rng: &mut Rng, one_in: u64) -> Option<u32> {
        rng.chance(1, one_in)
            .then(|| rng.below(self.workers() as u64) as u32)
    }

    // -----------------------------------------------------------------------------------------
    // The checks run after every scheduler call
    // -----------------------------------------------------------------------------------------

    fn check(&self) -> R {
        if let Err(e) = self.s.check_invariants() {
            return Err(self.fail(format!("check_invariants: {e}")));
        }
        let st = self.s.stats();
        let mut loads = 0u64;
        let mut stores = 0u64;
        let mut load_keys: HashSet<u64> = HashSet::new();
        let mut store_keys = HashSet::new();
        let mut finished_with_jobs = BTreeSet::new();
        let mut per_req: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        for (id, j) in self.jobs.iter().filter(|(_, j)| !j.stale) {
            let e = per_req.entry(j.req).or_default();
            match j.kind {
                JobKind::Load => {
                    loads += 1;
                    e.0 += 1;
                    // Keys shared by two loads are `check_invariants`'s to judge.
                    load_keys.extend(&j.keys);
                }
                JobKind::Store => {
                    stores += 1;
                    e.1 += 1;
                    for &k in &j.keys {
                        ensure!(
                            self,
                            store_keys.insert(k),
                            "key {k:#x} stored by two jobs ({id})"
                        );
                    }
                }
            }
            if !self.live(j.req) {
                finished_with_jobs.insert(j.req);
            }
        }
        for (&id, &(l, s)) in &per_req {
            ensure!(
                self,
                l == 0 || l + s == 1,
                "request {id} has {l} loads and {s} stores in flight at once (host view)"
            );
        }
        let live = self.reqs.keys().filter(|&&id| self.live(id)).count() as u64;
        ensure!(
            self,
            (st.loads_in_flight, st.stores_in_flight) == (loads, stores),
            "stats: {} loads and {} stores in flight, host expects completions of {loads} and {stores}",
            st.loads_in_flight,
            st.stores_in_flight
        );
        ensure!(
            self,
            st.requests == live + finished_with_jobs.len() as u64,
            "stats: {} requests tracked, host recounts {live} live + {} finished with jobs in flight {:?}",
            st.requests,
            finished_with_jobs.len(),
            finished_with_jobs
        );
        ensure!(
            self,
            (st.manager.pinned, st.manager.stores_in_flight)
                == (load_keys.len() as u64, store_keys.len() as u64),
            "tier: {} pinned and {} storing keys, in-flight jobs hold {} and {}",
            st.manager.pinned,
            st.manager.stores_in_flight,
            load_keys.len(),
            store_keys.len()
        );
        for &id in self.reqs.keys() {
            if !self.live(id) {
                continue;
            }
            let got = self.ok("has_jobs_in_flight", self.s.has_jobs_in_flight(id))?;
            let want = per_req.contains_key(&id);
            ensure!(
                self,
                got == want,
                "has_jobs_in_flight({id}) = {got}, host view: {:?}",
                self.host_jobs(id)
            );
        }
        let e = &self.exp;
        let got = Counters {
            matches: st.matches,
            deferred_jobs_in_flight: st.deferred_jobs_in_flight,
            deferred_store_in_flight: st.deferred_store_in_flight,
            deferred_being_loaded: st.deferred_being_loaded,
            hits: st.hits,
            hit_tokens: st.hit_tokens,
            load_jobs: st.load_jobs,
            store_jobs: st.store_jobs,
            stored_chunks: st.stored_chunks,
            failed_jobs: st.failed_jobs,
        };
        ensure!(
            self,
            format!("{got:?}") == format!("{e:?}"),
            "stats counters {got:?}\n  host recount  {e:?}"
        );
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // Scheduler calls with their host-side bookkeeping
    // -----------------------------------------------------------------------------------------

    /// Appends the hashes of blocks `hashed..to_block` and sets the token count.
    fn append(&mut self, id: u64, to_block: u64, tokens: u64) -> R {
        let m = self.meta[&id];
        let from = self.reqs[&id].hashed;
        let bytes: Vec<u8> = (from..to_block)
            .flat_map(|i| m.hash(id, i).to_be_bytes())
            .collect();
        let res = self.s.append_block_hashes(id, &bytes, tokens);
        self.note(format!(
            "append_block_hashes({id}, blocks {from}..{to_block}, {tokens}) -> {res:?}"
        ));
        self.ok("append_block_hashes", res)?;
        let r = self.reqs.get_mut(&id).unwrap();
        r.hashed = to_block;
        r.tokens = tokens;
        self.check()
    }

    fn finish(&mut self, id: u64) -> R {
        let res = self.s.finish_request(id);
        self.note(format!("finish_request({id}) -> {res:?}"));
        self.ok("finish_request", res)?;
        let unshipped = self.host_jobs(id).into_iter().find(|j| {
            let j = &self.jobs[j];
            j.kind == JobKind::Load && j.step.is_none()
        });
        if let Some(j) = unshipped {
            // Not shipped yet: the scheduler withdraws it, so the blocks are free at once.
            self.withdraw(j);
        }
        let load = match self.reqs[&id].st {
            St::Loading(j) => self.jobs.get(&j).map(|job| (j, job.step.is_some())),
            _ => None,
        };
        if let (Some((j, true)), false) = (load, self.eager_free) {
            // The core keeps the blocks of an aborted loading request until its load is done.
            self.reqs.get_mut(&id).unwrap().st = St::Aborted(j);
        } else {
            if let Some((j, true)) = load {
                // The host frees the blocks now: the fence must hold their reuse.
                self.jobs.get_mut(&j).unwrap().orphan = true;
            }
            let r = self.reqs.remove(&id).unwrap();
            self.free.extend(r.blocks);
            self.preempt_next.retain(|&p| p != id);
        }
        self.check()
    }

    /// The scheduler withdrew load `j` before it shipped: it never runs and is never reported.
    fn withdraw(&mut self, j: u64) {
        self.jobs.remove(&j);
        self.cov.withdrawn_loads += 1;
        self.note(format!("(host) load {j} withdrawn"));
    }

    fn preempt_host(&mut self, id: u64) {
        let r = self.reqs.get_mut(&id).unwrap();
        if let St::Loading(j) = r.st {
            // A shipped load keeps running: it is flushed by the step that names the preemption.
            // One not shipped yet is withdrawn by that step.
            if let Some(job) = self.jobs.get_mut(&j) {
                job.orphan = true;
                self.cov.preempted_loads += job.step.is_some() as u64;
            }
        }
        let r = self.reqs.get_mut(&id).unwrap();
        r.st = St::Waiting;
        r.nc = 0;
        r.sent = false;
        r.unsent = 0;
        r.gpu_hit = 0;
        r.resumed = true;
        let blocks = std::mem::take(&mut r.blocks);
        self.free.extend(blocks);
        self.note(format!("(host) preempt {id}: blocks freed"));
    }

    /// A worker runs the copies of job `id`.
    fn execute(&mut self, id: u64) -> R {
        let f = self.f as usize;
        let j = &self.jobs[&id];
        let fails = j.fail_worker.is_some();
        let (kind, req, block_index) = (j.kind, j.req, j.block_index as usize);
        let (src, dst, expected) = (j.src.clone(), j.dst.clone(), j.expected.clone());
        match kind {
            JobKind::Store => {
                for (s, &slot) in dst.iter().enumerate() {
                    let mut c = Vec::with_capacity(f);
                    for u in 0..f {
                        let b = src[s * f + u];
                        let got = self.gpu.get(&b).copied().unwrap_or(Content::Garbage);
                        let want = expected[s * f + u];
                        ensure!(
                            self,
                            got == want,
                            "store job {id} (request {}) reads GPU block {b} holding {got:?}, expected {want:?}: \
                             the block was overwritten before the store ran (missing flush)",
                            req
                        );
                        c.push(got);
                    }
                    let c = if fails { vec![Content::Garbage; f] } else { c };
                    self.cov.store_chunks_run += 1;
                    self.slots.insert(slot, c);
                }
            }
            JobKind::Load => {
                let m = self.meta[&req];
                let skip = block_index % f;
                self.cov.loads_run += 1;
                self.cov.partial_first_chunk_loads += (skip != 0) as u64;
                for (t, &b) in dst.iter().enumerate() {
                    let q = skip + t;
                    let slot = src[q / f];
                    let got = self.slots.get(&slot).map_or(Content::Garbage, |v| v[q % f]);
                    let want = Content::Full(m.hash(req, (block_index + t) as u64));
                    ensure!(
                        self,
                        got == want,
                        "load job {id} (request {req}) reads slot {slot}[{}] holding {got:?}, expected {want:?}",
                        q % f
                    );
                    self.gpu
                        .insert(b, if fails { Content::Garbage } else { got });
                }
            }
        }
        self.note(format!("(worker) run job {id}"));
        self.jobs.get_mut(&id).unwrap().executed = true;
        Ok(())
    }

    /// Reports `reps` in one `complete_jobs` call and handles the jobs it completes.
    fn complete(&mut self, reps: &[JobReport]) -> R {
        let res = self.s.complete_jobs(reps);
        self.note(format!("complete_jobs({reps:?}) -> {res:?}"));
        self.ok("complete_jobs", res)?;
        let mut done = Vec::new();
        for rep in reps {
            let j = self.jobs.get_mut(&rep.job_id).unwrap();
            self.cov.stale_reports += j.stale as u64;
            self.cov.split_reports += (rep.count < self.cfg.num_workers) as u64;
            j.reported += rep.count;
            if j.reported == self.cfg.num_workers {
                done.push(rep.job_id);
            }
        }
        for id in done {
            self.on_complete(id)?;
        }
        self.check()
    }

    fn on_complete(&mut self, id: u64) -> R {
        let j = self.jobs.remove(&id).unwrap();
        let failed = j.fail_worker.is_some();
        if failed && !j.stale {
            self.exp.failed_jobs += 1;
            match j.kind {
                JobKind::Load => self.cov.failed_loads += 1,
                JobKind::Store => self.cov.failed_stores += 1,
            }
        }
        if j.kind == JobKind::Store {
            return Ok(());
        }
        if j.orphan {
            self.cov.aborted_loads += 1;
            return Ok(());
        }
        let st = self.reqs.get(&j.req).map(|r| r.st);
        match st {
            Some(St::Loading(x)) if x == id => {
                let (c, n) = j.range;
                if !j.stale {
                    let res = self.s.load_failure(j.req);
                    self.note(format!("load_failure({}) -> {res:?}", j.req));
                    let got = self.ok("load_failure", res)?;
                    let want = failed.then_some(Recompute {
                        from_token: c,
                        to_token: c + n,
                    });
                    ensure!(
                        self,
                        got == want,
                        "load_failure({}) = {got:?} after load {id} completed (failed: {failed}), want {want:?}",
                        j.req
                    );
                }
                let r = self.reqs.get_mut(&j.req).unwrap();
                r.st = St::Running;
                r.sent = false;
                r.gpu_hit = c;
                r.nc = if failed {
                    c
                } else if c + n >= r.tokens {
                    r.tokens - 1
                } else {
                    c + n
                };
            }
            Some(St::Aborted(x)) if x == id => {
                self.cov.aborted_loads += 1;
                let r = self.reqs.remove(&j.req).unwrap();
                self.free.extend(r.blocks);
            }
            other => {
                return Err(self.fail(format!(
                    "load job {id} of request {} completed with the request in host state {other:?}",
                    j.req
                )));
            }
        }
        Ok(())
    }

    /// Reports of the remaining workers of `ids`: one report per worker, or one per job.
    fn reports_for(&self, ids: &[u64], rng: &mut Rng, partial: bool) -> Vec<JobReport> {
        let mut reps = Vec::new();
        for &id in ids {
            let j = &self.jobs[&id];
            let left = self.workers() - j.reported;
            let n = if partial && rng.chance(1, 2) {
                1 + rng.below(left as u64) as u32
            } else {
                left
            };
            let workers = j.reported..j.reported + n;
            if rng.chance(1, 2) {
                for w in workers {
                    reps.push(JobReport {
                        job_id: id,
                        count: 1,
                        success: j.fail_worker != Some(w),
                    });
                }
            } else {
                reps.push(JobReport {
                    job_id: id,
                    count: n,
                    success: !j.fail_worker.is_some_and(|w| workers.contains(&w)),
                });
            }
        }
        rng.shuffle(&mut reps);
        reps
    }

    /// Runs and reports `ids` completely (in one or two calls).
    fn report_fully(&mut self, ids: &[u64], rng: &mut Rng) -> R {
        for &id in ids {
            if !self.jobs[&id].executed {
                self.execute(id)?;
            }
        }
        if ids.is_empty() {
            return Ok(());
        }
        let reps = self.reports_for(ids, rng, false);
        if reps.len() > 1 && rng.chance(1, 3) {
            let (a, b) = reps.split_at(reps.len() / 2);
            self.complete(a)?;
            self.complete(b)
        } else {
            self.complete(&reps)
        }
    }

    /// Jobs flushed by step `m - 2` or earlier: their completions came with that step's output,
    /// which the host must have processed before building step `m`.
    fn report_overdue(&mut self, rng: &mut Rng) -> R {
        let m = self.step_no;
        let overdue: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.flushed_at.is_some_and(|f| f + 2 <= m))
            .map(|(&k, _)| k)
            .collect();
        self.report_fully(&overdue, rng)
    }

    /// Builds step `step_no` for `plan` (request, tokens to compute), runs the flush and the
    /// forward pass.
    fn build(&mut self, plan: &[(u64, u64, u64)], preempted: &[u64], rng: &mut Rng) -> R {
        let m = self.step_no;
        let (f, obs) = (self.f, self.obs);
        let new_ids: Vec<Vec<u32>> = plan
            .iter()
            .map(|&(id, _, _)| {
                let r = &self.reqs[&id];
                if r.sent {
                    r.blocks[r.unsent..].to_vec()
                } else {
                    r.blocks.clone()
                }
            })
            .collect();
        let sched: Vec<ScheduledRequest<'_>> = plan
            .iter()
            .zip(&new_ids)
            .map(|(&(id, k, num_tokens), b)| {
                let r = &self.reqs[&id];
                ScheduledRequest {
                    request_id: id,
                    num_computed_tokens: r.nc,
                    num_scheduled_tokens: k,
                    num_tokens,
                    new_block_ids: b,
                    resumed: !r.sent && r.resumed,
                }
            })
            .collect();
        let res = self.s.build_step(&sched, preempted, &mut self.step);
        let desc: Vec<String> = sched
            .iter()
            .map(|s| {
                format!(
                    "{}:{}+{}/{}{}{:?}",
                    s.request_id,
                    s.num_computed_tokens,
                    s.num_scheduled_tokens,
                    s.num_tokens,
                    if s.resumed { " resumed " } else { " " },
                    s.new_block_ids
                )
            })
            .collect();
        drop(sched);
        let step = self.step.clone();
        let jobs_desc: Vec<String> = step
            .jobs()
            .iter()
            .map(|j| {
                format!(
                    "{:?} {} req {} @{} {:?}->{:?}",
                    j.kind,
                    j.id,
                    j.request_id,
                    j.block_index,
                    step.src(j),
                    step.dst(j)
                )
            })
            .collect();
        self.note(format!(
            "build_step#{m}(scheduled [{}], preempted {preempted:?}) -> {res:?}: jobs [{}], flush {:?}",
            desc.join(", "),
            jobs_desc.join("; "),
            step.flush()
        ));
        self.ok("build_step", res)?;
        self.allocated_since_step.extend(new_ids.iter().flatten());
        for &p in preempted {
            if let Some(r) = self.reqs.get_mut(&p) {
                r.preempt_pending = false;
            }
            for j in self.host_jobs(p) {
                if self.jobs[&j].kind == JobKind::Load && self.jobs[&j].step.is_none() {
                    self.withdraw(j);
                }
            }
        }

        // Jobs of the step.
        let mut pending: BTreeSet<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.kind == JobKind::Load && j.step.is_none())
            .map(|(&k, _)| k)
            .collect();
        let mut slots_in_use: HashSet<u32> = HashSet::new();
        for j in self.jobs.values().filter(|j| !j.stale && j.step.is_some()) {
            slots_in_use.extend(if j.kind == JobKind::Load {
                &j.src
            } else {
                &j.dst
            });
        }
        for d in step.jobs() {
            let (src, dst) = (step.src(d).to_vec(), step.dst(d).to_vec());
            match d.kind {
                JobKind::Load => {
                    ensure!(
                        self,
                        pending.remove(&d.id),
                        "step {m}: load job {} was not made by on_alloc since the last step",
                        d.id
                    );
                    let j = &self.jobs[&d.id];
                    let (c, n) = j.range;
                    let r = &self.reqs[&j.req];
                    let (lo, hi) = ((c / GBS) as usize, (c + n).div_ceil(GBS) as usize);
                    ensure!(
                        self,
                        j.req == d.request_id
                            && d.block_index as usize == lo
                            && dst == r.blocks[lo..hi]
                            && src.len() as u64 == (c + n).div_ceil(obs) - lo as u64 / f
                            && d.group_size as usize == dst.len(),
                        "step {m}: load job {} of request {} (hit {c}+{n}, blocks {:?}) has block_index {}, src {src:?}, dst {dst:?}",
                        d.id,
                        j.req,
                        r.blocks,
                        d.block_index
                    );
                    for &sl in &src {
                        ensure!(
                            self,
                            slots_in_use.insert(sl),
                            "step {m}: load job {} reads slot {sl}, used by another job in flight",
                            d.id
                        );
                    }
                    let j = self.jobs.get_mut(&d.id).unwrap();
                    j.step = Some(m);
                    j.src = src;
                    j.dst = dst;
                    j.block_index = d.block_index;
                }
                JobKind::Store => {
                    let id = d.request_id;
                    ensure!(
                        self,
                        d.id >= self.job_ids_seen,
                        "step {m}: store job id {} reused",
                        d.id
                    );
                    let Some(&(_, k, num_tokens)) = plan.iter().find(|p| p.0 == id) else {
                        return Err(self.fail(format!(
                            "step {m}: store job {} for request {id}, not scheduled",
                            d.id
                        )));
                    };
                    let has_load = self
                        .host_jobs(id)
                        .iter()
                        .any(|j| self.jobs[j].kind == JobKind::Load);
                    ensure!(
                        self,
                        !has_load,
                        "step {m}: store job {} for request {id} while its load is in flight",
                        d.id
                    );
                    let meta = self.meta[&id];
                    let r = &self.reqs[&id];
                    let mut limit = (r.nc + k).min(num_tokens);
                    if let Some(cap) = meta.max_offload {
                        limit = limit.min(cap);
                    }
                    if self.cfg.offload_prompt_only {
                        limit = limit.min(meta.prompt_tokens);
                    }
                    let limit_chunk = limit / obs;
                    ensure!(
                        self,
                        !dst.is_empty()
                            && src.len() == dst.len() * f as usize
                            && d.group_size as usize == src.len(),
                        "step {m}: store job {} has src {src:?}, dst {dst:?}",
                        d.id
                    );
                    let mut prev = None;
                    let mut expected = Vec::new();
                    let mut keys = Vec::new();
                    for (s, grp) in src.chunks(f as usize).enumerate() {
                        let pos = r.blocks.iter().position(|&b| b == grp[0]);
                        let ok = pos.is_some_and(|p| {
                            p % f as usize == 0 && r.blocks.get(p..p + f as usize) == Some(grp)
                        });
                        ensure!(
                            self,
                            ok,
                            "step {m}: store job {} reads GPU blocks {grp:?}, not a chunk of request {id} (blocks {:?})",
                            d.id,
                            r.blocks
                        );
                        let ch = (pos.unwrap() / f as usize) as u64;
                        ensure!(
                            self,
                            ch < limit_chunk && prev.is_none_or(|p| p < ch),
                            "step {m}: store job {} stores chunk {ch} of request {id} (offloadable {limit} tokens, previous chunk {prev:?})",
                            d.id
                        );
                        if s == 0 {
                            ensure!(
                                self,
                                d.block_index as u64 == ch * f,
                                "step {m}: store job {} has block_index {}, first chunk {ch}",
                                d.id,
                                d.block_index
                            );
                        }
                        prev = Some(ch);
                        keys.push(meta.hash(id, ch * f + f - 1));
                        for u in 0..f {
                            expected.push(Content::Full(meta.hash(id, ch * f + u)));
                        }
                    }
                    for &sl in &dst {
                        ensure!(
                            self,
                            slots_in_use.insert(sl),
                            "step {m}: store job {} writes slot {sl}, used by another job in flight",
                            d.id
                        );
                    }
                    self.exp.store_jobs += 1;
                    self.exp.stored_chunks += dst.len() as u64;
                    let fail_worker = self.fail_worker(rng, 12);
                    self.jobs.insert(
                        d.id,
                        HJob {
                            kind: JobKind::Store,
                            req: id,
                            stale: false,
                            step: Some(m),
                            executed: false,
                            fail_worker,
                            reported: 0,
                            flushed_at: None,
                            src,
                            dst,
                            block_index: d.block_index,
                            expected,
                            keys,
                            range: (0, 0),
                            orphan: false,
                        },
                    );
                }
            }
            self.job_ids_seen = self.job_ids_seen.max(d.id + 1);
        }
        ensure!(
            self,
            pending.is_empty(),
            "step {m}: loads {pending:?} made by on_alloc are missing"
        );

        // The flush set: what the host is owed, and the workers wait for it.
        let flush: BTreeSet<u64> = step.flush().iter().copied().collect();
        for &p in preempted {
            for j in self.host_jobs(p) {
                ensure!(
                    self,
                    flush.contains(&j),
                    "step {m}: job {j} of preempted request {p} not flushed"
                );
                self.cov.preempt_flushes += 1;
            }
        }
        for j in std::mem::take(&mut self.reset_flush) {
            ensure!(
                self,
                flush.contains(&j),
                "step {m}: job {j} in flight at the reset not flushed"
            );
        }
        // The reuse fence: a shipped job whose request gave its GPU blocks back (finished,
        // aborted, preempted), not flushed before, must be flushed by the step that reallocates
        // one of them.
        let (mut fence, mut load_fence) = (0, 0);
        for (&jid, j) in &self.jobs {
            let released = match j.kind {
                JobKind::Store => !self.live(j.req),
                JobKind::Load => j.orphan,
            };
            if j.stale || !released || j.step.is_none() || j.flushed_at.is_some() {
                continue;
            }
            let touched = if j.kind == JobKind::Load {
                &j.dst
            } else {
                &j.src
            };
            if let Some(b) = touched
                .iter()
                .find(|b| self.allocated_since_step.contains(b))
            {
                ensure!(
                    self,
                    flush.contains(&jid),
                    "step {m}: {:?} {jid} of request {} (given back) touches GPU block {b}, reallocated, but is not flushed",
                    j.kind,
                    j.req
                );
                match j.kind {
                    JobKind::Store => fence += 1,
                    JobKind::Load => load_fence += 1,
                }
            }
        }
        self.cov.fence_flushes += fence;
        self.cov.load_fence_flushes += load_fence;
        for &id in &flush {
            ensure!(
                self,
                id < self.job_ids_seen,
                "step {m}: flush names unknown job {id}"
            );
            let Some(j) = self.jobs.get(&id) else {
                continue; // already reported
            };
            ensure!(
                self,
                j.step.is_some_and(|s| s < m),
                "step {m}: flushed job {id} is not from an earlier step"
            );
            let executed = j.executed;
            self.jobs.get_mut(&id).unwrap().flushed_at.get_or_insert(m);
            if !executed {
                self.execute(id)?;
            }
        }
        self.allocated_since_step.clear();
        self.step_no += 1;
        self.check()?;

        // The forward pass.
        for &(id, k, _) in plan {
            let meta = self.meta[&id];
            let (blocks, nc, gpu_hit) = {
                let r = &self.reqs[&id];
                (r.blocks.clone(), r.nc, r.gpu_hit)
            };
            for (i, &b) in blocks.iter().enumerate().take((gpu_hit / GBS) as usize) {
                self.gpu.insert(b, Content::Full(meta.hash(id, i as u64)));
            }
            for (i, &b) in blocks.iter().enumerate().take((nc / GBS) as usize) {
                let got = self.gpu.get(&b).copied().unwrap_or(Content::Garbage);
                let want = Content::Full(meta.hash(id, i as u64));
                ensure!(
                    self,
                    got == want,
                    "step {m}: request {id} computed block {i} (GPU block {b}) holds {got:?}, want {want:?}: its KV data was lost"
                );
            }
            let end = nc + k;
            for i in nc / GBS..end.div_ceil(GBS) {
                let c = if (i + 1) * GBS <= end {
                    Content::Full(meta.hash(id, i))
                } else {
                    Content::Partial(id, i)
                };
                self.gpu.insert(blocks[i as usize], c);
            }
            let r = self.reqs.get_mut(&id).unwrap();
            r.nc = end;
            r.sent = true;
            r.unsent = r.blocks.len();
            r.resumed = false;
            r.gpu_hit = 0;
        }
        // Sampling: a request that computed all its tokens gets one more, or finishes.
        for &(id, _, _) in plan {
            let r = &self.reqs[&id];
            if r.nc < r.tokens {
                continue;
            }
            if r.tokens >= r.max_tokens {
                self.finish(id)?;
            } else {
                let t = r.tokens + 1;
                self.append(id, t / GBS, t)?;
            }
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // Operations
    // -----------------------------------------------------------------------------------------

    fn op(&mut self, op: u8, rng: &mut Rng) -> R {
        match op % 100 {
            0..=9 => self.op_add(rng),
            10..=29 => self.op_admit(rng),
            30..=51 => self.op_step(rng),
            52..=67 => self.op_execute(rng),
            68..=83 => self.op_report(rng),
            84..=88 => self.op_preempt(rng),
            89..=94 => self.op_finish(rng),
            95..=96 => self.op_reset(rng),
            _ => self.op_report_all(rng),
        }
    }

    fn op_add(&mut self, rng: &mut Rng) -> R {
        if self.reqs.keys().filter(|&&k| self.live(k)).count() >= 8 {
            return Ok(());
        }
        let id = self.next_id;
        self.next_id += 1;
        let m = ReqMeta {
            family: rng.below(3),
            variant: rng.below(2),
            diverge: rng.below(14),
            prompt_tokens: 1 + rng.below(48),
            max_offload: rng.chance(1, 8).then(|| rng.below(4) * self.obs),
        };
        let decode = rng.below(13);
        let res = self.s.add_request(id, m.prompt_tokens, m.max_offload);
        self.note(format!(
            "add_request({id}, {m:?}, decode {decode}) -> {res:?}"
        ));
        self.ok("add_request", res)?;
        self.meta.insert(id, m);
        self.reqs.insert(
            id,
            HReq {
                st: St::Waiting,
                tokens: m.prompt_tokens,
                max_tokens: m.prompt_tokens + decode,
                hashed: 0,
                blocks: Vec::new(),
                unsent: 0,
                sent: false,
                nc: 0,
                gpu_hit: 0,
                resumed: false,
                preempt_pending: false,
            },
        );
        self.check()?;
        let full = m.prompt_tokens / GBS;
        if full > 0 && rng.chance(1, 3) {
            self.append(id, rng.below(full + 1), m.prompt_tokens)?;
        }
        self.append(id, full, m.prompt_tokens)
    }

    /// Matches a waiting request; on a hit or a miss allocates its blocks and calls `on_alloc`
    /// (in split mode possibly in a later operation).
    fn op_admit(&mut self, rng: &mut Rng) -> R {
        let cands: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| {
                (r.st == St::Waiting && !r.preempt_pending) || matches!(r.st, St::Matched(..))
            })
            .map(|(&k, _)| k)
            .collect();
        let Some(id) = rng.pick(&cands) else {
            return Ok(());
        };
        if let St::Matched(c, n) = self.reqs[&id].st {
            return self.allocate(id, c, n, rng);
        }
        let tokens = self.reqs[&id].tokens;
        let c = if rng.chance(1, 2) {
            0
        } else {
            rng.below((tokens - 1) / GBS + 1) * GBS
        };
        let res = self.s.match_request(id, c);
        self.note(format!("match_request({id}, {c}) -> {res:?}"));
        let m = self.ok("match_request", res)?;
        let jobs = self.host_jobs(id);
        ensure!(
            self,
            (m == Match::Defer(DeferReason::JobsInFlight)) != jobs.is_empty(),
            "match_request({id}) = {m:?}, but the host expects completions of {jobs:?} for it"
        );
        self.exp.matches += 1;
        match m {
            Match::Defer(DeferReason::JobsInFlight) => {
                self.exp.deferred_jobs_in_flight += 1;
                self.cov.window_defers +=
                    jobs.iter().all(|j| self.jobs[j].flushed_at.is_some()) as u64;
            }
            Match::Defer(DeferReason::StoreInFlight) => self.exp.deferred_store_in_flight += 1,
            Match::Defer(DeferReason::BeingLoaded) => self.exp.deferred_being_loaded += 1,
            Match::Hit(n) => {
                self.exp.hits += 1;
                self.exp.hit_tokens += n;
                ensure!(
                    self,
                    n > 0 && (c + n).is_multiple_of(self.obs) && c + n <= tokens,
                    "match_request({id}, {c}) = Hit({n}) for {tokens} tokens"
                );
            }
            Match::Miss => {}
        }
        self.check()?;
        let n = match m {
            Match::Defer(_) => return Ok(()),
            Match::Miss => 0,
            Match::Hit(n) => n,
        };
        if self.split && rng.chance(1, 2) {
            self.note(format!("(host) {id} matched, allocation later"));
            self.reqs.get_mut(&id).unwrap().st = St::Matched(c, n);
            return Ok(());
        }
        self.allocate(id, c, n, rng)
    }

    /// Allocates GPU blocks for a request matched with GPU hit `c` and hit `n` (0: miss), and
    /// calls `on_alloc`.
    fn allocate(&mut self, id: u64, c: u64, n: u64, rng: &mut Rng) -> R {
        let tokens = self.reqs[&id].tokens;
        self.reqs.get_mut(&id).unwrap().st = St::Waiting;
        let jobs = self.host_jobs(id);
        if rng.chance(1, 6) {
            self.note(format!("(host) allocation for {id} fails: stays waiting"));
            return Ok(());
        }
        let Some(blocks) = self.alloc(tokens.div_ceil(GBS) as usize) else {
            self.note(format!("(host) no GPU blocks for {id}: stays waiting"));
            return Ok(());
        };
        let meta = self.meta[&id];
        let f = self.f;
        let keys: Vec<u64> = if n == 0 {
            Vec::new()
        } else {
            ((c / GBS) / f..(c + n) / self.obs)
                .map(|ch| meta.hash(id, ch * f + f - 1))
                .collect()
        };
        // With operations between the match and `on_alloc`, the hit may have gone: the tier's
        // state of the hit keys now says which answers are legal.
        let states: Vec<Option<i32>> = keys
            .iter()
            .map(|k| self.s.manager().ref_count(&k.to_be_bytes()))
            .collect();
        let res = self.s.on_alloc(id, &blocks, n);
        self.note(format!(
            "on_alloc({id}, {blocks:?}, {n}) -> {res:?} (hit keys' ref counts {states:?})"
        ));
        let legal_error = match &res {
            Err(Error::NotFound(_)) => states.contains(&None),
            Err(Error::InvalidState(_)) => states.iter().any(|s| s.is_some_and(|r| r != 0)),
            _ => false,
        };
        if legal_error {
            self.free.extend(blocks);
            return self.check();
        }
        let job = self.ok("on_alloc", res)?;
        self.allocated_since_step.extend(&blocks);
        ensure!(
            self,
            states.iter().all(|s| s.is_some_and(|r| r >= 0)),
            "on_alloc({id}, .., {n}) made a load of keys not ready (ref counts {states:?})"
        );
        match (n, job) {
            (0, None) => {
                let r = self.reqs.get_mut(&id).unwrap();
                r.st = St::Running;
                r.nc = c;
                r.gpu_hit = c;
                r.sent = false;
                r.blocks = blocks;
            }
            (n, Some(j)) if n > 0 => {
                ensure!(
                    self,
                    jobs.is_empty() && j >= self.job_ids_seen,
                    "on_alloc({id}) made load {j} while the host expects completions of {jobs:?}"
                );
                self.job_ids_seen = j + 1;
                self.exp.load_jobs += 1;
                let fail_worker = self.fail_worker(rng, 10);
                self.jobs.insert(
                    j,
                    HJob {
                        kind: JobKind::Load,
                        req: id,
                        stale: false,
                        step: None,
                        executed: false,
                        fail_worker,
                        reported: 0,
                        flushed_at: None,
                        src: Vec::new(),
                        dst: Vec::new(),
                        block_index: 0,
                        expected: Vec::new(),
                        keys,
                        range: (c, n),
                        orphan: false,
                    },
                );
                let r = self.reqs.get_mut(&id).unwrap();
                r.st = St::Loading(j);
                r.gpu_hit = c;
                r.blocks = blocks;
            }
            _ => {
                return Err(self.fail(format!("on_alloc({id}, .., {n}) returned {job:?}")));
            }
        }
        self.check()
    }

    fn op_step(&mut self, rng: &mut Rng) -> R {
        self.report_overdue(rng)?;
        let mut preempted = std::mem::take(&mut self.preempt_next);
        let running: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.st == St::Running)
            .map(|(&k, _)| k)
            .collect();
        let mut plan: Vec<(u64, u64, u64)> = Vec::new();
        for id in running {
            if self.reqs.get(&id).is_none_or(|r| r.st != St::Running) || rng.chance(1, 6) {
                continue;
            }
            let (nc, tokens) = (self.reqs[&id].nc, self.reqs[&id].tokens);
            let left = tokens - nc;
            let k = if rng.chance(1, 3) {
                1 + rng.below(left)
            } else {
                left
            };
            let need = (nc + k).div_ceil(GBS) as usize;
            let mut go = true;
            loop {
                let have = self.reqs[&id].blocks.len();
                if have >= need {
                    break;
                }
                if let Some(b) = self.alloc(need - have) {
                    self.reqs.get_mut(&id).unwrap().blocks.extend(b);
                    break;
                }
                // Out of GPU blocks: preempt the newest running request not yet scheduled.
                let victim = self
                    .reqs
                    .iter()
                    .rev()
                    .find(|(v, r)| r.st == St::Running && !plan.iter().any(|p| p.0 == **v))
                    .map(|(&v, _)| v);
                match victim {
                    Some(v) if rng.chance(3, 4) => {
                        self.preempt_host(v);
                        preempted.push(v);
                        self.cov.forced_preemptions += 1;
                        if v == id {
                            go = false;
                            break;
                        }
                    }
                    _ => {
                        go = false;
                        break;
                    }
                }
            }
            if go {
                // Async scheduling: the token sampled by the last step may not be counted yet.
                let lagging = nc + 1 == tokens && tokens > self.meta[&id].prompt_tokens;
                let num_tokens = tokens - (lagging && rng.chance(1, 2)) as u64;
                plan.push((id, k, num_tokens));
            }
        }
        self.build(&plan, &preempted, rng)
    }

    fn op_execute(&mut self, rng: &mut Rng) -> R {
        let cands: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.step.is_some() && !j.executed)
            .map(|(&k, _)| k)
            .collect();
        for _ in 0..1 + rng.below(3) {
            if let Some(id) = rng.pick(&cands)
                && !self.jobs[&id].executed
            {
                self.execute(id)?;
            }
        }
        Ok(())
    }

    /// Reports some executed jobs, possibly only some of their workers, in random order.
    fn op_report(&mut self, rng: &mut Rng) -> R {
        let cands: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.executed)
            .map(|(&k, _)| k)
            .collect();
        let mut ids = BTreeSet::new();
        for _ in 0..1 + rng.below(3) {
            if let Some(id) = rng.pick(&cands) {
                ids.insert(id);
            }
        }
        if ids.is_empty() {
            return Ok(());
        }
        let ids: Vec<u64> = ids.into_iter().collect();
        let reps = self.reports_for(&ids, rng, true);
        self.complete(&reps)
    }

    /// Synchronous mode for a moment: every job in a step runs and is reported.
    fn op_report_all(&mut self, rng: &mut Rng) -> R {
        let ids: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.step.is_some())
            .map(|(&k, _)| k)
            .collect();
        self.report_fully(&ids, rng)
    }

    fn op_preempt(&mut self, rng: &mut Rng) -> R {
        // Now and then a loading request: its blocks go back while its load may be in flight.
        let loading = rng.chance(1, 3);
        let cands: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.st == St::Running || (loading && matches!(r.st, St::Loading(_))))
            .map(|(&k, _)| k)
            .collect();
        if let Some(id) = rng.pick(&cands) {
            self.preempt_host(id);
            let r = self.reqs.get_mut(&id).unwrap();
            r.preempt_pending = true;
            self.preempt_next.push(id);
        }
        Ok(())
    }

    fn op_finish(&mut self, rng: &mut Rng) -> R {
        let cands: Vec<u64> = self
            .reqs
            .keys()
            .copied()
            .filter(|&k| self.live(k))
            .collect();
        match rng.pick(&cands) {
            Some(id) => self.finish(id),
            None => Ok(()),
        }
    }

    fn op_reset(&mut self, rng: &mut Rng) -> R {
        let unshipped = self
            .jobs
            .values()
            .any(|j| j.kind == JobKind::Load && j.step.is_none());
        let res = self.s.reset();
        self.note(format!("reset() -> {res:?}"));
        match res {
            Err(Error::InvalidState(_)) if unshipped => {
                self.op_step(rng)?;
                let res = self.s.reset();
                self.note(format!("reset() -> {res:?}"));
                self.ok("reset after build_step", res)?;
                self.cov.resets_after_building += 1;
            }
            Err(e) => {
                return Err(self.fail(format!("reset() failed with every load in a step: {e:?}")));
            }
            Ok(()) => ensure!(
                self,
                !unshipped,
                "reset() succeeded with load jobs not in a step"
            ),
        }
        self.reset_flush = self
            .jobs
            .iter()
            .filter(|(_, j)| !j.stale)
            .map(|(&k, _)| k)
            .collect();
        for j in self.jobs.values_mut() {
            j.stale = true;
        }
        self.cov.resets += 1;
        self.check()
    }

    /// Runs and reports everything, builds steps, and checks that nothing stays in flight.
    fn drain(&mut self) -> R {
        self.note("-- drain --".into());
        let mut rng = Rng::new(7);
        self.report_overdue(&mut rng)?;
        let pre = std::mem::take(&mut self.preempt_next);
        self.build(&[], &pre, &mut rng)?;
        let ids: Vec<u64> = self.jobs.keys().copied().collect();
        self.report_fully(&ids, &mut rng)?;
        ensure!(
            self,
            self.jobs.is_empty(),
            "jobs left after the drain: {:?}",
            self.jobs.keys()
        );
        self.build(&[], &[], &mut rng)?;
        let st = self.s.stats();
        ensure!(
            self,
            st.manager.pinned == 0
                && st.loads_in_flight == 0
                && st.stores_in_flight == 0
                && st.manager.stores_in_flight == 0,
            "after the drain: {st:?}"
        );
        let live = self.reqs.keys().filter(|&&k| self.live(k)).count() as u64;
        ensure!(
            self,
            st.requests == live,
            "after the drain {} requests tracked, {live} live",
            st.requests
        );
        // Liveness: with nothing in flight, no waiting request is deferred.
        let waiting: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| matches!(r.st, St::Waiting | St::Matched(..)))
            .map(|(&k, _)| k)
            .collect();
        for id in waiting {
            let res = self.s.match_request(id, 0);
            self.note(format!("match_request({id}, 0) -> {res:?}"));
            let m = self.ok("match_request", res)?;
            ensure!(
                self,
                !matches!(m, Match::Defer(_)),
                "request {id} deferred ({m:?}) with nothing in flight"
            );
            self.exp.matches += 1;
            if let Match::Hit(n) = m {
                self.exp.hits += 1;
                self.exp.hit_tokens += n;
            }
            self.check()?;
        }
        let held: usize = self.reqs.values().map(|r| r.blocks.len()).sum();
        let distinct: HashSet<u32> = self.free.iter().copied().collect();
        ensure!(
            self,
            held + self.free.len() == self.total_blocks && distinct.len() == self.free.len(),
            "GPU blocks: {held} held + {} free of {}",
            self.free.len(),
            self.total_blocks
        );
        Ok(())
    }
}

fn run(p: &Params, ops: &[(u8, u32)]) -> R<Sim> {
    let mut sim = Sim::new(p)?;
    for &(op, arg) in ops {
        let mut rng = Rng::new(arg as u64);
        sim.op(op, &mut rng)?;
    }
    sim.drain()?;
    Ok(sim)
}

fn params(split: bool) -> impl Strategy<Value = Params> {
    (
        prop_oneof![Just(1u32), Just(3u32)],
        2usize..40,
        1u32..=2,
        any::<bool>(),
        any::<bool>(),
        12u32..48,
        any::<bool>(),
        prop_oneof![3 => Just(0u32), 1 => Just(2u32)],
        any::<bool>(),
    )
        .prop_map(
            move |(
                factor,
                num_slots,
                num_workers,
                arc,
                prompt_only,
                gpu_blocks,
                events,
                store_threshold,
                eager_free,
            )| Params {
                factor,
                num_slots,
                num_workers,
                arc,
                prompt_only,
                gpu_blocks,
                events,
                store_threshold,
                split,
                eager_free,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig {
        // PROPTEST_CASES raises it for a longer hunt.
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(128),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_async_host_keeps_the_scheduler_consistent(
        p in params(false),
        ops in prop::collection::vec((0u8..100, any::<u32>()), 50..300),
    ) {
        run(&p, &ops)?;
    }

    /// The same, with a host that calls `on_alloc` some operations after the match (the API
    /// allows it; vLLM does not do it): `on_alloc` may then answer that the hit is gone
    /// (`NotFound` / `InvalidState`, as its documentation says), or succeed, and the
    /// invariants must still hold.
    #[test]
    fn random_host_with_match_and_alloc_apart(
        p in params(true),
        ops in prop::collection::vec((0u8..100, any::<u32>()), 50..300),
    ) {
        run(&p, &ops)?;
    }
}

/// The random test is only as good as the states it reaches: fixed cases must reach every one
/// of them (a change to the simulation that makes it vacuous fails here).
#[test]
fn the_simulation_reaches_the_interesting_states() {
    let mut cov = Coverage::default();
    let mut stats = Counters::default();
    let (mut no_room, mut evictions) = (0, 0);
    for case in 0..48u64 {
        let mut g = Rng::new(case * 7919);
        let p = Params {
            factor: if g.chance(1, 2) { 1 } else { 3 },
            num_slots: 2 + g.below(38) as usize,
            num_workers: 1 + g.below(2) as u32,
            arc: g.chance(1, 2),
            prompt_only: g.chance(1, 2),
            gpu_blocks: 12 + g.below(36) as u32,
            events: g.chance(1, 2),
            store_threshold: if g.chance(1, 4) { 2 } else { 0 },
            split: false,
            eager_free: g.chance(1, 2),
        };
        let ops: Vec<(u8, u32)> = (0..200)
            .map(|_| (g.below(100) as u8, g.next() as u32))
            .collect();
        let sim = match run(&p, &ops) {
            Ok(sim) => sim,
            Err(e) => panic!("case {case} ({p:?}): {e}"),
        };
        let (c, e, st) = (sim.cov, sim.exp, sim.s.stats());
        macro_rules! add {
            ($dst:ident, $src:ident: $($f:ident),*) => { $($dst.$f += $src.$f;)* };
        }
        add!(cov, c: window_defers, preempt_flushes, forced_preemptions, fence_flushes, resets,
            resets_after_building, stale_reports, split_reports, failed_loads, failed_stores,
            aborted_loads, withdrawn_loads, preempted_loads, load_fence_flushes, loads_run, partial_first_chunk_loads, store_chunks_run);
        add!(stats, e: matches, deferred_jobs_in_flight, deferred_store_in_flight,
            deferred_being_loaded, hits, hit_tokens, load_jobs, store_jobs, stored_chunks,
            failed_jobs);
        no_room += st.store_no_room;
        evictions += st.manager.evictions;
    }
    println!("{cov:?}\n{stats:?}\nstore_no_room {no_room}, evictions {evictions}");
    let c = format!("{cov:?} {stats:?} store_no_room: {no_room}, evictions: {evictions}");
    assert!(
        !c.contains(": 0,") && !c.contains(": 0 }") && !c.ends_with(": 0"),
        "{c}"
    );
}

// ---------------------------------------------------------------------------------------------
// Deterministic: the batch-queue window of vLLM #46014, asynchronous and synchronous
// ---------------------------------------------------------------------------------------------

fn det_cfg(num_workers: u32) -> SchedulerConfig {
    SchedulerConfig {
        key_len: KEY_LEN,
        gpu_block_size: GBS as u32,
        block_size_factor: 3,
        num_slots: 100,
        policy: Policy::Lru,
        num_workers,
        offload_prompt_only: false,
        ..Default::default()
    }
}

/// Hashes of GPU blocks `from..to` of prompt family `seed`.
fn hashes(seed: u64, from: u64, to: u64) -> Vec<u8> {
    (from..to)
        .flat_map(|i| (seed * 1_000_000 + i).to_be_bytes())
        .collect()
}

fn sched(id: u64, computed: u64, n: u64, tokens: u64, blocks: &[u32]) -> ScheduledRequest<'_> {
    ScheduledRequest {
        request_id: id,
        num_computed_tokens: computed,
        num_scheduled_tokens: n,
        num_tokens: tokens,
        new_block_ids: blocks,
        resumed: false,
    }
}

struct Det {
    s: Scheduler,
    step: Step,
}

impl Det {
    fn check(&self) {
        self.s.check_invariants().unwrap();
    }

    fn build(&mut self, scheduled: &[ScheduledRequest<'_>], preempted: &[u64]) -> Step {
        self.s
            .build_step(scheduled, preempted, &mut self.step)
            .unwrap();
        self.check();
        self.step.clone()
    }

    fn ids(step: &Step, kind: JobKind) -> Vec<u64> {
        step.jobs()
            .iter()
            .filter(|j| j.kind == kind)
            .map(|j| j.id)
            .collect()
    }

    /// One worker's report for each job.
    fn report(&mut self, ids: &[u64]) {
        let reps: Vec<JobReport> = ids
            .iter()
            .map(|&job_id| JobReport {
                job_id,
                count: 1,
                success: true,
            })
            .collect();
        self.s.complete_jobs(&reps).unwrap();
        self.check();
    }

    fn matched(&mut self, id: u64, gpu_hit: u64) -> Match {
        let m = self.s.match_request(id, gpu_hit).unwrap();
        self.check();
        m
    }
}

/// Request R stores its three chunks; Q, sharing R's prefix, stores chunk 3; R is preempted with
/// its stores in flight and flushed, then re-matched with a GPU prefix hit over its in-flight
/// chunks, so a lookup would hit Q's chunk 3 without reaching R's in-flight keys and start a
/// load while R's stores are still tracked (the crash of vLLM #46014).
fn race_46014(sync: bool, workers: u32) {
    let mut d = Det {
        s: Scheduler::new(det_cfg(workers)).unwrap(),
        step: Step::new(),
    };
    let r_blocks: Vec<u32> = (0..9).collect();
    d.s.add_request(1, 36, None).unwrap();
    d.s.append_block_hashes(1, &hashes(7, 0, 9), 36).unwrap();
    assert_eq!(d.matched(1, 0), Match::Miss);
    assert_eq!(d.s.on_alloc(1, &r_blocks, 0).unwrap(), None);
    let st = d.build(&[sched(1, 0, 36, 36, &r_blocks)], &[]);
    let p = Det::ids(&st, JobKind::Store);
    assert_eq!(p.len(), 1, "R stores chunks 0..3 in one job");

    let q_blocks: Vec<u32> = (20..32).collect();
    d.s.add_request(2, 48, None).unwrap();
    d.s.append_block_hashes(2, &hashes(7, 0, 12), 48).unwrap();
    assert_eq!(d.matched(2, 36), Match::Miss);
    d.s.on_alloc(2, &q_blocks, 0).unwrap();
    let st = d.build(&[sched(2, 36, 12, 48, &q_blocks)], &[]);
    let q = Det::ids(&st, JobKind::Store);
    assert_eq!(
        st.src(&st.jobs()[0]),
        &[29, 30, 31],
        "Q stores chunk 3 only"
    );
    for _ in 0..workers {
        d.report(&q);
    }
    let chunk3 = 7_000_000u64 + 11;
    assert_eq!(d.s.manager().ref_count(&chunk3.to_be_bytes()), Some(0));

    // R decodes to 48 tokens (chunk 3 is already offloaded), then is preempted: the step
    // flushes R's stores without forgetting them.
    d.s.append_block_hashes(1, &hashes(7, 9, 12), 48).unwrap();
    let st = d.build(&[sched(1, 36, 12, 48, &[9, 10, 11])], &[]);
    assert!(st.jobs().is_empty());
    let st = d.build(&[], &[1]);
    assert_eq!(st.flush(), &p[..], "preemption flushes R's stores");
    assert!(st.jobs().is_empty());
    assert!(d.s.has_jobs_in_flight(1).unwrap());
    let load_blocks: Vec<u32> = (40..52).collect();

    if sync {
        // The flushed completions are consumed before the next schedule.
        for _ in 0..workers {
            d.report(&p);
        }
    } else {
        // Batch-queue window: step N+1 is scheduled before step N's output (with the flushed
        // completions) is processed. A lookup would hit chunk 3; the scheduler must defer
        // without looking anything up, and make no load.
        for w in 0..workers {
            let lookups = d.s.stats().manager.lookups;
            assert_eq!(d.matched(1, 36), Match::Defer(DeferReason::JobsInFlight));
            assert_eq!(d.s.stats().manager.lookups, lookups, "nothing looked up");
            let st = d.build(&[], &[]);
            assert!(st.jobs().is_empty(), "no load job in the next step");
            assert!(d.s.has_jobs_in_flight(1).unwrap());
            assert_eq!(d.s.stats().stores_in_flight, 1);
            assert!(
                matches!(
                    d.s.on_alloc(1, &load_blocks, 12),
                    Err(Error::InvalidState(_))
                ),
                "a load for a request with jobs in flight is refused"
            );
            d.check();
            // Worker w's report arrives (the last one completes the job).
            d.report(&p);
            assert_eq!(d.s.has_jobs_in_flight(1).unwrap(), w + 1 < workers);
        }
        assert_eq!(d.s.stats().deferred_jobs_in_flight, workers as u64);
    }

    // Completions consumed: R matches and loads chunk 3 normally.
    assert!(!d.s.has_jobs_in_flight(1).unwrap());
    assert_eq!(d.matched(1, 36), Match::Hit(12));
    let job = d.s.on_alloc(1, &load_blocks, 12).unwrap().unwrap();
    d.check();
    let st = d.build(&[], &[]);
    assert_eq!(Det::ids(&st, JobKind::Load), vec![job]);
    let l = st.jobs()[0];
    assert_eq!(l.block_index, 9);
    assert_eq!(st.dst(&l), &[49, 50, 51]);
    assert_eq!(st.src(&l).len(), 1);
    assert_eq!(d.s.stats().manager.pinned, 1);
    for _ in 0..workers {
        d.report(&[job]);
    }
    assert_eq!(d.s.load_failure(1).unwrap(), None);
    // R resumes with all its blocks; chunks 0..4 are offloaded, nothing is stored again.
    let st = d.build(
        &[ScheduledRequest {
            resumed: true,
            ..sched(1, 47, 1, 48, &load_blocks)
        }],
        &[],
    );
    assert!(st.jobs().is_empty());
    let s = d.s.stats();
    assert_eq!(
        (
            s.manager.pinned,
            s.loads_in_flight,
            s.stores_in_flight,
            s.manager.stores_in_flight,
            s.load_jobs,
            s.store_jobs
        ),
        (0, 0, 0, 0, 1, 2)
    );
    d.s.finish_request(1).unwrap();
    d.s.finish_request(2).unwrap();
    assert_eq!(d.s.stats().requests, 0);
    d.check();
}

#[test]
fn preempt_readmit_in_the_batch_queue_window_is_deferred() {
    race_46014(false, 1);
    race_46014(false, 2);
}

#[test]
fn preempt_readmit_after_synchronous_completions_loads() {
    race_46014(true, 1);
    race_46014(true, 2);
}

/// After a reset a request whose stores were in flight is not deferred, and the stale
/// completions are ignored.
#[test]
fn reset_does_not_defer_forever() {
    let mut d = Det {
        s: Scheduler::new(det_cfg(2)).unwrap(),
        step: Step::new(),
    };
    let b: Vec<u32> = (0..6).collect();
    d.s.add_request(1, 24, None).unwrap();
    d.s.append_block_hashes(1, &hashes(3, 0, 6), 24).unwrap();
    assert_eq!(d.matched(1, 0), Match::Miss);
    d.s.on_alloc(1, &b, 0).unwrap();
    let st = d.build(&[sched(1, 0, 24, 24, &b)], &[]);
    let p = Det::ids(&st, JobKind::Store);
    d.report(&p); // one worker of two
    let st = d.build(&[], &[1]);
    assert_eq!(st.flush(), &p[..]);
    assert_eq!(d.matched(1, 0), Match::Defer(DeferReason::JobsInFlight));
    d.s.reset().unwrap();
    d.check();
    assert!(!d.s.has_jobs_in_flight(1).unwrap());
    assert_eq!(d.matched(1, 0), Match::Miss);
    let st = d.build(&[], &[]);
    assert_eq!(st.flush(), &p[..], "the reset flushes what was in flight");
    d.report(&p); // the stale report is ignored
    let s = d.s.stats();
    assert_eq!(
        (s.stores_in_flight, s.manager.stores_in_flight, s.requests),
        (0, 0, 1)
    );
}

/// Minimal reproducer of what `random_host_with_match_and_alloc_apart` finds: two requests
/// sharing a prefix both match (both hits: nothing is pinned yet), then both allocate. The
/// second `on_alloc` pins chunks the first load already pins: the prefix is loaded twice (what
/// `DeferReason::BeingLoaded` exists to prevent) and `check_invariants` reports an internal
/// error ("key ... shared"). `on_alloc` should refuse (`InvalidState`, as for a hit that went
/// away), or the invariant should allow it.
#[test]
fn two_matches_then_two_allocs_do_not_load_one_prefix_twice() {
    let mut d = Det {
        s: Scheduler::new(det_cfg(1)).unwrap(),
        step: Step::new(),
    };
    let b: Vec<u32> = (0..6).collect();
    d.s.add_request(1, 24, None).unwrap();
    d.s.append_block_hashes(1, &hashes(3, 0, 6), 24).unwrap();
    assert_eq!(d.matched(1, 0), Match::Miss);
    d.s.on_alloc(1, &b, 0).unwrap();
    let st = d.build(&[sched(1, 0, 24, 24, &b)], &[]);
    d.report(&Det::ids(&st, JobKind::Store));
    d.s.finish_request(1).unwrap();
    for id in [2, 3] {
        d.s.add_request(id, 25, None).unwrap();
        d.s.append_block_hashes(id, &hashes(3, 0, 6), 25).unwrap();
    }
    assert_eq!(d.matched(2, 0), Match::Hit(24));
    assert_eq!(d.matched(3, 0), Match::Hit(24));
    let b2: Vec<u32> = (10..17).collect();
    let b3: Vec<u32> = (20..27).collect();
    d.s.on_alloc(2, &b2, 24).unwrap().unwrap();
    d.check();
    match d.s.on_alloc(3, &b3, 24) {
        Err(Error::InvalidState(_)) => {}
        Ok(Some(_)) => {
            if let Err(e) = d.s.check_invariants() {
                panic!("second load of the same chunks accepted, then check_invariants: {e}");
            }
        }
        other => panic!("on_alloc(3) = {other:?}"),
    }
    d.check();
}

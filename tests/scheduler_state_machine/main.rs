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
//! The deterministic races (the #46014 window, asynchronous and synchronous, and the minimal
//! reproducer of what the split-host test finds) are `tests/scheduler_races.rs`.
//!
//! Files: this one holds the host model (its requests, jobs, byte contents, parameters) and
//! the test entry points; `checks.rs` the checks after every call; `calls.rs` the scheduler
//! calls with their bookkeeping and a whole step; `ops.rs` the random operations and the drain.

use kvoffload::Error;
use kvoffload::manager::{Policy, Semantics};
use kvoffload::plan::{Direction, JobDesc, Step};
use kvoffload::scheduler::{
    DeferReason, JobReport, Match, Recompute, ScheduledRequest, Scheduler, SchedulerConfig,
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
    /// While `preempt_pending`: the blocks and computed tokens it had (the scheduler still
    /// counts on them until it is told).
    before_preempt: (Vec<u32>, u64),
}

#[derive(Debug)]
struct HJob {
    kind: Direction,
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
    /// vLLM 0.33: store jobs of requests finished since the previous step.
    final_stores: u64,
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
    /// vLLM 0.33 semantics (no touch, rewind at every match, final stores of finished requests
    /// in the next step).
    v033: bool,
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
    /// vLLM 0.33: requests finished since the last step (their blocks are free already); the
    /// next step may carry their final store jobs, then the scheduler drops them (`None`: an
    /// aborted request the host still holds, which has nothing to store).
    finishing: BTreeMap<u64, Option<HReq>>,
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

mod calls;
mod checks;
mod ops;

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
            semantics: if p.v033 {
                Semantics::Vllm033
            } else {
                Semantics::Vllm024
            },
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
            finishing: BTreeMap::new(),
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
                v033,
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
                v033,
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
    // Cases 48.. run in vLLM 0.33 semantics.
    for case in 0..72u64 {
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
            v033: case >= 48,
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
            aborted_loads, withdrawn_loads, preempted_loads, load_fence_flushes, loads_run, partial_first_chunk_loads, store_chunks_run,
            final_stores);
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

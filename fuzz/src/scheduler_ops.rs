//! Scheduler operation sequences, driven like a server would (requests added, matched,
//! allocated, scheduled, preempted, finished or aborted, completions reported) but in any order,
//! with unknown ids, reordered, duplicated, split and failed completions, and resets.
//!
//! The harness plays host and worker: it owns the GPU block allocator (a block is handed out only
//! when free; every hand-out starts a new generation of that block) and executes every job of
//! every step until it is reported or flushed. After every call it checks the scheduler's
//! recount and its own:
//! - slot accounting of the tier, and nothing pinned without a load in flight, nothing storing
//!   without a store in flight;
//! - no load for a request with jobs in flight, and a match of such a request defers;
//! - no GPU block reused while a job touches it: when a step is built, every job still executing
//!   (not reported, not in the step's flush set) touches only blocks of the generation it was
//!   made for, and jobs touch only blocks of their own request;
//! - every step plan survives encode and decode unchanged;
//! - a call that fails changes nothing (the stats are equal before and after).

use arbitrary::Arbitrary;
use kvoffload::Error;
use kvoffload::manager::{Policy, Semantics};
use kvoffload::plan::{Direction, Step};
use kvoffload::scheduler::{
    DeferReason, JobReport, Match, ScheduledRequest, Scheduler, SchedulerConfig,
};
use std::collections::{BTreeMap, BTreeSet};

/// A fuzz input: a configuration and the calls.
#[derive(Arbitrary, Debug)]
pub struct Input {
    key_len: u8,
    gpu_block_size: u8,
    factor: u8,
    num_slots: u8,
    arc: bool,
    num_workers: u8,
    prompt_only: bool,
    threshold: bool,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Add {
        req: u8,
        family: u8,
        blocks: u8,
        extra: u8,
        max_offload: Option<u8>,
    },
    /// Generated tokens: the request grows (new block hashes as blocks fill).
    Grow {
        req: u8,
        tokens: u8,
    },
    Match {
        req: u8,
        gpu_hit_blocks: u8,
    },
    Alloc {
        req: u8,
        external: External,
        extra_blocks: u8,
    },
    Step {
        scheduled: Vec<Sched>,
        preempted: Vec<u8>,
    },
    Complete(Vec<Report>),
    Finish {
        req: u8,
    },
    Reset,
}

#[derive(Arbitrary, Debug)]
enum External {
    None,
    Hit,
    Tokens(u16),
}

#[derive(Arbitrary, Debug)]
struct Sched {
    req: u8,
    tokens: u8,
    extra_block: bool,
    resumed: bool,
}

#[derive(Arbitrary, Debug)]
struct Report {
    job: JobRef,
    count: u8,
    success: bool,
}

#[derive(Arbitrary, Debug)]
enum JobRef {
    /// A job of a step not yet fully reported (by index).
    InStep(u8),
    /// A load made by `on_alloc` and not yet in a step.
    Pending(u8),
    /// A job from before a reset.
    Stale(u8),
    /// Any id.
    Any(u64),
}

const REQS: u8 = 6;
const GPU_BLOCKS: u32 = 48;

#[derive(Debug, Clone)]
struct HostReq {
    family: u8,
    num_tokens: u64,
    /// GPU blocks held (empty while waiting).
    blocks: Vec<u32>,
    running: bool,
    /// Blocks already given to the scheduler by `build_step` since the last allocation.
    announced: usize,
    computed: u64,
    gpu_hit: u64,
    hit: Option<u64>,
    was_preempted: bool,
}

#[derive(Debug, Clone)]
struct HostJob {
    req: u64,
    kind: Direction,
    /// Reports still expected.
    remaining: u32,
    in_step: bool,
    /// Made before a reset: the scheduler ignores its reports; the worker still runs it.
    stale: bool,
    /// Still copying on the worker (not reported, not flushed).
    executing: bool,
    /// GPU blocks and the generation each had when the job was made.
    blocks: Vec<(u32, u64)>,
    /// Host slots (known once in a step).
    slots: Vec<u32>,
    /// Loads before their step: the blocks allocated with them.
    allocated: Vec<(u32, u64)>,
}

#[derive(Debug, Clone)]
struct Host {
    kl: usize,
    gbs: u64,
    factor: u64,
    workers: u32,
    reqs: BTreeMap<u64, HostReq>,
    free: Vec<u32>,
    generation: Vec<u64>,
    jobs: BTreeMap<u64, HostJob>,
    seen_job_ids: BTreeSet<u64>,
    /// Job ids below this were made before the last reset.
    stale_below: u64,
    /// A reset happened and no step was built since: the next plan flushes every running job.
    reset_flush: bool,
}

impl Host {
    fn hashes(&self, family: u8, from: u64, to: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for i in from..to {
            let mut k = vec![0u8; self.kl];
            // Families 0..3 share their first two blocks with family % 3: prefixes overlap.
            k[0] = if i < 2 { family % 3 } else { family };
            k[1] = i as u8;
            k[2] = (i >> 8) as u8;
            out.extend_from_slice(&k);
        }
        out
    }

    fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let at = self.free.len() - n;
        let blocks: Vec<u32> = self.free.drain(at..).collect();
        for &b in &blocks {
            self.generation[b as usize] += 1;
        }
        Some(blocks)
    }

    fn release(&mut self, id: u64) {
        if let Some(r) = self.reqs.get_mut(&id) {
            self.free.append(&mut r.blocks);
            r.running = false;
            r.announced = 0;
        }
    }

    /// The scheduler withdraws a request's load that is not in a step yet when the request
    /// gives its blocks back (finished, preempted): it never ships.
    fn withdraw_unshipped(&mut self, req: u64) {
        self.jobs
            .retain(|_, j| j.req != req || j.kind != Direction::Load || j.in_step || j.stale);
    }

    fn with_gen(&self, blocks: &[u32]) -> Vec<(u32, u64)> {
        blocks
            .iter()
            .map(|&b| (b, self.generation[b as usize]))
            .collect()
    }

    fn live_jobs(&self, req: u64) -> impl Iterator<Item = (&u64, &HostJob)> {
        self.jobs
            .iter()
            .filter(move |(_, j)| j.req == req && !j.stale && j.remaining > 0)
    }

    /// A finished request whose jobs are still in flight: the scheduler still tracks it.
    fn is_zombie(&self, req: u64) -> bool {
        !self.reqs.contains_key(&req) && self.live_jobs(req).next().is_some()
    }

    fn pick(&self, filter: impl Fn(&HostJob) -> bool, i: u8) -> Option<u64> {
        let ids: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| filter(j))
            .map(|(&id, _)| id)
            .collect();
        (!ids.is_empty()).then(|| ids[i as usize % ids.len()])
    }
}

/// Runs one input; panics when the library breaks a promise.
pub fn run(input: &Input) {
    let cfg = SchedulerConfig {
        key_len: 3 + input.key_len as usize % 6,
        gpu_block_size: 1 + input.gpu_block_size as u32 % 4,
        block_size_factor: 1 + input.factor as u32 % 3,
        num_slots: input.num_slots as usize % 16,
        policy: if input.arc { Policy::Arc } else { Policy::Lru },
        num_workers: 1 + input.num_workers as u32 % 3,
        offload_prompt_only: input.prompt_only,
        store_threshold: if input.threshold { 2 } else { 0 },
        max_tracker_size: 8,
        enable_events: false,
        // The host model and the promises checked are those of vLLM 0.24 semantics.
        semantics: Semantics::Vllm024,
    };
    let mut s = Scheduler::new(cfg.clone()).expect("valid config");
    let mut host = Host {
        kl: cfg.key_len,
        gbs: cfg.gpu_block_size as u64,
        factor: cfg.block_size_factor as u64,
        workers: cfg.num_workers,
        reqs: BTreeMap::new(),
        free: (0..GPU_BLOCKS).rev().collect(),
        generation: vec![0; GPU_BLOCKS as usize],
        jobs: BTreeMap::new(),
        seen_job_ids: BTreeSet::new(),
        stale_below: 0,
        reset_flush: false,
    };
    let mut step = Step::new();
    let mut bytes = Vec::new();
    for (n, op) in input.ops.iter().enumerate() {
        let before = s.stats();
        let saved = host.clone();
        let r = apply(&mut s, &mut host, op, &mut step, &mut bytes);
        if let Err(e) = &r {
            assert_eq!(
                before,
                s.stats(),
                "op {n} {op:?} failed ({e}) and changed the stats"
            );
            host = saved;
        }
        if let Err(e) = s.check_invariants() {
            panic!("after op {n} {op:?}: {e}");
        }
        check(&s, &host, n, op);
    }
    // Drain: flush everything, report everything; nothing may stay pinned or storing.
    build_step(&mut s, &mut host, &[], &[], &mut step, &mut bytes).expect("an empty step");
    let reports: Vec<JobReport> = host
        .jobs
        .iter()
        .filter(|(_, j)| !j.stale && j.in_step && j.remaining > 0)
        .map(|(&job_id, j)| JobReport {
            job_id,
            count: j.remaining,
            success: true,
        })
        .collect();
    s.complete_jobs(&reports)
        .expect("reports of every job in flight");
    let st = s.stats();
    assert_eq!(
        (
            st.manager.pinned,
            st.manager.stores_in_flight,
            st.loads_in_flight,
            st.stores_in_flight
        ),
        (0, 0, 0, 0),
        "after all jobs completed: {st:?}"
    );
    s.check_invariants().expect("invariants after the drain");
}

fn check(s: &Scheduler, host: &Host, n: usize, op: &Op) {
    let st = s.stats();
    let m = st.manager;
    assert!(
        m.used <= m.capacity && m.ready + m.stores_in_flight == m.used,
        "{m:?}"
    );
    assert_eq!(m.evictable + m.pinned, m.ready, "{m:?}");
    let live: Vec<&HostJob> = host
        .jobs
        .values()
        .filter(|j| !j.stale && j.remaining > 0)
        .collect();
    let loads = live.iter().filter(|j| j.kind == Direction::Load).count() as u64;
    let stores = live.len() as u64 - loads;
    assert_eq!(
        (st.loads_in_flight, st.stores_in_flight),
        (loads, stores),
        "after op {n} {op:?}: jobs in flight differ from the host's"
    );
    let mut pinned = BTreeSet::new();
    let mut storing = BTreeSet::new();
    let mut all_in_step = true;
    for j in &live {
        all_in_step &= j.in_step;
        let set = if j.kind == Direction::Load {
            &mut pinned
        } else {
            &mut storing
        };
        set.extend(j.slots.iter().copied());
    }
    if loads == 0 {
        assert_eq!(
            m.pinned, 0,
            "after op {n} {op:?}: pinned without a load in flight"
        );
    }
    if all_in_step {
        assert_eq!(
            m.pinned,
            pinned.len() as u64,
            "after op {n} {op:?}: pins vs loads"
        );
    }
    assert_eq!(
        m.stores_in_flight,
        storing.len() as u64,
        "after op {n} {op:?}: in-flight slots vs store jobs"
    );
    for &id in host.reqs.keys() {
        let kinds: Vec<Direction> = host.live_jobs(id).map(|(_, j)| j.kind).collect();
        assert!(
            !kinds.contains(&Direction::Load) || kinds.len() == 1,
            "request {id} has a load and other jobs: {kinds:?}"
        );
        assert_eq!(
            s.has_jobs_in_flight(id).ok(),
            Some(!kinds.is_empty()),
            "request {id}"
        );
    }
    let zombies = host
        .jobs
        .values()
        .filter(|j| !j.stale && j.remaining > 0 && !host.reqs.contains_key(&j.req))
        .map(|j| j.req)
        .collect::<BTreeSet<_>>();
    assert_eq!(
        st.requests,
        (host.reqs.len() + zombies.len()) as u64,
        "requests tracked"
    );
}

fn apply(
    s: &mut Scheduler,
    host: &mut Host,
    op: &Op,
    step: &mut Step,
    bytes: &mut Vec<u8>,
) -> Result<(), Error> {
    let (gbs, factor) = (host.gbs, host.factor);
    match op {
        Op::Add {
            req,
            family,
            blocks,
            extra,
            max_offload,
        } => {
            let id = (*req % (REQS + 1)) as u64;
            let full = (*blocks % 12) as u64;
            let tokens = full * gbs + *extra as u64 % gbs;
            let max = max_offload.map(|m| m as u64 * 3);
            let r = s.add_request(id, tokens, max);
            let tracked = host.reqs.contains_key(&id) || host.is_zombie(id);
            match &r {
                Ok(()) => assert!(!tracked, "add_request of tracked {id} accepted"),
                Err(Error::InvalidState(_)) => assert!(tracked, "add_request of {id}: {r:?}"),
                Err(e) => panic!("add_request {id}: {e}"),
            }
            r?;
            let hashes = host.hashes(*family, 0, full);
            s.append_block_hashes(id, &hashes, tokens)
                .expect("hashes of a new request");
            host.reqs.insert(
                id,
                HostReq {
                    family: *family,
                    num_tokens: tokens,
                    blocks: Vec::new(),
                    running: false,
                    announced: 0,
                    computed: 0,
                    gpu_hit: 0,
                    hit: None,
                    was_preempted: false,
                },
            );
            Ok(())
        }
        Op::Grow { req, tokens } => {
            let id = (*req % (REQS + 1)) as u64;
            let Some(r) = host.reqs.get_mut(&id) else {
                let res = s.append_block_hashes(id, &[], 1 << 20);
                assert!(res.is_err(), "append for untracked {id} accepted");
                return res;
            };
            let before = r.num_tokens / gbs;
            r.num_tokens += *tokens as u64 % (3 * gbs + 1);
            let (fam, after, nt) = (r.family, r.num_tokens / gbs, r.num_tokens);
            let hashes = host.hashes(fam, before, after);
            s.append_block_hashes(id, &hashes, nt)
                .expect("growth of a live request");
            Ok(())
        }
        Op::Match {
            req,
            gpu_hit_blocks,
        } => {
            let id = (*req % (REQS + 1)) as u64;
            let Some(r) = host.reqs.get(&id) else {
                let res = s.match_request(id, 0);
                assert!(res.is_err(), "match of untracked {id} accepted");
                return res.map(|_| ());
            };
            if r.running {
                return Ok(());
            }
            let full = r.num_tokens / gbs;
            let hit_blocks = (*gpu_hit_blocks as u64).min(full.saturating_sub(1));
            let c = hit_blocks * gbs;
            let in_flight = host.live_jobs(id).next().is_some();
            let m = s.match_request(id, c).expect("match of a waiting request");
            assert_eq!(
                matches!(m, Match::Defer(DeferReason::JobsInFlight)),
                in_flight,
                "match of request {id} (jobs in flight: {in_flight}) answered {m:?}"
            );
            let r = host.reqs.get_mut(&id).expect("live");
            r.gpu_hit = c;
            r.hit = match m {
                Match::Hit(n) => {
                    assert!(
                        n >= gbs * factor && c + n <= r.num_tokens,
                        "hit {n} after {c}"
                    );
                    Some(n)
                }
                _ => None,
            };
            Ok(())
        }
        Op::Alloc {
            req,
            external,
            extra_blocks,
        } => {
            let id = (*req % (REQS + 1)) as u64;
            let Some(r) = host.reqs.get(&id).cloned() else {
                let res = s.on_alloc(id, &[], 0);
                assert!(res.is_err(), "on_alloc of untracked {id} accepted");
                return res.map(|_| ());
            };
            if r.running {
                return Ok(());
            }
            let ext = match external {
                External::None => 0,
                External::Hit => r.hit.unwrap_or(0),
                External::Tokens(t) => *t as u64 % (r.num_tokens + 2),
            };
            let total = (r.gpu_hit + ext).min(r.num_tokens.max(1));
            let need = total.div_ceil(gbs).max(1) as usize + *extra_blocks as usize % 3;
            let Some(blocks) = host.alloc(need) else {
                return Ok(());
            };
            let in_flight = host.live_jobs(id).next().is_some();
            let res = s.on_alloc(id, &blocks, ext);
            if let Ok(Some(job)) = res {
                assert!(
                    !in_flight,
                    "a load {job} for request {id}, which has jobs in flight"
                );
                assert!(
                    host.seen_job_ids.insert(job),
                    "job id {job} handed out twice"
                );
                let allocated = host.with_gen(&blocks);
                host.jobs.insert(
                    job,
                    HostJob {
                        req: id,
                        kind: Direction::Load,
                        remaining: host.workers,
                        in_step: false,
                        stale: false,
                        executing: false,
                        blocks: Vec::new(),
                        slots: Vec::new(),
                        allocated,
                    },
                );
            }
            let job = res?;
            let r = host.reqs.get_mut(&id).expect("live");
            r.blocks = blocks;
            r.running = true;
            r.announced = 0;
            r.computed = r.gpu_hit + if job.is_some() { ext } else { 0 };
            r.hit = None;
            Ok(())
        }
        Op::Step {
            scheduled,
            preempted,
        } => build_step(s, host, scheduled, preempted, step, bytes),
        Op::Complete(reports) => complete(s, host, reports),
        Op::Finish { req } => {
            let id = (*req % (REQS + 1)) as u64;
            let res = s.finish_request(id);
            if host.reqs.contains_key(&id) {
                res.as_ref().expect("finish of a live request");
                host.withdraw_unshipped(id);
                host.release(id);
                host.reqs.remove(&id);
            } else {
                assert!(
                    res.is_err(),
                    "finish of untracked or finished {id} accepted"
                );
            }
            res
        }
        Op::Reset => {
            let pending = host
                .jobs
                .values()
                .any(|j| !j.stale && j.remaining > 0 && !j.in_step);
            let res = s.reset();
            assert_eq!(
                res.is_ok(),
                !pending,
                "reset with pending loads: {pending}, {res:?}"
            );
            res?;
            for j in host.jobs.values_mut() {
                j.stale = true;
            }
            host.stale_below = host
                .seen_job_ids
                .last()
                .map_or(host.stale_below, |&m| m + 1);
            host.reset_flush = true;
            for r in host.reqs.values_mut() {
                r.hit = None;
            }
            Ok(())
        }
    }
}

fn build_step(
    s: &mut Scheduler,
    host: &mut Host,
    scheduled: &[Sched],
    preempted: &[u8],
    step: &mut Step,
    bytes: &mut Vec<u8>,
) -> Result<(), Error> {
    let gbs = host.gbs;
    let mut pre = Vec::new();
    for &p in preempted {
        let id = (p % (REQS + 2)) as u64;
        let id = if p == 255 { 1000 } else { id };
        if !host.reqs.get(&id).is_some_and(|r| r.running) && id != 1000 {
            continue;
        }
        if !pre.contains(&id) {
            pre.push(id);
        }
    }
    for &id in &pre {
        host.withdraw_unshipped(id);
        host.release(id);
        if let Some(r) = host.reqs.get_mut(&id) {
            r.was_preempted = true;
        }
    }
    let mut specs: Vec<(u64, u64, u64, u64, Vec<u32>, bool)> = Vec::new();
    for sc in scheduled {
        let id = (sc.req % (REQS + 1)) as u64;
        let Some(r) = host.reqs.get(&id).cloned() else {
            if sc.req == 255 {
                specs.push((1000, 0, 1, 1, Vec::new(), false));
            }
            continue;
        };
        if !r.running || specs.iter().any(|x| x.0 == id) {
            continue;
        }
        let left = r.num_tokens.saturating_sub(r.computed);
        let n = if left == 0 {
            0
        } else {
            1 + sc.tokens as u64 % left
        };
        let have = r.blocks.len() as u64;
        let need = (r.computed + n)
            .min(r.num_tokens)
            .div_ceil(gbs)
            .saturating_sub(have);
        let Some(mut fresh) = host.alloc(need as usize + sc.extra_block as usize) else {
            continue;
        };
        // The first schedule after an allocation gives all the request's blocks; after a
        // preemption it must say so (they replace the list the scheduler kept).
        let resumed = r.announced == 0 && (r.was_preempted || sc.resumed);
        let r = host.reqs.get_mut(&id).expect("live");
        r.blocks.append(&mut fresh);
        let new_ids = r.blocks[if resumed { 0 } else { r.announced }..].to_vec();
        specs.push((id, r.computed, n, r.num_tokens, new_ids, resumed));
    }
    let sched: Vec<ScheduledRequest<'_>> = specs
        .iter()
        .map(|(id, c, n, t, ids, resumed)| ScheduledRequest {
            request_id: *id,
            num_computed_tokens: *c,
            num_scheduled_tokens: *n,
            num_tokens: *t,
            new_block_ids: ids,
            resumed: *resumed,
        })
        .collect();
    s.build_step(&sched, &pre, step)?;
    for (id, _, n, _, _, _) in &specs {
        if let Some(r) = host.reqs.get_mut(id) {
            r.computed += n;
            r.announced = r.blocks.len();
        }
    }
    // The plan survives its encoding.
    step.encode(bytes);
    let mut decoded = Step::new();
    decoded.decode(bytes).expect("a plan's own bytes decode");
    assert_eq!(&decoded, step, "encode then decode changed the plan");
    assert_eq!(step.block_size_factor as u64, host.factor);

    // The worker waits for the flush set first.
    if std::mem::take(&mut host.reset_flush) {
        for (id, j) in &host.jobs {
            assert!(
                !j.executing || step.flush().contains(id),
                "job {id}, in flight at the reset, is not flushed by the next plan"
            );
        }
    }
    for &f in step.flush() {
        assert!(
            host.seen_job_ids.contains(&f),
            "flush names job {f}, never made"
        );
        if let Some(j) = host.jobs.get_mut(&f) {
            j.executing = false;
        }
    }
    for &id in &pre {
        for (jid, j) in &host.jobs {
            assert!(
                !(j.req == id && j.executing),
                "preempted request {id}: its job {jid} is not flushed"
            );
        }
    }
    // Every pending load is in this plan; every job touches its own request's blocks.
    for j in step.jobs() {
        let (gpu, slots) = match j.kind {
            Direction::Load => (step.dst(j), step.src(j)),
            Direction::Store => (step.src(j), step.dst(j)),
        };
        assert_eq!(
            j.num_gpu_blocks as usize,
            gpu.len(),
            "group size of job {}",
            j.id
        );
        let f = host.factor as usize;
        let skip = if j.kind == Direction::Load {
            j.block_index as usize % f
        } else {
            0
        };
        assert_eq!(
            slots.len(),
            (gpu.len() + skip).div_ceil(f),
            "slots of job {}",
            j.id
        );
        if j.kind == Direction::Store {
            assert_eq!(j.block_index as usize % f, 0, "a store starts on a chunk");
            assert_eq!(gpu.len(), slots.len() * f, "a store moves whole chunks");
        }
        let blocks = match j.kind {
            Direction::Load => {
                let hj = host.jobs.get_mut(&j.id).unwrap_or_else(|| {
                    panic!("load {} in a plan was never made by on_alloc", j.id)
                });
                assert!(
                    !hj.in_step && hj.req == j.request_id,
                    "load {} planned twice",
                    j.id
                );
                gpu.iter()
                    .map(|b| {
                        *hj.allocated.iter().find(|a| a.0 == *b).unwrap_or_else(|| {
                            panic!("load {} writes block {b}, not allocated with it", j.id)
                        })
                    })
                    .collect()
            }
            Direction::Store => {
                assert!(
                    host.seen_job_ids.insert(j.id),
                    "job id {} handed out twice",
                    j.id
                );
                let r = host.reqs.get(&j.request_id).unwrap_or_else(|| {
                    panic!("store {} for request {}, not live", j.id, j.request_id)
                });
                for b in gpu {
                    assert!(
                        r.blocks.contains(b),
                        "store {} reads block {b}, not one of request {}'s blocks {:?}",
                        j.id,
                        j.request_id,
                        r.blocks
                    );
                }
                host.with_gen(gpu)
            }
        };
        let hj = host.jobs.entry(j.id).or_insert(HostJob {
            req: j.request_id,
            kind: Direction::Store,
            remaining: host.workers,
            in_step: false,
            stale: false,
            executing: false,
            blocks: Vec::new(),
            slots: Vec::new(),
            allocated: Vec::new(),
        });
        hj.in_step = true;
        hj.executing = true;
        hj.blocks = blocks;
        hj.slots = slots.to_vec();
    }
    for (id, j) in &host.jobs {
        if j.kind == Direction::Load && !j.in_step && !j.stale && j.remaining > 0 {
            panic!("pending load {id} is missing from the plan");
        }
    }
    // No GPU block reused while a job touches it.
    for (id, j) in &host.jobs {
        if !j.executing {
            continue;
        }
        for &(b, g) in &j.blocks {
            assert_eq!(
                host.generation[b as usize], g,
                "GPU block {b} was handed out again while job {id} ({:?} of request {}) still touches it, and the plan does not flush it",
                j.kind, j.req
            );
        }
    }
    Ok(())
}

fn complete(s: &mut Scheduler, host: &mut Host, reports: &[Report]) -> Result<(), Error> {
    let mut reps = Vec::new();
    let mut valid = true;
    let mut left: BTreeMap<u64, u32> = BTreeMap::new();
    for rep in reports {
        let count = rep.count as u32 % (host.workers + 1);
        let id = match rep.job {
            JobRef::InStep(i) => host.pick(|j| j.in_step && !j.stale && j.remaining > 0, i),
            JobRef::Pending(i) => host.pick(|j| !j.in_step && !j.stale && j.remaining > 0, i),
            JobRef::Stale(i) => host.pick(|j| j.stale, i),
            JobRef::Any(x) => Some(x),
        };
        let Some(job_id) = id else { continue };
        valid &= count > 0;
        match host.jobs.get(&job_id) {
            Some(j) if j.stale => {}
            Some(j) if j.in_step && j.remaining > 0 => {
                let l = left.entry(job_id).or_insert(j.remaining);
                valid &= count <= *l;
                *l = l.saturating_sub(count);
            }
            // Not in flight, or a load not yet in a step: refused, except ids below the first
            // id made after the last reset, which are ignored as stale.
            _ => valid &= job_id < host.stale_below,
        }
        reps.push(JobReport {
            job_id,
            count,
            success: rep.success,
        });
    }
    let res = s.complete_jobs(&reps);
    assert_eq!(res.is_ok(), valid, "completion of {reps:?}: {res:?}");
    res?;
    let mut failed_loads = BTreeSet::new();
    for rep in &reps {
        let Some(j) = host.jobs.get_mut(&rep.job_id) else {
            continue;
        };
        if j.stale {
            continue;
        }
        j.remaining -= rep.count;
        if !rep.success && j.kind == Direction::Load {
            failed_loads.insert(j.req);
        }
        if j.remaining == 0 {
            j.executing = false;
        }
    }
    for req in failed_loads {
        let done = host.live_jobs(req).next().is_none();
        if done && host.reqs.contains_key(&req) {
            let f = s.load_failure(req).expect("live request");
            assert!(f.is_some(), "request {req}: failed load not reported");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(ops: Vec<Op>) -> Input {
        Input {
            key_len: 0,
            gpu_block_size: 0,
            factor: 0,
            num_slots: 8,
            arc: false,
            num_workers: 0,
            prompt_only: true,
            threshold: false,
            ops,
        }
    }

    fn add(req: u8, family: u8) -> Op {
        Op::Add {
            req,
            family,
            blocks: 4,
            extra: 0,
            max_offload: None,
        }
    }

    fn step(scheduled: Vec<Sched>) -> Op {
        Op::Step {
            scheduled,
            preempted: vec![],
        }
    }

    fn prefill(req: u8) -> Sched {
        Sched {
            req,
            tokens: 3,
            extra_block: false,
            resumed: false,
        }
    }

    /// Issue 10: a request aborted while its load is in flight gives its GPU blocks back; the
    /// request that gets them next must not run before the load is flushed.
    #[test]
    fn aborted_load_fences_its_blocks() {
        run(&input(vec![
            add(0, 0),
            Op::Match {
                req: 0,
                gpu_hit_blocks: 0,
            },
            Op::Alloc {
                req: 0,
                external: External::None,
                extra_blocks: 0,
            },
            step(vec![prefill(0)]),
            Op::Complete(vec![Report {
                job: JobRef::InStep(0),
                count: 1,
                success: true,
            }]),
            Op::Finish { req: 0 },
            add(1, 0),
            Op::Match {
                req: 1,
                gpu_hit_blocks: 0,
            },
            Op::Alloc {
                req: 1,
                external: External::Hit,
                extra_blocks: 0,
            },
            step(vec![]),
            Op::Finish { req: 1 },
            add(2, 1),
            Op::Match {
                req: 2,
                gpu_hit_blocks: 0,
            },
            Op::Alloc {
                req: 2,
                external: External::None,
                extra_blocks: 2,
            },
            step(vec![]),
        ]));
    }

    /// A load aborted before its step never ships, and its blocks are free at once.
    #[test]
    fn unshipped_load_is_withdrawn() {
        run(&input(vec![
            add(0, 0),
            Op::Match {
                req: 0,
                gpu_hit_blocks: 0,
            },
            Op::Alloc {
                req: 0,
                external: External::None,
                extra_blocks: 0,
            },
            step(vec![prefill(0)]),
            Op::Complete(vec![Report {
                job: JobRef::InStep(0),
                count: 1,
                success: true,
            }]),
            Op::Finish { req: 0 },
            add(1, 0),
            Op::Match {
                req: 1,
                gpu_hit_blocks: 0,
            },
            Op::Alloc {
                req: 1,
                external: External::Hit,
                extra_blocks: 0,
            },
            Op::Finish { req: 1 },
            add(2, 1),
            Op::Match {
                req: 2,
                gpu_hit_blocks: 0,
            },
            Op::Alloc {
                req: 2,
                external: External::None,
                extra_blocks: 2,
            },
            step(vec![]),
            Op::Reset,
        ]));
    }
}

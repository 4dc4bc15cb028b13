//! The simulated serving engine: drives the library's scheduler per engine step as a server
//! would, over a simulated GPU prefix cache, a batch of running requests and a transfer queue.
//!
//! One step:
//! 1. **Schedule the running requests** (admission order): each computes all its remaining
//!    tokens (a prefill) or one token (decode). A request that needs a GPU block when none is
//!    free preempts the most recently admitted running request (itself if it is the last): its
//!    blocks are freed, it goes back to the front of the queue, and the step's plan lists it
//!    as preempted (its jobs are flushed).
//! 2. **Admit waiting requests** (arrived, in order) while the batch has room: GPU prefix hit
//!    (whole blocks, at least one prompt token left to compute), then `match_request`. A
//!    deferred request stays waiting and the next one is tried; the first that does not fit in
//!    the free GPU blocks ends admission. After allocating, `on_alloc` with the host hit (capped
//!    so one token is computed): a load job makes the request wait for the load's completion,
//!    else it is scheduled in this step.
//! 3. **`build_step`** with the scheduled and preempted requests; the plan's jobs are shipped
//!    and their completions are reported `transfer_delay_steps` steps later (the copies of the
//!    plan's flush set finish before this step's forward pass, their reports keep that delay).
//! 4. **The forward pass**: computed full blocks enter the GPU prefix cache (with `--copy`,
//!    after the flush set finished, they are filled with their pattern and the step's jobs are
//!    submitted to the worker); a request that generated its last token is finished
//!    (`finish_request`, its blocks freed).
//! 5. **Completions** due at this step: `complete_jobs`; a completed load lets its request run
//!    from the next step (with `--copy`, after checking the loaded blocks' content).
//!
//! The engine's clock advances `step_ms` per step; an idle engine jumps to the next arrival.
//! Without a host tier (the baseline), steps 2–5 skip the scheduler, and a run of steps in which
//! nothing happens but one decode token per running request (no arrival, no admission, no GPU
//! block allocated, completed or hashed, no request finishing) is taken in one go, with the
//! figures of stepping through it. In vLLM 0.33 semantics a
//! request finished in a step gets its final store jobs from the next `build_step`, so the
//! engine is not idle until that step ran (as vLLM, whose scheduler has requests while finished
//! ones are still to be reported).

use crate::copier::{Copier, Traffic};
use crate::gpu_cache::GpuCache;
use crate::trace::Workload;
use anyhow::{Context, Result, bail};
use kvoffload::manager::{Policy, Semantics};
use kvoffload::plan::{Direction, Step};
use kvoffload::scheduler::{JobReport, Match, ScheduledRequest, Scheduler, SchedulerConfig};
use serde::Serialize;
use std::cell::Cell;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Engine settings.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// GPU blocks per host slot (`block_size_factor`); GPU blocks are `block_tokens / factor`.
    pub factor: u32,
    /// GPU blocks (0: no prefix cache, no limit).
    pub gpu_blocks: u32,
    /// Most requests running (or loading) at once.
    pub max_batch: usize,
    /// Steps from shipping a job to its completion report.
    pub transfer_delay_steps: u64,
    /// Virtual milliseconds per step.
    pub step_ms: u64,
    /// Generate each request's output tokens (one per step); off: a request ends after its
    /// prefill step.
    pub decode: bool,
    /// Width of block hashes (keys), 16..=64 bytes.
    pub key_len: usize,
    /// KV bytes per token (for the bytes moved).
    pub kv_bytes_per_token: u64,
    /// Check the scheduler's invariants every this many steps (0: at the end only).
    pub check_every: u64,
    /// The vLLM release whose semantics the scheduler and its tier follow.
    pub semantics: Semantics,
}

/// The host tier of a run; `None` runs the baseline without offloading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tier {
    /// Eviction policy.
    pub policy: Policy,
    /// Host slots (blocks of `block_tokens` tokens).
    pub num_slots: usize,
}

/// Matches deferred, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Deferrals {
    /// The request had jobs in flight (a preempted request re-admitted before its jobs finished).
    pub jobs_in_flight: u64,
    /// A hit block's store was in flight.
    pub store_in_flight: u64,
    /// A hit block was being loaded for another request.
    pub being_loaded: u64,
}

/// Steps in a row that admit, compute at admission and finish nothing before the engine
/// declares itself stalled.
const MAX_IDLE_STEPS: u64 = 1_000_000;

/// The scheduler's gauges after the last step (a run fails unless they are all 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct AtEnd {
    pub loads_in_flight: u64,
    pub stores_in_flight: u64,
    /// Host slots pinned by loads.
    pub pinned: u64,
    /// Requests the scheduler still tracks.
    pub requests_tracked: u64,
    /// GPU blocks requests still hold.
    pub gpu_blocks_held: u64,
}

/// Median and 99th percentile, microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub median_us: f64,
    pub p99_us: f64,
}

impl Percentiles {
    /// The values at ranks `round((n - 1) · q)` of the sorted `v` (selected, not sorted).
    fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        let rank = |q: f64| ((v.len() - 1) as f64 * q).round() as usize;
        let (m, p) = (rank(0.5), rank(0.99));
        let (below, &mut p99, _) = v.select_nth_unstable_by(p, f64::total_cmp);
        let median = if m < p {
            *below.select_nth_unstable_by(m, f64::total_cmp).1
        } else {
            p99
        };
        Self {
            median_us: median * 1e6,
            p99_us: p99 * 1e6,
        }
    }
}

/// What one run observed.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunStats {
    /// "none" (no host tier), "lru" or "arc".
    pub policy: String,
    /// Host slots (0 for none).
    pub host_blocks: u64,
    pub requests: u64,
    pub steps: u64,
    /// Prompt tokens over all requests.
    pub prompt_tokens: u64,
    /// Admissions (first ones and re-admissions after preemption).
    pub admissions: u64,
    /// Tokens to compute at admission (prompts, plus generated tokens after a preemption).
    pub prefill_tokens: u64,
    /// Of those: hit in the GPU prefix cache.
    pub gpu_hit_tokens: u64,
    /// Of those: loaded from the host tier.
    pub host_hit_tokens: u64,
    /// Of those: computed.
    pub computed_tokens: u64,
    /// `gpu_hit_tokens / prefill_tokens`, percent.
    pub gpu_hit_pct: f64,
    /// `host_hit_tokens / prefill_tokens`, percent.
    pub host_hit_pct: f64,
    /// Prefill tokens the host tier saved against the run without one (computed there less
    /// computed here); set by the caller.
    pub prefill_saved_tokens: i64,
    /// `prefill_saved_tokens` in percent of the baseline's computed tokens.
    pub prefill_saved_pct: f64,
    pub deferrals: Deferrals,
    /// Requests preempted.
    pub preemptions: u64,
    /// Of those, with jobs in flight (flushed by the next step's plan).
    pub preemptions_with_jobs: u64,
    /// Job ids in the plans' flush sets (preemptions and reused GPU blocks).
    pub flushed_jobs: u64,
    pub load_jobs: u64,
    pub store_jobs: u64,
    /// GPU blocks loaded / stored, and their bytes at `kv_bytes_per_token`.
    pub loaded_blocks: u64,
    pub stored_blocks: u64,
    pub loaded_bytes: u64,
    pub stored_bytes: u64,
    /// Host blocks evicted.
    pub evictions: u64,
    /// Store attempts the tier answered "no room".
    pub no_room: u64,
    /// Checks of the scheduler's invariants that passed (every `--check-every` steps and at
    /// the end; 0 without a host tier).
    pub invariant_checks: u64,
    /// The gauges after the last step.
    pub at_end: AtEnd,
    /// With `--copy`: the worker's traffic and the blocks checked after loads.
    pub copy_loads: Option<Traffic>,
    pub copy_stores: Option<Traffic>,
    pub copy_verified_blocks: Option<u64>,
    /// Time in the library's calls, per step and per request (its own calls).
    pub library_per_step: Percentiles,
    pub library_per_request: Percentiles,
    /// Seconds in the library's calls, and the whole run.
    pub library_seconds: f64,
    pub wall_seconds: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    /// Waiting for its load job; runs with `computed` = the target once it completes.
    Loading {
        target: u64,
    },
    Running,
    Finished,
}

/// A request in the engine.
struct Live {
    id: u64,
    output: u64,
    state: State,
    /// Prompt + generated tokens.
    tokens: u64,
    computed: u64,
    generated: u64,
    /// GPU blocks held; the first `reported` went to the scheduler already.
    blocks: Vec<u32>,
    reported: usize,
    /// Rescheduled after a preemption.
    resumed: bool,
    /// Hashes of the full GPU blocks of the tokens.
    hashes: Vec<u128>,
    library: Duration,
}

/// A shipped job awaiting its completion step.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    due: u64,
    id: u64,
    kind: Direction,
    request: usize,
    first_block: usize,
    num_blocks: usize,
}

/// The hash of GPU block `j` (of `factor`) of prompt block id `id`; the chunk's key is the hash
/// of its last GPU block.
fn prompt_hash(id: u64, j: u32) -> u128 {
    (1u128 << 120) | ((j as u128) << 64) | id as u128
}

/// The hash of decode block `i` of request `r` (unique: answers are not shared).
fn decode_hash(r: usize, i: usize) -> u128 {
    (2u128 << 120) | ((r as u128) << 64) | i as u128
}

/// Tokens per GPU block, dividing by a shift when it is a power of two (the engine divides
/// token counts by it for every request in every step).
#[derive(Debug, Clone, Copy)]
struct BlockSize {
    tokens: u64,
    /// `Some(log2(tokens))` for a power of two.
    shift: Option<u32>,
}

impl BlockSize {
    fn new(tokens: u64) -> Self {
        Self {
            tokens,
            shift: tokens.is_power_of_two().then(|| tokens.trailing_zeros()),
        }
    }

    /// Full blocks of `t` tokens.
    #[inline]
    fn full(self, t: u64) -> u64 {
        match self.shift {
            Some(s) => t >> s,
            None => t / self.tokens,
        }
    }

    /// Blocks holding `t` tokens.
    #[inline]
    fn ceil(self, t: u64) -> u64 {
        match self.shift {
            Some(s) => (t >> s) + u64::from(t & (self.tokens - 1) != 0),
            None => t.div_ceil(self.tokens),
        }
    }
}

fn key_into(hash: u128, key_len: usize, out: &mut Vec<u8>) {
    out.extend(std::iter::repeat_n(0, key_len - 16));
    out.extend_from_slice(&hash.to_be_bytes());
}

fn pct(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        100.0 * a as f64 / b as f64
    }
}

/// One simulation.
pub struct Engine<'w> {
    cfg: EngineConfig,
    gbs: u64,
    bs: BlockSize,
    work: &'w Workload,
    sched: Option<Scheduler>,
    gpu: GpuCache,
    copier: Option<Copier>,
    live: Vec<Live>,
    waiting: VecDeque<usize>,
    running: Vec<usize>,
    loading: usize,
    queue: Vec<InFlight>,
    step_no: u64,
    next_arrival: usize,
    finished: usize,
    stats: RunStats,
    step_times: Vec<f64>,
    step_lib: Duration,
    keys: Vec<u8>,
    scheduled: Vec<(usize, u64)>,
    preempted: Vec<u64>,
    plan: Step,
    /// vLLM 0.33: requests finished since the last `build_step` (their final stores are due).
    final_pending: bool,
    /// Buffers reused from step to step (no allocation per step).
    requests_buf: Vec<ScheduledRequest<'static>>,
    due: Vec<InFlight>,
    reports: Vec<JobReport>,
    got: Vec<u32>,
    /// Skip plain steps of the baseline in one go (off in a test that steps through them).
    skip_plain: bool,
    /// Steps skipped so.
    skipped: u64,
    /// [`Self::gpu_fit`]'s last answer: (request, GPU cache version, its tokens) → answer.
    fit_memo: Cell<Option<FitMemo>>,
}

type FitMemo = ((usize, u64, u64), (usize, bool));

/// `v` emptied, its allocation reused for another lifetime (collecting an empty iterator of a
/// type of the same layout reuses the buffer in place).
fn reuse<'b>(mut v: Vec<ScheduledRequest<'_>>) -> Vec<ScheduledRequest<'b>> {
    v.clear();
    v.into_iter().map(|_| unreachable!()).collect()
}

/// Runs `work` through the engine, with the host tier `tier` (None: the baseline) and, with
/// `copy`, the worker copying real blocks. `progress` is called with the requests finished.
pub fn run(
    work: &Workload,
    cfg: &EngineConfig,
    tier: Option<Tier>,
    copy: bool,
    progress: &mut dyn FnMut(u64),
) -> Result<RunStats> {
    let wall = Instant::now();
    let mut e = Engine::new(work, cfg, tier, copy)?;
    e.run(progress)?;
    let mut s = e.finish()?;
    s.wall_seconds = wall.elapsed().as_secs_f64();
    Ok(s)
}

impl<'w> Engine<'w> {
    fn new(work: &'w Workload, cfg: &EngineConfig, tier: Option<Tier>, copy: bool) -> Result<Self> {
        let bt = work.block_tokens;
        if cfg.factor == 0 || !bt.is_multiple_of(cfg.factor) {
            bail!(
                "--factor: {} does not divide the {bt}-token block",
                cfg.factor
            );
        }
        let gbs = (bt / cfg.factor) as u64;
        if cfg.gpu_blocks > 0 {
            let (i, need) = work
                .requests
                .iter()
                .map(|r| (r.input_tokens + r.output_tokens.max(1)).div_ceil(gbs))
                .enumerate()
                .max_by_key(|&(_, n)| n)
                .unwrap_or((0, 0));
            if need > cfg.gpu_blocks as u64 {
                bail!(
                    "--gpu-blocks: request {i} needs {need} GPU blocks of {gbs} tokens, more than the {} of the cache",
                    cfg.gpu_blocks
                );
            }
        }
        let sched = match tier {
            None => None,
            Some(t) => Some(
                Scheduler::new(SchedulerConfig {
                    key_len: cfg.key_len,
                    gpu_block_size: gbs as u32,
                    block_size_factor: cfg.factor,
                    num_slots: t.num_slots,
                    policy: t.policy,
                    num_workers: 1,
                    offload_prompt_only: true,
                    semantics: cfg.semantics,
                    ..Default::default()
                })
                .context("the scheduler's configuration")?,
            ),
        };
        let copier = match (copy, &tier) {
            (true, Some(t)) => {
                if cfg.gpu_blocks == 0 {
                    bail!("--copy needs a GPU cache of some size (--gpu-blocks > 0)");
                }
                let slots = u32::try_from(t.num_slots).context("--copy: too many host blocks")?;
                Some(Copier::new(
                    cfg.gpu_blocks,
                    gbs * cfg.kv_bytes_per_token,
                    slots,
                    cfg.factor,
                )?)
            }
            _ => None,
        };
        let stats = RunStats {
            policy: match tier {
                None => "none".into(),
                Some(t) => format!("{:?}", t.policy).to_lowercase(),
            },
            host_blocks: tier.map_or(0, |t| t.num_slots as u64),
            requests: work.requests.len() as u64,
            prompt_tokens: work.requests.iter().map(|r| r.input_tokens).sum(),
            ..Default::default()
        };
        Ok(Self {
            cfg: cfg.clone(),
            gbs,
            bs: BlockSize::new(gbs),
            work,
            sched,
            gpu: GpuCache::new(cfg.gpu_blocks),
            copier,
            live: Vec::with_capacity(work.requests.len()),
            waiting: VecDeque::new(),
            running: Vec::new(),
            loading: 0,
            queue: Vec::new(),
            step_no: 0,
            next_arrival: 0,
            finished: 0,
            stats,
            step_times: Vec::new(),
            step_lib: Duration::ZERO,
            keys: Vec::new(),
            scheduled: Vec::new(),
            preempted: Vec::new(),
            plan: Step::new(),
            final_pending: false,
            requests_buf: Vec::new(),
            due: Vec::new(),
            reports: Vec::new(),
            got: Vec::new(),
            skip_plain: true,
            skipped: 0,
            fit_memo: Cell::new(None),
        })
    }

    /// Times a library call, charging it to the step and to request `r`.
    fn timed<T>(&mut self, r: Option<usize>, f: impl FnOnce(&mut Scheduler) -> T) -> Option<T> {
        let sched = self.sched.as_mut()?;
        let t = Instant::now();
        let out = f(sched);
        let d = t.elapsed();
        self.step_lib += d;
        if let Some(r) = r {
            self.live[r].library += d;
        }
        Some(out)
    }

    fn run(&mut self, progress: &mut dyn FnMut(u64)) -> Result<()> {
        let n = self.work.requests.len();
        let mut idle_steps = 0u64;
        while self.finished < n || !self.queue.is_empty() || self.final_pending {
            let busy = !self.running.is_empty()
                || self.loading > 0
                || !self.queue.is_empty()
                || self.final_pending;
            if !busy && self.waiting.is_empty() && self.next_arrival < n {
                // Idle: jump to the next arrival.
                let at = self.work.requests[self.next_arrival].arrival_ms;
                self.step_no = self.step_no.max(at / self.cfg.step_ms.max(1));
            }
            self.step_no += 1;
            self.stats.steps += 1;
            self.step_lib = Duration::ZERO;
            self.arrivals()?;
            let before = (
                self.finished,
                self.stats.admissions,
                self.stats.computed_tokens,
            );
            self.step()?;
            if self.sched.is_some() {
                self.step_times.push(self.step_lib.as_secs_f64());
            }
            if self.cfg.check_every > 0 && self.stats.steps.is_multiple_of(self.cfg.check_every) {
                self.check()?;
            }
            if self.finished != before.0 {
                progress(self.finished as u64);
            }
            let after = (
                self.finished,
                self.stats.admissions,
                self.stats.computed_tokens,
            );
            idle_steps = if before == after && self.queue.is_empty() {
                idle_steps + 1
            } else {
                0
            };
            if idle_steps > MAX_IDLE_STEPS {
                bail!("the engine stalled at step {} (a bug)", self.step_no);
            }
            // A plain step changes neither the finished requests, nor the admissions, nor the
            // computed tokens (counted at admission): each counts as idle.
            let k = self.plain_steps(MAX_IDLE_STEPS - idle_steps);
            if k > 0 {
                self.skip(k);
                idle_steps += k;
            }
        }
        Ok(())
    }

    fn check(&mut self) -> Result<()> {
        if let Some(s) = &self.sched {
            s.check_invariants()
                .with_context(|| format!("scheduler invariants at step {}", self.step_no))?;
            self.stats.invariant_checks += 1;
        }
        Ok(())
    }

    /// Requests arrived by now join the queue (and the scheduler).
    fn arrivals(&mut self) -> Result<()> {
        let now = self.step_no.saturating_mul(self.cfg.step_ms);
        let (bt, f, kl) = (
            self.work.block_tokens as u64,
            self.cfg.factor,
            self.cfg.key_len,
        );
        while let Some(r) = self.work.requests.get(self.next_arrival) {
            if r.arrival_ms > now {
                break;
            }
            let idx = self.live.len();
            let full = r.input_tokens / self.gbs;
            let hashes: Vec<u128> = (0..full)
                .map(|i| {
                    prompt_hash(
                        r.blocks[(i * self.gbs / bt) as usize],
                        (i % f as u64) as u32,
                    )
                })
                .collect();
            self.keys.clear();
            for &h in &hashes {
                key_into(h, kl, &mut self.keys);
            }
            self.live.push(Live {
                id: idx as u64,
                output: r.output_tokens.max(1),
                state: State::Waiting,
                tokens: r.input_tokens,
                computed: 0,
                generated: 0,
                blocks: Vec::new(),
                reported: 0,
                resumed: false,
                hashes,
                library: Duration::ZERO,
            });
            let keys = std::mem::take(&mut self.keys);
            let prompt = r.input_tokens;
            let res = self.timed(Some(idx), |s| {
                s.add_request(idx as u64, prompt, None)?;
                s.append_block_hashes(idx as u64, &keys, prompt)
            });
            self.keys = keys;
            if let Some(res) = res {
                res.context("add_request")?;
            }
            self.waiting.push_back(idx);
            self.next_arrival += 1;
        }
        Ok(())
    }

    fn step(&mut self) -> Result<()> {
        self.scheduled.clear();
        self.preempted.clear();
        self.schedule_running()?;
        // As vLLM: no admissions in a step that preempted (the freed blocks are not reused at once).
        if self.preempted.is_empty() {
            self.admit()?;
        }
        self.build_and_ship()?;
        self.forward()?;
        self.complete()
    }

    /// Blocks a request needs to compute its tokens.
    fn blocks_needed(&self, r: usize) -> u32 {
        self.bs.ceil(self.live[r].tokens) as u32
    }

    fn schedule_running(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.running.len() {
            let r = self.running[i];
            let extra = self
                .blocks_needed(r)
                .saturating_sub(self.live[r].blocks.len() as u32);
            let mut preempted_self = false;
            let mut got = std::mem::take(&mut self.got);
            got.clear();
            while extra > 0 && !self.gpu.allocate(extra, &mut got) {
                let victim = self.running.pop().context("running list empty")?;
                self.preempt(victim)?;
                if victim == r {
                    preempted_self = true;
                    break;
                }
            }
            if !preempted_self {
                self.live[r].blocks.extend_from_slice(&got);
            }
            self.got = got;
            if preempted_self {
                continue;
            }
            let l = &self.live[r];
            self.scheduled.push((r, l.tokens - l.computed));
            i += 1;
        }
        Ok(())
    }

    fn preempt(&mut self, v: usize) -> Result<()> {
        self.stats.preemptions += 1;
        if let Some(res) = self.timed(Some(v), |s| s.has_jobs_in_flight(v as u64))
            && res?
        {
            self.stats.preemptions_with_jobs += 1;
        }
        let l = &mut self.live[v];
        self.gpu.free(&l.blocks);
        l.blocks.clear();
        l.reported = 0;
        l.computed = 0;
        l.resumed = true;
        l.state = State::Waiting;
        self.preempted.push(v as u64);
        self.waiting.push_front(v);
        Ok(())
    }

    /// Waiting request `r`'s GPU prefix hit in blocks (whole blocks, at least one prompt token
    /// left to compute), and whether it fits in the free GPU blocks. Remembered for the last
    /// request asked while the GPU cache does not change (a request that does not fit is asked
    /// again every step).
    fn gpu_fit(&self, r: usize) -> (usize, bool) {
        let (bs, l) = (self.bs, &self.live[r]);
        let key = (r, self.gpu.version(), l.tokens);
        if let Some((k, fit)) = self.fit_memo.get()
            && k == key
        {
            return fit;
        }
        let cap = bs.full(l.tokens - 1) as usize;
        let hits = self
            .gpu
            .lookup_prefix(&l.hashes[..bs.full(l.tokens) as usize])
            .min(cap);
        let need = self.blocks_needed(r) - hits as u32;
        let fits = self
            .gpu
            .free_for(&l.hashes[..hits])
            .is_none_or(|free| free >= need);
        self.fit_memo.set(Some((key, (hits, fits))));
        (hits, fits)
    }

    /// The baseline (no host tier) only: how many of the next steps are *plain*, changing
    /// nothing but the clock and the running requests' token counts: no arrival, no admission
    /// (the first waiting request does not fit, and nothing frees or fills a GPU block until it
    /// might), and every running request computes one decode token that needs no new GPU
    /// block, completes no block, is not its last and fills no block to hash. The engine skips
    /// such steps in one go ([`Self::skip`]); the figures are those of stepping through them.
    /// At most `limit` (the stall check's margin).
    fn plain_steps(&self, limit: u64) -> u64 {
        if !self.skip_plain
            || self.sched.is_some()
            || self.copier.is_some()
            || !self.cfg.decode
            || self.running.is_empty()
            || self.loading > 0
            || !self.queue.is_empty()
        {
            return 0;
        }
        let mut k = limit;
        if let Some(next) = self.work.requests.get(self.next_arrival) {
            // Step `step_no + j` admits it once (step_no + j) · step_ms >= its arrival.
            let Some(before) = next.arrival_ms.checked_sub(1) else {
                return 0;
            };
            k = k.min((before / self.cfg.step_ms.max(1)).saturating_sub(self.step_no));
        }
        if let Some(&w) = self.waiting.front()
            && self.running.len() < self.cfg.max_batch
            && self.gpu_fit(w).1
        {
            return 0;
        }
        let (bs, gbs) = (self.bs, self.gbs);
        for &r in &self.running {
            let l = &self.live[r];
            if k == 0 || l.tokens != l.computed + 1 || l.generated >= l.output {
                return 0;
            }
            // Step j (1-based) starts with t + j - 1 tokens and computes token c + j - 1.
            let (t, c) = (l.tokens, l.computed);
            // No GPU block to allocate: t + j - 1 tokens fit in the blocks held.
            let room = (l.blocks.len() as u64 * gbs + 1).saturating_sub(t);
            // No block completed (registered in the prefix cache): c + j is no block end.
            let to_block_end = gbs - (c - bs.full(c) * gbs);
            // Not the last token: generated + j < output.
            let to_last = l.output - l.generated;
            // No new full block to hash: t + j < (hashes + 1) · gbs tokens.
            let to_hash = ((l.hashes.len() as u64 + 1) * gbs).saturating_sub(t);
            k = k
                .min(room)
                .min(to_block_end - 1)
                .min(to_last - 1)
                .min(to_hash.saturating_sub(1));
        }
        k
    }

    /// Takes `k` plain steps (see [`Self::plain_steps`]) at once.
    fn skip(&mut self, k: u64) {
        self.skipped += k;
        self.step_no += k;
        self.stats.steps += k;
        for &r in &self.running {
            let l = &mut self.live[r];
            l.tokens += k;
            l.computed += k;
            l.generated += k;
        }
    }

    fn admit(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.waiting.len() && self.running.len() + self.loading < self.cfg.max_batch {
            let r = self.waiting[i];
            let tokens = self.live[r].tokens;
            let (hits, fits) = self.gpu_fit(r);
            let local = hits as u64 * self.gbs;
            let m = self.timed(Some(r), |s| s.match_request(r as u64, local));
            let host = match m.transpose().context("match_request")? {
                None | Some(Match::Miss) => 0,
                Some(Match::Hit(n)) => n.min(tokens - 1 - local),
                Some(Match::Defer(_)) => {
                    i += 1;
                    continue;
                }
            };
            if !fits {
                break;
            }
            let need = self.blocks_needed(r) - hits as u32;
            let mut blocks = std::mem::take(&mut self.live[r].blocks);
            self.gpu
                .take_cached(&self.live[r].hashes[..hits], &mut blocks);
            let allocated = self.gpu.allocate(need, &mut blocks);
            debug_assert!(allocated);
            let job = self
                .timed(Some(r), |s| s.on_alloc(r as u64, &blocks, host))
                .transpose()
                .context("on_alloc")?
                .flatten();
            self.waiting.remove(i);
            self.stats.admissions += 1;
            self.stats.prefill_tokens += tokens;
            self.stats.gpu_hit_tokens += local;
            self.stats.host_hit_tokens += host;
            self.stats.computed_tokens += tokens - local - host;
            let l = &mut self.live[r];
            l.blocks = blocks;
            l.computed = local;
            if job.is_some() {
                l.state = State::Loading {
                    target: local + host,
                };
                self.loading += 1;
            } else {
                l.state = State::Running;
                self.running.push(r);
                self.scheduled.push((r, tokens - local));
            }
        }
        Ok(())
    }

    fn build_and_ship(&mut self) -> Result<()> {
        let Some(sched) = self.sched.as_mut() else {
            return Ok(());
        };
        let mut reqs = reuse(std::mem::take(&mut self.requests_buf));
        reqs.extend(self.scheduled.iter().map(|&(r, n)| {
            let l = &self.live[r];
            ScheduledRequest {
                request_id: l.id,
                num_computed_tokens: l.computed,
                num_scheduled_tokens: n,
                num_tokens: l.tokens,
                new_block_ids: &l.blocks[l.reported..],
                resumed: l.resumed && l.reported == 0,
            }
        }));
        let t = Instant::now();
        let res = sched.build_step(&reqs, &self.preempted, &mut self.plan);
        self.step_lib += t.elapsed();
        self.requests_buf = reuse(reqs);
        res.context("build_step")?;
        self.final_pending = false;
        for &(r, _) in &self.scheduled {
            let l = &mut self.live[r];
            l.reported = l.blocks.len();
            l.resumed = false;
        }
        let (gbs, kv) = (self.gbs, self.cfg.kv_bytes_per_token);
        for j in self.plan.jobs() {
            let (n, first) = (j.num_gpu_blocks as u64, j.block_index as usize);
            let bytes = n * gbs * kv;
            match j.kind {
                Direction::Load => {
                    self.stats.load_jobs += 1;
                    self.stats.loaded_blocks += n;
                    self.stats.loaded_bytes += bytes;
                }
                Direction::Store => {
                    self.stats.store_jobs += 1;
                    self.stats.stored_blocks += n;
                    self.stats.stored_bytes += bytes;
                }
            }
            self.queue.push(InFlight {
                due: self.step_no + self.cfg.transfer_delay_steps,
                id: j.id,
                kind: j.kind,
                request: j.request_id as usize,
                first_block: first,
                num_blocks: n as usize,
            });
        }
        // The flush set's copies finish before this step's forward pass (with --copy the worker
        // waits for them); their reports still arrive on the queue's schedule.
        let flush = self.plan.flush();
        self.stats.flushed_jobs += flush.len() as u64;
        if let Some(c) = &mut self.copier {
            c.flush(flush)?;
        }
        Ok(())
    }

    fn forward(&mut self) -> Result<()> {
        let bs = self.bs;
        for k in 0..self.scheduled.len() {
            let (r, n) = self.scheduled[k];
            let l = &mut self.live[r];
            let (from, to) = (bs.full(l.computed), bs.full(l.computed + n));
            for b in from..to.min(l.hashes.len() as u64) {
                let (block, hash) = (l.blocks[b as usize], l.hashes[b as usize]);
                self.gpu.register(block, hash);
                if let Some(c) = &mut self.copier {
                    c.fill(block, hash);
                }
            }
            l.computed += n;
            l.generated += 1;
            l.tokens += 1;
        }
        if let Some(c) = &mut self.copier {
            c.submit(&self.plan)?;
        }
        for k in 0..self.scheduled.len() {
            let r = self.scheduled[k].0;
            let l = &self.live[r];
            if l.generated >= l.output || !self.cfg.decode {
                self.finish_request(r)?;
            } else if bs.full(l.tokens) > l.hashes.len() as u64 {
                let h = decode_hash(r, l.hashes.len());
                let tokens = l.tokens;
                self.live[r].hashes.push(h);
                self.keys.clear();
                key_into(h, self.cfg.key_len, &mut self.keys);
                let keys = std::mem::take(&mut self.keys);
                let res = self.timed(Some(r), |s| s.append_block_hashes(r as u64, &keys, tokens));
                self.keys = keys;
                res.transpose().context("append_block_hashes")?;
            }
        }
        Ok(())
    }

    fn finish_request(&mut self, r: usize) -> Result<()> {
        self.timed(Some(r), |s| s.finish_request(r as u64))
            .transpose()
            .context("finish_request")?;
        self.final_pending |= self.sched.is_some() && self.cfg.semantics == Semantics::Vllm033;
        let l = &mut self.live[r];
        self.gpu.free(&l.blocks);
        l.blocks = Vec::new();
        l.hashes = Vec::new();
        l.state = State::Finished;
        self.running.retain(|&x| x != r);
        self.finished += 1;
        Ok(())
    }

    fn complete(&mut self) -> Result<()> {
        let now = self.step_no;
        if !self.queue.iter().any(|q| q.due <= now) {
            return Ok(());
        }
        let mut due = std::mem::take(&mut self.due);
        due.clear();
        self.queue.retain(|q| {
            if q.due <= now {
                due.push(*q);
                false
            } else {
                true
            }
        });
        let mut reports = std::mem::take(&mut self.reports);
        reports.clear();
        reports.extend(due.iter().map(|q| JobReport {
            job_id: q.id,
            count: 1,
            success: true,
        }));
        if let Some(c) = &mut self.copier {
            for q in &due {
                c.complete(q.id, q.kind)?;
            }
        }
        let t = Instant::now();
        let res = self.sched.as_mut().map(|s| s.complete_jobs(&reports));
        self.step_lib += t.elapsed();
        res.transpose().context("complete_jobs")?;
        for q in due.iter().filter(|q| q.kind == Direction::Load) {
            let r = q.request;
            let State::Loading { target } = self.live[r].state else {
                bail!("load job {} of request {r}, which is not loading", q.id);
            };
            for b in q.first_block..q.first_block + q.num_blocks {
                let (block, hash) = (self.live[r].blocks[b], self.live[r].hashes[b]);
                if let Some(c) = &mut self.copier
                    && !c.check(block, hash)
                {
                    bail!(
                        "--copy: block {b} of request {r} (GPU block {block}) does not hold its KV after load job {}",
                        q.id
                    );
                }
                self.gpu.register(block, hash);
            }
            let l = &mut self.live[r];
            l.computed = target;
            l.state = State::Running;
            self.loading -= 1;
            self.running.push(r);
        }
        self.due = due;
        self.reports = reports;
        Ok(())
    }

    fn finish(mut self) -> Result<RunStats> {
        self.check()?;
        let mut s = std::mem::take(&mut self.stats);
        if let Some(sched) = &self.sched {
            let st = sched.stats();
            s.at_end = AtEnd {
                loads_in_flight: st.loads_in_flight,
                stores_in_flight: st.stores_in_flight,
                pinned: st.manager.pinned,
                requests_tracked: st.requests,
                gpu_blocks_held: 0,
            };
            if st.loads_in_flight + st.stores_in_flight > 0 || st.manager.pinned > 0 {
                bail!(
                    "at the end: {} loads and {} stores in flight, {} keys pinned",
                    st.loads_in_flight,
                    st.stores_in_flight,
                    st.manager.pinned
                );
            }
            if st.requests > 0 {
                bail!("at the end: {} requests still tracked", st.requests);
            }
            s.deferrals = Deferrals {
                jobs_in_flight: st.deferred_jobs_in_flight,
                store_in_flight: st.deferred_store_in_flight,
                being_loaded: st.deferred_being_loaded,
            };
            s.evictions = st.manager.evictions;
            s.no_room = st.store_no_room;
        }
        s.at_end.gpu_blocks_held = self.gpu.in_use() as u64;
        if self.gpu.in_use() > 0 {
            bail!("at the end: {} GPU blocks still held", self.gpu.in_use());
        }
        if let Some(c) = &self.copier {
            let (bl, bs) = (s.loaded_bytes, s.stored_bytes);
            if c.loads.bytes != bl || c.stores.bytes != bs {
                bail!(
                    "--copy: the worker moved {} / {} bytes (load / store), the plans {bl} / {bs}",
                    c.loads.bytes,
                    c.stores.bytes
                );
            }
            s.copy_loads = Some(c.loads);
            s.copy_stores = Some(c.stores);
            s.copy_verified_blocks = Some(c.verified_blocks);
        }
        s.gpu_hit_pct = pct(s.gpu_hit_tokens, s.prefill_tokens);
        s.host_hit_pct = pct(s.host_hit_tokens, s.prefill_tokens);
        s.library_seconds = self.step_times.iter().sum();
        s.library_per_step = Percentiles::of(std::mem::take(&mut self.step_times));
        if self.sched.is_some() {
            s.library_per_request =
                Percentiles::of(self.live.iter().map(|l| l.library.as_secs_f64()).collect());
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::ChatParams;

    #[test]
    fn percentiles_select_the_ranks_of_the_sorted_values() {
        for n in [1usize, 2, 3, 10, 101, 1000] {
            let v: Vec<f64> = (0..n).map(|i| ((i * 7919) % 1009) as f64 * 1e-6).collect();
            let mut sorted = v.clone();
            sorted.sort_by(f64::total_cmp);
            let at = |q: f64| sorted[((n - 1) as f64 * q).round() as usize] * 1e6;
            let p = Percentiles::of(v);
            assert_eq!((p.median_us, p.p99_us), (at(0.5), at(0.99)), "{n} values");
        }
        assert_eq!(Percentiles::of(Vec::new()), Percentiles::default());
    }

    fn untimed(mut s: RunStats) -> RunStats {
        s.wall_seconds = 0.0;
        s.library_seconds = 0.0;
        s.library_per_step = Percentiles::default();
        s.library_per_request = Percentiles::default();
        s
    }

    /// The baseline's figures, and the steps it skipped.
    fn baseline(work: &Workload, cfg: &EngineConfig, skip_plain: bool) -> (RunStats, u64) {
        let mut e = Engine::new(work, cfg, None, false).unwrap();
        e.skip_plain = skip_plain;
        e.run(&mut |_| {}).unwrap();
        let skipped = e.skipped;
        (untimed(e.finish().unwrap()), skipped)
    }

    /// The baseline's figures are the same whether its plain steps are skipped or stepped
    /// through: with a roomy GPU cache, a small one that preempts, GPU blocks of a power of two
    /// tokens and not, and one request at a time.
    #[test]
    fn skipping_plain_steps_changes_no_figure() {
        let cfg = EngineConfig {
            factor: 1,
            gpu_blocks: 256,
            max_batch: 64,
            transfer_delay_steps: 1,
            step_ms: 20,
            decode: true,
            key_len: 32,
            kv_bytes_per_token: 8,
            check_every: 0,
            semantics: Semantics::Vllm024,
        };
        for (block_tokens, factor, gpu_blocks, max_batch) in [
            (512, 1, 256, 64),
            (512, 1, 80, 64),
            (512, 4, 600, 64),
            (480, 3, 900, 16),
            (300, 1, 0, 64),
            (512, 1, 256, 1),
        ] {
            let work = ChatParams {
                block_tokens,
                conversations: 100,
                one_offs: 200,
                ..Default::default()
            }
            .generate()
            .unwrap();
            let cfg = EngineConfig {
                factor,
                gpu_blocks,
                max_batch,
                ..cfg.clone()
            };
            let what = format!(
                "{block_tokens}-token blocks, factor {factor}, {gpu_blocks} GPU blocks, batch {max_batch}"
            );
            let (stepped, none) = baseline(&work, &cfg, false);
            assert_eq!(none, 0);
            let (skipping, skipped) = baseline(&work, &cfg, true);
            assert_eq!(skipping, stepped, "{what}");
            assert!(
                skipped * 2 > stepped.steps,
                "{what}: {skipped} of {} steps skipped",
                stepped.steps
            );
            if gpu_blocks == 80 {
                assert!(stepped.preemptions > 0, "{what}");
            }
        }
    }
}

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
//! Without a host tier (the baseline), steps 2–5 skip the scheduler. In vLLM 0.33 semantics a
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
    fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] * 1e6;
        Self {
            median_us: at(0.5),
            p99_us: at(0.99),
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
            self.step_times.push(self.step_lib.as_secs_f64());
            if self.cfg.check_every > 0 && self.stats.steps.is_multiple_of(self.cfg.check_every) {
                self.check()?;
            }
            progress(self.finished as u64);
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
            if idle_steps > 1_000_000 {
                bail!("the engine stalled at step {} (a bug)", self.step_no);
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
        self.live[r].tokens.div_ceil(self.gbs) as u32
    }

    fn schedule_running(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.running.len() {
            let r = self.running[i];
            let extra = self
                .blocks_needed(r)
                .saturating_sub(self.live[r].blocks.len() as u32);
            let mut preempted_self = false;
            let mut got = Vec::new();
            while !self.gpu.allocate(extra, &mut got) {
                let victim = self.running.pop().context("running list empty")?;
                self.preempt(victim)?;
                if victim == r {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                continue;
            }
            self.live[r].blocks.extend_from_slice(&got);
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

    fn admit(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.waiting.len() && self.running.len() + self.loading < self.cfg.max_batch {
            let r = self.waiting[i];
            let gbs = self.gbs;
            let (tokens, full) = (self.live[r].tokens, self.live[r].tokens / gbs);
            let cap = ((tokens - 1) / gbs) as usize;
            let hits = self
                .gpu
                .lookup_prefix(&self.live[r].hashes[..full as usize])
                .min(cap);
            let local = hits as u64 * gbs;
            let m = self.timed(Some(r), |s| s.match_request(r as u64, local));
            let host = match m.transpose().context("match_request")? {
                None | Some(Match::Miss) => 0,
                Some(Match::Hit(n)) => n.min(tokens - 1 - local),
                Some(Match::Defer(_)) => {
                    i += 1;
                    continue;
                }
            };
            let need = self.blocks_needed(r) - hits as u32;
            if self
                .gpu
                .free_for(&self.live[r].hashes[..hits])
                .is_some_and(|free| free < need)
            {
                break;
            }
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
        let reqs: Vec<ScheduledRequest<'_>> = self
            .scheduled
            .iter()
            .map(|&(r, n)| {
                let l = &self.live[r];
                ScheduledRequest {
                    request_id: l.id,
                    num_computed_tokens: l.computed,
                    num_scheduled_tokens: n,
                    num_tokens: l.tokens,
                    new_block_ids: &l.blocks[l.reported..],
                    resumed: l.resumed && l.reported == 0,
                }
            })
            .collect();
        let t = Instant::now();
        let res = sched.build_step(&reqs, &self.preempted, &mut self.plan);
        self.step_lib += t.elapsed();
        res.context("build_step")?;
        self.final_pending = false;
        drop(reqs);
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
        let gbs = self.gbs;
        for k in 0..self.scheduled.len() {
            let (r, n) = self.scheduled[k];
            let l = &mut self.live[r];
            let (from, to) = (l.computed / gbs, (l.computed + n) / gbs);
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
            } else if l.tokens / gbs > l.hashes.len() as u64 {
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
        let mut due = Vec::new();
        self.queue.retain(|q| {
            if q.due <= now {
                due.push(*q);
                false
            } else {
                true
            }
        });
        let reports: Vec<JobReport> = due
            .iter()
            .map(|q| JobReport {
                job_id: q.id,
                count: 1,
                success: true,
            })
            .collect();
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

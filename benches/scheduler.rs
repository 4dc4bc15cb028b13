//! Scheduler benchmarks through the Rust API and the C ABI (called exactly as a C host would):
//! `build_step` with 256 running requests that each complete one chunk (one store job each),
//! and `match` on a 128k-token prompt (250 chunks of 512 tokens) that hits all of them, or
//! misses. Run: `cargo bench --bench scheduler`.
//!
//! `build_step` is timed alone (`iter_custom`): filling the request array, completing the jobs,
//! replacing requests that reached the end of their prompt and resetting the tier before it
//! fills happen outside the measured time. The requests' progress is staggered evenly over their
//! prompt, so every step does the same work: 256 one-chunk store jobs, and in vLLM 0.24
//! semantics a touch of each request's prompt keys (the scheduler touches all of them, as vLLM
//! 0.24 does, so the step's cost grows with the prompt length). In vLLM 0.33 semantics (cases
//! suffixed `_v033`) nothing is touched; a step also commits the requests that finished after
//! the previous one (on average 256 / chunks per prompt of them). Cases are named
//! `factor{F}_prompt{T}`: block_size_factor F, T-token prompts; the smallest T is one chunk,
//! the floor with a single key to touch.
//!
//! Every case builds its own 1M-slot scheduler (tens of MB), so the longer prompts are bound by
//! memory latency and vary from run to run on a shared machine.

use criterion::{BenchmarkId, Criterion, Throughput};
use kvoffload::ffi::{self, kvo_status};
use kvoffload::manager::{Policy, Semantics};
use kvoffload::plan::Step;
use kvoffload::scheduler::{JobReport, Match, ScheduledRequest, Scheduler, SchedulerConfig};
use std::ffi::c_char;
use std::hint::black_box;
use std::time::{Duration, Instant};

const KEY_LEN: usize = 32;
const GPU_BLOCK: u32 = 16;
const SLOTS: usize = 1 << 20;
/// Requests scheduled in every step.
const RUNNING: usize = 256;

/// Block hash `i`: 32 distinct-looking bytes.
fn hash(i: u64, out: &mut Vec<u8>) {
    let h = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    out.extend_from_slice(&i.to_le_bytes());
    for j in 1..KEY_LEN as u32 / 8 {
        out.extend_from_slice(&(h.rotate_left(j * 16) ^ j as u64).to_le_bytes());
    }
}

fn config(factor: u32, semantics: Semantics) -> SchedulerConfig {
    SchedulerConfig {
        semantics,
        key_len: KEY_LEN,
        gpu_block_size: GPU_BLOCK,
        block_size_factor: factor,
        num_slots: SLOTS,
        policy: Policy::Lru,
        num_workers: 1,
        offload_prompt_only: false,
        ..Default::default()
    }
}

/// One request of a step: it computes one chunk after `computed` tokens, with new GPU block ids
/// `blocks` (a range of the step's block-id buffer).
#[derive(Clone, Copy)]
struct Sched {
    id: u64,
    computed: u64,
    tokens: u64,
    blocks: (usize, usize),
}

/// The scheduler calls the benchmarks make, through one API or the other.
trait Api {
    fn add_request(&mut self, id: u64, prompt_tokens: u64, hashes: &[u8]);
    /// Builds a step where each of `reqs` computes `chunk` tokens; returns the time of the
    /// build call alone.
    fn build_step(&mut self, reqs: &[Sched], chunk: u64, blocks: &[u32]) -> Duration;
    /// Completes every job of the last step successfully; returns how many there were.
    fn complete_step(&mut self) -> usize;
    fn finish_request(&mut self, id: u64);
    fn reset(&mut self);
}

struct RustApi {
    sched: Scheduler,
    step: Step,
    reports: Vec<JobReport>,
}

impl RustApi {
    fn new(cfg: SchedulerConfig) -> Self {
        Self {
            sched: Scheduler::new(cfg).unwrap(),
            step: Step::new(),
            reports: Vec::new(),
        }
    }
}

impl Api for RustApi {
    fn add_request(&mut self, id: u64, prompt_tokens: u64, hashes: &[u8]) {
        self.sched.add_request(id, prompt_tokens, None).unwrap();
        self.sched
            .append_block_hashes(id, hashes, prompt_tokens)
            .unwrap();
    }

    fn build_step(&mut self, reqs: &[Sched], chunk: u64, blocks: &[u32]) -> Duration {
        let list: Vec<ScheduledRequest<'_>> = reqs
            .iter()
            .map(|r| ScheduledRequest {
                request_id: r.id,
                num_computed_tokens: r.computed,
                num_scheduled_tokens: chunk,
                num_tokens: r.tokens,
                new_block_ids: &blocks[r.blocks.0..r.blocks.1],
                resumed: false,
            })
            .collect();
        let t = Instant::now();
        let res = self.sched.build_step(&list, &[], &mut self.step);
        let d = t.elapsed();
        res.unwrap();
        d
    }

    fn complete_step(&mut self) -> usize {
        self.reports.clear();
        self.reports
            .extend(self.step.jobs().iter().map(|j| JobReport {
                job_id: j.id,
                count: 1,
                success: true,
            }));
        self.sched.complete_jobs(&self.reports).unwrap();
        self.reports.len()
    }

    fn finish_request(&mut self, id: u64) {
        self.sched.finish_request(id).unwrap();
    }

    fn reset(&mut self) {
        self.sched.reset().unwrap();
    }
}

/// Panics with the library's message unless `st` is `KVO_STATUS_OK`.
fn ok(st: kvo_status) {
    if st != kvo_status::Ok {
        let mut buf = [0 as c_char; 512];
        // SAFETY: `buf` holds 512 writable bytes; the message is NUL-terminated.
        let msg = unsafe {
            ffi::kvo_last_error_message(buf.as_mut_ptr(), buf.len());
            std::ffi::CStr::from_ptr(buf.as_ptr())
        };
        panic!("{st:?}: {}", msg.to_string_lossy());
    }
}

struct CApi {
    sched: *mut ffi::kvo_scheduler,
    step: *mut ffi::kvo_step,
    list: Vec<ffi::kvo_scheduled_request>,
    reports: Vec<ffi::kvo_job_report>,
}

impl CApi {
    fn new(cfg: &SchedulerConfig) -> Self {
        let mut c = std::mem::MaybeUninit::uninit();
        let (mut sched, mut step) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid out-pointers; the handles are freed in Drop.
        unsafe {
            ok(ffi::kvo_scheduler_config_default(c.as_mut_ptr()));
            let mut c = c.assume_init();
            c.key_len = cfg.key_len as u32;
            c.gpu_block_size = cfg.gpu_block_size;
            c.block_size_factor = cfg.block_size_factor;
            c.policy = ffi::kvo_policy::Lru as u32;
            c.num_slots = cfg.num_slots as u64;
            c.num_workers = cfg.num_workers;
            c.offload_prompt_only = cfg.offload_prompt_only as u32;
            c.semantics = match cfg.semantics {
                Semantics::Vllm024 => ffi::kvo_semantics::VLLM_0_24,
                Semantics::Vllm033 => ffi::kvo_semantics::VLLM_0_33,
            } as u32;
            ok(ffi::kvo_scheduler_new(&c, &mut sched));
            ok(ffi::kvo_step_new(&mut step));
        }
        Self {
            sched,
            step,
            list: Vec::new(),
            reports: Vec::new(),
        }
    }
}

impl Drop for CApi {
    fn drop(&mut self) {
        // SAFETY: handles from kvo_scheduler_new / kvo_step_new, freed once.
        unsafe {
            ffi::kvo_step_free(self.step);
            ffi::kvo_scheduler_free(self.sched);
        }
    }
}

impl Api for CApi {
    fn add_request(&mut self, id: u64, prompt_tokens: u64, hashes: &[u8]) {
        // SAFETY: live handle; `hashes` holds `len / KEY_LEN` hashes.
        unsafe {
            ok(ffi::kvo_scheduler_add_request(
                self.sched,
                id,
                prompt_tokens,
                ffi::KVO_NO_LIMIT,
            ));
            ok(ffi::kvo_scheduler_append_block_hashes(
                self.sched,
                id,
                hashes.as_ptr(),
                hashes.len() / KEY_LEN,
                prompt_tokens,
            ));
        }
    }

    fn build_step(&mut self, reqs: &[Sched], chunk: u64, blocks: &[u32]) -> Duration {
        self.list.clear();
        self.list
            .extend(reqs.iter().map(|r| ffi::kvo_scheduled_request {
                request_id: r.id,
                num_computed_tokens: r.computed,
                num_scheduled_tokens: chunk,
                num_tokens: r.tokens,
                new_block_ids: blocks[r.blocks.0..].as_ptr(),
                n_new_block_ids: r.blocks.1 - r.blocks.0,
                resumed: 0,
                reserved: 0,
            }));
        let t = Instant::now();
        // SAFETY: live handles; `list` and the block ids it points to outlive the call.
        let st = unsafe {
            ffi::kvo_scheduler_build_step(
                self.sched,
                self.list.as_ptr(),
                self.list.len(),
                std::ptr::null(),
                0,
                self.step,
            )
        };
        let d = t.elapsed();
        ok(st);
        d
    }

    fn complete_step(&mut self) -> usize {
        let mut info = ffi::kvo_step_info::default();
        // SAFETY: live handles; valid out-pointers; `reports` holds `len` entries.
        unsafe {
            ok(ffi::kvo_step_get_info(self.step, &mut info));
            self.reports.clear();
            for i in 0..info.num_jobs {
                let mut job = ffi::kvo_job_info::default();
                ok(ffi::kvo_step_get_job(self.step, i, &mut job));
                self.reports.push(ffi::kvo_job_report {
                    job_id: job.id,
                    count: 1,
                    success: 1,
                });
            }
            ok(ffi::kvo_scheduler_complete_jobs(
                self.sched,
                self.reports.as_ptr(),
                self.reports.len(),
            ));
        }
        info.num_jobs
    }

    fn finish_request(&mut self, id: u64) {
        // SAFETY: live handle.
        ok(unsafe { ffi::kvo_scheduler_finish_request(self.sched, id) });
    }

    fn reset(&mut self) {
        // SAFETY: live handle.
        ok(unsafe { ffi::kvo_scheduler_reset(self.sched) });
    }
}

/// `RUNNING` requests in chunked prefill of `chunks`-chunk prompts (all block hashes appended at
/// admission), each computing one chunk per step; request `i` starts `i * chunks / RUNNING`
/// chunks in, and a request that finishes its prompt is replaced by a new one with new hashes.
struct Prefill<A> {
    api: A,
    factor: usize,
    chunk: u64,
    chunks: u64,
    /// (request id, chunks computed)
    reqs: Vec<(u64, u64)>,
    next_id: u64,
    next_hash: u64,
    /// Chunks stored since the tier was last reset.
    stored: usize,
    hashes: Vec<u8>,
    blocks: Vec<u32>,
    sched: Vec<Sched>,
}

impl<A: Api> Prefill<A> {
    fn new(api: A, factor: u32, prompt_tokens: u64) -> Self {
        let chunk = (GPU_BLOCK * factor) as u64;
        assert_eq!(prompt_tokens % chunk, 0);
        let mut p = Self {
            api,
            factor: factor as usize,
            chunk,
            chunks: prompt_tokens / chunk,
            reqs: Vec::new(),
            next_id: 0,
            next_hash: 0,
            stored: 0,
            hashes: Vec::new(),
            blocks: Vec::new(),
            sched: Vec::new(),
        };
        p.restart();
        p
    }

    /// A new request with new hashes for its whole prompt, nothing computed.
    fn admit(&mut self) -> (u64, u64) {
        let id = self.next_id;
        self.next_id += 1;
        self.hashes.clear();
        for _ in 0..self.chunks * self.factor as u64 {
            hash(self.next_hash, &mut self.hashes);
            self.next_hash += 1;
        }
        self.api
            .add_request(id, self.chunks * self.chunk, &self.hashes);
        (id, 0)
    }

    /// Drops every request and the tier, admits `RUNNING` new requests and advances them to
    /// their staggered starting points.
    fn restart(&mut self) {
        for (id, _) in std::mem::take(&mut self.reqs) {
            self.api.finish_request(id);
        }
        self.api.reset();
        self.stored = 0;
        self.reqs = (0..RUNNING).map(|_| self.admit()).collect();
        let n = self.chunks as usize;
        for k in 0..n {
            self.step(|i| i * n / RUNNING > k);
        }
    }

    /// One step of the requests `pick` selects; returns the time of the build call.
    fn step(&mut self, pick: impl Fn(usize) -> bool) -> Duration {
        let (f, chunks) = (self.factor, self.chunks);
        self.sched.clear();
        self.blocks.clear();
        for (i, &(id, done)) in self.reqs.iter().enumerate() {
            if !pick(i) {
                continue;
            }
            let first = ((i as u64 * chunks + done) * f as u64) as u32;
            let at = self.blocks.len();
            self.blocks.extend(first..first + f as u32);
            self.sched.push(Sched {
                id,
                computed: done * self.chunk,
                tokens: chunks * self.chunk,
                blocks: (at, at + f),
            });
        }
        if self.sched.is_empty() {
            return Duration::ZERO;
        }
        let d = self.api.build_step(&self.sched, self.chunk, &self.blocks);
        assert_eq!(self.api.complete_step(), self.sched.len(), "one job each");
        self.stored += self.sched.len();
        for i in 0..RUNNING {
            if !pick(i) {
                continue;
            }
            self.reqs[i].1 += 1;
            if self.reqs[i].1 == chunks {
                self.api.finish_request(self.reqs[i].0);
                self.reqs[i] = self.admit();
            }
        }
        d
    }

    /// One step of all the requests (the tier is reset first when it would fill up).
    fn timed_step(&mut self) -> Duration {
        if self.stored + RUNNING > SLOTS {
            self.restart();
        }
        self.step(|_| true)
    }
}

fn build_step(c: &mut Criterion) {
    let mut g = c.benchmark_group(format!("scheduler_build_step/{RUNNING}_requests"));
    g.throughput(Throughput::Elements(RUNNING as u64));
    g.sample_size(20);
    // (block_size_factor, prompt tokens): one chunk (a single key to touch: the per-job floor),
    // then prompts of 128, 32 and 128 chunks. Factor 1 with 8192 tokens (512 keys to touch per
    // request) is left out to keep the run short: its step takes ~4x the 128-chunk ones.
    // In vLLM 0.33 semantics nothing is touched: the step's cost no longer grows with the
    // prompt (cases suffixed `_v033`).
    let v024 = Semantics::Vllm024;
    let v033 = Semantics::Vllm033;
    for (factor, prompt, semantics) in [
        (1u32, 16u64, v024),
        (1, 2048, v024),
        (4, 64, v024),
        (4, 2048, v024),
        (4, 8192, v024),
        (1, 16, v033),
        (4, 64, v033),
        (4, 8192, v033),
    ] {
        let suffix = if semantics == v033 { "_v033" } else { "" };
        let name = format!("factor{factor}_prompt{prompt}{suffix}");
        let config = |factor| config(factor, semantics);
        // Set up on first use (criterion calls the closure once per sample, and never for a
        // filtered-out case).
        let mut rust = None;
        g.bench_function(BenchmarkId::new("rust", &name), |b| {
            let p = rust
                .get_or_insert_with(|| Prefill::new(RustApi::new(config(factor)), factor, prompt));
            b.iter_custom(|iters| (0..iters).map(|_| p.timed_step()).sum())
        });
        drop(rust);
        let mut c_abi = None;
        g.bench_function(BenchmarkId::new("c_abi", &name), |b| {
            let p = c_abi
                .get_or_insert_with(|| Prefill::new(CApi::new(&config(factor)), factor, prompt));
            b.iter_custom(|iters| (0..iters).map(|_| p.timed_step()).sum())
        });
    }
    g.finish();
}

/// Tokens of the matched prompt: 250 chunks of 16 × 32 = 512 tokens.
const PROMPT: u64 = 128_000;
const FACTOR: u32 = 32;
const HIT: u64 = 1;
const MISS: u64 = 2;

/// A scheduler holding request `HIT`, whose 250 chunks are all stored and ready, and request
/// `MISS`, none of whose chunks is stored.
fn match_setup<A: Api>(mut api: A) -> A {
    let blocks_per_prompt = PROMPT / GPU_BLOCK as u64;
    for (id, from) in [(HIT, 0), (MISS, blocks_per_prompt)] {
        let mut hashes = Vec::new();
        for i in from..from + blocks_per_prompt {
            hash(i, &mut hashes);
        }
        api.add_request(id, PROMPT, &hashes);
    }
    let blocks: Vec<u32> = (0..blocks_per_prompt as u32).collect();
    let hit = Sched {
        id: HIT,
        computed: 0,
        tokens: PROMPT,
        blocks: (0, blocks.len()),
    };
    api.build_step(&[hit], PROMPT, &blocks);
    assert_eq!(api.complete_step(), 1);
    api
}

fn match_prompt(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler_match/128k_prompt_250_chunks");
    let chunks = PROMPT / (GPU_BLOCK * FACTOR) as u64;
    g.throughput(Throughput::Elements(chunks));

    let mut rust = match_setup(RustApi::new(config(FACTOR, Semantics::Vllm024)));
    assert_eq!(
        rust.sched.match_request(HIT, 0).unwrap(),
        Match::Hit(PROMPT)
    );
    assert_eq!(rust.sched.match_request(MISS, 0).unwrap(), Match::Miss);
    // Each timed match follows an untimed match of the other request, so that it cannot reuse
    // the tier's resolution of its own keys from the previous iteration.
    for (name, id, other) in [("hit", HIT, MISS), ("miss", MISS, HIT)] {
        g.bench_function(BenchmarkId::new("rust", name), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    black_box(rust.sched.match_request(other, 0).unwrap());
                    let t = Instant::now();
                    black_box(rust.sched.match_request(black_box(id), 0).unwrap());
                    total += t.elapsed();
                }
                total
            })
        });
    }
    drop(rust);

    let c_abi = match_setup(CApi::new(&config(FACTOR, Semantics::Vllm024)));
    let call = |id: u64| {
        let mut out = ffi::kvo_match_result::default();
        // SAFETY: live handle; valid out-pointer.
        ok(unsafe { ffi::kvo_scheduler_match(c_abi.sched, id, 0, &mut out) });
        out
    };
    let (hit, miss) = (call(HIT), call(MISS));
    assert_eq!((hit.kind, hit.tokens), (ffi::kvo_match::Hit as u32, PROMPT));
    assert_eq!(miss.kind, ffi::kvo_match::Miss as u32);
    for (name, id, other) in [("hit", HIT, MISS), ("miss", MISS, HIT)] {
        g.bench_function(BenchmarkId::new("c_abi", name), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    black_box(call(other));
                    let t = Instant::now();
                    black_box(call(black_box(id)));
                    total += t.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

criterion::criterion_group!(benches, build_step, match_prompt);
criterion::criterion_main!(benches);

//! Concurrency stress through the C API: each handle is used from 8 threads at once.
//!
//! - Scheduler: one scheduling thread plays the server (requests added, matched, allocated,
//!   scheduled in chunks, decoded, preempted, aborted, finished; steps built and re-encoded;
//!   occasional resets), four completion threads report every job of every step (two workers, so
//!   two reports per job, batched, reordered, some failed), three readers take stats and run
//!   the invariant check. At the end every job is reported and nothing may stay pinned, storing
//!   or tracked.
//! - Worker (host backend): three submitters copy their own blocks to their own host slots and
//!   back and check the bytes, three pollers take completions and check each against what was
//!   expected (success, bytes, reported once), two waiters wait for random jobs. At the end the
//!   host buffers must hold exactly what the submitters stored.
//!
//! `KVO_STRESS_OPS` sets the C calls per handle (default 1,000,000); the figures are printed.

use kvoffload::ffi::*;
use std::collections::{HashMap, HashSet, VecDeque};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

fn target_ops() -> u64 {
    std::env::var("KVO_STRESS_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000)
}

fn message() -> String {
    let mut buf = vec![0u8; 512];
    // SAFETY: a writable buffer of its length.
    let n = unsafe { kvo_last_error_message(buf.as_mut_ptr() as *mut _, buf.len()) };
    buf.truncate(n.min(buf.len() - 1));
    String::from_utf8_lossy(&buf).into_owned()
}

#[track_caller]
fn ok(st: kvo_status) {
    assert_eq!(st, kvo_status::Ok, "{}", message());
}

/// xorshift64*: a small deterministic generator per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A handle shared by the threads of one test (the library serializes calls per handle).
struct Shared<T>(*mut T);
impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Shared<T> {}
impl<T> Shared<T> {
    /// The handle (a method, so that closures capture the `Send` wrapper, not the pointer).
    fn h(self) -> *mut T {
        self.0
    }
}
// SAFETY: every kvoffload handle may be called from any thread (the header's contract).
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Shared<T> {}

// ---------------------------------------------------------------------------------------------
// Scheduler

const KEY_LEN: usize = 8;
const GBS: u64 = 4;
const FACTOR: u64 = 2;
const GPU_BLOCKS: u32 = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Loading(u64),
    Running,
}

struct HostReq {
    family: u64,
    num_tokens: u64,
    goal: u64,
    computed: u64,
    blocks: Vec<u32>,
    announced: usize,
    phase: Phase,
    resumed: bool,
}

/// Reports to give and the jobs whose reports are all in.
struct Queue {
    reports: Mutex<(VecDeque<kvo_job_report>, bool)>,
    ready: Condvar,
    done: Mutex<(HashMap<u64, u32>, HashSet<u64>)>,
}

fn hash_of(family: u64, req: u64, block: u64) -> [u8; KEY_LEN] {
    // The first 12 blocks are shared by the family: later requests hit earlier ones' chunks.
    let v = if block < 12 {
        (family << 32) | block
    } else {
        (1 << 63) | (req << 20) | block
    };
    v.to_le_bytes()
}

fn sched_stats(s: Shared<kvo_scheduler>) -> kvo_scheduler_stats {
    // SAFETY: zeroed plain-data struct.
    let mut st: kvo_scheduler_stats = unsafe { std::mem::zeroed() };
    st.struct_size = size_of::<kvo_scheduler_stats>();
    // SAFETY: live handle, struct of the declared size.
    ok(unsafe { kvo_scheduler_get_stats(s.h(), &mut st) });
    st
}

fn check_gauges(st: &kvo_scheduler_stats) {
    let m = &st.manager;
    assert!(m.used <= m.capacity, "{m:?}");
    assert_eq!(m.ready + m.stores_in_flight, m.used, "{m:?}");
    assert_eq!(m.evictable + m.pinned, m.ready, "{m:?}");
}

struct Host {
    s: Shared<kvo_scheduler>,
    ops: Arc<AtomicU64>,
    rng: Rng,
    reqs: HashMap<u64, HostReq>,
    free: Vec<u32>,
    next_id: u64,
    step: *mut kvo_step,
    copy: *mut kvo_step,
    bytes: Vec<u8>,
    q: Arc<Queue>,
    counts: [u64; 6],
}

impl Host {
    fn call(&self, st: kvo_status) -> kvo_status {
        self.ops.fetch_add(1, Relaxed);
        st
    }

    fn add(&mut self) {
        let id = self.next_id;
        self.next_id += 1;
        let family = self.rng.below(5);
        let prompt = (4 + self.rng.below(28)) * GBS + self.rng.below(GBS);
        let goal = prompt + self.rng.below(3 * GBS);
        // SAFETY: live handle.
        ok(self.call(unsafe { kvo_scheduler_add_request(self.s.h(), id, prompt, u64::MAX) }));
        let full = prompt / GBS;
        let hashes: Vec<u8> = (0..full).flat_map(|b| hash_of(family, id, b)).collect();
        // SAFETY: `full` hashes of KEY_LEN bytes.
        ok(self.call(unsafe {
            kvo_scheduler_append_block_hashes(
                self.s.h(),
                id,
                hashes.as_ptr(),
                full as usize,
                prompt,
            )
        }));
        self.reqs.insert(
            id,
            HostReq {
                family,
                num_tokens: prompt,
                goal,
                computed: 0,
                blocks: Vec::new(),
                announced: 0,
                phase: Phase::Waiting,
                resumed: false,
            },
        );
    }

    fn release(&mut self, id: u64) {
        let r = self.reqs.get_mut(&id).expect("live");
        self.free.append(&mut r.blocks);
        r.announced = 0;
    }

    fn abort(&mut self, id: u64) {
        // SAFETY: live handle.
        ok(self.call(unsafe { kvo_scheduler_finish_request(self.s.h(), id) }));
        self.release(id);
        self.reqs.remove(&id);
        self.counts[4] += 1;
    }

    fn admit(&mut self, id: u64) {
        let mut m = kvo_match_result {
            kind: 0,
            defer_reason: 0,
            tokens: 0,
        };
        // SAFETY: live handle, writable result.
        ok(self.call(unsafe { kvo_scheduler_match(self.s.h(), id, 0, &mut m) }));
        if m.kind == kvo_match::Defer as u32 {
            self.counts[0] += 1;
            return;
        }
        let hit = if m.kind == kvo_match::Hit as u32 {
            m.tokens
        } else {
            0
        };
        let r = &self.reqs[&id];
        let need = (r.goal + GBS).div_ceil(GBS) as usize;
        if self.free.len() < need {
            return;
        }
        let blocks = self.free.split_off(self.free.len() - need);
        let (mut has, mut job) = (0u32, 0u64);
        // SAFETY: `need` block ids, writable outputs.
        let st = self.call(unsafe {
            kvo_scheduler_on_alloc(
                self.s.h(),
                id,
                blocks.as_ptr(),
                need,
                hit,
                &mut has,
                &mut job,
            )
        });
        if st != kvo_status::Ok {
            // Since the match, another request's load pinned the hit (INVALID_STATE) or a failed
            // load dropped its keys (NOT_FOUND): match again later.
            assert!(
                matches!(st, kvo_status::InvalidState | kvo_status::NotFound),
                "{st:?}: {}",
                message()
            );
            self.free.extend(blocks);
            return;
        }
        let r = self.reqs.get_mut(&id).expect("live");
        r.blocks = blocks;
        r.announced = 0;
        if has != 0 {
            r.phase = Phase::Loading(job);
            r.computed = hit;
            self.counts[1] += 1;
        } else {
            r.phase = Phase::Running;
            r.computed = 0;
        }
    }

    fn load_done(&mut self, id: u64, job: u64) {
        if !self.q.done.lock().unwrap().1.remove(&job) {
            return;
        }
        let (mut failed, mut from, mut to) = (0u32, 0u64, 0u64);
        // SAFETY: live handle, writable outputs.
        ok(self.call(unsafe {
            kvo_scheduler_load_failure(self.s.h(), id, &mut failed, &mut from, &mut to)
        }));
        let r = self.reqs.get_mut(&id).expect("live");
        if failed != 0 {
            r.computed = from;
        }
        r.phase = Phase::Running;
    }

    fn step(&mut self) {
        let mut ids: Vec<u64> = self.reqs.keys().copied().collect();
        ids.sort_unstable();
        let mut preempted = Vec::new();
        let mut sched: Vec<(u64, u64, u64, u64, Vec<u32>, bool)> = Vec::new();
        for id in ids {
            let r = self.reqs.get_mut(&id).expect("live");
            if r.phase != Phase::Running {
                continue;
            }
            if self.rng.below(60) == 0 {
                preempted.push(id);
                continue;
            }
            if r.computed >= r.num_tokens {
                // Decode: one generated token, a new block hash when a block fills.
                if r.num_tokens >= r.goal {
                    continue;
                }
                r.num_tokens += 1;
                if r.num_tokens.is_multiple_of(GBS) {
                    let h = hash_of(r.family, id, r.num_tokens / GBS - 1);
                    // SAFETY: one hash of KEY_LEN bytes.
                    ok(unsafe {
                        kvo_scheduler_append_block_hashes(
                            self.s.h(),
                            id,
                            h.as_ptr(),
                            1,
                            r.num_tokens,
                        )
                    });
                    self.ops.fetch_add(1, Relaxed);
                }
            }
            let n = (r.num_tokens - r.computed).min(8 * GBS);
            let ids = r.blocks[r.announced..].to_vec();
            sched.push((id, r.computed, n, r.num_tokens, ids, r.resumed));
        }
        for &p in &preempted {
            self.release(p);
            let r = self.reqs.get_mut(&p).expect("live");
            r.phase = Phase::Waiting;
            r.resumed = true;
            self.counts[3] += 1;
        }
        let list: Vec<kvo_scheduled_request> = sched
            .iter()
            .map(|(id, c, n, t, ids, resumed)| kvo_scheduled_request {
                request_id: *id,
                num_computed_tokens: *c,
                num_scheduled_tokens: *n,
                num_tokens: *t,
                new_block_ids: ids.as_ptr(),
                n_new_block_ids: ids.len(),
                resumed: *resumed as u32,
                reserved: 0,
            })
            .collect();
        // SAFETY: arrays of their lengths, a live step.
        ok(self.call(unsafe {
            kvo_scheduler_build_step(
                self.s.h(),
                list.as_ptr(),
                list.len(),
                preempted.as_ptr(),
                preempted.len(),
                self.step,
            )
        }));
        self.counts[2] += 1;
        for (id, _, n, _, _, _) in &sched {
            let r = self.reqs.get_mut(id).expect("live");
            r.computed += n;
            r.announced = r.blocks.len();
            r.resumed = false;
        }
        self.ship();
    }

    /// Reads the step's jobs (through a re-encoded copy of the plan now and then) and queues
    /// their reports: two workers, one report each, some failed.
    fn ship(&mut self) {
        let mut plan = self.step;
        if self.rng.below(8) == 0 {
            let mut len = 0usize;
            // SAFETY: live step; a NULL buffer of capacity 0 asks for the size.
            let st = unsafe { kvo_step_encode(self.step, null_mut(), 0, &mut len) };
            assert!(matches!(st, kvo_status::Ok | kvo_status::BufferTooSmall));
            self.bytes.resize(len, 0);
            // SAFETY: a buffer of `len` bytes.
            ok(unsafe { kvo_step_encode(self.step, self.bytes.as_mut_ptr(), len, &mut len) });
            // SAFETY: `len` readable bytes, a live step.
            ok(unsafe { kvo_step_decode(self.copy, self.bytes.as_ptr(), len) });
            plan = self.copy;
        }
        // SAFETY: zeroed plain-data structs.
        let mut info: kvo_step_info = unsafe { std::mem::zeroed() };
        // SAFETY: live step, writable info.
        ok(self.call(unsafe { kvo_step_get_info(plan, &mut info) }));
        let mut reps = Vec::new();
        for i in 0..info.num_jobs {
            // SAFETY: as above.
            let mut j: kvo_job_info = unsafe { std::mem::zeroed() };
            // SAFETY: index below num_jobs, writable info.
            ok(self.call(unsafe { kvo_step_get_job(plan, i, &mut j) }));
            for _ in 0..2 {
                reps.push(kvo_job_report {
                    job_id: j.id,
                    count: 1,
                    success: (self.rng.below(200) != 0) as u32,
                });
            }
        }
        let mut q = self.q.reports.lock().unwrap();
        // Reordered: the reports of a step go in at random places of the queue's tail.
        for r in reps {
            let at = q.0.len() - self.rng.below(q.0.len().min(8) as u64 + 1) as usize;
            q.0.insert(at, r);
        }
        drop(q);
        self.q.ready.notify_all();
    }

    fn round(&mut self) {
        while self.reqs.len() < 24 {
            self.add();
        }
        let ids: Vec<u64> = self.reqs.keys().copied().collect();
        for id in ids {
            let Some(phase) = self.reqs.get(&id).map(|r| r.phase) else {
                continue;
            };
            match phase {
                Phase::Waiting => {
                    if self.rng.below(80) == 0 {
                        self.abort(id);
                    } else {
                        self.admit(id);
                    }
                }
                Phase::Loading(job) => {
                    if self.rng.below(40) == 0 {
                        self.abort(id);
                    } else {
                        self.load_done(id, job);
                    }
                }
                Phase::Running => {
                    let r = &self.reqs[&id];
                    let done = r.computed >= r.num_tokens && r.num_tokens >= r.goal;
                    if done || self.rng.below(150) == 0 {
                        self.abort(id);
                    }
                }
            }
        }
        self.step();
        if self.rng.below(3000) == 0 {
            // SAFETY: live handle; just after a step, no load is waiting for one.
            ok(self.call(unsafe { kvo_scheduler_reset(self.s.h()) }));
            self.counts[5] += 1;
        }
    }
}

fn completer(s: Shared<kvo_scheduler>, q: Arc<Queue>, ops: Arc<AtomicU64>, seed: u64) {
    let mut rng = Rng(seed);
    loop {
        let batch: Vec<kvo_job_report> = {
            let mut g = q.reports.lock().unwrap();
            while g.0.is_empty() && !g.1 {
                g = q.ready.wait(g).unwrap();
            }
            if g.0.is_empty() {
                return;
            }
            let n = (1 + rng.below(4) as usize).min(g.0.len());
            g.0.drain(..n).collect()
        };
        // SAFETY: an array of its length.
        let st = unsafe { kvo_scheduler_complete_jobs(s.h(), batch.as_ptr(), batch.len()) };
        ops.fetch_add(1, Relaxed);
        ok(st);
        let mut d = q.done.lock().unwrap();
        for r in &batch {
            let c = d.0.entry(r.job_id).or_insert(0);
            *c += 1;
            if *c == 2 {
                d.0.remove(&r.job_id);
                d.1.insert(r.job_id);
            }
        }
    }
}

#[test]
fn scheduler_from_eight_threads() {
    let target = target_ops();
    // SAFETY: zeroed plain-data struct, then the defaults.
    let mut cfg: kvo_scheduler_config = unsafe { std::mem::zeroed() };
    // SAFETY: writable config.
    ok(unsafe { kvo_scheduler_config_default(&mut cfg) });
    cfg.key_len = KEY_LEN as u32;
    cfg.gpu_block_size = GBS as u32;
    cfg.block_size_factor = FACTOR as u32;
    cfg.num_slots = 96;
    cfg.policy = 1;
    cfg.num_workers = 2;
    let mut raw = null_mut();
    // SAFETY: valid config and out-pointer.
    ok(unsafe { kvo_scheduler_new(&cfg, &mut raw) });
    let s = Shared(raw);
    let ops = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let q = Arc::new(Queue {
        reports: Mutex::new((VecDeque::new(), false)),
        ready: Condvar::new(),
        done: Mutex::new((HashMap::new(), HashSet::new())),
    });
    let t0 = Instant::now();
    let mut threads = Vec::new();
    for i in 0..4 {
        let (q, ops) = (q.clone(), ops.clone());
        threads.push(std::thread::spawn(move || completer(s, q, ops, 7 + i)));
    }
    let mut readers = Vec::new();
    for _ in 0..3 {
        let (ops, stop) = (ops.clone(), stop.clone());
        readers.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Relaxed) {
                check_gauges(&sched_stats(s));
                // SAFETY: live handle.
                ok(unsafe { kvo_scheduler_check_invariants(s.h()) });
                ops.fetch_add(2, Relaxed);
                n += 2;
                // Readers take at most a share of the calls: the mutating threads make the rest.
                while ops.load(Relaxed) < n * 10 && !stop.load(Relaxed) {
                    std::thread::yield_now();
                }
            }
        }));
    }
    let (step, copy) = (
        {
            let mut p = null_mut();
            // SAFETY: out-pointer.
            ok(unsafe { kvo_step_new(&mut p) });
            p
        },
        {
            let mut p = null_mut();
            // SAFETY: out-pointer.
            ok(unsafe { kvo_step_new(&mut p) });
            p
        },
    );
    let mut host = Host {
        s,
        ops: ops.clone(),
        rng: Rng(0x5eed),
        reqs: HashMap::new(),
        free: (0..GPU_BLOCKS).collect(),
        next_id: 1,
        step,
        copy,
        bytes: Vec::new(),
        q: q.clone(),
        counts: [0; 6],
    };
    while ops.load(Relaxed) < target {
        host.round();
        // Keep the report queue short so that completions interleave with the steps.
        while q.reports.lock().unwrap().0.len() > 64 {
            std::thread::yield_now();
        }
    }
    // Drain: abort everything, ship the last plan, let every report in.
    let ids: Vec<u64> = host.reqs.keys().copied().collect();
    for id in ids {
        host.abort(id);
    }
    host.step();
    q.reports.lock().unwrap().1 = true;
    q.ready.notify_all();
    for t in threads {
        t.join().expect("completion thread");
    }
    stop.store(true, Relaxed);
    for t in readers {
        t.join().expect("stats reader");
    }
    let st = sched_stats(s);
    assert_eq!(
        (
            st.requests,
            st.loads_in_flight,
            st.stores_in_flight,
            st.manager.pinned,
            st.manager.stores_in_flight
        ),
        (0, 0, 0, 0, 0),
        "after every job was reported: {st:?}"
    );
    // SAFETY: live handle.
    ok(unsafe { kvo_scheduler_check_invariants(s.h()) });
    assert!(
        st.load_jobs > 0 && st.store_jobs > 0 && st.hits > 0 && st.failed_jobs > 0,
        "{st:?}"
    );
    let [deferred, loads, steps, preempted, finished, resets] = host.counts;
    println!(
        "scheduler stress: {} C calls from 8 threads in {:.1} s: {steps} steps, {} stores, {loads} loads, {} failed jobs, {deferred} deferred matches, {preempted} preemptions, {finished} finished/aborted, {resets} resets",
        ops.load(Relaxed),
        t0.elapsed().as_secs_f64(),
        st.store_jobs,
        st.failed_jobs
    );
    // SAFETY: handles freed once, no other call in flight.
    unsafe {
        kvo_step_free(step);
        kvo_step_free(copy);
        kvo_scheduler_free(s.h());
    }
}

// ---------------------------------------------------------------------------------------------
// Worker

const SUBMITTERS: u32 = 3;
const OWN: u32 = 32;
const PAGE: usize = 64;
const TENSORS: usize = 2;

/// What pollers expect of each job: (success, bytes).
type Expected = Mutex<HashMap<u64, (bool, u64)>>;

fn pattern(t: usize, seed: u64, i: usize) -> u8 {
    (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (i % 56)) as u8 ^ (t as u8 * 29) ^ i as u8
}

#[test]
fn worker_from_eight_threads() {
    let target = target_ops();
    let blocks = SUBMITTERS * OWN;
    let mut kv: Vec<Vec<u64>> = (0..TENSORS)
        .map(|_| vec![0u64; blocks as usize * PAGE / 8])
        .collect();
    let tensors: Vec<kvo_kv_tensor> = kv
        .iter_mut()
        .map(|m| kvo_kv_tensor {
            base: m.as_mut_ptr() as u64,
            block_stride: PAGE as u64,
            page_size: PAGE as u64,
            num_blocks: blocks,
            on_device: 0,
        })
        .collect();
    // SAFETY: zeroed plain-data struct, then the defaults.
    let mut cfg: kvo_worker_config = unsafe { std::mem::zeroed() };
    // SAFETY: writable config.
    ok(unsafe { kvo_worker_config_default(&mut cfg) });
    cfg.block_size_factor = 1;
    cfg.num_host_slots = blocks;
    cfg.threads = 2;
    let mut raw = null_mut();
    // SAFETY: tensors of their count; the memory outlives the worker.
    ok(unsafe { kvo_worker_new(&cfg, tensors.as_ptr(), TENSORS, null(), &mut raw) });
    let w = Shared(raw);
    let kv_at: Vec<usize> = kv.iter().map(|m| m.as_ptr() as usize).collect();
    let ops = Arc::new(AtomicU64::new(0));
    let expected: Arc<Expected> = Arc::new(Mutex::new(HashMap::new()));
    let recent: Arc<Mutex<Vec<u64>>> = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let jobs = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut submitters = Vec::new();
    for k in 0..SUBMITTERS {
        let (ops, expected, recent, kv_at, jobs) = (
            ops.clone(),
            expected.clone(),
            recent.clone(),
            kv_at.clone(),
            jobs.clone(),
        );
        submitters.push(std::thread::spawn(move || {
            let mut rng = Rng(0xabc + k as u64);
            let base = k * OWN;
            // The model: the pattern seed each own slot holds (None: never stored).
            let mut slots: Vec<Option<u64>> = vec![None; OWN as usize];
            let mut next = (k as u64) << 40;
            let kv_block =
                |t: usize, b: u32| -> *mut u8 { (kv_at[t] + b as usize * PAGE) as *mut u8 };
            let calls = &ops;
            let submit = |id: u64, kind: kvo_job_kind, src: &[u32], dst: &[u32], good: bool| {
                calls.fetch_add(1, Relaxed);
                jobs.fetch_add(1, Relaxed);
                expected.lock().unwrap().insert(
                    id,
                    (
                        good,
                        if good {
                            (src.len() * PAGE * TENSORS) as u64
                        } else {
                            0
                        },
                    ),
                );
                // SAFETY: id arrays of their lengths.
                ok(unsafe {
                    kvo_worker_submit_job(
                        w.h(),
                        id,
                        kind as u32,
                        src.as_ptr(),
                        src.len(),
                        dst.as_ptr(),
                        dst.len(),
                        0,
                        0,
                    )
                });
                recent.lock().unwrap().push(id);
            };
            let wait = |ids: &[u64]| {
                calls.fetch_add(1, Relaxed);
                // SAFETY: ids of their count.
                let st = unsafe { kvo_worker_wait(w.h(), ids.as_ptr(), ids.len(), 60_000) };
                // NOT_FOUND: a poller already took one of them, so it finished.
                assert!(
                    matches!(st, kvo_status::Ok | kvo_status::NotFound),
                    "wait: {st:?} {}",
                    message()
                );
                if st == kvo_status::NotFound {
                    for &id in ids {
                        calls.fetch_add(1, Relaxed);
                        // SAFETY: a single id.
                        let s = unsafe { kvo_worker_wait(w.h(), &id, 1, 60_000) };
                        assert!(matches!(s, kvo_status::Ok | kvo_status::NotFound));
                    }
                }
            };
            while calls.load(Relaxed) < target {
                // Store: fresh bytes in up to 4 own blocks, to random own slots.
                let n = 1 + rng.below(4) as usize;
                let (mut src, mut dst, mut seeds) = (Vec::new(), Vec::new(), Vec::new());
                for _ in 0..n {
                    let b = base + rng.below(OWN as u64) as u32;
                    let s = base + rng.below(OWN as u64) as u32;
                    if src.contains(&b) || dst.contains(&s) {
                        continue;
                    }
                    let seed = rng.next();
                    for t in 0..TENSORS {
                        // SAFETY: an own block, touched by no job now (all own jobs waited).
                        let page = unsafe { std::slice::from_raw_parts_mut(kv_block(t, b), PAGE) };
                        for (i, x) in page.iter_mut().enumerate() {
                            *x = pattern(t, seed, i);
                        }
                    }
                    src.push(b);
                    dst.push(s);
                    seeds.push(seed);
                }
                let store = next;
                next += 1;
                submit(store, kvo_job_kind::Store, &src, &dst, true);
                // A job that must fail: a block outside the registration.
                let bad = next;
                next += 1;
                submit(bad, kvo_job_kind::Store, &[blocks + 5], &[base], false);
                wait(&[store, bad]);
                for (&s, &seed) in dst.iter().zip(&seeds) {
                    slots[(s - base) as usize] = Some(seed);
                }
                // Load stored slots back into other own blocks and check every byte.
                let stored: Vec<u32> = (0..OWN)
                    .filter(|&i| slots[i as usize].is_some())
                    .map(|i| base + i)
                    .collect();
                let m = (1 + rng.below(4) as usize).min(stored.len());
                let (mut lsrc, mut ldst) = (Vec::new(), Vec::new());
                for _ in 0..m {
                    let s = stored[rng.below(stored.len() as u64) as usize];
                    let b = base + rng.below(OWN as u64) as u32;
                    if lsrc.contains(&s) || ldst.contains(&b) {
                        continue;
                    }
                    lsrc.push(s);
                    ldst.push(b);
                }
                let load = next;
                next += 1;
                submit(load, kvo_job_kind::Load, &lsrc, &ldst, true);
                wait(&[load]);
                for (&s, &b) in lsrc.iter().zip(&ldst) {
                    let seed = slots[(s - base) as usize].expect("stored");
                    for t in 0..TENSORS {
                        // SAFETY: an own block; its load has finished.
                        let page = unsafe { std::slice::from_raw_parts(kv_block(t, b), PAGE) };
                        for (i, &x) in page.iter().enumerate() {
                            assert_eq!(
                                x,
                                pattern(t, seed, i),
                                "tensor {t} block {b} byte {i} after loading slot {s}"
                            );
                        }
                    }
                }
            }
            slots
        }));
    }
    let mut pollers = Vec::new();
    for _ in 0..3 {
        let (ops, expected, stop) = (ops.clone(), expected.clone(), stop.clone());
        pollers.push(std::thread::spawn(move || {
            let mut out = vec![
                kvo_completion {
                    job_id: 0,
                    bytes: 0,
                    seconds: 0.0,
                    success: 0,
                    reserved: 0
                };
                16
            ];
            let mut taken = 0u64;
            loop {
                let done = stop.load(Relaxed);
                let mut n = 0usize;
                // SAFETY: a buffer of 16 completions.
                ok(unsafe { kvo_worker_poll(w.h(), out.as_mut_ptr(), out.len(), &mut n) });
                ops.fetch_add(1, Relaxed);
                for c in &out[..n] {
                    let (good, bytes) =
                        expected
                            .lock()
                            .unwrap()
                            .remove(&c.job_id)
                            .unwrap_or_else(|| {
                                panic!("job {} reported twice or never submitted", c.job_id)
                            });
                    assert_eq!(
                        (c.success != 0, c.bytes),
                        (good, bytes),
                        "completion of job {}",
                        c.job_id
                    );
                    taken += 1;
                }
                if done && n == 0 {
                    return taken;
                }
                if n == 0 {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
            }
        }));
    }
    let mut waiters = Vec::new();
    for i in 0..2 {
        let (ops, recent, stop) = (ops.clone(), recent.clone(), stop.clone());
        waiters.push(std::thread::spawn(move || {
            let mut rng = Rng(99 + i);
            while !stop.load(Relaxed) {
                let id = {
                    let mut r = recent.lock().unwrap();
                    if r.len() > 256 {
                        r.drain(..128);
                    }
                    if r.is_empty() {
                        None
                    } else {
                        Some(r[rng.below(r.len() as u64) as usize])
                    }
                };
                let Some(id) = id else {
                    std::thread::yield_now();
                    continue;
                };
                // SAFETY: a single id.
                let st = unsafe { kvo_worker_wait(w.h(), &id, 1, 10_000) };
                assert!(
                    matches!(st, kvo_status::Ok | kvo_status::NotFound),
                    "wait: {st:?} {}",
                    message()
                );
                ops.fetch_add(1, Relaxed);
                if st == kvo_status::NotFound {
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
            }
        }));
    }
    let models: Vec<Vec<Option<u64>>> = submitters
        .into_iter()
        .map(|t| t.join().expect("submitter"))
        .collect();
    stop.store(true, Relaxed);
    let taken: u64 = pollers.into_iter().map(|t| t.join().expect("poller")).sum();
    for t in waiters {
        t.join().expect("waiter");
    }
    assert!(
        expected.lock().unwrap().is_empty(),
        "completions never polled"
    );
    // The host buffers hold what the submitters stored, byte for byte.
    for t in 0..TENSORS {
        let (mut p, mut len) = (null_mut(), 0usize);
        // SAFETY: live handle, writable outputs.
        ok(unsafe { kvo_worker_get_host_buffer(w.h(), t as u32, &mut p, &mut len) });
        // SAFETY: the worker's buffer of `len` bytes; no job is running.
        let host = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
        for (k, model) in models.iter().enumerate() {
            for (i, seed) in model.iter().enumerate() {
                let Some(seed) = seed else { continue };
                let s = k * OWN as usize + i;
                for j in 0..PAGE {
                    assert_eq!(
                        host[s * PAGE + j],
                        pattern(t, *seed, j),
                        "tensor {t} slot {s} byte {j}"
                    );
                }
            }
        }
    }
    println!(
        "worker stress: {} C calls from 8 threads in {:.1} s: {} jobs submitted, {taken} completions checked",
        ops.load(Relaxed),
        t0.elapsed().as_secs_f64(),
        jobs.load(Relaxed)
    );
    // SAFETY: freed once, after every thread stopped; the tensors outlive it.
    unsafe { kvo_worker_free(w.h()) };
    drop(kv);
}

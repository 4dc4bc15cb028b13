//! The CUDA backend against a fake driver library (`c_tests/fake_cuda.c`), built here with `$CC`
//! (default `cc`) as `libcuda.so` in several variants: with `cuMemcpyBatchAsync` (driver 12.8),
//! without it (12.0), with the symbol but an old driver version, with only the CUDA 13
//! `cuMemcpyBatchAsync_v2`, and without a required entry point.
//!
//! `cudarc` opens the driver library once per process, so every check runs in a child process:
//! each outer `#[test]` builds one variant and re-runs this test binary on one inner test
//! (`--exact`) with `LD_LIBRARY_PATH` pointing at the variant and `KVO_FAKE_CUDA_INNER` saying
//! what to expect. The inner tests return at once when that variable is not set.
#![cfg(target_os = "linux")]

use kvoffload::Error;
use kvoffload::plan::Direction;
use kvoffload::transfer::cuda::PIN_CHUNK_BYTES;
use kvoffload::transfer::cuda::{CudaBackend, cuda_available, cuda_driver_version};
use kvoffload::transfer::{
    Backend, BackendKind, Completion, CopyDesc, JobBlocks, KvTensor, Worker, WorkerConfig,
};
use std::ffi::{CString, c_char};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const INNER: &str = "KVO_FAKE_CUDA_INNER";
const EXPECT: &str = "KVO_FAKE_CUDA_EXPECT";
const BAD_ADDR: u64 = 0xBAD000;
/// A made-up compute stream handle: the fake treats streams it did not create as foreign.
const COMPUTE_STREAM: u64 = 0xC0FFEE;

// ---- outer tests: build a variant, run an inner test in a child ------------------------------

/// Compiles the fake driver with `defines` into its own directory as `libcuda.so` and
/// `libcuda.so.1`; returns the directory.
fn build_fake(variant: &str, defines: &[&str]) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fake_cuda-{}-{variant}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the fake driver's directory");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("c_tests/fake_cuda.c");
    let so = dir.join("libcuda.so");
    let cc = std::env::var("CC").unwrap_or_default();
    let mut words = cc.split_whitespace();
    let mut cmd = Command::new(words.next().unwrap_or("cc"));
    cmd.args(words)
        .args([
            "-std=c11",
            "-D_GNU_SOURCE",
            "-Wall",
            "-Wextra",
            "-O1",
            "-shared",
            "-fPIC",
        ])
        .args(defines)
        .arg("-o")
        .arg(&so)
        .arg(&src)
        .arg("-lpthread");
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler ({cmd:?}): {e}"));
    assert!(
        out.status.success(),
        "compiling {} failed:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::copy(&so, dir.join("libcuda.so.1")).expect("copy libcuda.so.1");
    dir
}

/// Runs inner test `test` of this binary with `LD_LIBRARY_PATH=lib_dir`, `KVO_FAKE_CUDA_INNER=mode`
/// and `env`; fails unless it ran and passed.
fn run_inner(test: &str, mode: &str, lib_dir: &Path, env: &[(&str, &str)]) {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(INNER, mode)
        .env("LD_LIBRARY_PATH", lib_dir)
        .env_remove("FAKE_CUDA_DEVICES")
        .env_remove(EXPECT);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the inner test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "inner test {test} ({mode}) failed: {}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
        out.status
    );
    // Built per test process; nothing else uses it.
    let _ = std::fs::remove_dir_all(lib_dir);
}

#[test]
fn fake_driver_with_batch() {
    let dir = build_fake("batch", &[]);
    run_inner("inner_fake_driver", "batch", &dir, &[]);
}

#[test]
fn fake_driver_without_batch() {
    let dir = build_fake(
        "nobatch",
        &["-DFAKE_NO_BATCH", "-DFAKE_DRIVER_VERSION=12000"],
    );
    run_inner("inner_fake_driver", "nobatch", &dir, &[]);
}

#[test]
fn fake_driver_old_version_falls_back() {
    // The symbol is there but the driver is older than 12.8: the loop must be used.
    let dir = build_fake("oldver", &["-DFAKE_DRIVER_VERSION=12000"]);
    run_inner("inner_fake_driver", "oldver", &dir, &[]);
}

#[test]
fn fake_driver_with_batch_v2_only() {
    let dir = build_fake(
        "v2",
        &["-DFAKE_BATCH_V2_ONLY", "-DFAKE_DRIVER_VERSION=13000"],
    );
    run_inner("inner_fake_driver", "v2", &dir, &[]);
}

#[test]
fn fake_driver_missing_required_symbol() {
    let dir = build_fake("missing", &["-DFAKE_MISSING_REQUIRED"]);
    run_inner(
        "inner_unavailable",
        "missing",
        &dir,
        &[(EXPECT, "does not export cuStreamWaitEvent")],
    );
}

#[test]
fn fake_driver_without_device() {
    let dir = build_fake("nodevice", &[]);
    run_inner(
        "inner_unavailable",
        "nodevice",
        &dir,
        &[
            ("FAKE_CUDA_DEVICES", "0"),
            (EXPECT, "cuInit failed: CUDA_ERROR_NO_DEVICE (100)"),
        ],
    );
}

#[test]
fn no_driver_library() {
    if Path::new("/dev/nvidia0").exists() {
        eprintln!("skipped: this machine has a GPU, so the real driver would be found");
        return;
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fake_cuda-{}-empty", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create an empty directory");
    run_inner(
        "inner_unavailable",
        "nodriver",
        &dir,
        &[(EXPECT, "no CUDA driver library found")],
    );
}

// ---- inner tests ------------------------------------------------------------------------------

fn inner_mode() -> Option<String> {
    std::env::var(INNER).ok()
}

#[test]
fn inner_unavailable() {
    let Some(mode) = inner_mode() else { return };
    assert!(!cuda_available(), "{mode}: cuda_available() must be false");
    assert!(!cuda_available(), "cached answer");
    let expect = std::env::var(EXPECT).unwrap_or_default();
    for device in [0, 1, -1] {
        match CudaBackend::new(device) {
            Err(Error::CudaUnavailable(msg)) => {
                assert!(msg.contains(&expect), "{mode}: {msg:?} lacks {expect:?}")
            }
            Err(e) => panic!("{mode}: expected CudaUnavailable, got {e:?}"),
            Ok(_) => panic!("{mode}: a backend without a usable driver"),
        }
    }
    if mode == "nodriver" {
        assert_eq!(cuda_driver_version(), None);
    }
}

/// Reads a counter of the fake driver (the library cudarc loaded).
fn stat(name: &str) -> u64 {
    type F = unsafe extern "C" fn(*const c_char) -> u64;
    // SAFETY: the fake driver is loaded (a backend was created) and exports `fake_stat` with
    // this prototype.
    let f: F = unsafe {
        *cudarc::driver::sys::culib()
            .get::<F>(b"fake_stat\0")
            .expect("fake_stat")
    };
    let c = CString::new(name).expect("stat name");
    // SAFETY: a NUL-terminated string.
    let v = unsafe { f(c.as_ptr()) };
    assert_ne!(v, u64::MAX, "the fake has no counter {name}");
    v
}

/// Sets a knob of the fake driver.
fn knob(name: &str, value: i64) {
    type F = unsafe extern "C" fn(*const c_char, i64);
    // SAFETY: as for `stat`.
    let f: F = unsafe {
        *cudarc::driver::sys::culib()
            .get::<F>(b"fake_set\0")
            .expect("fake_set")
    };
    let c = CString::new(name).expect("knob name");
    // SAFETY: a NUL-terminated string.
    unsafe { f(c.as_ptr(), value) };
}

/// xorshift64*: deterministic test data without dependencies.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next() as u8;
        }
    }
    /// `k` distinct numbers below `n`.
    fn distinct(&mut self, k: usize, n: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..n).collect();
        for i in 0..k {
            let j = i + self.below((n - i) as u64) as usize;
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }
}

/// Polls until `n` completions arrived (each poll queries each head at most once).
fn poll_n(be: &mut CudaBackend, n: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    for _ in 0..10_000 {
        be.poll(&mut out).expect("poll");
        if out.len() >= n {
            break;
        }
    }
    assert_eq!(out.len(), n, "completions: {out:?}");
    out
}

fn ids(c: &[Completion]) -> Vec<u64> {
    c.iter().map(|c| c.job_id).collect()
}

fn desc(src: *const u8, dst: *mut u8, size: usize) -> CopyDesc {
    CopyDesc {
        src: src as u64,
        dst: dst as u64,
        size: size as u64,
    }
}

#[test]
fn inner_fake_driver() {
    let Some(mode) = inner_mode() else { return };
    let (batch, version) = match mode.as_str() {
        "batch" => (true, 12080),
        "nobatch" => (false, 12000),
        "oldver" => (false, 12000),
        "v2" => (true, 13000),
        other => panic!("unknown mode {other}"),
    };
    assert!(cuda_available());
    assert_eq!(cuda_driver_version(), Some(version));
    assert!(matches!(
        CudaBackend::new(1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        CudaBackend::new(-1),
        Err(Error::InvalidArgument(_))
    ));

    let mut be = CudaBackend::new(0).expect("backend on the fake driver");
    assert_eq!(be.driver_version(), version);
    assert_eq!(be.uses_batch_copy(), batch, "{mode}");
    assert_eq!(be.batch_copy_available(), batch);
    assert_eq!(stat("primary_ctx_refs"), 1);
    assert_eq!(stat("streams_live"), 2);
    assert_eq!(stat("nonblocking_streams_created"), 2);
    // The thread's previous (null) context is restored after each call.
    assert_eq!(stat("current_ctx_is_primary"), 0);

    copies_are_byte_exact(&mut be, &mut Rng(0x1234_5678_9abc_def1));
    path_and_access_order(&mut be, batch, &mode);
    fifo_order_and_readiness(&mut be);
    wait_and_timeout(&mut be);
    stores_wait_on_compute_stream(&mut be);
    bad_descriptors(&mut be, batch, &mode);
    host_registration(&mut be);
    events_are_reused(&mut be);
    if batch {
        batch_failure_falls_back_to_the_loop(&mut be);
    }
    pinning_in_pieces(&mut be);
    worker_creation_rolls_back(&mode);
    a_poll_during_a_long_wait_returns_promptly();
    assert_eq!(stat("current_ctx_is_primary"), 0);
    assert_eq!(stat("context_errors"), 0);

    // Send: the backend works from another thread, which has no context current.
    let mut be = std::thread::spawn(move || {
        let mut dev = vec![1u8; 64];
        let host = vec![2u8; 64];
        be.submit(
            900,
            Direction::Load,
            &[desc(host.as_ptr(), dev.as_mut_ptr(), 64)],
            0,
        )
        .expect("submit from another thread");
        be.wait(&[900], Duration::from_secs(5)).expect("wait");
        let done = poll_n(&mut be, 1);
        assert!(done[0].success);
        assert_eq!(dev, host);
        be
    })
    .join()
    .expect("worker thread");

    // Drop with work in flight and a registration left: everything is released.
    let mut buf = vec![0u8; 4096];
    be.register_host(buf.as_mut_ptr(), buf.len())
        .expect("register");
    knob("never_complete", 1);
    let src = [3u8; 32];
    be.submit(
        901,
        Direction::Store,
        &[desc(src.as_ptr(), buf.as_mut_ptr(), 32)],
        0,
    )
    .expect("submit");
    assert_eq!(be.in_flight(Direction::Store), 1);
    drop(be);
    knob("never_complete", 0);
    assert_eq!(stat("streams_live"), 0);
    assert_eq!(stat("events_live"), 0);
    assert_eq!(stat("primary_ctx_refs"), 0);
    assert_eq!(stat("host_registered_live"), 0);
    assert_eq!(stat("context_errors"), 0);
}

/// Random descriptor sets in both directions copy exactly the bytes they describe.
fn copies_are_byte_exact(be: &mut CudaBackend, rng: &mut Rng) {
    const BLOCKS: usize = 48;
    const BS: usize = 256;
    let mut dev = vec![0u8; BLOCKS * BS];
    let mut host = vec![0u8; BLOCKS * BS];
    rng.fill(&mut dev);
    rng.fill(&mut host);
    for round in 0..40u64 {
        let dir = if rng.below(2) == 0 {
            Direction::Load
        } else {
            Direction::Store
        };
        let k = rng.below(BLOCKS as u64 + 1) as usize;
        let srcs = rng.distinct(k, BLOCKS);
        let dsts = rng.distinct(k, BLOCKS);
        let (mut exp_dev, mut exp_host) = (dev.clone(), host.clone());
        let mut descs = Vec::new();
        let mut bytes = 0u64;
        for (&s, &d) in srcs.iter().zip(&dsts) {
            // Sizes 0 (skipped), partial, whole.
            let size = match rng.below(4) {
                0 => 0,
                1 => 1 + rng.below(BS as u64) as usize,
                _ => BS,
            };
            let (so, doff) = (s * BS + rng.below((BS - size + 1) as u64) as usize, d * BS);
            match dir {
                Direction::Load => {
                    exp_dev[doff..doff + size].copy_from_slice(&host[so..so + size]);
                    descs.push(desc(host[so..].as_ptr(), dev[doff..].as_mut_ptr(), size));
                }
                Direction::Store => {
                    exp_host[doff..doff + size].copy_from_slice(&dev[so..so + size]);
                    descs.push(desc(dev[so..].as_ptr(), host[doff..].as_mut_ptr(), size));
                }
            }
            bytes += size as u64;
        }
        let job = 100 + round;
        be.submit(job, dir, &descs, 0).expect("submit");
        let done = poll_n(be, 1);
        assert_eq!(done[0].job_id, job);
        assert!(done[0].success, "{:?}", done[0]);
        assert_eq!(done[0].bytes, bytes);
        assert!(done[0].seconds > 0.0, "{:?}", done[0]);
        assert!(done[0].error.is_none());
        assert!(dev == exp_dev, "round {round}: KV bytes differ");
        assert!(host == exp_host, "round {round}: host bytes differ");
    }
}

/// The batch call or the loop, per variant; access order and location hints per direction;
/// descriptors of size 0 and empty jobs issue no copy.
fn path_and_access_order(be: &mut CudaBackend, batch: bool, mode: &str) {
    let host = vec![7u8; 1024];
    let mut dev = vec![0u8; 1024];
    let descs: Vec<CopyDesc> = (0..5)
        .map(|i| desc(host[i * 100..].as_ptr(), dev[i * 200..].as_mut_ptr(), 100))
        .collect();
    let (b0, m0) = (stat("batch_calls"), stat("memcpy_async_calls"));
    be.submit(200, Direction::Load, &descs, 0).expect("load");
    if batch {
        assert_eq!(stat("batch_calls"), b0 + 1, "{mode}");
        assert_eq!(stat("memcpy_async_calls"), m0, "{mode}");
        assert_eq!(stat("last_batch_src_order"), 3, "ANY for loads");
        assert_eq!(stat("last_batch_src_loc_type"), 2, "host source");
        assert_eq!(stat("last_batch_dst_loc_type"), 1, "device destination");
        assert_eq!(stat("batch_v2_calls") > 0, mode == "v2");
    } else {
        assert_eq!(stat("batch_calls"), b0, "{mode}");
        assert_eq!(stat("memcpy_async_calls"), m0 + 5, "{mode}");
    }
    let back: Vec<CopyDesc> = (0..5)
        .map(|i| {
            desc(
                dev[i * 200..].as_ptr(),
                dev[i * 200 + 100..].as_mut_ptr(),
                100,
            )
        })
        .collect();
    be.submit(201, Direction::Store, &back, 0).expect("store");
    if batch {
        assert_eq!(stat("batch_calls"), b0 + 2);
        assert_eq!(stat("last_batch_src_order"), 1, "STREAM for stores");
        assert_eq!(stat("last_batch_src_loc_type"), 1, "device source");
        assert_eq!(stat("last_batch_dst_loc_type"), 2, "host destination");
    } else {
        assert_eq!(stat("memcpy_async_calls"), m0 + 10);
    }
    assert_eq!(ids(&poll_n(be, 2)), [200, 201]);
    for i in 0..5 {
        assert!(dev[i * 200..i * 200 + 200].iter().all(|&b| b == 7));
    }

    // Nothing to copy: no copy call, the job still completes in order.
    let (b1, m1) = (stat("batch_calls"), stat("memcpy_async_calls"));
    let zero = [desc(host.as_ptr(), dev.as_mut_ptr(), 0); 3];
    be.submit(202, Direction::Load, &zero, 0)
        .expect("zero-size");
    be.submit(203, Direction::Load, &[], 0).expect("empty");
    assert_eq!((stat("batch_calls"), stat("memcpy_async_calls")), (b1, m1));
    let done = poll_n(be, 2);
    assert_eq!(ids(&done), [202, 203]);
    assert!(done.iter().all(|c| c.success && c.bytes == 0));

    // The loop can be chosen where the batch exists; the batch cannot be forced where it does
    // not.
    assert!(!be.set_batch_copy(false));
    be.submit(204, Direction::Load, &descs, 0).expect("load");
    assert_eq!(stat("batch_calls"), b1);
    assert_eq!(stat("memcpy_async_calls"), m1 + 5);
    assert_eq!(be.set_batch_copy(true), batch);
    assert_eq!(ids(&poll_n(be, 1)), [204]);
}

/// A driver whose batch call fails where plain copies work: the job still succeeds, through the
/// cuMemcpyAsync loop, and later jobs use the loop directly.
fn batch_failure_falls_back_to_the_loop(be: &mut CudaBackend) {
    assert!(be.uses_batch_copy());
    knob("batch_fails", 1);
    let host = vec![9u8; 256];
    let mut dev = vec![0u8; 256];
    let descs = [
        desc(host.as_ptr(), dev.as_mut_ptr(), 128),
        desc(host[128..].as_ptr(), dev[128..].as_mut_ptr(), 128),
    ];
    let (b0, m0) = (stat("batch_calls"), stat("memcpy_async_calls"));
    be.submit(700, Direction::Load, &descs, 0)
        .expect("falls back");
    assert_eq!(
        (stat("batch_calls"), stat("memcpy_async_calls")),
        (b0 + 1, m0 + 2)
    );
    assert!(!be.uses_batch_copy(), "the loop from now on");
    be.submit(701, Direction::Load, &descs, 0).expect("loop");
    assert_eq!(
        (stat("batch_calls"), stat("memcpy_async_calls")),
        (b0 + 1, m0 + 4)
    );
    let done = poll_n(be, 2);
    assert!(done.iter().all(|c| c.success));
    assert!(dev.iter().all(|&b| b == 9));
    knob("batch_fails", 0);
    assert!(be.set_batch_copy(true));
}

/// Several jobs per direction in flight: nothing completes before the fake's events are ready;
/// completions come per direction in submission order.
fn fifo_order_and_readiness(be: &mut CudaBackend) {
    let src = vec![9u8; 4096];
    let mut dst = vec![0u8; 4096];
    let d = |i: usize, dst: &mut Vec<u8>| {
        [desc(src[i * 64..].as_ptr(), dst[i * 64..].as_mut_ptr(), 64)]
    };
    let plan = [
        (300, Direction::Load),
        (301, Direction::Store),
        (302, Direction::Load),
        (303, Direction::Load),
        (304, Direction::Store),
        (305, Direction::Load),
        (306, Direction::Store),
    ];
    for (i, &(job, dir)) in plan.iter().enumerate() {
        be.submit(job, dir, &d(i, &mut dst), 0).expect("submit");
    }
    assert_eq!(be.in_flight(Direction::Load), 4);
    assert_eq!(be.in_flight(Direction::Store), 3);
    let mut out = Vec::new();
    be.poll(&mut out).expect("poll");
    assert!(out.is_empty(), "a poll right after submit: {out:?}");
    let done = poll_n(be, plan.len());
    let loads: Vec<u64> = done
        .iter()
        .filter(|c| [300, 302, 303, 305].contains(&c.job_id))
        .map(|c| c.job_id)
        .collect();
    let stores: Vec<u64> = done
        .iter()
        .filter(|c| [301, 304, 306].contains(&c.job_id))
        .map(|c| c.job_id)
        .collect();
    assert_eq!(loads, [300, 302, 303, 305]);
    assert_eq!(stores, [301, 304, 306]);
    assert!(done.iter().all(|c| c.success && c.bytes == 64));
    assert_eq!(be.in_flight(Direction::Load), 0);
    assert_eq!(be.in_flight(Direction::Store), 0);
}

/// `wait` returns once the listed jobs finished (and so those before them), ignores unknown
/// ids, and times out while the fake's events never complete.
fn wait_and_timeout(be: &mut CudaBackend) {
    let src = vec![5u8; 256];
    let mut dst = vec![0u8; 256];
    for (i, job) in [400u64, 401, 402].into_iter().enumerate() {
        let descs = [desc(src[i * 64..].as_ptr(), dst[i * 64..].as_mut_ptr(), 64)];
        be.submit(job, Direction::Load, &descs, 0).expect("submit");
    }
    be.wait(&[], Duration::ZERO).expect("nothing to wait for");
    be.wait(&[12345, 67890], Duration::ZERO)
        .expect("unknown ids");
    be.wait(&[401, 12345], Duration::from_secs(5))
        .expect("wait 401");
    // 400 finished before 401 (stream order); 402 is not queried enough yet.
    let mut out = Vec::new();
    be.poll(&mut out).expect("poll");
    assert_eq!(ids(&out), [400, 401]);
    assert_eq!(ids(&poll_n(be, 1)), [402]);

    knob("never_complete", 1);
    be.submit(
        403,
        Direction::Store,
        &[desc(src.as_ptr(), dst.as_mut_ptr(), 8)],
        0,
    )
    .expect("submit");
    match be.wait(&[403], Duration::from_millis(30)) {
        Err(Error::Timeout(msg)) => assert!(msg.contains("403"), "{msg}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    let mut out = Vec::new();
    be.poll(&mut out).expect("poll");
    assert!(out.is_empty());
    assert_eq!(be.in_flight(Direction::Store), 1);
    knob("never_complete", 0);
    be.wait(&[403], Duration::from_secs(5)).expect("wait 403");
    assert_eq!(ids(&poll_n(be, 1)), [403]);
}

/// A store given a compute stream waits on an event recorded there; loads and stores without
/// one do not.
fn stores_wait_on_compute_stream(be: &mut CudaBackend) {
    let src = [1u8; 64];
    let mut dst = vec![0u8; 64];
    let descs = [desc(src.as_ptr(), dst.as_mut_ptr(), 64)];
    let (w0, x0) = (stat("stream_waits"), stat("event_records_external"));
    be.submit(500, Direction::Load, &descs, COMPUTE_STREAM)
        .expect("load");
    assert_eq!(
        (stat("stream_waits"), stat("event_records_external")),
        (w0, x0)
    );
    be.submit(501, Direction::Store, &descs, COMPUTE_STREAM)
        .expect("store");
    assert_eq!(stat("stream_waits"), w0 + 1);
    assert_eq!(stat("event_records_external"), x0 + 1);
    assert_eq!(stat("stream_waits_on_other_stream"), w0 + 1);
    be.submit(502, Direction::Store, &descs, 0)
        .expect("store without stream");
    assert_eq!(stat("stream_waits"), w0 + 1);
    let done = poll_n(be, 3);
    assert_eq!(ids(&done), [500, 501, 502]);
}

/// A descriptor the driver rejects: `Error::Cuda` naming the call, the job is not queued, the
/// stream is synchronized, and the backend keeps working.
fn bad_descriptors(be: &mut CudaBackend, batch: bool, mode: &str) {
    let src = vec![4u8; 256];
    let mut dst = vec![0u8; 256];
    let good =
        |i: usize, dst: &mut Vec<u8>| desc(src[i * 64..].as_ptr(), dst[i * 64..].as_mut_ptr(), 64);
    for bad in [
        CopyDesc {
            src: BAD_ADDR,
            dst: dst.as_mut_ptr() as u64,
            size: 64,
        },
        CopyDesc {
            src: src.as_ptr() as u64,
            dst: BAD_ADDR,
            size: 64,
        },
        CopyDesc {
            src: src.as_ptr() as u64,
            dst: 0,
            size: 64,
        },
    ] {
        let descs = [good(0, &mut dst), good(1, &mut dst), bad, good(3, &mut dst)];
        let syncs = stat("stream_syncs");
        let err = be
            .submit(600, Direction::Load, &descs, 0)
            .expect_err("bad descriptor");
        let Error::Cuda(msg) = err else {
            panic!("expected Error::Cuda, got {err:?}")
        };
        let expected = match (batch, mode) {
            (true, "v2") => "cuMemcpyBatchAsync_v2 failed: CUDA_ERROR_INVALID_VALUE (1) (4 copies)",
            (true, _) => "cuMemcpyBatchAsync failed: CUDA_ERROR_INVALID_VALUE (1) at copy 2 of 4",
            (false, _) => "cuMemcpyAsync failed: CUDA_ERROR_INVALID_VALUE (1) at copy 2 of 4",
        };
        assert!(
            msg.starts_with(expected),
            "{msg:?} does not start with {expected:?}"
        );
        assert_eq!(
            stat("stream_syncs"),
            syncs + 1,
            "the failed job's stream is synchronized"
        );
        assert_eq!(be.in_flight(Direction::Load), 0);
        be.wait(&[600], Duration::ZERO)
            .expect("a failed job is unknown");
        let mut out = Vec::new();
        be.poll(&mut out).expect("poll");
        assert!(out.is_empty(), "{out:?}");
    }
    // Still usable.
    dst.fill(0);
    be.submit(601, Direction::Load, &[good(2, &mut dst)], 0)
        .expect("good job");
    let done = poll_n(be, 1);
    assert_eq!(done[0].job_id, 601);
    assert!(done[0].success);
    assert!(dst[128..192].iter().all(|&b| b == 4));

    // Sizes overflowing 64 bits are rejected before any driver call.
    let huge = [
        CopyDesc {
            src: 1,
            dst: 2,
            size: u64::MAX,
        },
        CopyDesc {
            src: 1,
            dst: 2,
            size: 2,
        },
    ];
    assert!(matches!(
        be.submit(602, Direction::Store, &huge, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(be.in_flight(Direction::Store), 0);
}

fn host_registration(be: &mut CudaBackend) {
    let mut a = vec![0u8; 8192];
    let mut b = vec![0u8; 4096];
    let calls = stat("host_register_calls");
    be.register_host(a.as_mut_ptr(), a.len())
        .expect("register a");
    be.register_host(b.as_mut_ptr(), b.len())
        .expect("register b");
    assert_eq!(stat("host_register_calls"), calls + 2);
    assert_eq!(stat("host_registered_live"), 2);
    assert_eq!(
        stat("last_register_flags"),
        1,
        "CU_MEMHOSTREGISTER_PORTABLE"
    );
    // Memory page-locked already (here: by the first call) is used as is, and not taken over.
    be.register_host(a.as_mut_ptr(), a.len())
        .expect("already registered memory is accepted");
    be.unregister_host(a.as_mut_ptr()).expect("unregister a");
    be.unregister_host(b.as_mut_ptr()).expect("unregister b");
    assert_eq!(stat("host_registered_live"), 0);
    assert_eq!(stat("host_unregister_calls"), 2);
    match be.unregister_host(a.as_mut_ptr()) {
        Err(Error::Cuda(msg)) => assert!(
            msg.starts_with(
                "cuMemHostUnregister failed: CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED (713)"
            ),
            "{msg}"
        ),
        other => panic!("expected Error::Cuda, got {other:?}"),
    }
    assert!(matches!(
        be.register_host(std::ptr::null_mut(), 4096),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        be.register_host(a.as_mut_ptr(), 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        be.unregister_host(std::ptr::null_mut()),
        Err(Error::InvalidArgument(_))
    ));
}

/// Timing events come from a pool: a steady stream of jobs creates no new events.
fn events_are_reused(be: &mut CudaBackend) {
    let src = [6u8; 64];
    let mut dst = vec![0u8; 64];
    let descs = [desc(src.as_ptr(), dst.as_mut_ptr(), 64)];
    for job in 700..702 {
        be.submit(job, Direction::Load, &descs, 0).expect("submit");
        be.submit(job + 100, Direction::Store, &descs, COMPUTE_STREAM)
            .expect("submit");
        poll_n(be, 2);
    }
    let created = stat("events_created");
    for job in 702..750 {
        be.submit(job, Direction::Load, &descs, 0).expect("submit");
        be.submit(job + 100, Direction::Store, &descs, COMPUTE_STREAM)
            .expect("submit");
        poll_n(be, 2);
    }
    assert_eq!(stat("events_created"), created);
}

/// Host memory is page-locked in pieces of at most 64 GiB: a tier of hundreds of GiB passes a
/// driver that refuses larger single calls, and a piece that fails unlocks the pieces before it.
fn pinning_in_pieces(be: &mut CudaBackend) {
    assert_eq!(be.pin_chunk(), PIN_CHUNK_BYTES);
    assert_eq!(PIN_CHUNK_BYTES, 64 << 30);
    // The fake touches no memory when it registers: an address range stands for the tier.
    let huge: usize = 300 << 30;
    let p = std::ptr::without_provenance_mut::<u8>(0x7000_0000_0000);
    knob("register_max_bytes", 64 << 30);
    let calls = stat("host_register_calls");
    be.register_host(p, huge).expect("300 GiB in pieces");
    assert_eq!(
        stat("host_register_calls"),
        calls + 5,
        "4 x 64 GiB + 44 GiB"
    );
    assert_eq!(stat("host_registered_bytes"), huge as u64);
    assert_eq!(stat("largest_register_bytes"), 64 << 30);
    let unregs = stat("host_unregister_calls");
    be.unregister_host(p).expect("unregister every piece");
    assert_eq!(stat("host_unregister_calls"), unregs + 5);
    assert_eq!(stat("host_registered_live"), 0);
    assert_eq!(stat("host_registered_bytes"), 0);

    // The third piece fails: the two before it are unlocked again, nothing stays registered.
    knob("register_fail_in", 3);
    match be.register_host(p, huge) {
        Err(Error::Cuda(msg)) => {
            assert!(msg.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{msg}");
            assert!(msg.contains("2 pieces before it unregistered"), "{msg}");
        }
        other => panic!("expected Error::Cuda, got {other:?}"),
    }
    assert_eq!(stat("host_registered_live"), 0);
    assert_eq!(stat("host_registered_bytes"), 0);
    knob("register_max_bytes", 0);
    // Nothing is left to unregister at drop either.
    let unregs = stat("host_unregister_calls");
    assert!(be.unregister_host(p).is_err());
    assert_eq!(stat("host_unregister_calls"), unregs + 1);

    // Smaller pieces when asked (rounded to pages).
    let mut buf = vec![0u8; (7 << 20) / 2];
    be.set_pin_chunk((1 << 20) - 5);
    assert_eq!(be.pin_chunk(), 1 << 20);
    let calls = stat("host_register_calls");
    be.register_host(buf.as_mut_ptr(), buf.len())
        .expect("register");
    assert_eq!(stat("host_register_calls"), calls + 4);
    be.unregister_host(buf.as_mut_ptr()).expect("unregister");
    assert_eq!(stat("host_registered_live"), 0);
    be.set_pin_chunk(PIN_CHUNK_BYTES);
}

/// Three "device" tensors (host memory in the fake) of 16 blocks of 4 KiB.
fn device_tensors(mem: &mut [u8]) -> Vec<KvTensor> {
    (0..3)
        .map(|i| KvTensor {
            base: mem[i * (64 << 10)..].as_mut_ptr() as u64,
            num_blocks: 16,
            block_stride: 4096,
            page_size: 4096,
            on_device: true,
        })
        .collect()
}

fn cuda_config() -> WorkerConfig {
    WorkerConfig {
        block_size_factor: 1,
        num_host_slots: 32,
        threads: 4,
        backend: BackendKind::Cuda(0),
    }
}

/// A worker whose third host tier cannot be page-locked fails and releases everything: the
/// tiers locked before, its streams, events and context reference.
fn worker_creation_rolls_back(mode: &str) {
    let mut mem = vec![0u8; 3 << 16];
    let tensors = device_tensors(&mut mem);
    let before = (
        stat("primary_ctx_refs"),
        stat("streams_live"),
        stat("events_live"),
    );
    let w = Worker::new(cuda_config(), &tensors, None).expect("worker on the fake driver");
    assert_eq!(stat("host_registered_live"), 3);
    assert_eq!(stat("host_registered_bytes"), 3 * 32 * 4096);
    // Pre-faulted before page-locking: every page of each owned tier is resident.
    for t in 0..3 {
        let (p, len) = w.host_buffer(t).expect("host buffer");
        let mut v = vec![0u8; len.div_ceil(4096)];
        // SAFETY: `p` is the page-aligned start of the tier's mapping of `len` bytes.
        assert_eq!(unsafe { libc::mincore(p.cast(), len, v.as_mut_ptr()) }, 0);
        assert!(
            v.iter().all(|&b| b & 1 != 0),
            "{mode}: tier {t} not pre-faulted"
        );
    }
    drop(w);
    assert_eq!(stat("host_registered_live"), 0);

    knob("register_fail_in", 3);
    match Worker::new(cuda_config(), &tensors, None) {
        Err(Error::Cuda(msg)) => assert!(msg.contains("cuMemHostRegister"), "{mode}: {msg}"),
        Err(e) => panic!("{mode}: expected Error::Cuda, got {e:?}"),
        Ok(_) => panic!("{mode}: the third registration was to fail"),
    }
    assert_eq!(stat("host_registered_live"), 0, "{mode}");
    assert_eq!(stat("host_registered_bytes"), 0, "{mode}");
    assert_eq!(
        (
            stat("primary_ctx_refs"),
            stat("streams_live"),
            stat("events_live"),
        ),
        before,
        "{mode}: the failed worker's context, streams and events are released"
    );
    knob("register_fail_in", 0);
}

/// A thread blocked in a wait for 2 s (the fake never completes the job, so the wait times out)
/// does not hold up another thread's poll and submit (generous margin: 0.5 s).
fn a_poll_during_a_long_wait_returns_promptly() {
    let mut mem = vec![0u8; 3 << 16];
    let tensors = device_tensors(&mut mem);
    let w = std::sync::Arc::new(Worker::new(cuda_config(), &tensors, None).expect("worker"));
    let store = |id: u64, w: &Worker| {
        let job = JobBlocks {
            kind: Direction::Store,
            src: &[1],
            dst: &[2],
            block_index: 0,
        };
        w.submit(id, &job, 0).expect("submit");
    };
    knob("never_complete", 1);
    store(1, &w);
    let waiter = {
        let w = w.clone();
        std::thread::spawn(move || {
            let t = std::time::Instant::now();
            let r = w.wait(&[1], Duration::from_secs(2));
            (r, t.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    assert!(!waiter.is_finished());
    let t = std::time::Instant::now();
    let mut out = Vec::new();
    w.poll(&mut out, 16).expect("poll");
    assert!(out.is_empty());
    store(2, &w);
    let took = t.elapsed();
    assert!(
        took < Duration::from_millis(500),
        "poll and submit took {took:?} while a thread waited"
    );
    let (r, waited) = waiter.join().expect("waiter");
    assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
    assert!(waited >= Duration::from_secs(2), "{waited:?}");
    knob("never_complete", 0);
    w.wait(&[1, 2], Duration::from_secs(5)).expect("wait");
    for _ in 0..100 {
        w.poll(&mut out, 16).expect("poll");
        if out.len() == 2 {
            break;
        }
    }
    assert_eq!(ids(&out), [1, 2]);
    assert!(out.iter().all(|c| c.success));
}

// ---- a real GPU -------------------------------------------------------------------------------

/// On a machine with an NVIDIA GPU (run by `scripts/gpu-check.sh`): stores wait for the compute
/// stream, loads and stores copy exactly, both copy paths, timings. Prints what it measured.
#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn real_gpu_round_trip() {
    use cudarc::driver::sys;
    use std::time::Instant;

    if inner_mode().is_some() {
        return;
    }
    // Asked for explicitly (it is ignored by default): without a GPU it fails, never passes.
    assert!(
        cuda_available(),
        "real_gpu_round_trip needs a usable CUDA driver and device"
    );
    fn ck(what: &str, rc: sys::CUresult) {
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "{what}");
    }
    const BLOCK: usize = 256 << 10;
    const BLOCKS: usize = 256;
    const N: usize = BLOCK * BLOCKS;

    let mut be = CudaBackend::new(0).expect("CudaBackend::new(0)");
    println!(
        "driver {} batch available {} ({:?})",
        be.driver_version(),
        be.batch_copy_available(),
        be
    );
    // The test's own allocations, in the same primary context.
    let mut dev: sys::CUdevice = 0;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    let (mut kv_a, mut kv_b): (sys::CUdeviceptr, sys::CUdeviceptr) = (0, 0);
    let mut compute: sys::CUstream = std::ptr::null_mut();
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        ck("cuDeviceGet", sys::cuDeviceGet(&mut dev, 0));
        ck("retain", sys::cuDevicePrimaryCtxRetain(&mut ctx, dev));
        ck("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
        ck("cuMemAlloc a", sys::cuMemAlloc_v2(&mut kv_a, N));
        ck("cuMemAlloc b", sys::cuMemAlloc_v2(&mut kv_b, N));
        ck("cuStreamCreate", sys::cuStreamCreate(&mut compute, 1));
    }
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let mut pattern = vec![0u8; N];
    rng.fill(&mut pattern);
    let mut host = vec![0u8; N];
    be.register_host(host.as_mut_ptr(), N)
        .expect("register_host");

    for (round, batch) in [(0u64, true), (1, false), (2, true), (3, false)] {
        let used = be.set_batch_copy(batch);
        if batch && !used {
            println!("round {round}: batch copy unavailable, loop used");
        }
        host.fill(0);
        // SAFETY: N bytes from a live Vec into a live allocation; synchronous copy.
        unsafe {
            ck(
                "HtoD",
                sys::cuMemcpyHtoD_v2(kv_a, pattern.as_ptr().cast(), N),
            );
            ck("memset b", sys::cuMemsetD8_v2(kv_b, 0, N));
        }
        // Keep the compute stream busy, ending with 0x5A over the first half of the KV: a store
        // that did not wait for it would read other bytes.
        for i in 0..40u8 {
            let v = if i == 39 { 0x5A } else { i };
            // SAFETY: within the allocation; asynchronous on the test's stream.
            unsafe { ck("memset", sys::cuMemsetD8Async(kv_a, v, N / 2, compute)) };
        }
        let perm = rng.distinct(BLOCKS, BLOCKS);
        let store: Vec<CopyDesc> = (0..BLOCKS)
            .map(|i| CopyDesc {
                src: kv_a + (i * BLOCK) as u64,
                dst: host.as_ptr() as u64 + (perm[i] * BLOCK) as u64,
                size: BLOCK as u64,
            })
            .collect();
        let load: Vec<CopyDesc> = (0..BLOCKS)
            .map(|i| CopyDesc {
                src: host.as_ptr() as u64 + (perm[i] * BLOCK) as u64,
                dst: kv_b + (i * BLOCK) as u64,
                size: BLOCK as u64,
            })
            .collect();
        let (sj, lj) = (1000 + 2 * round, 1001 + 2 * round);
        let t = Instant::now();
        be.submit(sj, Direction::Store, &store, compute as u64)
            .expect("submit store");
        let submit_store = t.elapsed();
        be.wait(&[sj], Duration::from_secs(20)).expect("wait store");
        let t = Instant::now();
        be.submit(lj, Direction::Load, &load, 0)
            .expect("submit load");
        let submit_load = t.elapsed();
        be.wait(&[lj], Duration::from_secs(20)).expect("wait load");
        let done = poll_n(&mut be, 2);
        let mut expect = pattern.clone();
        expect[..N / 2].fill(0x5A);
        for i in 0..BLOCKS {
            let h = &host[perm[i] * BLOCK..(perm[i] + 1) * BLOCK];
            assert!(
                h == &expect[i * BLOCK..(i + 1) * BLOCK],
                "round {round}: stored block {i} differs (did the store wait for the compute stream?)"
            );
        }
        let mut back = vec![0u8; N];
        // SAFETY: N bytes into a live Vec.
        unsafe {
            ck(
                "DtoH",
                sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), kv_b, N),
            )
        };
        assert!(back == expect, "round {round}: loaded bytes differ");
        for c in &done {
            assert!(c.success, "{c:?}");
            assert_eq!(c.bytes, N as u64);
            assert!(c.seconds > 0.0, "{c:?}");
            println!(
                "round {round} {} {:>5}: {} MiB in {:.3} ms = {:.1} GB/s (submit {:?})",
                if used { "batch" } else { "loop " },
                if c.job_id == sj { "store" } else { "load" },
                N >> 20,
                c.seconds * 1e3,
                N as f64 / c.seconds / 1e9,
                if c.job_id == sj {
                    submit_store
                } else {
                    submit_load
                },
            );
        }
    }

    // From another thread.
    let be = std::thread::spawn(move || {
        let mut be = be;
        let d = [CopyDesc {
            src: kv_a,
            dst: kv_b,
            size: 4096,
        }];
        be.submit(2000, Direction::Store, &d, 0).expect("submit");
        be.wait(&[2000], Duration::from_secs(10)).expect("wait");
        assert!(poll_n(&mut be, 1)[0].success);
        be
    })
    .join()
    .expect("thread");
    let mut be = be;
    be.unregister_host(host.as_mut_ptr())
        .expect("unregister_host");
    drop(be);
    // SAFETY: frees what this test allocated, after every copy finished.
    unsafe {
        ck("sync", sys::cuCtxSynchronize());
        ck("free a", sys::cuMemFree_v2(kv_a));
        ck("free b", sys::cuMemFree_v2(kv_b));
        ck("stream", sys::cuStreamDestroy_v2(compute));
        ck("release", sys::cuDevicePrimaryCtxRelease_v2(dev));
    }
}

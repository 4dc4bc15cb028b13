//! Transfer benchmarks: host backend bandwidth against a plain single-threaded memcpy of the same
//! bytes (64 KiB blocks), scaling with threads, and copy-plan building per block; and, on a
//! machine with a CUDA driver and device, host↔device bandwidth of the CUDA backend (group `gpu`,
//! see [`gpu`]). Run: `cargo bench --bench transfer` (only the GPU ones:
//! `cargo bench --bench transfer -- gpu`, or `scripts/gpu-check.sh`).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvoffload::plan::Direction;
use kvoffload::transfer::{BackendKind, JobBlocks, KvTensor, Worker, WorkerConfig};
use std::hint::black_box;
use std::time::Duration;

const BLOCKS: u32 = 256;

struct Setup {
    _kv: Vec<u64>,
    worker: Worker,
    gpu: Vec<u32>,
    slots: Vec<u32>,
    page: u64,
}

/// A "GPU" tensor in host memory and a worker over it; a job storing every block to a slot in
/// reverse order (so no two copies merge).
fn setup(page: u64, threads: usize) -> Setup {
    let kv = vec![0x5au64; (BLOCKS as u64 * page / 8) as usize];
    let tensor = KvTensor {
        base: kv.as_ptr() as u64,
        num_blocks: BLOCKS,
        block_stride: page,
        page_size: page,
        on_device: false,
    };
    let cfg = WorkerConfig {
        block_size_factor: 1,
        num_host_slots: BLOCKS,
        threads,
        backend: BackendKind::Host,
    };
    let worker = Worker::new(cfg, &[tensor], None).unwrap();
    let gpu: Vec<u32> = (0..BLOCKS).collect();
    let slots: Vec<u32> = (0..BLOCKS).rev().collect();
    Setup {
        _kv: kv,
        worker,
        gpu,
        slots,
        page,
    }
}

fn run_job(s: &mut Setup, id: u64) {
    let job = JobBlocks {
        kind: Direction::Store,
        src: &s.gpu,
        dst: &s.slots,
        block_index: 0,
    };
    s.worker.submit(id, &job, 0).unwrap();
    s.worker.wait(&[id], Duration::from_secs(60)).unwrap();
    let mut out = Vec::new();
    s.worker.poll(&mut out, usize::MAX).unwrap();
    assert!(out.iter().all(|c| c.success));
}

fn host_bandwidth(c: &mut Criterion) {
    let page = 64 << 10;
    let mut g = c.benchmark_group("host_store_256x64KiB");
    g.throughput(Throughput::Bytes(BLOCKS as u64 * page));
    g.sample_size(30);
    {
        // The same bytes, same (src, dst) pairs, one thread, plain memcpy.
        let s = setup(page, 1);
        let mut plan = Vec::new();
        let job = JobBlocks {
            kind: Direction::Store,
            src: &s.gpu,
            dst: &s.slots,
            block_index: 0,
        };
        s.worker.plan(&job, &mut plan).unwrap();
        g.bench_function("plain_memcpy_1_thread", |b| {
            b.iter(|| {
                for d in &plan {
                    // SAFETY: descriptors inside the tensor and the worker's host buffer.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            d.src as *const u8,
                            d.dst as *mut u8,
                            d.size as usize,
                        )
                    }
                }
            })
        });
    }
    for threads in [1usize, 2, 4] {
        let mut s = setup(page, threads);
        let mut id = 0;
        g.bench_function(format!("worker_{threads}_threads"), |b| {
            b.iter(|| {
                id += 1;
                run_job(&mut s, id)
            })
        });
    }
    g.finish();
}

fn plan_building(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan");
    g.throughput(Throughput::Elements(BLOCKS as u64));
    let s = setup(4096, 1);
    let mut out = Vec::with_capacity(BLOCKS as usize);
    let job = JobBlocks {
        kind: Direction::Store,
        src: &s.gpu,
        dst: &s.slots,
        block_index: 0,
    };
    g.bench_function("store_256_blocks", |b| {
        b.iter(|| {
            out.clear();
            black_box(s.worker.plan(&job, &mut out).unwrap())
        })
    });
    let _ = s.page;
    g.finish();
}

/// Host↔device bandwidth of the CUDA backend on device 0 (benchmark ids `gpu/...`).
///
/// Without a usable CUDA driver and device ([`cuda_available`] false) this prints one line and
/// registers nothing. Otherwise, for blocks of 16 KiB, 64 KiB, 256 KiB and 2 MiB: a device KV
/// tensor of N = max(32, 64 MiB / block) blocks (`cuMemAlloc` with the device's primary context
/// current on the bench thread) and a [`Worker`] with `BackendKind::Cuda(0)` over it and N host
/// slots (the worker allocates and page-locks them). One job moves all N blocks, 64 MiB, block i
/// to or from slot N-1-i, so that no two copies merge: one copy per block. An iteration is
/// submit + wait + poll of one job; criterion's throughput is in GB/s (1e9 B/s, as PCIe rates).
///
/// Ids are `gpu/<direction>/<block>/<path>`:
/// - `d2h_store/<block>/worker` and `h2d_load/<block>/worker`: the worker on its default copy path
///   (one `cuMemcpyBatchAsync` per job with a driver >= 12.8 exporting it, else a loop of
///   `cuMemcpyAsync`; printed at the start);
/// - `.../memcpy_async`, only where the default is the batch: the same descriptors
///   (`Worker::plan`) submitted to a second [`CudaBackend`] with `set_batch_copy(false)`, i.e. the
///   fallback loop. The worker does not expose its backend, so the fallback cannot be forced on
///   the worker itself; the difference between the two routes is the worker's bookkeeping only.
///
/// Before timing a block size, each path it measures is checked once: the device memory is set to
/// 0xA5, a pattern is loaded into it from reversed host slots, the host buffer is zeroed and the
/// blocks are stored back into other (permuted) slots; every byte must come back where expected,
/// else the bench panics, so a broken copy cannot produce a fast-looking figure. At the end a
/// summary prints wall-clock and device-timed (CUDA events, `Completion::seconds`) GB/s against
/// the PCIe Gen5 x16 line rate and the target (>= 45 GB/s from 256 KiB blocks).
mod gpu {
    use super::{BackendKind, Direction, JobBlocks, KvTensor, Worker, WorkerConfig};
    use criterion::measurement::WallTime;
    use criterion::{BenchmarkGroup, Criterion, Throughput};
    use cudarc::driver::sys;
    use kvoffload::transfer::cuda::{CudaBackend, cuda_available, cuda_driver_version};
    use kvoffload::transfer::{Backend, Completion, CopyDesc};
    use std::ffi::{CStr, c_char, c_int, c_uint};
    use std::time::{Duration, Instant};

    /// Bytes one job moves (at least).
    const JOB_BYTES: u64 = 64 << 20;
    const MIN_BLOCKS: u64 = 32;
    const SIZES: [(u64, &str); 4] = [
        (16 << 10, "16KiB"),
        (64 << 10, "64KiB"),
        (256 << 10, "256KiB"),
        (2 << 20, "2MiB"),
    ];
    /// PCIe Gen5 x16 per direction: 32 GT/s × 16 lanes, 128b/130b encoding, in GB/s.
    const PCIE_GEN5_X16_GBPS: f64 = 32.0 * 16.0 / 8.0 * 128.0 / 130.0;
    const TARGET_GBPS: f64 = 45.0;
    /// The target applies from this block size up.
    const TARGET_FROM: u64 = 256 << 10;
    const TIMEOUT: Duration = Duration::from_secs(60);

    /// A raw `CUresult`.
    type CuResult = c_uint;
    const CUDA_SUCCESS: CuResult = 0;

    type FnDeviceGet = unsafe extern "C" fn(*mut sys::CUdevice, c_int) -> CuResult;
    type FnDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, sys::CUdevice) -> CuResult;
    type FnCtxRetain = unsafe extern "C" fn(*mut sys::CUcontext, sys::CUdevice) -> CuResult;
    type FnCtxRelease = unsafe extern "C" fn(sys::CUdevice) -> CuResult;
    type FnCtxSet = unsafe extern "C" fn(sys::CUcontext) -> CuResult;
    type FnCtxSynchronize = unsafe extern "C" fn() -> CuResult;
    type FnMemAlloc = unsafe extern "C" fn(*mut sys::CUdeviceptr, usize) -> CuResult;
    type FnMemFree = unsafe extern "C" fn(sys::CUdeviceptr) -> CuResult;
    type FnMemsetD8 = unsafe extern "C" fn(sys::CUdeviceptr, u8, usize) -> CuResult;

    /// The driver entry points the bench itself needs (device memory, the primary context),
    /// resolved as `src/transfer/cuda.rs` does: through `sys::culib()`, returning raw `CUresult`s.
    struct Driver {
        device_get: FnDeviceGet,
        device_get_name: Option<FnDeviceGetName>,
        primary_ctx_retain: FnCtxRetain,
        primary_ctx_release: FnCtxRelease,
        ctx_set_current: FnCtxSet,
        ctx_synchronize: FnCtxSynchronize,
        mem_alloc: FnMemAlloc,
        mem_free: FnMemFree,
        memset_d8: FnMemsetD8,
    }

    /// Looks `name` (NUL-terminated) up in the driver library.
    ///
    /// # Safety
    /// The driver library must be loaded ([`cuda_available`] returned true) and `T` must be the
    /// symbol's function pointer type.
    unsafe fn symbol<T: Copy>(name: &str) -> Result<T, String> {
        // SAFETY: the caller checked that the library is present, so `culib` does not panic; it
        // stays loaded for the life of the process.
        let lib = unsafe { sys::culib() };
        // SAFETY: the caller guarantees the type.
        unsafe { lib.get::<T>(name.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("{}: {e}", name.trim_end_matches('\0')))
    }

    impl Driver {
        /// # Safety
        /// Only after [`cuda_available`] returned true.
        unsafe fn load() -> Result<Driver, String> {
            // SAFETY (all): the caller's guarantee; each type is the prototype in cuda.h.
            unsafe {
                Ok(Driver {
                    device_get: symbol("cuDeviceGet\0")?,
                    device_get_name: symbol("cuDeviceGetName\0").ok(),
                    primary_ctx_retain: symbol("cuDevicePrimaryCtxRetain\0")?,
                    primary_ctx_release: symbol("cuDevicePrimaryCtxRelease_v2\0")?,
                    ctx_set_current: symbol("cuCtxSetCurrent\0")?,
                    ctx_synchronize: symbol("cuCtxSynchronize\0")?,
                    mem_alloc: symbol("cuMemAlloc_v2\0")?,
                    mem_free: symbol("cuMemFree_v2\0")?,
                    memset_d8: symbol("cuMemsetD8_v2\0")?,
                })
            }
        }
    }

    fn check(what: &str, rc: CuResult) {
        assert_eq!(rc, CUDA_SUCCESS, "{what} failed: CUresult {rc}");
    }

    /// Device 0's primary context, retained and current on this thread while alive.
    struct Primary<'d> {
        drv: &'d Driver,
        dev: sys::CUdevice,
    }

    impl<'d> Primary<'d> {
        fn open(drv: &'d Driver) -> Primary<'d> {
            let mut dev: sys::CUdevice = 0;
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: out-pointers to locals; the driver is initialised (cuda_available).
            unsafe {
                check("cuDeviceGet", (drv.device_get)(&mut dev, 0));
                check(
                    "cuDevicePrimaryCtxRetain",
                    (drv.primary_ctx_retain)(&mut ctx, dev),
                );
                check("cuCtxSetCurrent", (drv.ctx_set_current)(ctx));
            }
            Primary { drv, dev }
        }

        fn name(&self) -> String {
            let Some(f) = self.drv.device_get_name else {
                return "?".into();
            };
            let mut buf = [0 as c_char; 256];
            // SAFETY: writes at most `len` bytes, NUL-terminated, into the buffer.
            let rc = unsafe { f(buf.as_mut_ptr(), buf.len() as c_int, self.dev) };
            if rc != CUDA_SUCCESS {
                return "?".into();
            }
            // SAFETY: NUL-terminated within the buffer (the driver truncates).
            unsafe { CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        }
    }

    impl Drop for Primary<'_> {
        fn drop(&mut self) {
            // SAFETY: unbinds this thread's context and balances the retain in `open`.
            unsafe {
                let _ = (self.drv.ctx_set_current)(std::ptr::null_mut());
                let _ = (self.drv.primary_ctx_release)(self.dev);
            }
        }
    }

    /// A device allocation in the current (primary) context.
    struct DeviceMem<'d> {
        drv: &'d Driver,
        ptr: sys::CUdeviceptr,
        len: usize,
    }

    impl<'d> DeviceMem<'d> {
        fn alloc(ctx: &Primary<'d>, len: usize) -> DeviceMem<'d> {
            let drv = ctx.drv;
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: writes one device pointer; the primary context is current.
            check("cuMemAlloc", unsafe { (drv.mem_alloc)(&mut ptr, len) });
            DeviceMem { drv, ptr, len }
        }

        /// Sets every byte to `v` and waits for it (the backend's streams are non-blocking: they
        /// do not wait for the legacy default stream the memset runs on).
        fn fill(&self, v: u8) {
            // SAFETY: within this allocation.
            unsafe {
                check("cuMemsetD8", (self.drv.memset_d8)(self.ptr, v, self.len));
                check("cuCtxSynchronize", (self.drv.ctx_synchronize)());
            }
        }
    }

    impl Drop for DeviceMem<'_> {
        fn drop(&mut self) {
            // SAFETY: every job touching the memory finished (the workers were dropped first);
            // freed once.
            unsafe {
                let _ = (self.drv.ctx_synchronize)();
                let _ = (self.drv.mem_free)(self.ptr);
            }
        }
    }

    /// A worker over one device tensor, and buffers for running its jobs.
    struct Rig {
        worker: Worker,
        /// Bytes per block.
        size: u64,
        descs: Vec<CopyDesc>,
        out: Vec<Completion>,
        next_id: u64,
    }

    impl Rig {
        fn new(mem: &DeviceMem<'_>, size: u64, n: u32) -> Rig {
            let tensor = KvTensor {
                base: mem.ptr,
                num_blocks: n,
                block_stride: size,
                page_size: size,
                on_device: true,
            };
            let cfg = WorkerConfig {
                block_size_factor: 1,
                num_host_slots: n,
                threads: 1,
                backend: BackendKind::Cuda(0),
            };
            let worker = Worker::new(cfg, &[tensor], None).expect("Worker::new (CUDA device 0)");
            Rig {
                worker,
                size,
                descs: Vec::with_capacity(n as usize),
                out: Vec::with_capacity(1),
                next_id: 0,
            }
        }

        /// Runs one job to completion: through the worker (`direct` None) or planned by the worker
        /// and submitted to `direct`. Panics unless it completed successfully.
        fn run(&mut self, direct: Option<&mut CudaBackend>, job: &JobBlocks<'_>) -> Completion {
            self.next_id += 1;
            let id = self.next_id;
            self.out.clear();
            match direct {
                None => {
                    self.worker.submit(id, job, 0).expect("Worker::submit");
                    self.worker.wait(&[id], TIMEOUT).expect("Worker::wait");
                    self.worker
                        .poll(&mut self.out, usize::MAX)
                        .expect("Worker::poll");
                }
                Some(be) => {
                    self.descs.clear();
                    self.worker
                        .plan(job, &mut self.descs)
                        .expect("Worker::plan");
                    be.submit(id, job.kind, &self.descs, 0)
                        .expect("CudaBackend::submit");
                    be.wait(&[id], TIMEOUT).expect("CudaBackend::wait");
                    be.poll(&mut self.out).expect("CudaBackend::poll");
                }
            }
            match self.out.pop() {
                Some(c) if self.out.is_empty() && c.job_id == id && c.success => c,
                last => panic!("job {id}: {:?} {last:?}", self.out),
            }
        }

        /// The worker's host buffer as words; only between jobs (`run` needs `&mut self`).
        fn host_words(&mut self) -> &mut [u64] {
            let (p, len) = self.worker.host_buffer(0).expect("host_buffer");
            // SAFETY: the worker's page-aligned buffer of `len` bytes (a multiple of the block
            // size), alive as long as the worker; every job has finished (`run` waits), and the
            // borrow of `self` keeps another from starting while the slice lives.
            unsafe { std::slice::from_raw_parts_mut(p.cast::<u64>(), len / 8) }
        }
    }

    /// Word `w` of host slot `slot` of the check pattern.
    fn pattern(seed: u64, slot: usize, w: usize) -> u64 {
        let mut x = seed
            ^ (slot as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (w as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^ (x >> 29)
    }

    /// Block ids of the jobs.
    struct Ids {
        blocks: Vec<u32>,
        /// Slot n-1-i for block i: the benches' mapping (no two copies merge).
        reversed: Vec<u32>,
        /// Slot (5i+3) mod n for block i: the check's store mapping, another permutation.
        mixed: Vec<u32>,
    }

    impl Ids {
        fn new(n: u32) -> Ids {
            let mixed: Vec<u32> = (0..n)
                .map(|i| ((5 * u64::from(i) + 3) % u64::from(n)) as u32)
                .collect();
            let mut sorted = mixed.clone();
            sorted.sort_unstable();
            assert!(
                sorted.iter().copied().eq(0..n),
                "not a permutation of {n} slots"
            );
            Ids {
                blocks: (0..n).collect(),
                reversed: (0..n).rev().collect(),
                mixed,
            }
        }

        fn store(&self) -> JobBlocks<'_> {
            JobBlocks {
                kind: Direction::Store,
                src: &self.blocks,
                dst: &self.reversed,
                block_index: 0,
            }
        }

        fn load(&self) -> JobBlocks<'_> {
            JobBlocks {
                kind: Direction::Load,
                src: &self.reversed,
                dst: &self.blocks,
                block_index: 0,
            }
        }
    }

    /// Loads a pattern into the (poisoned) device tensor and stores it back to other slots;
    /// panics unless every byte arrives where expected.
    fn check_round_trip(
        rig: &mut Rig,
        mem: &DeviceMem<'_>,
        mut direct: Option<&mut CudaBackend>,
        ids: &Ids,
        seed: u64,
        what: &str,
    ) {
        let size = rig.size;
        let words = (size / 8) as usize;
        mem.fill(0xA5);
        for (s, slot) in rig.host_words().chunks_exact_mut(words).enumerate() {
            for (w, x) in slot.iter_mut().enumerate() {
                *x = pattern(seed, s, w);
            }
        }
        // Block i <- slot n-1-i.
        rig.run(direct.as_deref_mut(), &ids.load());
        rig.host_words().fill(0);
        // Slot mixed[i] <- block i.
        rig.run(
            direct,
            &JobBlocks {
                kind: Direction::Store,
                src: &ids.blocks,
                dst: &ids.mixed,
                block_index: 0,
            },
        );
        let host = rig.host_words();
        for (i, (&to, &from)) in ids.mixed.iter().zip(&ids.reversed).enumerate() {
            let got = &host[to as usize * words..][..words];
            if let Some(w) = (0..words).find(|&w| got[w] != pattern(seed, from as usize, w)) {
                panic!(
                    "{what}: round trip of {} blocks of {} bytes is wrong: block {i} (from slot \
                     {from}, stored to slot {to}) differs at byte {} ({:#018x}, expected {:#018x})",
                    ids.blocks.len(),
                    size,
                    w * 8,
                    got[w],
                    pattern(seed, from as usize, w)
                );
            }
        }
        println!(
            "gpu check ok: {what}: {} blocks of {} bytes, host -> device -> host",
            ids.blocks.len(),
            size
        );
    }

    #[derive(Default)]
    struct Tally {
        jobs: u64,
        bytes: u64,
        wall: f64,
        device: f64,
    }

    struct Row {
        block: u64,
        label: &'static str,
        dir: &'static str,
        path: &'static str,
        t: Tally,
    }

    /// One benchmark: `job` per iteration on `path`; returns what it moved and how long it took
    /// (warm-up included).
    fn measure(
        g: &mut BenchmarkGroup<'_, WallTime>,
        id: String,
        rig: &mut Rig,
        mut direct: Option<&mut CudaBackend>,
        job: &JobBlocks<'_>,
    ) -> Tally {
        let mut t = Tally::default();
        g.bench_function(id, |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    let c = rig.run(direct.as_deref_mut(), job);
                    t.jobs += 1;
                    t.bytes += c.bytes;
                    t.device += c.seconds;
                }
                let elapsed = start.elapsed();
                t.wall += elapsed.as_secs_f64();
                elapsed
            })
        });
        t
    }

    fn gbps(bytes: u64, seconds: f64) -> f64 {
        if seconds > 0.0 {
            bytes as f64 / seconds / 1e9
        } else {
            0.0
        }
    }

    pub fn bandwidth(c: &mut Criterion) {
        if !cuda_available() {
            println!("gpu benches skipped: no CUDA driver/device");
            return;
        }
        // SAFETY: cuda_available() returned true: the driver library is loaded and initialised.
        let drv = match unsafe { Driver::load() } {
            Ok(d) => d,
            Err(e) => {
                println!("gpu benches skipped: the CUDA driver lacks an entry point ({e})");
                return;
            }
        };
        let primary = Primary::open(&drv);
        // Also decides whether the worker's backends use the batch (the same rule).
        let mut fallback = CudaBackend::new(0).expect("CudaBackend::new(0)");
        let default_batch = fallback.uses_batch_copy();
        let default_path = if default_batch {
            "batch"
        } else {
            "memcpy_async"
        };
        let mut fallback = (default_batch && !fallback.set_batch_copy(false)).then_some(fallback);
        let driver = cuda_driver_version().unwrap_or(0);
        println!(
            "gpu benches: device 0 ({}), driver {}.{}; the worker copies with {}; {}",
            primary.name(),
            driver / 1000,
            driver % 1000 / 10,
            if default_batch {
                "one cuMemcpyBatchAsync per job"
            } else {
                "a cuMemcpyAsync loop (no cuMemcpyBatchAsync: driver < 12.8 or symbol missing)"
            },
            if fallback.is_some() {
                "the cuMemcpyAsync fallback is measured through a second CudaBackend"
            } else {
                "no separate fallback bench"
            }
        );

        let mut rows = Vec::new();
        let mut g = c.benchmark_group("gpu");
        g.sample_size(10);
        for (seed, &(size, label)) in (1u64..).zip(&SIZES) {
            let n = (JOB_BYTES / size).max(MIN_BLOCKS);
            let bytes = n * size;
            let n = u32::try_from(n).expect("block count");
            let ids = Ids::new(n);
            let mem = DeviceMem::alloc(&primary, bytes as usize);
            // Dropped before `mem` (declared after it): the worker finishes its jobs first.
            let mut rig = Rig::new(&mem, size, n);
            check_round_trip(
                &mut rig,
                &mem,
                None,
                &ids,
                seed,
                &format!("worker ({default_path}), {label}"),
            );
            if let Some(be) = fallback.as_mut() {
                check_round_trip(
                    &mut rig,
                    &mem,
                    Some(be),
                    &ids,
                    seed << 32,
                    &format!("CudaBackend (memcpy_async), {label}"),
                );
            }
            g.throughput(Throughput::BytesDecimal(bytes));
            for (dir, job) in [("d2h_store", ids.store()), ("h2d_load", ids.load())] {
                let t = measure(
                    &mut g,
                    format!("{dir}/{label}/worker"),
                    &mut rig,
                    None,
                    &job,
                );
                rows.push(Row {
                    block: size,
                    label,
                    dir,
                    path: if default_batch {
                        "worker (batch)"
                    } else {
                        "worker (memcpy_async)"
                    },
                    t,
                });
                if let Some(be) = fallback.as_mut() {
                    let t = measure(
                        &mut g,
                        format!("{dir}/{label}/memcpy_async"),
                        &mut rig,
                        Some(be),
                        &job,
                    );
                    rows.push(Row {
                        block: size,
                        label,
                        dir,
                        path: "backend (memcpy_async)",
                        t,
                    });
                }
            }
            drop(rig);
            drop(mem);
        }
        g.finish();
        drop(fallback);
        drop(primary);
        summary(&rows);
    }

    fn summary(rows: &[Row]) {
        let rows: Vec<&Row> = rows.iter().filter(|r| r.t.jobs > 0).collect();
        if rows.is_empty() {
            return;
        }
        println!(
            "\ngpu summary: GB/s = 1e9 B/s per direction; wall = submit + wait + poll of a \
             64 MiB job, averaged over every run including warm-up (criterion's estimate above \
             is the reference); device = CUDA event time of the copies; line rate = PCIe Gen5 \
             x16, {PCIE_GEN5_X16_GBPS:.1} GB/s (the H200's host link; check nvidia-smi's \
             pcie.link.* in the gpu-check log); target >= {TARGET_GBPS} GB/s from 256 KiB \
             blocks, judged on the wall-clock figure"
        );
        println!(
            "{:<7} {:<10} {:<22} {:>5} {:>10} {:>7} {:>12}  target",
            "block", "direction", "path", "jobs", "wall GB/s", "% line", "device GB/s"
        );
        for r in rows {
            let wall = gbps(r.t.bytes, r.t.wall);
            let target = if r.block < TARGET_FROM {
                "-"
            } else if wall >= TARGET_GBPS {
                "met"
            } else {
                "BELOW"
            };
            println!(
                "{:<7} {:<10} {:<22} {:>5} {:>10.1} {:>6.0}% {:>12.1}  {target}",
                r.label,
                r.dir,
                r.path,
                r.t.jobs,
                wall,
                100.0 * wall / PCIE_GEN5_X16_GBPS,
                gbps(r.t.bytes, r.t.device)
            );
        }
    }
}

/// One 4 KiB store through the worker: submit, wait, poll (the per-job cost of the worker's
/// bookkeeping and waiting, not of copying); and a poll with nothing to report.
fn round_trip(c: &mut Criterion) {
    let mut g = c.benchmark_group("round_trip_1x4KiB");
    let s = setup(4096, 1);
    let job = JobBlocks {
        kind: Direction::Store,
        src: &s.gpu[..1],
        dst: &s.slots[..1],
        block_index: 0,
    };
    let (mut id, mut out) = (0u64, Vec::with_capacity(4));
    g.bench_function("submit_wait_poll", |b| {
        b.iter(|| {
            id += 1;
            s.worker.submit(id, &job, 0).unwrap();
            s.worker.wait(&[id], Duration::from_secs(60)).unwrap();
            out.clear();
            s.worker.poll(&mut out, 4).unwrap();
            assert_eq!(out.len(), 1);
        })
    });
    g.bench_function("poll_idle", |b| {
        b.iter(|| {
            out.clear();
            s.worker.poll(&mut out, 4).unwrap();
        })
    });
    g.finish();
}

criterion_group!(
    benches,
    host_bandwidth,
    plan_building,
    round_trip,
    gpu::bandwidth
);
criterion_main!(benches);

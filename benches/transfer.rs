//! Transfer benchmarks: host backend bandwidth against a plain single-threaded memcpy of the same
//! bytes (64 KiB blocks), scaling with threads, and copy-plan building per block.
//! Run: `cargo bench --bench transfer`.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvoffload::scheduler::JobKind;
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
        kind: JobKind::Store,
        src: &s.gpu,
        dst: &s.slots,
        block_index: 0,
    };
    s.worker.submit(id, &job, 0).unwrap();
    s.worker.wait(&[id], Duration::from_secs(60)).unwrap();
    let mut out = Vec::new();
    s.worker.poll(&mut out).unwrap();
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
            kind: JobKind::Store,
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
        kind: JobKind::Store,
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

criterion_group!(benches, host_bandwidth, plan_building);
criterion_main!(benches);

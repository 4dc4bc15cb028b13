//! Worker tests on the host backend: byte-exact copies, layouts, ordering and bad input.

use super::backend::Backend;
use super::*;
use crate::Error;
use crate::plan::{Direction, Step};
use std::time::Duration;

/// A fake "GPU" tensor in host memory: `blocks` blocks of `page` bytes, `stride` apart, filled
/// with a pattern unique to the tensor and the byte.
struct Mem {
    buf: Vec<u64>,
    tensor: KvTensor,
}

impl Mem {
    fn new(tag: u8, blocks: u32, page: u64, stride: u64) -> Self {
        let words = (blocks as u64 * stride).div_ceil(8) as usize;
        let mut buf = vec![0u64; words];
        let bytes = bytes_mut(&mut buf);
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31) ^ tag;
        }
        let tensor = KvTensor {
            base: buf.as_ptr() as u64,
            num_blocks: blocks,
            block_stride: stride,
            page_size: page,
            on_device: false,
        };
        Self { buf, tensor }
    }

    fn page(&self, b: u32) -> Vec<u8> {
        let t = &self.tensor;
        let at = (b as u64 * t.block_stride) as usize;
        bytes(&self.buf)[at..at + t.page_size as usize].to_vec()
    }

    fn snapshot(&self) -> Vec<u8> {
        bytes(&self.buf).to_vec()
    }
}

fn bytes(v: &[u64]) -> &[u8] {
    // SAFETY: u64 storage viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 8) }
}

fn bytes_mut(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 storage viewed as bytes.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 8) }
}

fn host_sub_block(w: &Worker, t: usize, slot: u32, sub: u32, page: u64) -> Vec<u8> {
    let (p, _) = w.host_buffer(t).unwrap();
    let factor = w.config().block_size_factor as u64;
    let at = (slot as u64 * page * factor + sub as u64 * page) as usize;
    // SAFETY: inside the worker's host buffer.
    unsafe { std::slice::from_raw_parts(p.add(at), page as usize).to_vec() }
}

fn worker(factor: u32, slots: u32, mems: &[&Mem]) -> Worker {
    let cfg = WorkerConfig {
        block_size_factor: factor,
        num_host_slots: slots,
        threads: 2,
        backend: BackendKind::Host,
    };
    let tensors: Vec<KvTensor> = mems.iter().map(|m| m.tensor).collect();
    Worker::new(cfg, &tensors, None).unwrap()
}

fn drain(w: &Worker, ids: &[u64]) -> Vec<Completion> {
    w.wait(ids, Duration::from_secs(10)).unwrap();
    let mut out = Vec::new();
    w.poll(&mut out, usize::MAX).unwrap();
    out
}

/// Deterministic pseudo-random numbers.
struct Rng(u64);
impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[test]
fn store_then_load_round_trips_byte_exact() {
    for factor in [1u32, 3] {
        for skip in [0u32, 1, 2] {
            if skip >= factor && skip > 0 {
                continue;
            }
            let a = Mem::new(1, 40, 256, 256);
            let b = Mem::new(2, 40, 128, 192); // strided: padding between pages
            let w = worker(factor, 16, &[&a, &b]);
            let mut rng = Rng(factor as u64 * 10 + skip as u64);
            let n = 7u32;
            let gpu: Vec<u32> = (0..n).map(|_| rng.next(40) as u32).collect();
            let slots_needed = (n + skip).div_ceil(factor);
            let slots: Vec<u32> = (0..slots_needed).map(|i| 15 - i).collect();
            let (a0, b0) = (a.snapshot(), b.snapshot());
            let store = JobBlocks {
                kind: Direction::Store,
                src: &gpu,
                dst: &slots,
                block_index: skip,
            };
            w.submit(1, &store, 0).unwrap();
            let done = drain(&w, &[1]);
            assert_eq!(done.len(), 1);
            assert!(done[0].success, "{:?}", done[0].error);
            assert_eq!(
                done[0].bytes,
                n as u64 * (256 + 128),
                "bytes = blocks x sum of pages"
            );
            assert_eq!(
                (a.snapshot(), b.snapshot()),
                (a0.clone(), b0.clone()),
                "sources unchanged"
            );
            for (i, &g) in gpu.iter().enumerate() {
                let k = skip + i as u32;
                for (t, m) in [&a, &b].iter().enumerate() {
                    let page = m.tensor.page_size;
                    assert_eq!(
                        host_sub_block(&w, t, slots[(k / factor) as usize], k % factor, page),
                        m.page(g)
                    );
                }
            }
            // Skipped leading sub-blocks of the first slot stay zero.
            for j in 0..skip {
                assert!(
                    host_sub_block(&w, 0, slots[0], j, 256)
                        .iter()
                        .all(|&x| x == 0)
                );
            }
            // Load back into other blocks of fresh tensors.
            let c = Mem::new(3, 40, 256, 256);
            let d = Mem::new(4, 40, 128, 192);
            let (c0, d0) = (c.snapshot(), d.snapshot());
            let w2 = worker(factor, 16, &[&c, &d]);
            for t in 0..2 {
                let (src, len) = w.host_buffer(t).unwrap();
                let (dst, len2) = w2.host_buffer(t).unwrap();
                assert_eq!(len, len2);
                // SAFETY: two distinct host buffers of equal length.
                unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
            }
            let targets: Vec<u32> = (0..n).map(|i| 39 - 2 * i).collect();
            let load = JobBlocks {
                kind: Direction::Load,
                src: &slots,
                dst: &targets,
                block_index: skip,
            };
            w2.submit(2, &load, 0).unwrap();
            assert!(drain(&w2, &[2])[0].success);
            for (i, &g) in gpu.iter().enumerate() {
                assert_eq!(c.page(targets[i]), a.page(g));
                assert_eq!(d.page(targets[i]), b.page(g));
            }
            // Blocks not loaded are untouched (including the stride padding).
            let (c1, d1) = (c.snapshot(), d.snapshot());
            for blk in 0..40u32 {
                if targets.contains(&blk) {
                    continue;
                }
                let (s, e) = ((blk * 256) as usize, (blk * 256 + 256) as usize);
                assert_eq!(c1[s..e], c0[s..e]);
                let (s, e) = ((blk * 192) as usize, (blk * 192 + 192) as usize);
                assert_eq!(d1[s..e], d0[s..e]);
            }
        }
    }
}

#[test]
fn plans_merge_contiguous_runs() {
    let a = Mem::new(1, 16, 64, 64);
    let w = worker(2, 8, &[&a]);
    let mut out = Vec::new();
    let job = JobBlocks {
        kind: Direction::Store,
        src: &[4, 5, 6, 7, 9],
        dst: &[2, 3, 5],
        block_index: 0,
    };
    let bytes = w.plan(&job, &mut out).unwrap();
    assert_eq!(bytes, 5 * 64);
    // GPU 4..8 → slots 2, 3 (contiguous on both sides): one descriptor; GPU 9 → slot 5.
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].size, 4 * 64);
    assert_eq!((out[1].src, out[1].size), (a.tensor.block(9), 64));
}

#[test]
fn fifo_completion_per_direction_and_large_split_jobs() {
    let a = Mem::new(1, 64, 1 << 16, 1 << 16); // 4 MiB of 64 KiB blocks
    let w = worker(1, 64, &[&a]);
    let all: Vec<u32> = (0..64).collect();
    for id in 0..6u64 {
        let job = JobBlocks {
            kind: Direction::Store,
            src: &all,
            dst: &all,
            block_index: 0,
        };
        w.submit(id, &job, 0).unwrap();
    }
    let done = drain(&w, &[0, 1, 2, 3, 4, 5]);
    assert_eq!(
        done.iter().map(|c| c.job_id).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4, 5]
    );
    assert!(done.iter().all(|c| c.success && c.bytes == 64 << 16));
    for b in [0u32, 31, 63] {
        assert_eq!(host_sub_block(&w, 0, b, 0, 1 << 16), a.page(b));
    }
}

#[test]
fn bad_jobs_fail_and_nothing_crashes() {
    let a = Mem::new(1, 8, 64, 64);
    let w = worker(1, 4, &[&a]);
    let before = a.snapshot();
    w.submit(
        1,
        &JobBlocks {
            kind: Direction::Store,
            src: &[8],
            dst: &[0],
            block_index: 0,
        },
        0,
    )
    .unwrap();
    w.submit(
        2,
        &JobBlocks {
            kind: Direction::Store,
            src: &[0],
            dst: &[4],
            block_index: 0,
        },
        0,
    )
    .unwrap();
    w.submit(
        3,
        &JobBlocks {
            kind: Direction::Load,
            src: &[0, 1],
            dst: &[0],
            block_index: 0,
        },
        0,
    )
    .unwrap();
    assert!(matches!(
        w.submit(
            3,
            &JobBlocks {
                kind: Direction::Load,
                src: &[0],
                dst: &[0],
                block_index: 0
            },
            0
        ),
        Err(Error::InvalidState(_))
    ));
    let mut out = Vec::new();
    w.poll(&mut out, usize::MAX).unwrap();
    assert_eq!(out.len(), 3);
    assert!(out.iter().all(|c| !c.success));
    assert!(out[0].error.as_ref().unwrap().contains("block id 8"));
    assert!(out[1].error.as_ref().unwrap().contains("host slot 4"));
    assert_eq!(a.snapshot(), before);
    assert!(
        matches!(w.wait(&[42], Duration::from_secs(1)), Err(Error::NotFound(m)) if m.contains("42"))
    );
    w.shutdown().unwrap();
    assert!(matches!(
        w.submit(
            9,
            &JobBlocks {
                kind: Direction::Store,
                src: &[0],
                dst: &[0],
                block_index: 0
            },
            0
        ),
        Err(Error::InvalidState(_))
    ));
}

#[test]
fn registrations_are_validated() {
    let a = Mem::new(1, 8, 64, 64);
    let cfg = WorkerConfig {
        num_host_slots: 4,
        ..Default::default()
    };
    let t = a.tensor;
    let cases = [
        (vec![], "none"),
        (
            vec![
                t,
                KvTensor {
                    base: t.base + 64,
                    ..t
                },
            ],
            "overlaps",
        ),
        (vec![KvTensor { page_size: 0, ..t }], "page_size"),
        (vec![KvTensor { num_blocks: 0, ..t }], "num_blocks"),
        (
            vec![KvTensor {
                block_stride: 60,
                page_size: 60,
                ..t
            }],
            "multiples",
        ),
        (
            vec![KvTensor {
                block_stride: 32,
                ..t
            }],
            "block_stride",
        ),
        (vec![KvTensor { base: 0, ..t }], "NULL"),
        (
            vec![KvTensor {
                on_device: true,
                ..t
            }],
            "CUDA",
        ),
        (
            vec![KvTensor {
                base: u64::MAX - 63,
                ..t
            }],
            "overflow",
        ),
    ];
    for (tensors, what) in cases {
        let r = Worker::new(cfg, &tensors, None);
        assert!(
            matches!(&r, Err(Error::InvalidArgument(m)) if m.contains(what)),
            "{what}: {:?}",
            r.err()
        );
    }
    assert!(matches!(
        Worker::new(
            WorkerConfig {
                num_host_slots: 0,
                ..cfg
            },
            &[t],
            None
        ),
        Err(Error::InvalidArgument(_))
    ));
    let mut small = vec![0u8; 100];
    let r = Worker::new(cfg, &[t], Some(&[(small.as_mut_ptr(), 100)]));
    assert!(matches!(r, Err(Error::InvalidArgument(m)) if m.contains("host_buffers[0]")));
}

#[test]
fn caller_host_memory_and_swap_blocks() {
    let a = Mem::new(1, 8, 64, 64);
    let b = Mem::new(2, 8, 64, 128);
    let mut host = vec![0u8; 4 * 64 * 2];
    let cfg = WorkerConfig {
        num_host_slots: 4,
        ..Default::default()
    };
    let half = host.len() / 2;
    let (h0, h1) = host.split_at_mut(half);
    let w = Worker::new(
        cfg,
        &[a.tensor, b.tensor],
        Some(&[(h0.as_mut_ptr(), half), (h1.as_mut_ptr(), half)]),
    )
    .unwrap();
    w.submit(
        1,
        &JobBlocks {
            kind: Direction::Store,
            src: &[3],
            dst: &[2],
            block_index: 0,
        },
        0,
    )
    .unwrap();
    drain(&w, &[1]);
    assert_eq!(&host[128..192], &a.page(3)[..]);
    // Synchronous swap: a's blocks 1, 2 → b's blocks 6, 7.
    w.swap_blocks(0, 1, &[1, 2], &[6, 7], None).unwrap();
    assert_eq!((b.page(6), b.page(7)), (a.page(1), a.page(2)));
    // As a job.
    w.swap_blocks(1, 0, &[0], &[5], Some(77)).unwrap();
    let done = drain(&w, &[77]);
    assert_eq!((done[0].job_id, done[0].bytes), (77, 64));
    assert_eq!(a.page(5), b.page(0));
    assert!(matches!(
        w.swap_blocks(0, 1, &[8], &[0], None),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        w.swap_blocks(0, 2, &[0], &[0], None),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn submit_step_runs_a_scheduler_plan() {
    use crate::manager::Policy;
    use crate::scheduler::{Match, ScheduledRequest, Scheduler, SchedulerConfig};
    let a = Mem::new(1, 32, 64, 64);
    let w = worker(2, 8, &[&a]);
    let mut s = Scheduler::new(SchedulerConfig {
        key_len: 8,
        gpu_block_size: 4,
        block_size_factor: 2,
        num_slots: 8,
        policy: Policy::Lru,
        offload_prompt_only: false,
        ..Default::default()
    })
    .unwrap();
    let hashes: Vec<u8> = (0..4u64).flat_map(|i| i.to_be_bytes()).collect();
    s.add_request(1, 16, None).unwrap();
    s.append_block_hashes(1, &hashes, 16).unwrap();
    assert_eq!(s.match_request(1, 0).unwrap(), Match::Miss);
    let blocks = [10u32, 11, 12, 13];
    let mut step = Step::new();
    let req = ScheduledRequest {
        request_id: 1,
        num_computed_tokens: 0,
        num_scheduled_tokens: 16,
        num_tokens: 16,
        new_block_ids: &blocks,
        resumed: false,
    };
    s.build_step(&[req], &[], &mut step).unwrap();
    // Ship it as bytes, as to another process.
    let mut bytes = Vec::new();
    step.encode(&mut bytes);
    let mut received = Step::new();
    received.decode(&bytes).unwrap();
    w.submit_step(&received, 0).unwrap();
    let ids: Vec<u64> = received.jobs().iter().map(|j| j.id).collect();
    let done = drain(&w, &ids);
    assert!(done.iter().all(|c| c.success));
    let slots = received.dst(&received.jobs()[0]).to_vec();
    assert_eq!(host_sub_block(&w, 0, slots[0], 1, 64), a.page(11));
    assert_eq!(host_sub_block(&w, 0, slots[1], 0, 64), a.page(12));
    let mut other = received.clone();
    other.block_size_factor = 3;
    assert!(
        matches!(w.submit_step(&other, 0), Err(Error::InvalidArgument(m)) if m.contains("block_size_factor"))
    );
}

#[test]
fn ids_stay_in_use_until_handed_out_and_poll_respects_max() {
    let a = Mem::new(1, 8, 64, 64);
    let w = worker(1, 8, &[&a]);
    let job = JobBlocks {
        kind: Direction::Store,
        src: &[1],
        dst: &[1],
        block_index: 0,
    };
    for id in [5, 6, 7] {
        w.submit(id, &job, 0).unwrap();
    }
    w.wait(&[5, 6, 7], Duration::from_secs(10)).unwrap();
    let mut out = Vec::new();
    w.poll(&mut out, 1).unwrap();
    assert_eq!(out.iter().map(|c| c.job_id).collect::<Vec<_>>(), vec![5]);
    // 6 finished but was not handed out: its id is still in use, and waiting on it is fine.
    assert!(matches!(w.submit(6, &job, 0), Err(Error::InvalidState(_))));
    w.wait(&[6], Duration::from_secs(1)).unwrap();
    assert!(matches!(
        w.wait(&[5], Duration::from_secs(1)),
        Err(Error::NotFound(_))
    ));
    w.submit(5, &job, 0).unwrap();
    // A synchronous swap does not collide with a caller's id near the top of the range.
    w.submit(u64::MAX, &job, 0).unwrap();
    w.swap_blocks(0, 0, &[2], &[3], None).unwrap();
    let ids: Vec<u64> = drain(&w, &[5, u64::MAX]).iter().map(|c| c.job_id).collect();
    assert_eq!(ids, vec![6, 7, 5, u64::MAX]);
    // An empty plan after shutdown is refused too.
    w.shutdown().unwrap();
    assert!(matches!(
        w.submit_step(&Step::new(), 0),
        Err(Error::InvalidState(_))
    ));
}

#[test]
fn host_tier_sizes_that_overflow_are_refused() {
    let mut big = [0u64; 8];
    let t = KvTensor {
        base: big.as_mut_ptr() as u64,
        num_blocks: 1,
        block_stride: (1 << 62) + 8,
        page_size: (1 << 62) + 8,
        on_device: false,
    };
    let cfg = WorkerConfig {
        block_size_factor: 4,
        num_host_slots: 1,
        ..Default::default()
    };
    assert!(
        matches!(Worker::new(cfg, &[t], None), Err(Error::InvalidArgument(m)) if m.contains("overflow"))
    );
    // The caller's 64 bytes cannot hold 8 pages of 2^61 bytes (the size must not wrap).
    let r = layout::HostBuffer::borrowed(big.as_mut_ptr() as *mut u8, 64, 1, 1 << 61, 8);
    assert!(matches!(r, Err(Error::InvalidArgument(m)) if m.contains("overflow")));
}

#[test]
fn caller_host_buffers_must_not_overlap() {
    let a = Mem::new(1, 8, 64, 64);
    let cfg = WorkerConfig {
        num_host_slots: 2,
        ..Default::default()
    };
    let mut host = vec![0u8; 1024];
    let p = host.as_mut_ptr();
    let two = Mem::new(2, 8, 64, 64);
    // SAFETY: offsets inside `host`.
    let r = Worker::new(
        cfg,
        &[a.tensor, two.tensor],
        Some(&[(p, 256), (unsafe { p.add(128) }, 256)]),
    );
    assert!(
        matches!(r, Err(Error::InvalidArgument(m)) if m.contains("host_buffers[1] overlaps host_buffers[0]"))
    );
    let r = Worker::new(cfg, &[a.tensor], Some(&[(a.tensor.base as *mut u8, 256)]));
    assert!(matches!(r, Err(Error::InvalidArgument(m)) if m.contains("overlaps tensors[0]")));
}

#[test]
fn submit_step_waits_for_the_flush_set_first() {
    use crate::manager::Policy;
    use crate::scheduler::{Match, ScheduledRequest, Scheduler, SchedulerConfig};
    // Request 1 stores GPU block 3 (64 KiB pages, so the copy takes a while); it finishes and
    // block 3 is reallocated to request 2, whose next step must flush that store before the
    // forward pass (and before any copy of its own) overwrites block 3.
    let page = 4 << 20;
    let a = Mem::new(1, 8, page, page);
    let w = worker(1, 8, &[&a]);
    let mut s = Scheduler::new(SchedulerConfig {
        key_len: 8,
        gpu_block_size: 4,
        num_slots: 8,
        policy: Policy::Lru,
        offload_prompt_only: false,
        ..Default::default()
    })
    .unwrap();
    s.add_request(1, 4, None).unwrap();
    s.append_block_hashes(1, &7u64.to_be_bytes(), 4).unwrap();
    assert_eq!(s.match_request(1, 0).unwrap(), Match::Miss);
    let req = |id, blocks: &'static [u32]| ScheduledRequest {
        request_id: id,
        num_computed_tokens: 0,
        num_scheduled_tokens: 4,
        num_tokens: 4,
        new_block_ids: blocks,
        resumed: false,
    };
    let mut step = Step::new();
    s.build_step(&[req(1, &[3])], &[], &mut step).unwrap();
    let store = step.jobs()[0].id;
    w.submit_step(&step, 0).unwrap();
    s.finish_request(1).unwrap();
    s.add_request(2, 4, None).unwrap();
    s.append_block_hashes(2, &9u64.to_be_bytes(), 4).unwrap();
    s.match_request(2, 0).unwrap();
    s.build_step(&[req(2, &[3])], &[], &mut step).unwrap();
    assert_eq!(step.flush(), &[store]);
    w.submit_step(&step, 0).unwrap();
    // When submit_step returns, the flushed store has finished (a zero-timeout wait would say
    // Timeout otherwise): the forward pass may now write block 3.
    w.wait(&[store], Duration::ZERO).unwrap();
    assert_eq!(host_sub_block(&w, 0, 0, 0, page), a.page(3));
}

/// A plan's stores read the KV its own forward pass writes: `submit_step` defers them, so they
/// copy what the forward pass wrote (not what the blocks held before it), and they are
/// submitted by the next plan, `submit_stores`, a `wait` naming them, or `shutdown`.
#[test]
fn a_plans_stores_copy_what_its_forward_pass_wrote() {
    let mut a = Mem::new(1, 8, 64, 64);
    let w = worker(1, 8, &[&a]);
    let forward = |a: &mut Mem, b: u32, v: u8| {
        let at = (b as u64 * 64) as usize;
        bytes_mut(&mut a.buf)[at..at + 64].fill(v);
    };
    let plan = |id: u64, block: u32, slot: u32| {
        let mut s = Step::new();
        s.clear(1);
        s.push_job(id, Direction::Store, 7, 0, &[block], &[slot]);
        s
    };

    // Step 1's store: deferred until step 2's submit_step.
    w.submit_step(&plan(1, 0, 0), 0).unwrap();
    forward(&mut a, 0, 0xA1);
    std::thread::sleep(Duration::from_millis(20));
    let mut out = Vec::new();
    w.poll(&mut out, 16).unwrap();
    assert!(
        out.is_empty(),
        "a deferred store does not run before the next step"
    );
    assert!(
        matches!(
            w.submit(
                1,
                &JobBlocks {
                    kind: Direction::Store,
                    src: &[1],
                    dst: &[1],
                    block_index: 0
                },
                0
            ),
            Err(Error::InvalidState(_))
        ),
        "its id is in use"
    );
    w.submit_step(&plan(2, 1, 1), 0).unwrap();
    forward(&mut a, 1, 0xA2);
    assert_eq!(drain(&w, &[1]).len(), 1);
    assert_eq!(host_sub_block(&w, 0, 0, 0, 64), vec![0xA1; 64]);

    // Step 2's store: a wait naming it submits it (after the forward pass).
    assert_eq!(drain(&w, &[2]).len(), 1);
    assert_eq!(host_sub_block(&w, 0, 1, 0, 64), vec![0xA2; 64]);

    // submit_stores, and shutdown, submit what is deferred.
    w.submit_step(&plan(3, 2, 2), 0).unwrap();
    forward(&mut a, 2, 0xA3);
    w.submit_stores().unwrap();
    w.submit_step(&plan(4, 3, 3), 0).unwrap();
    forward(&mut a, 3, 0xA4);
    w.shutdown().unwrap();
    let mut out = Vec::new();
    w.poll(&mut out, 16).unwrap();
    let ids: Vec<u64> = out.iter().map(|c| c.job_id).collect();
    assert_eq!(ids, [3, 4]);
    assert_eq!(host_sub_block(&w, 0, 2, 0, 64), vec![0xA3; 64]);
    assert_eq!(host_sub_block(&w, 0, 3, 0, 64), vec![0xA4; 64]);
    assert!(matches!(w.submit_stores(), Err(Error::InvalidState(_))));
}

/// A backend whose jobs finish (copying nothing) only once the test opens its gate.
#[derive(Clone, Default)]
struct Gate(std::sync::Arc<std::sync::Mutex<(bool, Vec<u64>)>>);

impl Gate {
    fn open(&self) {
        self.0.lock().unwrap().0 = true;
    }
}

impl Backend for Gate {
    fn register_host(&mut self, _: *mut u8, _: usize) -> crate::Result<()> {
        Ok(())
    }
    fn unregister_host(&mut self, _: *mut u8) -> crate::Result<()> {
        Ok(())
    }
    fn submit(&mut self, id: u64, _: Direction, _: &[CopyDesc], _: u64) -> crate::Result<()> {
        self.0.lock().unwrap().1.push(id);
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<Completion>) -> crate::Result<()> {
        let mut g = self.0.lock().unwrap();
        if g.0 {
            out.extend(g.1.drain(..).map(|job_id| Completion {
                job_id,
                success: true,
                bytes: 0,
                seconds: 0.0,
                error: None,
            }));
        }
        Ok(())
    }
    fn wait(&mut self, _: &[u64], timeout: Duration) -> crate::Result<()> {
        let t = std::time::Instant::now();
        while !self.0.lock().unwrap().0 {
            if t.elapsed() >= timeout {
                return Err(Error::Timeout("gate closed".into()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }
}

/// While one thread blocks for 2 s in each waiting call (the gate opens after 2 s), another
/// thread's poll, submit and wait with a zero timeout return at once (generous margin: 0.5 s).
#[test]
fn a_blocked_wait_does_not_block_the_worker() {
    let a = Mem::new(1, 8, 64, 64);
    let cfg = WorkerConfig {
        num_host_slots: 8,
        ..Default::default()
    };
    type Op = (&'static str, fn(&Worker));
    let ops: [Op; 4] = [
        ("wait", |w| w.wait(&[1], Duration::from_secs(30)).unwrap()),
        ("submit_step", |w| {
            let mut step = Step::new();
            step.clear(1);
            step.push_job(50, Direction::Load, 9, 0, &[5], &[4]);
            step.set_flush([1]);
            w.submit_step(&step, 0).unwrap();
        }),
        ("swap_blocks", |w| {
            // Host tensor destination: queued behind the store (job 1), so it waits for it.
            w.swap_blocks(0, 0, &[6], &[7], None).unwrap()
        }),
        ("shutdown", |w| w.shutdown().unwrap()),
    ];
    for (name, op) in ops {
        let gate = Gate::default();
        let w = std::sync::Arc::new(
            Worker::with_backend(cfg, &[a.tensor], None, Box::new(gate.clone())).unwrap(),
        );
        let blocks = |src: &'static [u32], dst: &'static [u32]| JobBlocks {
            kind: Direction::Store,
            src,
            dst,
            block_index: 0,
        };
        w.submit(1, &blocks(&[0], &[0]), 0).unwrap();
        let started = std::time::Instant::now();
        let waiter = {
            let w = w.clone();
            std::thread::spawn(move || {
                op(&w);
                started.elapsed()
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            !waiter.is_finished(),
            "{name} returned before the gate opened"
        );
        let t = std::time::Instant::now();
        let mut out = Vec::new();
        w.poll(&mut out, 16).unwrap();
        assert!(out.is_empty(), "{name}: {out:?}");
        if name != "shutdown" {
            w.submit(2, &blocks(&[1], &[1]), 0).unwrap();
            assert!(matches!(
                w.wait(&[2], Duration::ZERO),
                Err(Error::Timeout(_))
            ));
        }
        w.host_buffer(0).unwrap();
        let took = t.elapsed();
        assert!(
            took < Duration::from_millis(500),
            "{name}: other calls took {took:?} while a thread waited"
        );
        std::thread::sleep(Duration::from_secs(2).saturating_sub(started.elapsed()));
        assert!(
            !waiter.is_finished(),
            "{name} returned before the gate opened"
        );
        gate.open();
        let blocked = waiter.join().unwrap();
        assert!(blocked >= Duration::from_secs(2), "{name}: {blocked:?}");
        w.poll(&mut out, 16).unwrap();
        let mut ids: Vec<u64> = out.iter().map(|c| c.job_id).collect();
        ids.sort_unstable();
        let want: &[u64] = match name {
            "shutdown" => &[1],
            "submit_step" => &[1, 2, 50],
            _ => &[1, 2],
        };
        // The synchronous swap's own job is never handed out.
        assert_eq!(ids, want, "{name}");
    }
}

/// Every failed job's message comes with its completion, however many fail at once.
#[test]
fn messages_of_many_failed_jobs_are_all_kept() {
    let a = Mem::new(1, 8, 64, 64);
    let w = worker(1, 8, &[&a]);
    let n = 3000u64;
    for id in 0..n {
        // KV block 100 is outside the registration of 8 blocks.
        let job = JobBlocks {
            kind: Direction::Store,
            src: &[100],
            dst: &[0],
            block_index: 0,
        };
        w.submit(id, &job, 0).unwrap();
    }
    let mut out = Vec::new();
    w.poll(&mut out, usize::MAX).unwrap();
    assert_eq!(out.len(), n as usize);
    for (i, c) in out.iter().enumerate() {
        assert_eq!(c.job_id, i as u64);
        assert!(!c.success);
        let msg = c.error.as_deref().unwrap_or_default();
        assert!(msg.contains("100"), "job {i}: {msg:?}");
    }
}

/// Per-layer views into one allocation: pages interleave without sharing a byte, and are
/// accepted; views that do share bytes are refused, for equal and for different strides.
#[test]
fn interleaved_tensors_overlap_only_where_pages_do() {
    let a = Mem::new(1, 16, 4096, 8192);
    let t = a.tensor;
    let cfg = WorkerConfig {
        num_host_slots: 4,
        ..Default::default()
    };
    // Layer 0 at base, layer 1 at base + 4096: stride 8192, page 4096.
    let l0 = KvTensor { num_blocks: 8, ..t };
    let l1 = KvTensor {
        base: t.base + 4096,
        num_blocks: 8,
        ..t
    };
    let w = Worker::new(cfg, &[l0, l1], None).expect("interleaved views are disjoint");
    // They copy independently.
    w.submit(
        1,
        &JobBlocks {
            kind: Direction::Store,
            src: &[2],
            dst: &[0],
            block_index: 0,
        },
        0,
    )
    .unwrap();
    w.submit(
        2,
        &JobBlocks {
            kind: Direction::Store,
            src: &[2],
            dst: &[0],
            block_index: 0,
        },
        0,
    )
    .unwrap();
    drain(&w, &[1, 2]);
    let page = |base: u64, b: u64| {
        let at = (base - t.base + b * 8192) as usize;
        bytes(&a.buf)[at..at + 4096].to_vec()
    };
    assert_eq!(host_sub_block(&w, 0, 0, 0, 4096), page(l0.base, 2));
    drop(w);
    let refused = |ts: &[KvTensor], want: &str| {
        let r = Worker::new(cfg, ts, None);
        assert!(
            matches!(&r, Err(Error::InvalidArgument(m)) if m.contains(want)),
            "{ts:?}: {:?}",
            r.as_ref().err()
        );
    };
    // One byte shared: layer 1 starts at base + 4095 (an 8-aligned base is needed: use a page
    // of 4104 instead).
    refused(
        &[
            KvTensor {
                page_size: 4104,
                ..l0
            },
            l1,
        ],
        "tensors[1] overlaps tensors[0]",
    );
    // Layer 1's last page running into layer 0's next page.
    refused(
        &[
            l0,
            KvTensor {
                page_size: 4104,
                ..l1
            },
        ],
        "tensors[1] overlaps tensors[0]",
    );
    // The same bytes twice.
    refused(&[l0, l0], "tensors[1] overlaps tensors[0]");
    // Disjoint extents that only touch end to start are fine.
    let tail = KvTensor {
        base: l0.end().unwrap() + 4096,
        num_blocks: 2,
        ..t
    };
    Worker::new(cfg, &[l0, tail], None).expect("touching, not overlapping");
    // Different strides: a tensor of 16 pages of 2048 bytes, 4096 apart, at base + 4096 puts
    // its pages 0, 2, 4, ... in layer 1's pages and 1, 3, ... in layer 0's.
    let fine = KvTensor {
        base: t.base + 4096,
        num_blocks: 4,
        block_stride: 16384,
        page_size: 4096,
        on_device: false,
    };
    Worker::new(cfg, &[l0, fine], None).expect("every other layer-1 page: no shared byte");
    let bad = KvTensor {
        base: t.base + 4096,
        num_blocks: 16,
        block_stride: 4096,
        page_size: 2048,
        on_device: false,
    };
    refused(&[l0, bad], "tensors[1] overlaps tensors[0]");
    // A caller host buffer lying in the gap between two pages of a host tensor is fine; one
    // that reaches into a page is not.
    let mut gap = a.tensor;
    gap.num_blocks = 2;
    let hole = (t.base + 4096) as *mut u8;
    let one_slot = WorkerConfig {
        num_host_slots: 1,
        ..cfg
    };
    Worker::new(
        one_slot,
        &[KvTensor {
            num_blocks: 2,
            ..l0
        }],
        Some(&[(hole, 4096)]),
    )
    .map(drop)
    .unwrap_or_else(|e| panic!("a buffer between pages: {e}"));
    let r = Worker::new(one_slot, &[gap], Some(&[(hole, 4104)]));
    assert!(
        matches!(r, Err(Error::InvalidArgument(m)) if m.contains("host_buffers[0] overlaps tensors[0]"))
    );
}

/// A tier larger than the machine is refused before anything is allocated or touched.
#[test]
fn a_tier_larger_than_memory_is_refused_up_front() {
    let a = Mem::new(1, 8, 1 << 20, 1 << 20);
    let cfg = WorkerConfig {
        num_host_slots: u32::MAX,
        ..Default::default()
    };
    let t = std::time::Instant::now();
    let r = Worker::new(cfg, &[a.tensor], None);
    assert!(
        matches!(&r, Err(Error::OutOfMemory(m)) if m.contains("exceed the machine")),
        "{:?}",
        r.err()
    );
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
}

/// An owned tier is mapped, not written: creating a large one makes none of its pages resident
/// (counted with `mincore` on the buffer itself); reading it gives zeros.
#[test]
fn an_owned_tier_is_not_touched_at_creation() {
    let a = Mem::new(1, 8, 1 << 20, 1 << 20);
    let cfg = WorkerConfig {
        num_host_slots: 2048,
        ..Default::default()
    };
    let w = Worker::new(cfg, &[a.tensor], None).unwrap();
    let (p, len) = w.host_buffer(0).unwrap();
    assert_eq!(len, 2048 << 20);
    let resident = || {
        let mut v = vec![0u8; len.div_ceil(4096)];
        // SAFETY: `p` is the page-aligned start of a mapping of `len` bytes; `v` has one byte
        // per page.
        assert_eq!(unsafe { libc::mincore(p.cast(), len, v.as_mut_ptr()) }, 0);
        v.iter().filter(|&&b| b & 1 != 0).count()
    };
    assert_eq!(
        resident(),
        0,
        "pages of a 2 GiB tier resident after creation"
    );
    // A store touches only the slot it writes.
    w.submit(
        1,
        &JobBlocks {
            kind: Direction::Store,
            src: &[3],
            dst: &[100],
            block_index: 0,
        },
        0,
    )
    .unwrap();
    drain(&w, &[1]);
    // One 1 MiB slot: 256 pages (up to two 2 MiB pages with transparent huge pages).
    assert!((256..=1024).contains(&resident()), "{} pages", resident());
    assert_eq!(host_sub_block(&w, 0, 100, 0, 1 << 20), a.page(3));
}

/// A shutdown while a step waits for its flush set: the step then submits nothing, fails with
/// InvalidState, and gives its job ids back; the shutdown waits for the flushed job only.
#[test]
fn a_shutdown_during_a_steps_flush_wait_cancels_the_step() {
    let a = Mem::new(1, 8, 64, 64);
    let cfg = WorkerConfig {
        num_host_slots: 8,
        ..Default::default()
    };
    let gate = Gate::default();
    let w = std::sync::Arc::new(
        Worker::with_backend(cfg, &[a.tensor], None, Box::new(gate.clone())).unwrap(),
    );
    let job = JobBlocks {
        kind: Direction::Store,
        src: &[0],
        dst: &[0],
        block_index: 0,
    };
    w.submit(1, &job, 0).unwrap();
    let stepper = {
        let w = w.clone();
        std::thread::spawn(move || {
            let mut step = Step::new();
            step.clear(1);
            step.push_job(60, Direction::Store, 9, 0, &[4], &[5]);
            step.set_flush([1]);
            w.submit_step(&step, 0)
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    // The step's id is taken while it waits.
    assert!(matches!(w.submit(60, &job, 0), Err(Error::InvalidState(m)) if m.contains("60")));
    let closer = {
        let w = w.clone();
        std::thread::spawn(move || w.shutdown())
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(!stepper.is_finished() && !closer.is_finished());
    gate.open();
    assert!(
        matches!(stepper.join().unwrap(), Err(Error::InvalidState(m)) if m.contains("shut down"))
    );
    closer.join().unwrap().unwrap();
    let mut out = Vec::new();
    w.poll(&mut out, 16).unwrap();
    assert_eq!(out.iter().map(|c| c.job_id).collect::<Vec<_>>(), [1]);
    assert!(matches!(
        w.wait(&[60], Duration::ZERO),
        Err(Error::NotFound(_))
    ));
}

#[test]
fn stats_count_reported_jobs_per_direction() {
    let a = Mem::new(1, 8, 4096, 4096);
    let w = worker(1, 4, &[&a]);
    assert_eq!(w.stats().unwrap(), WorkerStats::default());
    let job = |kind, src: &'static [u32], dst: &'static [u32]| JobBlocks {
        kind,
        src,
        dst,
        block_index: 0,
    };
    w.submit(1, &job(Direction::Store, &[0, 1], &[0, 1]), 0)
        .unwrap();
    w.submit(2, &job(Direction::Store, &[9], &[2]), 0).unwrap(); // block 9 of 8: fails
    w.submit(3, &job(Direction::Load, &[0], &[5]), 0).unwrap();
    assert_eq!(w.stats().unwrap().jobs_in_flight, 3);
    w.wait(&[1, 3], Duration::from_secs(10)).unwrap();
    assert_eq!(
        w.stats().unwrap().store.jobs,
        0,
        "counted when handed out, not when finished"
    );
    let mut out = Vec::new();
    w.poll(&mut out, usize::MAX).unwrap();
    assert_eq!(out.len(), 3);
    let s = w.stats().unwrap();
    assert_eq!(s.jobs_in_flight, 0);
    assert_eq!(
        (s.store.jobs, s.store.failed_jobs, s.store.bytes),
        (2, 1, 8192)
    );
    assert_eq!(
        (s.load.jobs, s.load.failed_jobs, s.load.bytes),
        (1, 0, 4096)
    );
    assert!(s.store.seconds >= 0.0 && s.load.seconds >= 0.0);
    assert_eq!(s.store.size_buckets[0], 1, "8 KiB: the first bucket");
    assert_eq!(
        s.store.size_buckets.iter().sum::<u64>(),
        1,
        "failed jobs: no size"
    );
    assert_eq!(s.load.size_buckets[0], 1);
    // A synchronous swap into a host tensor counts as a store when it finishes.
    w.swap_blocks(0, 0, &[2], &[3], None).unwrap();
    let s2 = w.stats().unwrap();
    assert_eq!((s2.store.jobs, s2.store.bytes), (3, 8192 + 4096));
    assert_eq!(s2.jobs_in_flight, 0);
}

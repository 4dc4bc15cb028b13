//! Manager benchmarks: prefix lookup (LRU) and store throughput (LRU and ARC) on a 1M-slot
//! tier (8- and 32-byte keys), and the conversation-trace replay (5,859 slots, LRU and ARC, in
//! vLLM 0.24 and 0.33 semantics) through the Rust API and the C ABI, each on a fresh tier made
//! outside the timing. Run:
//! `cargo bench --bench manager`.

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvoffload::manager::{Manager, ManagerConfig, Policy, Semantics, StorePlan};
#[path = "common/tier_replay.rs"]
mod tier_replay;
use std::hint::black_box;
use tier_replay::{FfiTier, RustTier, load_trace, replay, trace_keys, traces_dir};

const SLOTS: usize = 1 << 20;

fn key(i: u64, kl: usize) -> Vec<u8> {
    let mut k = vec![0u8; kl];
    // Spread the bits like a real hash would.
    let h = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for (j, b) in k.iter_mut().enumerate() {
        *b = (h.rotate_left(j as u32 * 8) as u8) ^ (i >> (j % 8 * 8)) as u8;
    }
    k[..8].copy_from_slice(&i.to_le_bytes());
    k
}

fn keys(from: u64, to: u64, kl: usize) -> Vec<u8> {
    (from..to).flat_map(|i| key(i, kl)).collect()
}

/// A tier of SLOTS slots, all holding ready keys 0..SLOTS.
fn full_manager(kl: usize, policy: Policy) -> Manager {
    let mut m = Manager::new(ManagerConfig {
        key_len: kl,
        num_slots: SLOTS,
        policy,
        ..Default::default()
    })
    .unwrap();
    let mut plan = StorePlan::default();
    for from in (0..SLOTS as u64).step_by(4096) {
        let ks = keys(from, from + 4096, kl);
        m.prepare_store(&ks, &mut plan).unwrap();
        m.complete_store(&ks, true).unwrap();
    }
    m
}

fn tier_ops(c: &mut Criterion) {
    for kl in [8usize, 32] {
        // Tiers are filled on a benchmark's first run (a filtered-out benchmark builds none).
        let (mut lru, mut arc) = (None, None);
        let mut g = c.benchmark_group(format!("manager_1M_slots/{kl}B_keys"));
        const N: u64 = 256;
        g.throughput(Throughput::Elements(N));
        let mut at = 0u64;
        g.bench_function("lookup_prefix_256_hits", |b| {
            let m = lru.get_or_insert_with(|| full_manager(kl, Policy::Lru));
            let windows: Vec<Vec<u8>> = (0..64)
                .map(|w| keys(w * 16_000, w * 16_000 + N, kl))
                .collect();
            b.iter(|| {
                at = (at + 1) % 64;
                black_box(m.lookup_prefix(&windows[at as usize]).unwrap())
            })
        });
        // Fresh keys, precomputed: one window more than the tier holds, so a window comes round
        // again only after it was evicted (no touches). ARC's evicted keys become ghosts, and
        // once its ghost list is full every store also trims the oldest ghosts.
        let mut windows: Vec<Vec<u8>> = Vec::new();
        for (name, policy, m) in [("", Policy::Lru, &mut lru), ("arc_", Policy::Arc, &mut arc)] {
            let mut plan = StorePlan::default();
            let mut next = 0;
            g.bench_function(format!("{name}prepare_complete_store_256_evicting"), |b| {
                let m = m.get_or_insert_with(|| full_manager(kl, policy));
                if windows.is_empty() {
                    windows = (0..(SLOTS as u64 / N + 1))
                        .map(|w| keys(SLOTS as u64 + w * N, SLOTS as u64 + (w + 1) * N, kl))
                        .collect();
                }
                b.iter(|| {
                    let ks = &windows[next % windows.len()];
                    next += 1;
                    m.prepare_store(ks, &mut plan).unwrap();
                    m.complete_store(ks, true).unwrap();
                    assert_eq!(plan.slots.len(), N as usize, "every key fresh");
                    black_box(plan.slots.len())
                })
            });
        }
        g.finish();
    }
}

fn trace_replay(c: &mut Criterion) {
    let path = traces_dir().join("conversation_trace.jsonl");
    let trace = match load_trace(&path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!(
                "SKIPPED replay_conversation_5859_slots: {e} (the trace is not part of the repository)"
            );
            return;
        }
    };
    let requests = trace_keys(&trace, 8);
    let blocks: u64 = trace.iter().map(|r| r.hash_ids.len() as u64).sum();
    let mut g = c.benchmark_group("replay_conversation_5859_slots");
    g.sample_size(10);
    g.throughput(Throughput::Elements(blocks));
    for (policy, semantics) in [
        (Policy::Lru, Semantics::Vllm024),
        (Policy::Arc, Semantics::Vllm024),
        (Policy::Lru, Semantics::Vllm033),
        (Policy::Arc, Semantics::Vllm033),
    ] {
        let cfg = ManagerConfig {
            key_len: 8,
            num_slots: 5859,
            policy,
            semantics,
            ..Default::default()
        };
        // 0.24 keeps its names (figures compare across versions); 0.33 gets a suffix.
        let name = match semantics {
            Semantics::Vllm024 => format!("{policy:?}"),
            Semantics::Vllm033 => format!("{policy:?}_v033"),
        };
        g.bench_with_input(BenchmarkId::new("rust", &name), &cfg, |b, cfg| {
            b.iter_batched_ref(
                || RustTier::new(cfg.clone()).unwrap(),
                |t| black_box(replay(t, &requests, 8)),
                BatchSize::PerIteration,
            )
        });
        g.bench_with_input(BenchmarkId::new("c_abi", &name), &cfg, |b, cfg| {
            b.iter_batched_ref(
                || FfiTier::new(cfg),
                |t| black_box(replay(t, &requests, 8)),
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, tier_ops, trace_replay);
criterion_main!(benches);

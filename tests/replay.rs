//! Tier replays of the Mooncake request traces (`../shared/traces`, or `$KVO_TRACES`; not part of
//! the repository: these tests are ignored by default; run them with
//! `cargo test --test replay -- --ignored`, and they fail when the traces are missing): with room
//! for every block, the tier's prefix hits equal an independent count of the ideal prefix-cache
//! hits (the Mooncake paper's ~37 % and ~64 % of blocks); with a small tier, the Rust API and the
//! C ABI give the same answers and the tier's invariants hold. Both policies, in vLLM 0.24 and
//! 0.33 semantics.

#[path = "../benches/common/tier_replay.rs"]
mod tier_replay;

use kvoffload::manager::{ManagerConfig, Policy, Semantics};
use std::collections::HashSet;
use tier_replay::{FfiTier, RustTier, TraceRequest, load_trace, replay, trace_keys, traces_dir};

fn trace(name: &str) -> Vec<TraceRequest> {
    let path = traces_dir().join(name);
    load_trace(&path).unwrap_or_else(|e| panic!("{e} (the trace is not part of the repository)"))
}

/// Both policies in both semantics.
fn both() -> [(Policy, Semantics); 4] {
    [
        (Policy::Lru, Semantics::Vllm024),
        (Policy::Arc, Semantics::Vllm024),
        (Policy::Lru, Semantics::Vllm033),
        (Policy::Arc, Semantics::Vllm033),
    ]
}

/// Blocks that a prefix cache holding every block ever seen would hit.
fn ideal_hits(trace: &[TraceRequest]) -> u64 {
    let mut seen = HashSet::new();
    let mut hits = 0;
    for r in trace {
        hits += r
            .hash_ids
            .iter()
            .take_while(|id| seen.contains(*id))
            .count() as u64;
        seen.extend(r.hash_ids.iter().copied());
    }
    hits
}

#[test]
#[ignore = "reads ../shared/traces (not in the repository); run with --ignored"]
fn unlimited_tier_hits_the_ideal_prefix_blocks() {
    for (name, paper) in [
        ("conversation_trace.jsonl", 0.37),
        ("synthetic_trace.jsonl", 0.64),
    ] {
        let t = trace(name);
        let blocks: u64 = t.iter().map(|r| r.hash_ids.len() as u64).sum();
        let requests = trace_keys(&t, 8);
        for (policy, semantics) in both() {
            let cfg = ManagerConfig {
                key_len: 8,
                num_slots: blocks as usize,
                policy,
                semantics,
                ..Default::default()
            };
            let mut tier = RustTier::new(cfg).unwrap();
            let out = replay(&mut tier, &requests, 8);
            assert_eq!(
                out.hit_blocks,
                ideal_hits(&t),
                "{name} {policy:?} {semantics:?}"
            );
            assert_eq!(out.no_room, 0);
            let rate = out.hit_blocks as f64 / blocks as f64;
            assert!(
                (rate - paper).abs() < 0.01,
                "{name}: {rate:.4} vs the paper's {paper}"
            );
            tier.manager.check_invariants().unwrap();
        }
    }
}

#[test]
#[ignore = "reads ../shared/traces (not in the repository); run with --ignored"]
fn small_tier_rust_api_and_c_abi_agree() {
    let t = trace("conversation_trace.jsonl");
    let requests = trace_keys(&t[..3000], 32);
    for (policy, semantics) in both() {
        let cfg = ManagerConfig {
            key_len: 32,
            num_slots: 1024,
            policy,
            semantics,
            ..Default::default()
        };
        let mut rust = RustTier::new(cfg.clone()).unwrap();
        let mut c = FfiTier::new(&cfg);
        let (a, b) = (
            replay(&mut rust, &requests, 32),
            replay(&mut c, &requests, 32),
        );
        assert_eq!(a, b, "{policy:?} {semantics:?}");
        assert!(a.hit_blocks > 0 && a.stored_blocks > 0);
        rust.manager.check_invariants().unwrap();
        let s = rust.manager.stats();
        assert_eq!(
            (s.used, s.pinned, s.stores_in_flight),
            (1024, 0, 0),
            "{policy:?}"
        );
        assert_eq!(c.stats().evictions, s.evictions);
    }
}

//! `kvo-replay`: replays a request trace through the offload tier and reports hit rates,
//! evictions and the time per block and per request, through the Rust API and the C ABI.
//!
//! Usage: `kvo-replay [--trace PATH] [--slots N] [--key-len BYTES] [--policy lru|arc|both]`
//! Defaults: `../shared/traces/conversation_trace.jsonl`, 5859 slots, 8-byte keys, both policies.

use kvoffload::manager::{ManagerConfig, Policy};
use kvoffload::replay::{FfiTier, RustTier, load_trace, replay, trace_keys};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// Replays per policy and API; the times printed are their medians.
const RUNS: usize = 21;

struct Args {
    trace: PathBuf,
    slots: usize,
    key_len: usize,
    policies: Vec<Policy>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        trace: PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../shared/traces/conversation_trace.jsonl"
        )),
        slots: 5859,
        key_len: 8,
        policies: vec![Policy::Lru, Policy::Arc],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--trace" => a.trace = PathBuf::from(value()?),
            "--slots" => a.slots = value()?.parse().map_err(|e| format!("--slots: {e}"))?,
            "--key-len" => a.key_len = value()?.parse().map_err(|e| format!("--key-len: {e}"))?,
            "--policy" => {
                a.policies = match value()?.as_str() {
                    "lru" => vec![Policy::Lru],
                    "arc" => vec![Policy::Arc],
                    "both" => vec![Policy::Lru, Policy::Arc],
                    p => return Err(format!("--policy: unknown policy {p:?}")),
                }
            }
            "-h" | "--help" => {
                return Err("usage: kvo-replay [--trace PATH] [--slots N] [--key-len 8..64] [--policy lru|arc|both]".into());
            }
            f => return Err(format!("unknown argument {f:?} (try --help)")),
        }
    }
    if !(8..=64).contains(&a.key_len) {
        return Err(format!("--key-len: {} is not in 8..=64", a.key_len));
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let trace = match load_trace(&args.trace) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvo-replay: {e}");
            return ExitCode::FAILURE;
        }
    };
    let requests = trace_keys(&trace, args.key_len);
    println!(
        "trace {} : {} requests, {} blocks; tier of {} slots, {}-byte keys",
        args.trace.display(),
        requests.len(),
        trace.iter().map(|r| r.hash_ids.len()).sum::<usize>(),
        args.slots,
        args.key_len
    );
    for &policy in &args.policies {
        let cfg = ManagerConfig {
            key_len: args.key_len,
            num_slots: args.slots,
            policy,
            ..Default::default()
        };
        // Median of a few runs on fresh tiers (the first run also pays for cold memory).
        let mut runs = Vec::new();
        let (mut rust, mut out, mut out_c) = (None, None, None);
        for _ in 0..RUNS {
            let mut r = RustTier::new(cfg.clone()).expect("valid config");
            let t = Instant::now();
            out = Some(replay(&mut r, &requests, args.key_len));
            let rust_ns = t.elapsed().as_nanos() as f64;
            let mut c = FfiTier::new(&cfg);
            let t = Instant::now();
            out_c = Some(replay(&mut c, &requests, args.key_len));
            runs.push((rust_ns, t.elapsed().as_nanos() as f64));
            rust = Some(r);
        }
        let (out, rust) = (out.expect("ran"), rust.expect("ran"));
        assert_eq!(Some(out), out_c, "the C ABI and the Rust API disagree");
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let rust_ns = median(runs.iter().map(|r| r.0).collect());
        let c_ns = median(runs.iter().map(|r| r.1).collect());
        let s = rust.manager.stats();
        println!(
            "{policy:?}: hit rate {:.2}% of blocks ({} of {}), stored {}, evicted {}, no-room requests {}",
            100.0 * out.hit_blocks as f64 / out.blocks as f64,
            out.hit_blocks,
            out.blocks,
            out.stored_blocks,
            s.evictions,
            out.no_room
        );
        println!(
            "  Rust API: {:.1} ns/block, {:.2} us/request; C ABI: {:.1} ns/block, {:.2} us/request (median of {RUNS} runs)",
            rust_ns / out.blocks as f64,
            rust_ns / out.requests as f64 / 1e3,
            c_ns / out.blocks as f64,
            c_ns / out.requests as f64 / 1e3
        );
    }
    ExitCode::SUCCESS
}

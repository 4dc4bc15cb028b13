//! `kvo-replay` on the Mooncake traces of `../shared/traces` (not part of the repository: these
//! tests are ignored by default and fail when the traces are missing; `.ci/run` runs them with
//! `--ignored` where the traces exist): with no GPU cache and factor 1 (the sweep's sequential
//! model) the LRU hit rate equals the plain LRU prefix cache at every capacity, and with room for
//! every block every policy reaches the trace's maximum (leading blocks already seen), in vLLM
//! 0.33 semantics too.

mod common;

use common::*;
use std::path::{Path, PathBuf};

fn trace(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/traces")
        .join(name);
    assert!(
        p.exists(),
        "{} is missing (the traces are not part of the repository)",
        p.display()
    );
    p
}

/// The `--json` report of a sweep of trace `path` in `semantics`, every policy, no GPU cache.
fn sweep(path: &Path, semantics: &str) -> serde_json::Value {
    kvo_json(&[
        "--trace",
        path.to_str().unwrap(),
        "--semantics",
        semantics,
        "--policy",
        "all",
        "--sweep",
        "--gpu-blocks",
        "0",
        "--max-batch",
        "1024",
    ])
}

fn check(name: &str) {
    let path = trace(name);
    let r = sweep(&path, "0.24");
    check_sweep(&r, &read_trace(&path), 512);
    eprintln!("{name}: {}", r["sweep"]);
}

/// In vLLM 0.33 semantics (whose LRU the plain model does not follow: no touch, a request's
/// recency committed when it finishes) every policy still reaches the maximum with room for
/// every block.
fn check_033(name: &str) {
    let path = trace(name);
    let r = sweep(&path, "0.33");
    assert_eq!(r["settings"]["semantics"], "0.33");
    let reqs = read_trace(&path);
    let unlimited = 100.0 * unlimited_hits(&reqs, 512) as f64 / prompt_tokens(&reqs) as f64;
    for p in ["lru", "arc", "min"] {
        let last = curve(&r, p).last().unwrap().as_f64().unwrap();
        assert!(
            (last - unlimited).abs() < 1e-9,
            "{p} at every block: {last} vs {unlimited}"
        );
    }
    eprintln!("{name} in 0.33: {}", r["sweep"]);
}

#[test]
#[ignore = "reads ../shared/traces (not in the repository); run with --ignored"]
fn conversation_trace_vllm_033() {
    check_033("conversation_trace.jsonl");
}

#[test]
#[ignore = "reads ../shared/traces (not in the repository); run with --ignored"]
fn synthetic_trace_vllm_033() {
    check_033("synthetic_trace.jsonl");
}

#[test]
#[ignore = "reads ../shared/traces (not in the repository); run with --ignored"]
fn conversation_trace() {
    check("conversation_trace.jsonl");
}

#[test]
#[ignore = "reads ../shared/traces (not in the repository); run with --ignored"]
fn synthetic_trace() {
    check("synthetic_trace.jsonl");
}

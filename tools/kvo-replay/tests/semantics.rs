//! `--semantics 0.24|0.33` on the embedded workload: a vLLM 0.33 run keeps the scheduler's
//! invariants and ends with nothing in flight, pinned or tracked (its finished requests' final
//! store jobs included), the report names the semantics, and with room for every block and no
//! GPU cache both semantics reach the unlimited-capacity maximum.

mod common;

use common::*;
use serde_json::Value;

fn runs(r: &Value) -> &Vec<Value> {
    r["runs"].as_array().unwrap()
}

/// The run ended clean and checked its invariants every `every` steps and at the end.
fn ended_clean(run: &Value, every: u64) {
    let end = &run["at_end"];
    for k in [
        "loads_in_flight",
        "stores_in_flight",
        "pinned",
        "requests_tracked",
        "gpu_blocks_held",
    ] {
        assert_eq!(end[k], 0, "{k} at the end of {run}");
    }
    let steps = run["steps"].as_u64().unwrap();
    assert_eq!(
        run["invariant_checks"].as_u64().unwrap(),
        steps / every + 1,
        "{run}"
    );
}

#[test]
fn a_vllm_033_run_keeps_the_invariants_and_ends_with_nothing_in_flight() {
    let r = kvo_json(&[
        "--semantics",
        "0.33",
        "--policy",
        "all",
        "--check-every",
        "20",
    ]);
    assert_eq!(r["settings"]["semantics"], "0.33");
    let all = runs(&r);
    assert_eq!(all.len(), 3);
    assert_eq!(
        all[0]["invariant_checks"], 0,
        "the baseline has no scheduler"
    );
    for run in &all[1..] {
        ended_clean(run, 20);
        assert!(run["host_hit_tokens"].as_u64().unwrap() > 0, "{run}");
        assert!(run["store_jobs"].as_u64().unwrap() > 0, "{run}");
    }
    // Preemptions with jobs in flight, deferrals and flushes in 0.33 too.
    let r = kvo_json(&[
        "--semantics",
        "0.33",
        "--gpu-blocks",
        "80",
        "--transfer-delay-steps",
        "4",
        "--check-every",
        "25",
    ]);
    for run in &runs(&r)[1..] {
        ended_clean(run, 25);
        assert!(run["preemptions_with_jobs"].as_u64().unwrap() > 0, "{run}");
        assert!(run["flushed_jobs"].as_u64().unwrap() > 0, "{run}");
        assert!(
            run["deferrals"]["being_loaded"].as_u64().unwrap() > 0,
            "{run}"
        );
    }
}

#[test]
fn the_report_names_the_semantics() {
    let r = kvo_json(&["--policy", "lru"]);
    assert_eq!(r["settings"]["semantics"], "0.24", "the default");
    let r = kvo_json(&["--policy", "lru", "--semantics", "0.24"]);
    assert_eq!(r["settings"]["semantics"], "0.24");
    for (sem, line) in [
        ("0.24", "vLLM 0.24 semantics"),
        ("0.33", "vLLM 0.33 semantics"),
    ] {
        let out = kvo(&["--policy", "lru", "--semantics", sem]);
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        let host = text
            .lines()
            .find(|l| l.starts_with("host tier:"))
            .unwrap_or_else(|| panic!("no host tier line in\n{text}"));
        assert!(host.contains(line), "{host}");
    }
}

#[test]
fn unlimited_host_capacity_without_gpu_cache_reaches_the_maximum_in_both_semantics() {
    let trace = temp("semantics.jsonl");
    let w = kvo_json(&["--policy", "lru", "--write-trace", trace.to_str().unwrap()]);
    let distinct = w["workload"]["distinct_full_blocks"].as_u64().unwrap();
    let max = unlimited_hits(&read_trace(&trace), 512);
    assert!(max > 0);
    let mut hits = Vec::new();
    for sem in ["0.24", "0.33"] {
        // Room for every distinct full block (the only blocks stored: decode blocks are not
        // offloaded), no GPU prefix cache; otherwise the default engine (64 requests a step,
        // completions one step after shipping).
        let r = kvo_json(&[
            "--semantics",
            sem,
            "--policy",
            "all",
            "--gpu-blocks",
            "0",
            "--host-blocks",
            &distinct.to_string(),
        ]);
        for run in &runs(&r)[1..] {
            ended_clean(run, u64::MAX);
            assert_eq!(run["evictions"], 0, "{sem}: {run}");
            assert_eq!(run["no_room"], 0, "{sem}: {run}");
            assert_eq!(
                run["host_hit_tokens"].as_u64().unwrap(),
                max,
                "{sem} {}: the unlimited-capacity maximum",
                run["policy"]
            );
            hits.push(run["host_hit_tokens"].clone());
        }
    }
    assert!(hits.windows(2).all(|w| w[0] == w[1]), "{hits:?}");
}

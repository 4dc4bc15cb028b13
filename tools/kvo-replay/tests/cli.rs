//! `kvo-replay` on its embedded workload: determinism, the JSON report against the text one,
//! preemptions, deferrals and flushes under a small GPU cache, copies that verify, and the sweep
//! against independent models.

mod common;

use common::*;
use serde_json::Value;

/// The runs of a report without their timings (which vary).
fn untimed(report: &Value) -> Vec<Value> {
    report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let mut r = r.clone();
            for k in [
                "library_per_step",
                "library_per_request",
                "library_seconds",
                "wall_seconds",
            ] {
                r.as_object_mut().unwrap().remove(k);
            }
            r
        })
        .collect()
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[test]
fn seeded_runs_are_deterministic_and_json_carries_the_text_figures() {
    let args = ["--seed", "3", "--policy", "all"];
    let a = kvo_json(&args);
    let b = kvo_json(&args);
    assert_eq!(
        untimed(&a),
        untimed(&b),
        "the same seed gives the same figures"
    );
    let runs = a["runs"].as_array().unwrap();
    assert_eq!(
        runs.iter()
            .map(|r| r["policy"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["none", "lru", "arc"]
    );
    let other = kvo_json(&["--seed", "4", "--policy", "lru"]);
    assert_ne!(
        other["workload"]["prompt_tokens"],
        a["workload"]["prompt_tokens"]
    );

    let out = kvo(&args);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let w = &a["workload"];
    for k in [
        "requests",
        "prompt_tokens",
        "output_tokens",
        "full_blocks",
        "distinct_full_blocks",
    ] {
        assert!(
            text.contains(&thousands(w[k].as_u64().unwrap())),
            "workload {k} in\n{text}"
        );
    }
    // Every row of the table against its JSON field, column by column.
    let rows: Vec<(&str, &str)> = vec![
        ("steps", "steps"),
        ("admissions", "admissions"),
        ("prefill tokens", "prefill_tokens"),
        ("  GPU prefix hits", "gpu_hit_tokens"),
        ("  host-tier hits", "host_hit_tokens"),
        ("  computed", "computed_tokens"),
        ("prefill saved vs none", "prefill_saved_tokens"),
        ("deferred: jobs in flight", "deferrals.jobs_in_flight"),
        ("deferred: store in flight", "deferrals.store_in_flight"),
        ("deferred: being loaded", "deferrals.being_loaded"),
        ("preemptions", "preemptions"),
        ("  with jobs in flight", "preemptions_with_jobs"),
        ("flushed jobs", "flushed_jobs"),
        ("host evictions", "evictions"),
        ("no-room answers", "no_room"),
        ("loads: jobs, blocks", "load_jobs"),
        ("stores: jobs, blocks", "store_jobs"),
    ];
    for (label, field) in rows {
        let line = text
            .lines()
            .find(|l| l.starts_with(label) && l[label.len()..].starts_with("  "))
            .unwrap_or_else(|| panic!("no row {label:?} in\n{text}"));
        let cells: Vec<&str> = line[label.len()..]
            .split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .collect();
        assert_eq!(cells.len(), 3, "{line}");
        for (run, cell) in runs.iter().zip(&cells) {
            let v = field.split('.').fold(run, |v, k| &v[k]);
            if run["policy"] == "none"
                && ![
                    "steps",
                    "admissions",
                    "prefill_tokens",
                    "gpu_hit_tokens",
                    "computed_tokens",
                    "preemptions",
                ]
                .contains(&field)
            {
                assert_eq!(*cell, "-", "{label}");
                continue;
            }
            let n = v.as_i64().unwrap_or_else(|| panic!("{field}: {v}"));
            let want = if n < 0 {
                format!("-{}", thousands(n.unsigned_abs()))
            } else {
                thousands(n as u64)
            };
            assert!(
                cell.starts_with(&want),
                "{label} of {}: {cell:?} vs {want}",
                run["policy"]
            );
        }
    }
    // The tier saves prefill: loads from the host replace computation.
    for run in &runs[1..] {
        assert!(run["host_hit_tokens"].as_u64().unwrap() > 0);
        assert_eq!(
            run["prefill_saved_tokens"].as_i64().unwrap(),
            runs[0]["computed_tokens"].as_i64().unwrap() - run["computed_tokens"].as_i64().unwrap()
        );
    }
}

#[test]
fn a_small_gpu_cache_preempts_defers_and_flushes() {
    let r = kvo_json(&[
        "--gpu-blocks",
        "80",
        "--transfer-delay-steps",
        "4",
        "--check-every",
        "25",
    ]);
    for run in r["runs"].as_array().unwrap() {
        assert!(run["preemptions"].as_u64().unwrap() > 0, "{run}");
        if run["policy"] == "none" {
            continue;
        }
        let with_jobs = run["preemptions_with_jobs"].as_u64().unwrap();
        assert!(with_jobs > 0, "{run}");
        assert!(run["flushed_jobs"].as_u64().unwrap() >= with_jobs, "{run}");
        let d = &run["deferrals"];
        assert!(d["jobs_in_flight"].as_u64().unwrap() > 0, "{run}");
        assert!(d["being_loaded"].as_u64().unwrap() > 0, "{run}");
        // More admissions than requests: preempted requests came back.
        assert!(run["admissions"].as_u64().unwrap() > run["requests"].as_u64().unwrap());
    }
}

#[test]
fn copies_move_the_planned_bytes_and_loaded_blocks_hold_their_kv() {
    let r = kvo_json(&[
        "--copy",
        "--kv-bytes-per-token",
        "8",
        "--gpu-blocks",
        "80",
        "--host-blocks",
        "512",
        "--transfer-delay-steps",
        "2",
    ]);
    assert_eq!(r["settings"]["copy"], true);
    for run in &r["runs"].as_array().unwrap()[1..] {
        let (loads, stores) = (&run["copy_loads"], &run["copy_stores"]);
        assert!(run["loaded_bytes"].as_u64().unwrap() > 0);
        assert_eq!(loads["bytes"], run["loaded_bytes"], "{run}");
        assert_eq!(stores["bytes"], run["stored_bytes"], "{run}");
        assert_eq!(loads["jobs"], run["load_jobs"]);
        assert_eq!(stores["jobs"], run["store_jobs"]);
        assert_eq!(
            run["copy_verified_blocks"], run["loaded_blocks"],
            "every loaded block checked"
        );
        assert!(
            loads["gb_per_s"].as_f64().unwrap() > 0.0 && stores["gb_per_s"].as_f64().unwrap() > 0.0
        );
    }
}

#[test]
fn the_sweep_matches_the_models_and_plots() {
    let (svg, trace) = (temp("sweep.svg"), temp("embedded.jsonl"));
    let r = kvo_json(&[
        "--policy",
        "all",
        "--sweep",
        "--plot",
        svg.to_str().unwrap(),
        "--write-trace",
        trace.to_str().unwrap(),
    ]);
    let reqs = read_trace(&trace);
    assert_eq!(
        reqs.len() as u64,
        r["workload"]["requests"].as_u64().unwrap()
    );
    check_sweep(&r, &reqs, 512);
    // MIN against LRU and ARC: at or above them at most capacities; the report lists the others.
    let (lru, arc, min) = (curve(&r, "lru"), curve(&r, "arc"), curve(&r, "min"));
    let below: Vec<usize> = (0..min.len())
        .filter(|&i| {
            min[i].as_f64().unwrap() < lru[i].as_f64().unwrap().max(arc[i].as_f64().unwrap())
        })
        .collect();
    eprintln!("capacities where MIN is below LRU or ARC: {below:?}");
    assert!(below.len() * 4 <= min.len(), "MIN below at {below:?}");
    assert_eq!(
        r["sweep"]["min_below"].as_array().unwrap().is_empty(),
        below.is_empty()
    );
    let text = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("the plot is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let lines = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline") || n.has_tag_name("path"))
        .count();
    assert!(lines >= 4, "{lines} lines");
    let labels: String = doc.descendants().filter_map(|n| n.text()).collect();
    for want in ["LRU", "ARC", "MIN", "host capacity"] {
        assert!(labels.contains(want), "{want} in the plot");
    }
}

//! The report: what the runs found, as text (a table, one column per policy) or as JSON (the
//! same figures, every one of them).

use crate::engine::RunStats;
use crate::sweep::Sweep;
use serde::Serialize;
use std::fmt::Write;

/// The workload, as the report describes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkloadInfo {
    pub name: String,
    pub requests: u64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub block_tokens: u32,
    pub full_blocks: u64,
    pub distinct_full_blocks: u64,
}

/// The settings of the runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Settings {
    /// The vLLM release whose semantics the scheduler and its tier follow: "0.24" or "0.33".
    pub semantics: String,
    pub host_blocks: u64,
    pub host_gib: f64,
    pub kv_bytes_per_token: u64,
    pub key_len: usize,
    pub factor: u32,
    pub gpu_block_tokens: u64,
    /// 0: no GPU prefix cache.
    pub gpu_blocks: u32,
    pub max_batch: usize,
    pub transfer_delay_steps: u64,
    pub step_ms: u64,
    pub copy: bool,
}

/// Everything a run of `kvo-replay` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub workload: WorkloadInfo,
    pub settings: Settings,
    /// The baseline without a host tier ("none"), then one run per policy.
    pub runs: Vec<RunStats>,
    pub sweep: Option<Sweep>,
}

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
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

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn share(n: u64, pct: f64) -> String {
    format!("{} ({pct:.1} %)", thousands(n))
}

impl Report {
    /// The text report.
    pub fn text(&self) -> String {
        let (w, s) = (&self.workload, &self.settings);
        let mut o = String::new();
        let _ = writeln!(o, "kvo-replay: {}", w.name);
        let _ = writeln!(
            o,
            "workload: {} requests, {} prompt tokens, {} output tokens; {}-token blocks: {} full, {} distinct",
            thousands(w.requests),
            thousands(w.prompt_tokens),
            thousands(w.output_tokens),
            w.block_tokens,
            thousands(w.full_blocks),
            thousands(w.distinct_full_blocks)
        );
        let gpu = if s.gpu_blocks == 0 {
            "no GPU prefix cache".to_string()
        } else {
            format!(
                "GPU prefix cache of {} blocks",
                thousands(s.gpu_blocks as u64)
            )
        };
        let _ = writeln!(
            o,
            "engine: {gpu}, {}-token GPU blocks (factor {}), up to {} requests a step, {} ms a step, completions {} step(s) after shipping",
            s.gpu_block_tokens, s.factor, s.max_batch, s.step_ms, s.transfer_delay_steps
        );
        let _ = writeln!(
            o,
            "host tier: {} blocks ({:.1} GiB at {} KV bytes per token), {}-byte keys, vLLM {} semantics{}",
            thousands(s.host_blocks),
            s.host_gib,
            thousands(s.kv_bytes_per_token),
            s.key_len,
            s.semantics,
            if s.copy {
                ", copies executed (--copy)"
            } else {
                ""
            }
        );
        let mut rows: Vec<(String, Vec<String>)> = Vec::new();
        let mut row = |label: &str, f: &dyn Fn(&RunStats) -> String| {
            rows.push((label.to_string(), self.runs.iter().map(f).collect()));
        };
        let tier = |r: &RunStats, v: String| {
            if r.policy == "none" {
                "-".to_string()
            } else {
                v
            }
        };
        row("policy", &|r| r.policy.clone());
        row("steps", &|r| thousands(r.steps));
        row("admissions", &|r| thousands(r.admissions));
        row("prefill tokens", &|r| thousands(r.prefill_tokens));
        row("  GPU prefix hits", &|r| {
            share(r.gpu_hit_tokens, r.gpu_hit_pct)
        });
        row("  host-tier hits", &|r| {
            tier(r, share(r.host_hit_tokens, r.host_hit_pct))
        });
        row("  computed", &|r| thousands(r.computed_tokens));
        row("prefill saved vs none", &|r| {
            let sign = if r.prefill_saved_tokens < 0 { "-" } else { "" };
            let n = thousands(r.prefill_saved_tokens.unsigned_abs());
            tier(r, format!("{sign}{n} ({:.1} %)", r.prefill_saved_pct))
        });
        row("deferred: jobs in flight", &|r| {
            tier(r, thousands(r.deferrals.jobs_in_flight))
        });
        row("deferred: store in flight", &|r| {
            tier(r, thousands(r.deferrals.store_in_flight))
        });
        row("deferred: being loaded", &|r| {
            tier(r, thousands(r.deferrals.being_loaded))
        });
        row("preemptions", &|r| thousands(r.preemptions));
        row("  with jobs in flight", &|r| {
            tier(r, thousands(r.preemptions_with_jobs))
        });
        row("flushed jobs", &|r| tier(r, thousands(r.flushed_jobs)));
        row("host evictions", &|r| tier(r, thousands(r.evictions)));
        row("no-room answers", &|r| tier(r, thousands(r.no_room)));
        row("loads: jobs, blocks", &|r| {
            tier(
                r,
                format!("{}, {}", thousands(r.load_jobs), thousands(r.loaded_blocks)),
            )
        });
        row("loaded", &|r| tier(r, gib(r.loaded_bytes)));
        row("stores: jobs, blocks", &|r| {
            tier(
                r,
                format!(
                    "{}, {}",
                    thousands(r.store_jobs),
                    thousands(r.stored_blocks)
                ),
            )
        });
        row("stored", &|r| tier(r, gib(r.stored_bytes)));
        if s.copy {
            let gbps = |t: &Option<crate::copier::Traffic>| {
                t.map_or("-".to_string(), |t| format!("{:.2} GB/s", t.gb_per_s))
            };
            row("copy: load (host->GPU)", &|r| gbps(&r.copy_loads));
            row("copy: store (GPU->host)", &|r| gbps(&r.copy_stores));
            row("copy: blocks verified", &|r| {
                r.copy_verified_blocks.map_or("-".into(), thousands)
            });
        }
        row("library/step median, p99", &|r| {
            tier(
                r,
                format!(
                    "{:.1}, {:.1} us",
                    r.library_per_step.median_us, r.library_per_step.p99_us
                ),
            )
        });
        row("library/request median, p99", &|r| {
            tier(
                r,
                format!(
                    "{:.1}, {:.1} us",
                    r.library_per_request.median_us, r.library_per_request.p99_us
                ),
            )
        });
        row("library time", &|r| {
            tier(r, format!("{:.3} s", r.library_seconds))
        });
        row("wall time", &|r| format!("{:.3} s", r.wall_seconds));
        let lw = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
        let cw = rows
            .iter()
            .flat_map(|r| r.1.iter().map(|c| c.len()))
            .max()
            .unwrap_or(0)
            .max(10);
        let _ = writeln!(o);
        for (label, cells) in &rows {
            let _ = write!(o, "{label:<lw$}");
            for c in cells {
                let _ = write!(o, "  {c:>cw$}");
            }
            let _ = writeln!(o);
        }
        if let Some(sw) = &self.sweep {
            o.push_str(&sweep_text(sw));
        }
        o
    }
}

fn sweep_text(sw: &Sweep) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "\nsweep: host hit rate (% of prompt tokens) against host capacity; sequential model (no GPU cache, one request at a time)"
    );
    let _ = write!(o, "{:>12}", "blocks");
    for c in &sw.curves {
        let _ = write!(o, "  {:>8}", c.policy);
    }
    let _ = writeln!(o);
    for (i, cap) in sw.capacities.iter().enumerate() {
        let _ = write!(o, "{:>12}", thousands(*cap));
        for c in &sw.curves {
            let _ = write!(o, "  {:>8.2}", c.hit_pct[i]);
        }
        let _ = writeln!(o);
    }
    let _ = writeln!(o, "unlimited capacity: {:.2} %", sw.unlimited_hit_pct);
    for c in &sw.curves {
        let _ = writeln!(
            o,
            "{}: 90 % of that from {}",
            c.policy,
            c.capacity_for_90pct
                .map_or("no swept capacity".into(), |n| format!(
                    "{} blocks",
                    thousands(n)
                ))
        );
    }
    if sw.min_below.is_empty() {
        let _ = writeln!(o, "MIN is at or above LRU and ARC at every swept capacity");
    } else {
        let _ = writeln!(o, "MIN below a policy (it is not optimal for prefix hits):");
        for m in &sw.min_below {
            let _ = writeln!(o, "  {m}");
        }
    }
    o
}

#[cfg(test)]
mod tests {
    #[test]
    fn thousands_separators() {
        assert_eq!(super::thousands(0), "0");
        assert_eq!(super::thousands(999), "999");
        assert_eq!(super::thousands(1000), "1,000");
        assert_eq!(super::thousands(1234567), "1,234,567");
    }
}

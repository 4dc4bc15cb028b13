//! `kvo-replay`: simulates a serving engine through kvoffload and reports what offloading buys:
//! prefill saved, hit rates, transfers, deferrals, preemptions, per policy against a run without
//! a host tier. With no `--trace` it runs an embedded synthetic chat workload ([`workload`]).
//!
//! Exit status: 0 on success, 2 for invalid options, 1 when the input cannot be read or a run
//! fails (a broken invariant, a copy that did not verify).

mod belady;
mod copier;
mod engine;
mod fasthash;
mod gpu_cache;
mod options;
mod report;
mod sweep;
mod trace;
mod workload;

use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use options::{Options, Plan};
use report::{Report, Settings, WorkloadInfo};
use std::process::ExitCode;

fn progress_bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{prefix:>10} [{bar:40}] {pos}/{len} {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(what.to_string());
    bar
}

/// Why a run failed: an option impossible for the workload (exit 2) or anything else (exit 1).
enum Failure {
    Usage(anyhow::Error),
    Run(anyhow::Error),
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::Run(e)
    }
}

fn run(plan: &Plan) -> Result<Report, Failure> {
    let work = plan.workload()?;
    if let Some(path) = &plan.write_trace {
        trace::write(&work, path)?;
    }
    let cfg = plan.engine(&work).map_err(Failure::Usage)?;
    let host_blocks = plan.host_blocks(&work).map_err(Failure::Usage)?;
    let mut runs = Vec::new();
    let mut tiers = vec![None];
    tiers.extend(plan.policies.iter().map(|&policy| {
        Some(engine::Tier {
            policy,
            num_slots: host_blocks as usize,
        })
    }));
    for tier in tiers {
        let name = tier.map_or("none".into(), |t| format!("{:?}", t.policy).to_lowercase());
        let bar = progress_bar(work.requests.len() as u64, &name);
        let copy = plan.copy && tier.is_some();
        let mut stats = engine::run(&work, &cfg, tier, copy, &mut |n| bar.set_position(n))?;
        bar.finish_and_clear();
        if let Some(base) = runs.first() {
            let base: &engine::RunStats = base;
            stats.prefill_saved_tokens = base.computed_tokens as i64 - stats.computed_tokens as i64;
            stats.prefill_saved_pct = if base.computed_tokens == 0 {
                0.0
            } else {
                100.0 * stats.prefill_saved_tokens as f64 / base.computed_tokens as f64
            };
        }
        runs.push(stats);
    }
    let sweep = if plan.sweep {
        let points = options::SWEEP_POINTS;
        let bar = progress_bar((points * (plan.policies.len() + 1)) as u64, "sweep");
        let s = sweep::run(&work, &cfg, &plan.policies, points, &mut |n| {
            bar.set_position(n)
        })?;
        bar.finish_and_clear();
        if let Some(path) = &plan.plot {
            sweep::plot(&s, &format!("kvo-replay: {}", work.name), path)?;
        }
        Some(s)
    } else {
        None
    };
    let gbs = (work.block_tokens / cfg.factor) as u64;
    let block_bytes = work.block_tokens as u64 * cfg.kv_bytes_per_token;
    Ok(Report {
        workload: WorkloadInfo {
            name: work.name.clone(),
            requests: work.requests.len() as u64,
            prompt_tokens: work.requests.iter().map(|r| r.input_tokens).sum(),
            output_tokens: work.requests.iter().map(|r| r.output_tokens).sum(),
            block_tokens: work.block_tokens,
            full_blocks: work.full_blocks(),
            distinct_full_blocks: work.distinct_full_blocks() as u64,
        },
        settings: Settings {
            semantics: options::semantics_name(cfg.semantics).into(),
            host_blocks,
            host_gib: (host_blocks as f64 * block_bytes as f64) / (1u64 << 30) as f64,
            kv_bytes_per_token: cfg.kv_bytes_per_token,
            key_len: cfg.key_len,
            factor: cfg.factor,
            gpu_block_tokens: gbs,
            gpu_blocks: cfg.gpu_blocks,
            max_batch: cfg.max_batch,
            transfer_delay_steps: cfg.transfer_delay_steps,
            step_ms: cfg.step_ms,
            copy: plan.copy,
        },
        runs,
        sweep,
    })
}

fn main() -> ExitCode {
    let plan = match Options::parse().plan() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kvo-replay: error: {e:#}");
            return ExitCode::from(2);
        }
    };
    match run(&plan) {
        Ok(report) => {
            if plan.json {
                match serde_json::to_string_pretty(&report) {
                    Ok(s) => println!("{s}"),
                    Err(e) => {
                        eprintln!("kvo-replay: error: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                print!("{}", report.text());
            }
            ExitCode::SUCCESS
        }
        Err(Failure::Usage(e)) => {
            eprintln!("kvo-replay: error: {e:#}");
            ExitCode::from(2)
        }
        Err(Failure::Run(e)) => {
            eprintln!("kvo-replay: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

//! `--sweep`: host hit rate against host capacity, per policy, next to the far-sighted
//! reference ([`crate::belady`]) and the unlimited-capacity maximum; `--plot` draws it.
//!
//! Each point is an engine run in the sequential model: no GPU prefix cache, one request at a
//! time, completions in the step that shipped them, no decode. Every request then sees every
//! earlier request's blocks, so the hit rate depends on the policy and the capacity alone, and
//! is comparable with MIN, which is computed on the same model.

use crate::belady;
use crate::engine::{self, EngineConfig, Tier};
use crate::fasthash::HashSet;
use crate::trace::Workload;
use anyhow::{Context, Result};
use kvoffload::manager::Policy;
use serde::Serialize;
use std::path::Path;

/// One policy's curve.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Curve {
    /// "lru", "arc" or "min" (the far-sighted reference).
    pub policy: String,
    /// Host hit rate (% of prompt tokens) at each capacity of [`Sweep::capacities`].
    pub hit_pct: Vec<f64>,
    /// The smallest swept capacity that reaches 90 % of the unlimited-capacity hit rate.
    pub capacity_for_90pct: Option<u64>,
}

/// The sweep.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sweep {
    /// Host capacities swept, in blocks (the last holds every distinct block).
    pub capacities: Vec<u64>,
    /// The hit rate with unlimited capacity: the leading full blocks already seen.
    pub unlimited_hit_pct: f64,
    pub curves: Vec<Curve>,
    /// Capacities where MIN hits less than LRU or ARC (MIN is not optimal for prefix hits).
    pub min_below: Vec<String>,
}

/// Hit tokens of a request whose first `hits` full blocks hit (one prompt token is always
/// computed).
pub fn hit_tokens(hits: u64, block_tokens: u64, input_tokens: u64) -> u64 {
    (hits * block_tokens).min(input_tokens - 1)
}

/// The unlimited-capacity hit tokens: per request, its leading full blocks seen before.
pub fn unlimited_hit_tokens(w: &Workload) -> u64 {
    let bt = w.block_tokens as u64;
    let mut seen = HashSet::default();
    let mut total = 0;
    for r in &w.requests {
        let full = &r.blocks[..(r.input_tokens / bt) as usize];
        let hits = full.iter().take_while(|b| seen.contains(*b)).count() as u64;
        total += hit_tokens(hits, bt, r.input_tokens);
        seen.extend(full.iter().copied());
    }
    total
}

/// The engine settings of a sweep point, from the run's.
pub fn sequential(cfg: &EngineConfig) -> EngineConfig {
    EngineConfig {
        gpu_blocks: 0,
        max_batch: 1,
        transfer_delay_steps: 0,
        decode: false,
        ..cfg.clone()
    }
}

/// Sweeps `points` capacities (geometric, up to every distinct block) for `policies`.
pub fn run(
    w: &Workload,
    cfg: &EngineConfig,
    policies: &[Policy],
    points: usize,
    progress: &mut dyn FnMut(u64),
) -> Result<Sweep> {
    let distinct = w.distinct_full_blocks().max(1) as f64;
    let lo = (distinct / 256.0).max(1.0);
    let mut capacities: Vec<u64> = (0..points)
        .map(|i| (lo * (distinct / lo).powf(i as f64 / (points - 1).max(1) as f64)).round() as u64)
        .collect();
    capacities.dedup();
    let prompt: u64 = w.requests.iter().map(|r| r.input_tokens).sum();
    let pct = |t: u64| 100.0 * t as f64 / prompt as f64;
    let unlimited = pct(unlimited_hit_tokens(w));
    let seq = sequential(cfg);
    let mut curves = Vec::new();
    let mut done = 0;
    for &policy in policies {
        let mut hit_pct = Vec::new();
        for &c in &capacities {
            let tier = Tier {
                policy,
                num_slots: c as usize,
            };
            let s = engine::run(w, &seq, Some(tier), false, &mut |_| {})
                .with_context(|| format!("sweep: {policy:?} at {c} blocks"))?;
            hit_pct.push(pct(s.host_hit_tokens));
            done += 1;
            progress(done);
        }
        curves.push(Curve {
            policy: format!("{policy:?}").to_lowercase(),
            hit_pct,
            capacity_for_90pct: None,
        });
    }
    let bt = w.block_tokens as u64;
    let min_pct = capacities
        .iter()
        .map(|&c| {
            let r = belady::run(w, c as usize);
            let t: u64 = r
                .hits
                .iter()
                .zip(&w.requests)
                .map(|(&h, q)| hit_tokens(h, bt, q.input_tokens))
                .sum();
            done += 1;
            progress(done);
            pct(t)
        })
        .collect::<Vec<_>>();
    let mut min_below = Vec::new();
    for (i, &c) in capacities.iter().enumerate() {
        for cv in &curves {
            if min_pct[i] < cv.hit_pct[i] {
                min_below.push(format!(
                    "at {c} blocks MIN hits {:.2} %, {} {:.2} %",
                    min_pct[i], cv.policy, cv.hit_pct[i]
                ));
            }
        }
    }
    curves.push(Curve {
        policy: "min".into(),
        hit_pct: min_pct,
        capacity_for_90pct: None,
    });
    for cv in &mut curves {
        cv.capacity_for_90pct = capacities
            .iter()
            .zip(&cv.hit_pct)
            .find(|&(_, &h)| h >= 0.9 * unlimited)
            .map(|(&c, _)| c);
    }
    Ok(Sweep {
        capacities,
        unlimited_hit_pct: unlimited,
        curves,
        min_below,
    })
}

/// Draws the sweep as an SVG line chart (capacity on a log axis).
pub fn plot(s: &Sweep, title: &str, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
        root.fill(&WHITE)?;
        let lo = *s.capacities.first().unwrap_or(&1) as f64;
        let hi = (*s.capacities.last().unwrap_or(&2) as f64).max(lo * 2.0);
        let top = s
            .curves
            .iter()
            .flat_map(|c| c.hit_pct.iter().copied())
            .fold(s.unlimited_hit_pct, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(56)
            .build_cartesian_2d((lo..hi).log_scale(), 0f64..(top * 1.1).max(1.0))?;
        chart
            .configure_mesh()
            .x_desc("host capacity (blocks)")
            .y_desc("host hit rate (% of prompt tokens)")
            .draw()?;
        let colours = [RED, BLUE, BLACK, GREEN];
        for (cv, colour) in s.curves.iter().zip(colours) {
            let pts: Vec<(f64, f64)> = s
                .capacities
                .iter()
                .map(|&c| c as f64)
                .zip(cv.hit_pct.iter().copied())
                .collect();
            let label = match cv.policy.as_str() {
                "min" => "MIN (far-sighted)".to_string(),
                p => p.to_uppercase(),
            };
            chart
                .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                });
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, colour.filled())))?;
        }
        let grey = RGBColor(128, 128, 128);
        chart
            .draw_series(LineSeries::new(
                vec![(lo, s.unlimited_hit_pct), (hi, s.unlimited_hit_pct)],
                grey.stroke_width(1),
            ))?
            .label("unlimited capacity")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("--plot {}: {e}", path.display()))
}

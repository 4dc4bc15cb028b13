//! Command-line options, checked into a [`Plan`] (impossible combinations are refused here,
//! before anything runs).

use crate::engine::EngineConfig;
use crate::trace::{self, Workload};
use crate::workload::ChatParams;
use anyhow::{Result, bail};
use clap::{Parser, ValueEnum};
use kvoffload::manager::{Policy, Semantics};
use std::path::PathBuf;

/// Capacities a sweep tries.
pub const SWEEP_POINTS: usize = 12;

/// Default host capacity when neither `--host-blocks` nor `--host-gib` is given.
const DEFAULT_HOST_GIB: f64 = 64.0;

/// Default GPU KV cache, in tokens (16 GiB at 128 KiB per token).
const DEFAULT_GPU_TOKENS: u64 = 131_072;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyArg {
    Lru,
    Arc,
    /// LRU and ARC side by side.
    All,
}

/// The vLLM release whose offloading semantics the scheduler and its tier follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SemanticsArg {
    /// vLLM 0.24: a match touches the hit, every step touches the scheduled requests' keys.
    #[value(name = "0.24")]
    V024,
    /// vLLM 0.33: no touch; keys carry positions, a request's recency is committed after it
    /// finishes (after its final store jobs); every match rewinds the next chunk to store.
    #[value(name = "0.33")]
    V033,
}

impl SemanticsArg {
    /// The library's value.
    pub fn semantics(self) -> Semantics {
        match self {
            SemanticsArg::V024 => Semantics::Vllm024,
            SemanticsArg::V033 => Semantics::Vllm033,
        }
    }
}

/// The release number of `s`, as the option spells it ("0.24", "0.33").
pub fn semantics_name(s: Semantics) -> &'static str {
    match s {
        Semantics::Vllm024 => "0.24",
        Semantics::Vllm033 => "0.33",
    }
}

/// Simulates a serving engine through kvoffload on a request trace (or an embedded synthetic
/// chat workload) and reports what offloading KV blocks to host memory buys: prefill saved,
/// hit rates, transfers, deferrals, preemptions, per eviction policy.
#[derive(Debug, Parser)]
#[command(name = "kvo-replay", version)]
pub struct Options {
    /// A Mooncake JSON-lines trace (timestamp, input_length, output_length, hash_ids); without
    /// it, the embedded synthetic chat workload.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Tokens per block id of the workload (512 for Mooncake traces); one host slot each.
    #[arg(long, default_value_t = 512)]
    pub block_tokens: u32,
    /// Host tier capacity in blocks.
    #[arg(long, conflicts_with = "host_gib")]
    pub host_blocks: Option<u64>,
    /// Host tier capacity in GiB of KV (blocks of block_tokens × kv_bytes_per_token) [default: 64].
    #[arg(long)]
    pub host_gib: Option<f64>,
    /// KV cache bytes per token (all layers, keys and values); 131072 is a Llama-3-8B in fp16.
    #[arg(long, default_value_t = 131_072)]
    pub kv_bytes_per_token: u64,
    /// Eviction policy of the host tier.
    #[arg(long, value_enum, default_value_t = PolicyArg::All)]
    pub policy: PolicyArg,
    /// The vLLM release whose semantics the scheduler and its host tier follow (every run,
    /// the sweep's too; the far-sighted reference does not depend on it).
    #[arg(long, value_enum, default_value_t = SemanticsArg::V024)]
    pub semantics: SemanticsArg,
    /// GPU blocks per host block (block_size_factor): GPU blocks are block_tokens / factor tokens.
    #[arg(long, default_value_t = 1)]
    pub factor: u32,
    /// GPU KV cache blocks (0: no GPU prefix cache and no limit) [default: 131072 tokens' worth,
    /// or more if the largest request needs it].
    #[arg(long)]
    pub gpu_blocks: Option<u32>,
    /// Engine steps from shipping a transfer job to its completion report.
    #[arg(long, default_value_t = 1)]
    pub transfer_delay_steps: u64,
    /// Most requests running at once (scheduled in one step).
    #[arg(long, default_value_t = 64)]
    pub max_batch: usize,
    /// Milliseconds of trace time per engine step.
    #[arg(long, default_value_t = 20)]
    pub step_ms: u64,
    /// Width of block hashes in bytes (16..=64).
    #[arg(long, default_value_t = 32)]
    pub key_len: usize,
    /// Also sweep host capacity: hit rate per policy against far-sighted eviction (MIN).
    #[arg(long)]
    pub sweep: bool,
    /// Draw the sweep as an SVG line chart (needs --sweep).
    #[arg(long, value_name = "FILE.svg", requires = "sweep")]
    pub plot: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Seed of the embedded workload.
    #[arg(long, default_value_t = 1, conflicts_with = "trace")]
    pub seed: u64,
    /// Execute every job with the library's worker on real host buffers and check the KV
    /// content of every loaded block (needs a GPU cache size: --gpu-blocks > 0).
    #[arg(long)]
    pub copy: bool,
    /// Write the workload (the embedded one, or the trace) to FILE in the trace format, then run.
    #[arg(long, value_name = "FILE")]
    pub write_trace: Option<PathBuf>,
    /// Check the scheduler's invariants every N steps (0: at the end only).
    #[arg(long, default_value_t = 0)]
    pub check_every: u64,
}

/// Checked options.
#[derive(Debug, Clone)]
pub struct Plan {
    opts: OptionsCopy,
    pub policies: Vec<Policy>,
    pub sweep: bool,
    pub plot: Option<PathBuf>,
    pub json: bool,
    pub copy: bool,
    pub write_trace: Option<PathBuf>,
}

#[derive(Debug, Clone)]
struct OptionsCopy {
    trace: Option<PathBuf>,
    block_tokens: u32,
    host_blocks: Option<u64>,
    host_gib: Option<f64>,
    kv_bytes_per_token: u64,
    factor: u32,
    gpu_blocks: Option<u32>,
    transfer_delay_steps: u64,
    max_batch: usize,
    step_ms: u64,
    key_len: usize,
    semantics: Semantics,
    seed: u64,
    check_every: u64,
}

impl Options {
    /// Refuses impossible options, naming the option.
    pub fn plan(self) -> Result<Plan> {
        if self.block_tokens == 0 {
            bail!("--block-tokens: 0");
        }
        if self.factor == 0 || !self.block_tokens.is_multiple_of(self.factor) {
            bail!(
                "--factor: {} does not divide the {}-token block",
                self.factor,
                self.block_tokens
            );
        }
        if !(16..=64).contains(&self.key_len) {
            bail!("--key-len: {} is not in 16..=64", self.key_len);
        }
        if self.kv_bytes_per_token == 0 {
            bail!("--kv-bytes-per-token: 0");
        }
        if self.host_blocks == Some(0) {
            bail!("--host-blocks: 0 (the host tier needs room)");
        }
        if let Some(g) = self.host_gib
            && !(g > 0.0 && g.is_finite())
        {
            bail!("--host-gib: {g} (the host tier needs room)");
        }
        if self.max_batch == 0 {
            bail!("--max-batch: 0");
        }
        if self.step_ms == 0 {
            bail!("--step-ms: 0");
        }
        if self.copy && self.gpu_blocks == Some(0) {
            bail!("--copy needs a GPU cache of some size (--gpu-blocks > 0)");
        }
        if let Some(p) = &self.plot
            && p.extension().is_none_or(|e| e != "svg")
        {
            bail!("--plot: {} is not an .svg file", p.display());
        }
        let policies = match self.policy {
            PolicyArg::Lru => vec![Policy::Lru],
            PolicyArg::Arc => vec![Policy::Arc],
            PolicyArg::All => vec![Policy::Lru, Policy::Arc],
        };
        Ok(Plan {
            policies,
            sweep: self.sweep,
            plot: self.plot,
            json: self.json,
            copy: self.copy,
            write_trace: self.write_trace,
            opts: OptionsCopy {
                trace: self.trace,
                block_tokens: self.block_tokens,
                host_blocks: self.host_blocks,
                host_gib: self.host_gib,
                kv_bytes_per_token: self.kv_bytes_per_token,
                factor: self.factor,
                gpu_blocks: self.gpu_blocks,
                transfer_delay_steps: self.transfer_delay_steps,
                max_batch: self.max_batch,
                step_ms: self.step_ms,
                key_len: self.key_len,
                semantics: self.semantics.semantics(),
                seed: self.seed,
                check_every: self.check_every,
            },
        })
    }
}

impl Plan {
    /// The trace, or the embedded workload.
    pub fn workload(&self) -> Result<Workload> {
        match &self.opts.trace {
            Some(path) => trace::read(path, self.opts.block_tokens),
            None => ChatParams {
                seed: self.opts.seed,
                block_tokens: self.opts.block_tokens,
                ..Default::default()
            }
            .generate(),
        }
    }

    /// The engine settings for `work`.
    pub fn engine(&self, work: &Workload) -> Result<EngineConfig> {
        let o = &self.opts;
        let gbs = (o.block_tokens / o.factor) as u64;
        let gpu_blocks = match o.gpu_blocks {
            Some(n) => n,
            None => {
                let largest = work
                    .requests
                    .iter()
                    .map(|r| (r.input_tokens + r.output_tokens.max(1)).div_ceil(gbs))
                    .max()
                    .unwrap_or(0);
                let n = (DEFAULT_GPU_TOKENS / gbs).max(largest);
                u32::try_from(n)
                    .map_err(|_| anyhow::anyhow!("--gpu-blocks: {n} needed, too many"))?
            }
        };
        if gpu_blocks > 0 {
            let (i, need) = work
                .requests
                .iter()
                .map(|r| (r.input_tokens + r.output_tokens.max(1)).div_ceil(gbs))
                .enumerate()
                .max_by_key(|&(_, n)| n)
                .unwrap_or((0, 0));
            if need > gpu_blocks as u64 {
                bail!(
                    "--gpu-blocks: request {i} needs {need} GPU blocks of {gbs} tokens, more than the {gpu_blocks} of the cache"
                );
            }
        }
        Ok(EngineConfig {
            factor: o.factor,
            gpu_blocks,
            max_batch: o.max_batch,
            transfer_delay_steps: o.transfer_delay_steps,
            step_ms: o.step_ms,
            decode: true,
            key_len: o.key_len,
            kv_bytes_per_token: o.kv_bytes_per_token,
            check_every: o.check_every,
            semantics: o.semantics,
        })
    }

    /// Host capacity in blocks.
    pub fn host_blocks(&self, work: &Workload) -> Result<u64> {
        let o = &self.opts;
        let n = match o.host_blocks {
            Some(n) => n,
            None => {
                let gib = o.host_gib.unwrap_or(DEFAULT_HOST_GIB);
                let block = work.block_tokens as f64 * o.kv_bytes_per_token as f64;
                (gib * (1u64 << 30) as f64 / block).floor() as u64
            }
        };
        if n == 0 {
            bail!(
                "--host-gib: less than one block of {} tokens",
                work.block_tokens
            );
        }
        Ok(n)
    }
}

//! In-flight transfer jobs and their completion reports.

use crate::plan::Direction;

/// One completion report: `count` workers finished `job_id`, all successfully or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobReport {
    /// The job.
    pub job_id: u64,
    /// Workers reporting (at least 1).
    pub count: u32,
    /// False when any of those workers failed the job.
    pub success: bool,
}

/// A job whose completion is awaited.
#[derive(Debug, Clone)]
pub(crate) struct Job {
    pub request_id: u64,
    pub kind: Direction,
    /// Reports still expected (starts at `num_workers`).
    pub pending: u32,
    pub failed: bool,
    /// The offload keys the job moves, back to back.
    pub keys: Vec<u8>,
    /// The GPU blocks the job touches: a store reads them, a load writes them.
    pub gpu_blocks: Vec<u32>,
    /// Stores: the host slots the keys go to (completion finds them without a hash lookup).
    pub slots: Vec<u32>,
    /// Loads: tokens `[from, to)` the job fills, to recompute if it fails.
    pub tokens: (u64, u64),
    /// The request gave its GPU blocks back while this job touches them: the job is in the
    /// reuse fence, or was flushed at the request's preemption.
    pub released: bool,
    /// The first chunk the job moves: a failed job makes its request offer chunks again from here.
    pub first_chunk: u64,
}

//! The step plan: the contract between the scheduler, which produces one per engine step, and
//! the workers, which execute it. A plan lists the load and store jobs of the step (direction,
//! request, block ids) and the jobs the workers must finish before the step's copies and forward
//! pass (the flush set). `wire` is its versioned byte format, for workers in other processes
//! (specified in `docs/step-format.md`).

mod wire;

pub use wire::FORMAT_VERSION;

/// Direction of a job: `kvo_job_kind` in C (`kvo_job_info.kind`, `kvo_worker_submit_job`), the
/// job kind of the wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Direction {
    /// Host slots → GPU blocks.
    Load = 0,
    /// GPU blocks → host slots.
    Store = 1,
}

impl Direction {
    /// The direction numbered `v` (`0` load, `1` store), if any.
    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::Load),
            1 => Some(Self::Store),
            _ => None,
        }
    }
}

/// One job of a step. Its block ids are ranges of the step's block arena (see [`Step::src`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobDesc {
    /// Job id, unique for the scheduler's lifetime.
    pub id: u64,
    /// Direction.
    pub kind: Direction,
    /// The request the job belongs to.
    pub request_id: u64,
    /// GPU blocks copied (one per GPU block; a host slot holds `block_size_factor` of them).
    pub num_gpu_blocks: u32,
    /// Logical index, within the request, of the first GPU block copied. For loads,
    /// `block_index % block_size_factor` sub-blocks of the first host slot are skipped (a partial
    /// first chunk); stores always start on a chunk boundary.
    pub block_index: u32,
    src: (u32, u32),
    dst: (u32, u32),
}

/// A step plan. Reused across steps: building into it does not allocate once warm.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    /// GPU blocks per host slot.
    pub block_size_factor: u32,
    jobs: Vec<JobDesc>,
    blocks: Vec<u32>,
    flush: Vec<u64>,
}

impl Step {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn clear(&mut self, block_size_factor: u32) {
        self.block_size_factor = block_size_factor;
        self.jobs.clear();
        self.blocks.clear();
        self.flush.clear();
    }

    /// The jobs: loads first (in creation order), then stores.
    pub fn jobs(&self) -> &[JobDesc] {
        &self.jobs
    }

    /// Source block ids of `job` (host slots for a load, GPU block ids for a store).
    pub fn src(&self, job: &JobDesc) -> &[u32] {
        &self.blocks[job.src.0 as usize..job.src.1 as usize]
    }

    /// Destination block ids of `job` (GPU block ids for a load, host slots for a store).
    pub fn dst(&self, job: &JobDesc) -> &[u32] {
        &self.blocks[job.dst.0 as usize..job.dst.1 as usize]
    }

    /// Jobs the workers must finish before this step's copies and forward pass (preempted
    /// requests' jobs, fenced jobs touching a reallocated GPU block, everything at a reset),
    /// ascending.
    pub fn flush(&self) -> &[u64] {
        &self.flush
    }

    /// Appends a job whose block ids are `src` and `dst`.
    pub(crate) fn push_job(
        &mut self,
        id: u64,
        kind: Direction,
        request_id: u64,
        block_index: u32,
        src: &[u32],
        dst: &[u32],
    ) {
        let num_gpu_blocks = if kind == Direction::Load {
            dst.len()
        } else {
            src.len()
        } as u32;
        let s0 = self.blocks.len() as u32;
        self.blocks.extend_from_slice(src);
        let s1 = self.blocks.len() as u32;
        self.blocks.extend_from_slice(dst);
        let d1 = self.blocks.len() as u32;
        self.jobs.push(JobDesc {
            id,
            kind,
            request_id,
            num_gpu_blocks,
            block_index,
            src: (s0, s1),
            dst: (s1, d1),
        });
    }

    /// Appends a job copied from another plan.
    pub(crate) fn push_from(&mut self, other: &Step, job: &JobDesc) {
        self.push_job(
            job.id,
            job.kind,
            job.request_id,
            job.block_index,
            other.src(job),
            other.dst(job),
        );
    }

    pub(crate) fn set_flush(&mut self, ids: impl IntoIterator<Item = u64>) {
        self.flush.clear();
        self.flush.extend(ids);
        self.flush.sort_unstable();
        self.flush.dedup();
    }
}

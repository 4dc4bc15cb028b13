//! What a copy backend does: execute a job's copy descriptors in its direction's FIFO, and report
//! completions in submission order. Implemented by [`super::host::HostBackend`] (memcpy on worker
//! threads) and [`super::cuda::CudaBackend`] (CUDA driver, streams and events).

use crate::error::Result;
use crate::plan::Direction;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// One copy: `size` bytes from address `src` to address `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CopyDesc {
    /// Source address (device or host).
    pub src: u64,
    /// Destination address (device or host).
    pub dst: u64,
    /// Bytes.
    pub size: u64,
}

/// A finished job.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The job.
    pub job_id: u64,
    /// False when a copy failed; `error` says why.
    pub success: bool,
    /// Bytes the job copies.
    pub bytes: u64,
    /// Time the copies took (device time for CUDA).
    pub seconds: f64,
    /// What went wrong, for a failed job.
    pub error: Option<String>,
}

/// A copy engine. Jobs of one direction run and complete in submission order; the two
/// directions are independent.
pub trait Backend: Send {
    /// Prepares `len` bytes of host memory at `ptr` for fast copies (CUDA: page-locks it with
    /// `cuMemHostRegister`); the host backend does nothing. Called once per host buffer.
    fn register_host(&mut self, ptr: *mut u8, len: usize) -> Result<()>;

    /// Undoes [`Backend::register_host`] before the memory is freed.
    fn unregister_host(&mut self, ptr: *mut u8) -> Result<()>;

    /// Queues a job. `descs` is read during the call only. `compute_stream` is the host's stream
    /// (CUDA `CUstream` as an integer, 0 for none): stores must not start before the work already
    /// queued on it. An error means the job was not queued (and will not complete).
    fn submit(
        &mut self,
        job_id: u64,
        dir: Direction,
        descs: &[CopyDesc],
        compute_stream: u64,
    ) -> Result<()>;

    /// Appends the jobs finished since the last call, in submission order per direction.
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()>;

    /// Blocks until every job of `job_ids` that is still queued has finished, or `timeout`
    /// passes ([`crate::Error::Timeout`]). Ids the backend does not know are ignored.
    fn wait(&mut self, job_ids: &[u64], timeout: Duration) -> Result<()>;

    /// A count of finished jobs that threads can sleep on without holding the backend, if the
    /// backend keeps one (the host backend); without, waiting threads poll.
    fn progress(&self) -> Option<Arc<Progress>> {
        None
    }
}

/// A count of jobs finished, with a condition variable: a thread reads [`Progress::count`],
/// looks for completions, and if it must wait sleeps in [`Progress::wait_past`] until the count
/// moves on (no finish in between is missed).
#[derive(Debug, Default)]
pub struct Progress {
    count: Mutex<u64>,
    cv: Condvar,
}

impl Progress {
    /// Jobs finished so far.
    pub fn count(&self) -> u64 {
        *self.count.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one more finished job and wakes the sleepers.
    pub fn bump(&self) {
        *self.count.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.cv.notify_all();
    }

    /// Sleeps until the count is above `seen` or `timeout` passes.
    pub fn wait_past(&self, seen: u64, timeout: Duration) {
        let guard = self.count.lock().unwrap_or_else(|p| p.into_inner());
        let _ = self.cv.wait_timeout_while(guard, timeout, |c| *c <= seen);
    }
}

//! A worker's counters: per direction, the jobs finished and failed, the bytes and copy time of
//! the jobs that succeeded, and a histogram of their sizes on vLLM's buckets.

use super::backend::Completion;
use crate::plan::Direction;

/// Upper bounds in bytes of the transfer-size buckets (vLLM's `kv_offload_load_size` and
/// `kv_offload_store_size` buckets); one more bucket takes every larger job.
pub const SIZE_BUCKET_BOUNDS: [u64; 10] = [
    1_000_000,
    5_000_000,
    10_000_000,
    20_000_000,
    40_000_000,
    60_000_000,
    80_000_000,
    100_000_000,
    150_000_000,
    200_000_000,
];

/// Buckets of [`DirectionStats::size_buckets`]: one per bound, and one above the last.
pub const SIZE_BUCKETS: usize = SIZE_BUCKET_BOUNDS.len() + 1;

/// The counters of one direction (loads: host tier → KV tensors; stores: the other way).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DirectionStats {
    /// Jobs finished and handed out by `poll` (or finished synchronously), failed ones included.
    pub jobs: u64,
    /// Of those, the jobs that failed.
    pub failed_jobs: u64,
    /// Bytes copied by the jobs that succeeded.
    pub bytes: u64,
    /// Copy time of the jobs that succeeded, in seconds (device time for CUDA).
    pub seconds: f64,
    /// Jobs that succeeded, per size bucket, not cumulative: bucket `i` counts sizes in
    /// `(SIZE_BUCKET_BOUNDS[i - 1], SIZE_BUCKET_BOUNDS[i]]`, the last one sizes above the last
    /// bound.
    pub size_buckets: [u64; SIZE_BUCKETS],
}

impl DirectionStats {
    /// Counts one finished job.
    pub fn record(&mut self, c: &Completion) {
        self.jobs += 1;
        if !c.success {
            self.failed_jobs += 1;
            return;
        }
        self.bytes += c.bytes;
        self.seconds += c.seconds;
        self.size_buckets[size_bucket(c.bytes)] += 1;
    }
}

/// The bucket of a transfer of `bytes`: the first whose bound is at least `bytes`.
pub fn size_bucket(bytes: u64) -> usize {
    SIZE_BUCKET_BOUNDS.partition_point(|&bound| bound < bytes)
}

/// A worker's counters and gauges. `swap_blocks` copies count in the direction of their
/// destination (a device tensor: load; a host tensor: store).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WorkerStats {
    /// Jobs copying host tier → KV tensors.
    pub load: DirectionStats,
    /// Jobs copying KV tensors → host tier.
    pub store: DirectionStats,
    /// Jobs submitted and not yet handed out by `poll` (copying, or finished and waiting).
    pub jobs_in_flight: u64,
}

impl WorkerStats {
    /// The counters of direction `dir`.
    pub fn direction(&mut self, dir: Direction) -> &mut DirectionStats {
        match dir {
            Direction::Load => &mut self.load,
            Direction::Store => &mut self.store,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(bytes: u64, success: bool) -> Completion {
        Completion {
            job_id: 1,
            success,
            bytes,
            seconds: 0.5,
            error: None,
        }
    }

    #[test]
    fn buckets_are_upper_bounds_inclusive() {
        assert_eq!(size_bucket(0), 0);
        assert_eq!(size_bucket(1_000_000), 0);
        assert_eq!(size_bucket(1_000_001), 1);
        assert_eq!(size_bucket(200_000_000), SIZE_BUCKETS - 2);
        assert_eq!(size_bucket(200_000_001), SIZE_BUCKETS - 1);
        assert_eq!(size_bucket(u64::MAX), SIZE_BUCKETS - 1);
    }

    #[test]
    fn failed_jobs_count_but_copy_nothing() {
        let mut s = DirectionStats::default();
        s.record(&done(4096, true));
        s.record(&done(7_000_000, true));
        s.record(&done(4096, false));
        assert_eq!((s.jobs, s.failed_jobs, s.bytes), (3, 1, 4096 + 7_000_000));
        assert_eq!(s.seconds, 1.0);
        assert_eq!(s.size_buckets[0], 1);
        assert_eq!(s.size_buckets[2], 1);
        assert_eq!(s.size_buckets.iter().sum::<u64>(), 2);
    }
}

//! `kvo_step_*`: a step plan (the jobs of one step and the flush set) and its binary encoding.

use super::{
    Failure, free_handle, give, guard, handle, kvo_status, lock, non_null, slice, slice_mut, write,
};
use crate::plan::{JobDesc, Step};
use std::sync::{Mutex, MutexGuard};

/// Version of the encoding written by `kvo_step_encode`; `kvo_step_decode` rejects others.
pub const KVO_STEP_FORMAT_VERSION: u16 = 1;
const _: () = assert!(KVO_STEP_FORMAT_VERSION == crate::plan::FORMAT_VERSION);

/// The step plan's [`crate::plan::Direction`], named for C (cbindgen renames it).
pub use crate::plan::Direction as kvo_job_kind;

/// A step plan: filled by `kvo_scheduler_build_step` or `kvo_step_decode`. Opaque.
pub struct kvo_step {
    inner: Mutex<StepState>,
}

#[derive(Default)]
struct StepState {
    step: Step,
    encoded: Vec<u8>,
}

impl kvo_step {
    pub(crate) fn with_step<T>(&self, f: impl FnOnce(&mut Step) -> T) -> Result<T, Failure> {
        Ok(f(&mut self.get()?.step))
    }

    fn get(&self) -> Result<MutexGuard<'_, StepState>, Failure> {
        lock(&self.inner, "step")
    }
}

/// Summary of a step plan.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvo_step_info {
    /// Jobs in the plan (loads first, then stores).
    pub num_jobs: usize,
    /// Job ids to wait for before the forward pass.
    pub num_flush: usize,
    /// GPU blocks per host slot.
    pub block_size_factor: u32,
    /// Zero.
    pub reserved: u32,
}

/// One job of a step plan.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvo_job_info {
    /// Job id (unique for the scheduler's lifetime).
    pub id: u64,
    /// The request the job belongs to.
    pub request_id: u64,
    /// A `kvo_job_kind` value.
    pub kind: u32,
    /// GPU blocks the job copies (`block_size_factor` of them fill one host slot).
    pub group_size: u32,
    /// Logical index within the request of the first GPU block copied; for loads
    /// `block_index % block_size_factor` leading GPU blocks of the first host slot are skipped.
    pub block_index: u32,
    /// Zero.
    pub reserved: u32,
    /// Source block ids (host slots for a load, GPU blocks for a store).
    pub n_src: usize,
    /// Destination block ids (GPU blocks for a load, host slots for a store).
    pub n_dst: usize,
}

const STEP: &str = "step";

fn job_info(s: &Step, j: &JobDesc) -> kvo_job_info {
    kvo_job_info {
        id: j.id,
        request_id: j.request_id,
        kind: j.kind as u32,
        group_size: j.num_gpu_blocks,
        block_index: j.block_index,
        reserved: 0,
        n_src: s.src(j).len(),
        n_dst: s.dst(j).len(),
    }
}

/// Creates an empty step plan; writes it to `*out` on success. Free it with `kvo_step_free`.
///
/// Returns `KVO_STATUS_OK` or `KVO_STATUS_NULL_ARGUMENT`.
///
/// # Safety
/// `out` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_step_new(out: *mut *mut kvo_step) -> kvo_status {
    guard(|| {
        non_null(out, "out")?;
        // SAFETY: `out`, checked non-NULL above, is writable (the contract).
        unsafe {
            give(
                out,
                kvo_step {
                    inner: Mutex::new(StepState::default()),
                },
            )
        };
        Ok(())
    })
}

/// Frees a step plan. NULL is ignored. Must not race with other calls on the same handle.
///
/// # Safety
/// `step` is NULL or a handle from `kvo_step_new` not freed yet.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvo_step_free(step: *mut kvo_step) {
    // SAFETY: forwarded from the caller.
    unsafe { free_handle(step) }
}

/// Writes the plan's summary to `*out`.
///
/// Returns `KVO_STATUS_OK` or `KVO_STATUS_NULL_ARGUMENT`.
///
/// # Safety
/// `step` is NULL or live; `out` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_step_get_info(
    step: *const kvo_step,
    out: *mut kvo_step_info,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(step, STEP) }?;
        non_null(out, "out")?;
        let info = h.with_step(|s| kvo_step_info {
            num_jobs: s.jobs().len(),
            num_flush: s.flush().len(),
            block_size_factor: s.block_size_factor,
            reserved: 0,
        })?;
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out, info) };
        Ok(())
    })
}

/// Writes job `index` (0-based, below `num_jobs`) to `*out`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` if `index`
/// is out of range.
///
/// # Safety
/// `step` is NULL or live; `out` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_step_get_job(
    step: *const kvo_step,
    index: usize,
    out: *mut kvo_job_info,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(step, STEP) }?;
        non_null(out, "out")?;
        let info = h.with_step(|s| {
            let j = s.jobs().get(index).ok_or_else(|| {
                Failure::invalid(format!(
                    "index: {index}, the step has {} jobs",
                    s.jobs().len()
                ))
            })?;
            Ok::<_, Failure>(job_info(s, j))
        })??;
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out, info) };
        Ok(())
    })
}

/// Copies job `index`'s source and destination block ids to `out_src` (`src_cap` entries) and
/// `out_dst` (`dst_cap` entries); `kvo_step_get_job` gives the counts.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` if `index`
/// is out of range; `KVO_STATUS_BUFFER_TOO_SMALL` if a capacity is below the job's count.
///
/// # Safety
/// `step` is NULL or live; `out_src` / `out_dst` NULL or `src_cap` / `dst_cap` writable entries.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_step_get_job_blocks(
    step: *const kvo_step,
    index: usize,
    out_src: *mut u32,
    src_cap: usize,
    out_dst: *mut u32,
    dst_cap: usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(step, STEP) }?;
        h.with_step(|s| {
            let j = s.jobs().get(index).ok_or_else(|| {
                Failure::invalid(format!(
                    "index: {index}, the step has {} jobs",
                    s.jobs().len()
                ))
            })?;
            let (src, dst) = (s.src(j), s.dst(j));
            for (name, cap, need) in [
                ("src_cap", src_cap, src.len()),
                ("dst_cap", dst_cap, dst.len()),
            ] {
                if cap < need {
                    return Err(Failure::new(
                        kvo_status::BufferTooSmall,
                        format!("{name}: {cap}, {need} needed"),
                    ));
                }
            }
            // SAFETY: forwarded from the caller.
            let out_s = unsafe { slice_mut(out_src, src.len(), "out_src") }?;
            // SAFETY: forwarded from the caller.
            let out_d = unsafe { slice_mut(out_dst, dst.len(), "out_dst") }?;
            out_s.copy_from_slice(src);
            out_d.copy_from_slice(dst);
            Ok(())
        })?
    })
}

/// Copies every job of the plan at once: `kvo_job_info` of job `i` to `out_jobs[i]`, and the
/// block ids of all jobs, back to back in job order (each job's `n_src` source ids, then its
/// `n_dst` destination ids), to `out_blocks`. Writes the numbers of jobs and of block ids to
/// `*out_n_jobs` and `*out_n_blocks`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_BUFFER_TOO_SMALL` if
/// `jobs_cap` or `blocks_cap` is too small (both needed numbers are written to `*out_n_jobs` /
/// `*out_n_blocks`, nothing else; pass 0 and 0 to ask).
///
/// # Safety
/// `step` is NULL or live; `out_jobs` NULL or `jobs_cap` writable entries; `out_blocks` NULL or
/// `blocks_cap` writable entries; `out_n_jobs`, `out_n_blocks` NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_step_get_jobs(
    step: *const kvo_step,
    out_jobs: *mut kvo_job_info,
    jobs_cap: usize,
    out_blocks: *mut u32,
    blocks_cap: usize,
    out_n_jobs: *mut usize,
    out_n_blocks: *mut usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(step, STEP) }?;
        non_null(out_n_jobs, "out_n_jobs")?;
        non_null(out_n_blocks, "out_n_blocks")?;
        h.with_step(|s| {
            let jobs = s.jobs();
            let n_blocks: usize = jobs.iter().map(|j| s.src(j).len() + s.dst(j).len()).sum();
            if jobs_cap < jobs.len() || blocks_cap < n_blocks {
                // SAFETY: the out-pointers, checked non-NULL above, are writable (the contract).
                unsafe {
                    write(out_n_jobs, jobs.len());
                    write(out_n_blocks, n_blocks);
                }
                let (name, cap, need) = if jobs_cap < jobs.len() {
                    ("jobs_cap", jobs_cap, jobs.len())
                } else {
                    ("blocks_cap", blocks_cap, n_blocks)
                };
                return Err(Failure::new(
                    kvo_status::BufferTooSmall,
                    format!("{name}: {cap}, {need} needed"),
                ));
            }
            // SAFETY: forwarded from the caller.
            let out_j = unsafe { slice_mut(out_jobs, jobs.len(), "out_jobs") }?;
            // SAFETY: forwarded from the caller.
            let out_b = unsafe { slice_mut(out_blocks, n_blocks, "out_blocks") }?;
            let mut at = 0;
            for (slot, j) in out_j.iter_mut().zip(jobs) {
                *slot = job_info(s, j);
                for ids in [s.src(j), s.dst(j)] {
                    out_b[at..at + ids.len()].copy_from_slice(ids);
                    at += ids.len();
                }
            }
            // SAFETY: as above.
            unsafe {
                write(out_n_jobs, jobs.len());
                write(out_n_blocks, n_blocks);
            }
            Ok(())
        })?
    })
}

/// Copies the flush set (job ids to wait for before the forward pass, ascending) to `out_ids`
/// and its size to `*out_n`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_BUFFER_TOO_SMALL` if `cap` is
/// too small (the size is written to `*out_n`).
///
/// # Safety
/// `step` is NULL or live; `out_ids` NULL or `cap` writable entries; `out_n` NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_step_get_flush(
    step: *const kvo_step,
    out_ids: *mut u64,
    cap: usize,
    out_n: *mut usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(step, STEP) }?;
        non_null(out_n, "out_n")?;
        h.with_step(|s| {
            let ids = s.flush();
            if cap < ids.len() {
                // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
                unsafe { write(out_n, ids.len()) };
                return Err(Failure::new(
                    kvo_status::BufferTooSmall,
                    format!("cap: {cap}, {} needed", ids.len()),
                ));
            }
            // SAFETY: forwarded from the caller.
            unsafe { slice_mut(out_ids, ids.len(), "out_ids") }?.copy_from_slice(ids);
            // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
            unsafe { write(out_n, ids.len()) };
            Ok(())
        })?
    })
}

/// Encodes the plan for another process (versioned, checksummed) into `buf` and writes its
/// length to `*out_len`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_BUFFER_TOO_SMALL` if `cap`
/// is too small (the needed length is written to `*out_len`; pass `cap` 0 to ask).
///
/// # Safety
/// `step` is NULL or live; `buf` NULL or `cap` writable bytes; `out_len` NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_step_encode(
    step: *const kvo_step,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(step, STEP) }?;
        non_null(out_len, "out_len")?;
        let mut st = h.get()?;
        let StepState { step, encoded } = &mut *st;
        step.encode(encoded);
        if cap < encoded.len() {
            // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
            unsafe { write(out_len, encoded.len()) };
            return Err(Failure::new(
                kvo_status::BufferTooSmall,
                format!("cap: {cap}, {} needed", encoded.len()),
            ));
        }
        // SAFETY: forwarded from the caller.
        unsafe { slice_mut(buf, encoded.len(), "buf") }?.copy_from_slice(encoded);
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_len, encoded.len()) };
        Ok(())
    })
}

/// Replaces the plan with one decoded from `len` bytes made by `kvo_step_encode`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_CORRUPT_DATA` for truncated
/// or corrupt bytes or another format version (the plan is then unchanged).
///
/// # Safety
/// `step` is NULL or live; `bytes` NULL or `len` readable bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_step_decode(
    step: *mut kvo_step,
    bytes: *const u8,
    len: usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(step, STEP) }?;
        // SAFETY: forwarded from the caller.
        let bytes = unsafe { slice(bytes, len, "bytes") }?;
        Ok(h.with_step(|s| s.decode(bytes))??)
    })
}

//! `kvo_worker_*`: block copies ([`crate::transfer::Worker`]) behind a C handle.

use super::{
    Failure, copy_c_string, free_handle, give, guard, handle, kvo_status, kvo_step, lock, non_null,
    read_config, slice, slice_mut, write,
};
use crate::plan::Direction;
use crate::transfer::{BackendKind, Completion, JobBlocks, KvTensor, Worker, WorkerConfig};
use std::collections::VecDeque;
use std::ffi::{c_char, c_void};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Copy engines (`kvo_worker_config.backend`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvo_backend {
    /// memcpy on host threads; every tensor in host memory.
    Host = 0,
    /// The CUDA driver (loaded at run time).
    Cuda = 1,
}

/// Configuration of a worker. Fill it with `kvo_worker_config_default`, then change fields.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvo_worker_config {
    /// `sizeof(kvo_worker_config)`, set by `kvo_worker_config_default`.
    pub struct_size: usize,
    /// GPU blocks per host slot, as the scheduler's (default 1).
    pub block_size_factor: u32,
    /// Host slots, as the scheduler's (default 0: must be set).
    pub num_host_slots: u32,
    /// Threads the host backend may use for one large job (default 4).
    pub threads: u32,
    /// A `kvo_backend` value (default `KVO_BACKEND_HOST`).
    pub backend: u32,
    /// CUDA device ordinal (default 0).
    pub device: i32,
    /// Zero.
    pub reserved: u32,
}

/// One registered KV tensor: `num_blocks` pages of `page_size` bytes, `block_stride` bytes apart
/// from `base` (device or host address). The memory must stay valid until `kvo_worker_free`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvo_kv_tensor {
    /// Address of block 0 (a multiple of 8).
    pub base: u64,
    /// Bytes between blocks (a multiple of 8, >= `page_size`).
    pub block_stride: u64,
    /// Bytes copied per block.
    pub page_size: u64,
    /// Blocks.
    pub num_blocks: u32,
    /// Non-zero for device memory.
    pub on_device: u32,
}

/// Caller memory for one tensor's host tier: at least `num_host_slots * page_size *
/// block_size_factor` bytes, valid until `kvo_worker_free`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvo_host_buffer {
    /// Start.
    pub ptr: *mut c_void,
    /// Bytes.
    pub len: usize,
}

/// A finished job (see `kvo_worker_poll`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvo_completion {
    /// The job.
    pub job_id: u64,
    /// Bytes the job copies (0 if it failed before copying).
    pub bytes: u64,
    /// Seconds the copies took.
    pub seconds: f64,
    /// 1 on success; 0 if it failed (`kvo_worker_job_error` says why).
    pub success: u32,
    /// Zero.
    pub reserved: u32,
}

/// Block copies between registered KV tensors and the host tier. Opaque.
pub struct kvo_worker {
    inner: Mutex<WorkerState>,
}

struct WorkerState {
    worker: Worker,
    /// Messages of the last failed jobs handed out.
    errors: VecDeque<(u64, String)>,
    scratch: Vec<Completion>,
}

const KEPT_ERRORS: usize = 1024;

impl kvo_worker {
    fn get(&self) -> Result<MutexGuard<'_, WorkerState>, Failure> {
        lock(&self.inner, "worker")
    }
}

/// # Safety
/// `w` is NULL or a live handle.
unsafe fn worker<'a>(w: *const kvo_worker) -> Result<&'a kvo_worker, Failure> {
    // SAFETY: forwarded from the caller.
    unsafe { handle(w, "worker") }
}

/// 1 when a CUDA driver and device are usable, else 0. Never fails, never aborts.
#[unsafe(no_mangle)]
pub extern "C" fn kvo_cuda_available() -> i32 {
    std::panic::catch_unwind(crate::transfer::cuda::cuda_available).unwrap_or(false) as i32
}

/// Fills `out` with the defaults and `struct_size = sizeof(kvo_worker_config)`.
///
/// Returns `KVO_STATUS_OK` or `KVO_STATUS_NULL_ARGUMENT`.
///
/// # Safety
/// `out` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_worker_config_default(out: *mut kvo_worker_config) -> kvo_status {
    guard(|| {
        non_null(out, "out")?;
        let d = WorkerConfig::default();
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe {
            write(
                out,
                kvo_worker_config {
                    struct_size: size_of::<kvo_worker_config>(),
                    block_size_factor: d.block_size_factor,
                    num_host_slots: d.num_host_slots,
                    threads: d.threads as u32,
                    backend: kvo_backend::Host as u32,
                    device: 0,
                    reserved: 0,
                },
            )
        };
        Ok(())
    })
}

/// Creates a worker over `n_tensors` KV tensors. `host_buffers` is NULL (the worker allocates
/// page-aligned host tier buffers, page-locked with CUDA) or `n_tensors` caller buffers.
/// On success writes the handle to `*out`, freed with `kvo_worker_free`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` for a bad
/// config (struct_size, zero factor or slots, unknown backend), an empty, overlapping, misaligned
/// or zero-sized registration, device tensors with the host backend, or a host buffer too small;
/// `KVO_STATUS_CUDA_UNAVAILABLE` / `KVO_STATUS_CUDA_ERROR` for the CUDA backend without a
/// usable driver or device; `KVO_STATUS_OUT_OF_MEMORY` if the host tier cannot be allocated;
/// `KVO_STATUS_IO_ERROR` if page-locking or threads cannot be had.
///
/// # Safety
/// `cfg` NULL or `cfg->struct_size` readable bytes; `tensors` NULL or `n_tensors` entries;
/// `host_buffers` NULL or `n_tensors` entries; `out` NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_worker_new(
    cfg: *const kvo_worker_config,
    tensors: *const kvo_kv_tensor,
    n_tensors: usize,
    host_buffers: *const kvo_host_buffer,
    out: *mut *mut kvo_worker,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let c = unsafe { read_config(cfg, "cfg") }?;
        non_null(out, "out")?;
        // SAFETY: forwarded from the caller.
        let ts = unsafe { slice(tensors, n_tensors, "tensors") }?;
        let backend = match c.backend {
            0 => BackendKind::Host,
            1 => BackendKind::Cuda(c.device),
            b => {
                return Err(Failure::invalid(format!(
                    "cfg->backend: {b} is not a kvo_backend"
                )));
            }
        };
        let config = WorkerConfig {
            block_size_factor: c.block_size_factor,
            num_host_slots: c.num_host_slots,
            threads: c.threads.max(1) as usize,
            backend,
        };
        let kv: Vec<KvTensor> = ts
            .iter()
            .map(|t| KvTensor {
                base: t.base,
                num_blocks: t.num_blocks,
                block_stride: t.block_stride,
                page_size: t.page_size,
                on_device: t.on_device != 0,
            })
            .collect();
        let mem: Option<Vec<(*mut u8, usize)>> = if host_buffers.is_null() {
            None
        } else {
            // SAFETY: forwarded from the caller.
            let hb = unsafe { slice(host_buffers, n_tensors, "host_buffers") }?;
            Some(hb.iter().map(|h| (h.ptr as *mut u8, h.len)).collect())
        };
        let w = Worker::new(config, &kv, mem.as_deref())?;
        let state = WorkerState {
            worker: w,
            errors: VecDeque::new(),
            scratch: Vec::new(),
        };
        // SAFETY: `out`, checked non-NULL above, is writable (the contract).
        unsafe {
            give(
                out,
                kvo_worker {
                    inner: Mutex::new(state),
                },
            )
        };
        Ok(())
    })
}

/// Waits for the jobs in flight to finish, releases the host tier and frees the
/// worker. NULL is ignored. Must not race with other calls on the same handle.
///
/// # Safety
/// `w` is NULL or a handle from `kvo_worker_new` not freed yet.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvo_worker_free(w: *mut kvo_worker) {
    // SAFETY: forwarded from the caller.
    unsafe { free_handle(w) }
}

/// Submits one job: `kind` a `kvo_job_kind`; `src`/`dst` block ids as in a step plan (load:
/// host slots → KV blocks; store: KV blocks → host slots); `block_index` as in `kvo_job_info`;
/// `compute_stream` a CUDA stream handle (0: none) that stores wait for. A job whose block ids do
/// not fit the registration, or that the driver rejects, completes as failed at the next poll.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` for an
/// unknown kind; `KVO_STATUS_INVALID_STATE` if `job_id` is in use (submitted and not yet handed
/// out by `kvo_worker_poll`) or after shutdown.
///
/// # Safety
/// `w` NULL or live; `src`/`dst` NULL or `n_src`/`n_dst` readable entries.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)] // one job's fields, flat for C
pub unsafe extern "C" fn kvo_worker_submit_job(
    w: *mut kvo_worker,
    job_id: u64,
    kind: u32,
    src: *const u32,
    n_src: usize,
    dst: *const u32,
    n_dst: usize,
    block_index: u32,
    compute_stream: u64,
) -> kvo_status {
    guard(|| {
        let kind = Direction::from_u32(kind)
            .ok_or_else(|| Failure::invalid(format!("kind: {kind} is not a kvo_job_kind")))?;
        // SAFETY: forwarded from the caller.
        let src = unsafe { slice(src, n_src, "src") }?;
        // SAFETY: forwarded from the caller.
        let dst = unsafe { slice(dst, n_dst, "dst") }?;
        // SAFETY: forwarded from the caller.
        let mut st = unsafe { worker(w) }?.get()?;
        st.worker.submit(
            job_id,
            &JobBlocks {
                kind,
                src,
                dst,
                block_index,
            },
            compute_stream,
        )?;
        Ok(())
    })
}

/// Executes a step plan (from `kvo_scheduler_build_step` or `kvo_step_decode`): first blocks
/// until the plan's flush set has finished (jobs of earlier steps that must not overlap this
/// step's copies or forward pass; ids already finished and handed out are skipped), then submits
/// every job, loads first. `compute_stream` as for `kvo_worker_submit_job`. When it returns, the
/// forward pass may run.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` if the plan's
/// block_size_factor differs from the worker's; `KVO_STATUS_INVALID_STATE` if a job id is in use
/// or repeated in the plan, or after shutdown (then nothing is submitted); `KVO_STATUS_CUDA_ERROR`
/// if the driver fails while waiting.
///
/// # Safety
/// `w`, `step` NULL or live.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_worker_submit_step(
    w: *mut kvo_worker,
    step: *const kvo_step,
    compute_stream: u64,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let step = unsafe { handle(step, "step") }?;
        // SAFETY: forwarded from the caller.
        let mut st = unsafe { worker(w) }?.get()?;
        step.with_step(|s| st.worker.submit_step(s, compute_stream))??;
        Ok(())
    })
}

/// Writes up to `cap` finished jobs to `out` and their number to `*out_n`; the rest stay for the
/// next call (their ids stay in use until handed out). Order: per direction in submission order,
/// except that a job refused at submission (block ids outside the registration, a driver error)
/// comes at the next poll, ahead of jobs still copying. Report them to the scheduler with
/// `kvo_scheduler_complete_jobs`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_CUDA_ERROR` if the driver
/// fails while querying.
///
/// # Safety
/// `w` NULL or live; `out` NULL or `cap` writable entries; `out_n` NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_worker_poll(
    w: *mut kvo_worker,
    out: *mut kvo_completion,
    cap: usize,
    out_n: *mut usize,
) -> kvo_status {
    guard(|| {
        non_null(out_n, "out_n")?;
        // SAFETY: forwarded from the caller.
        let mut guard = unsafe { worker(w) }?.get()?;
        let st = &mut *guard;
        // SAFETY: forwarded from the caller.
        let out = unsafe { slice_mut(out, cap, "out") }?;
        st.scratch.clear();
        st.worker.poll(&mut st.scratch, cap)?;
        let n = st.scratch.len();
        for (slot, c) in out.iter_mut().zip(st.scratch.drain(..)) {
            *slot = kvo_completion {
                job_id: c.job_id,
                bytes: c.bytes,
                seconds: c.seconds,
                success: c.success as u32,
                reserved: 0,
            };
            if let Some(e) = c.error {
                if st.errors.len() == KEPT_ERRORS {
                    st.errors.pop_front();
                }
                st.errors.push_back((c.job_id, e));
            }
        }
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_n, n) };
        Ok(())
    })
}

/// Copies the message of a failed job handed out by `kvo_worker_poll` (the last 1024 are kept)
/// into `buf` (NUL-terminated, truncated) and writes its full length to `*out_len`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_NOT_FOUND` if no message is
/// kept for `job_id`.
///
/// # Safety
/// `w` NULL or live; `buf` NULL or `len` writable bytes; `out_len` NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_worker_job_error(
    w: *const kvo_worker,
    job_id: u64,
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
) -> kvo_status {
    guard(|| {
        non_null(out_len, "out_len")?;
        // SAFETY: forwarded from the caller.
        let st = unsafe { worker(w) }?.get()?;
        let msg = st
            .errors
            .iter()
            .rev()
            .find(|(id, _)| *id == job_id)
            .map(|(_, m)| m)
            .ok_or_else(|| {
                Failure::new(
                    kvo_status::NotFound,
                    format!("job_id: no error kept for job {job_id}"),
                )
            })?;
        // SAFETY: forwarded from the caller.
        let out = unsafe { slice_mut(buf as *mut u8, len, "buf") }?;
        copy_c_string(msg, out);
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_len, msg.len()) };
        Ok(())
    })
}

/// Blocks until every listed job has finished, or `timeout_ms` passes. Completions remain to be
/// polled. (`kvo_worker_submit_step` already waits for a plan's flush set.)
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_NOT_FOUND` for an id never
/// submitted or already handed out by `kvo_worker_poll`; `KVO_STATUS_TIMEOUT`;
/// `KVO_STATUS_CUDA_ERROR`.
///
/// # Safety
/// `w` NULL or live; `job_ids` NULL or `n` readable entries.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_worker_wait(
    w: *mut kvo_worker,
    job_ids: *const u64,
    n: usize,
    timeout_ms: u64,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let ids = unsafe { slice(job_ids, n, "job_ids") }?;
        // SAFETY: forwarded from the caller.
        let mut st = unsafe { worker(w) }?.get()?;
        st.worker.wait(ids, Duration::from_millis(timeout_ms))?;
        Ok(())
    })
}

/// Copies block `src_blocks[i]` of tensor `src_tensor` to block `dst_blocks[i]` of tensor
/// `dst_tensor` (indices into the registration; equal page sizes). With `as_job` non-zero the copy
/// is queued as job `job_id` and reported by `kvo_worker_poll`; otherwise it runs now.
///
/// The copies have no order among themselves, so within one tensor a block may not be both a
/// source and a destination.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` for tensor
/// indices, block ids or page sizes that do not fit, or a block both read and written;
/// `KVO_STATUS_INVALID_STATE` for a job id in use or after shutdown; `KVO_STATUS_CUDA_ERROR` when
/// the driver rejects or fails the copy.
///
/// # Safety
/// `w` NULL or live; `src_blocks`, `dst_blocks` NULL or `n` readable entries.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)] // a swap's fields, flat for C
pub unsafe extern "C" fn kvo_worker_swap_blocks(
    w: *mut kvo_worker,
    src_tensor: u32,
    dst_tensor: u32,
    src_blocks: *const u32,
    dst_blocks: *const u32,
    n: usize,
    as_job: u32,
    job_id: u64,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let s = unsafe { slice(src_blocks, n, "src_blocks") }?;
        // SAFETY: forwarded from the caller.
        let d = unsafe { slice(dst_blocks, n, "dst_blocks") }?;
        // SAFETY: forwarded from the caller.
        let mut st = unsafe { worker(w) }?.get()?;
        let id = (as_job != 0).then_some(job_id);
        st.worker
            .swap_blocks(src_tensor as usize, dst_tensor as usize, s, d, id)?;
        Ok(())
    })
}

/// Writes the address and length of tensor `tensor`'s host tier buffer (owned by the worker
/// unless the caller provided it; valid until `kvo_worker_free`).
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` for an
/// index out of range.
///
/// # Safety
/// `w` NULL or live; outputs NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_worker_get_host_buffer(
    w: *const kvo_worker,
    tensor: u32,
    out_ptr: *mut *mut c_void,
    out_len: *mut usize,
) -> kvo_status {
    guard(|| {
        non_null(out_ptr, "out_ptr")?;
        non_null(out_len, "out_len")?;
        // SAFETY: forwarded from the caller.
        let st = unsafe { worker(w) }?.get()?;
        let (p, len) = st.worker.host_buffer(tensor as usize)?;
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_ptr, p as *mut c_void) };
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_len, len) };
        Ok(())
    })
}

/// Finishes every job in flight, then refuses new submissions (`KVO_STATUS_INVALID_STATE`).
/// Completions stay pollable.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_CUDA_ERROR`.
///
/// # Safety
/// `w` NULL or live.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_worker_shutdown(w: *mut kvo_worker) -> kvo_status {
    // SAFETY: forwarded from the caller.
    guard(|| Ok(unsafe { worker(w) }?.get()?.worker.shutdown()?))
}

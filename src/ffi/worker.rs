//! `kvo_worker_*`: block copies ([`crate::transfer::Worker`]) behind a C handle.

use super::metrics::{kvo_label, naming, write_text};
use super::{
    Failure, copy_c_string, free_handle, give, guard, handle, kvo_status, kvo_step, lock, non_null,
    read_config, slice, slice_mut, write, write_sized,
};
use crate::plan::Direction;
use crate::transfer::{
    BackendKind, Completion, DirectionStats, JobBlocks, KvTensor, Worker, WorkerConfig,
};
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

/// Buckets of `kvo_transfer_stats.size_buckets`.
pub const KVO_SIZE_BUCKETS: usize = 11;
const _: () = assert!(KVO_SIZE_BUCKETS == crate::transfer::SIZE_BUCKETS);

/// A worker's counters for one direction (see `kvo_worker_stats`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvo_transfer_stats {
    /// Jobs finished and handed out by `kvo_worker_poll` (or finished synchronously), failed
    /// ones included.
    pub jobs: u64,
    /// Of those, the jobs that failed.
    pub failed_jobs: u64,
    /// Bytes copied by the jobs that succeeded.
    pub bytes: u64,
    /// Copy time of the jobs that succeeded, in seconds (device time for CUDA).
    pub seconds: f64,
    /// Jobs that succeeded per size, not cumulative: bucket `i` counts jobs of at most 1e6,
    /// 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6 bytes (and above the bucket
    /// before); the last bucket counts larger jobs. vLLM's buckets.
    pub size_buckets: [u64; KVO_SIZE_BUCKETS],
}

impl From<DirectionStats> for kvo_transfer_stats {
    fn from(d: DirectionStats) -> Self {
        Self {
            jobs: d.jobs,
            failed_jobs: d.failed_jobs,
            bytes: d.bytes,
            seconds: d.seconds,
            size_buckets: d.size_buckets,
        }
    }
}

/// Counters and gauges of a worker. Set `struct_size` before `kvo_worker_get_stats`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvo_worker_stats {
    /// `sizeof(kvo_worker_stats)` as the caller knows it; only that many bytes are written.
    pub struct_size: usize,
    /// Loads: host tier → KV tensors (and `kvo_worker_swap_blocks` into device tensors).
    pub load: kvo_transfer_stats,
    /// Stores: KV tensors → host tier (and `kvo_worker_swap_blocks` into host tensors).
    pub store: kvo_transfer_stats,
    /// Jobs submitted and not yet handed out by `kvo_worker_poll`.
    pub jobs_in_flight: u64,
}

/// Block copies between registered KV tensors and the host tier. Opaque.
pub struct kvo_worker {
    /// Shared by every call: waits do not hold a lock other calls need.
    worker: Worker,
    polled: Mutex<Polled>,
}

/// What the latest `kvo_worker_poll` handed out.
struct Polled {
    /// Messages of the failed jobs handed out by the latest poll that handed out any job.
    errors: Vec<(u64, String)>,
    scratch: Vec<Completion>,
}

impl kvo_worker {
    fn polled(&self) -> Result<MutexGuard<'_, Polled>, Failure> {
        lock(&self.polled, "worker")
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
/// usable driver or device; `KVO_STATUS_OUT_OF_MEMORY` if the host tier cannot be allocated or is
/// larger than the machine's memory (checked before any memory is touched); `KVO_STATUS_IO_ERROR`
/// if threads cannot be had. On failure everything allocated or page-locked is released.
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
        let c = unsafe { read_config(cfg, "cfg", &[], || unreachable!("no older size")) }?;
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
        let worker = Worker::new(config, &kv, mem.as_deref())?;
        // SAFETY: `out`, checked non-NULL above, is writable (the contract).
        unsafe {
            give(
                out,
                kvo_worker {
                    worker,
                    polled: Mutex::new(Polled {
                        errors: Vec::new(),
                        scratch: Vec::new(),
                    }),
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
        unsafe { worker(w) }?.worker.submit(
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

/// Executes a step plan (from `kvo_scheduler_build_step` or `kvo_step_decode`); call it before
/// the step's forward pass. It submits the stores deferred from the previous plan (whose forward
/// pass has been issued by now), blocks until the plan's flush set has finished (jobs of earlier
/// steps that must not overlap this step's copies or forward pass; ids already finished and
/// handed out are skipped), submits the plan's loads, and defers the plan's stores: they read the
/// KV that this step's forward pass writes, so they are submitted by the next
/// `kvo_worker_submit_step`, by `kvo_worker_submit_stores`, or by a `kvo_worker_wait` naming one
/// of them (vLLM 0.24 likewise submits step N's stores at step N + 1). `compute_stream` (CUDA) is
/// the stream the forward pass runs on: deferred stores start after the work queued on it when
/// they are submitted. When it returns, the forward pass may run. The plan's job ids are in use
/// from the start of the call; other calls on the worker proceed while it waits.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` if the plan's
/// block_size_factor differs from the worker's; `KVO_STATUS_INVALID_STATE` if a job id is in use
/// or repeated in the plan, or when the worker is shut down before or during the wait (then
/// nothing is submitted); `KVO_STATUS_CUDA_ERROR` if the driver fails while waiting.
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
        let w = unsafe { worker(w) }?;
        step.with_step(|s| w.worker.submit_step(s, compute_stream))??;
        Ok(())
    })
}

/// Submits the stores deferred from the last plan (see `kvo_worker_submit_step`) now. Call it once
/// the last plan's forward pass has been issued when no further plan follows soon (the last step,
/// an idle engine); with CUDA the stores start after the work then queued on that plan's
/// compute stream.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_STATE` after shutdown
/// (then nothing is submitted).
///
/// # Safety
/// `w` NULL or live.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_worker_submit_stores(w: *mut kvo_worker) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let w = unsafe { worker(w) }?;
        w.worker.submit_stores()?;
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
        let w = unsafe { worker(w) }?;
        // SAFETY: forwarded from the caller.
        let out = unsafe { slice_mut(out, cap, "out") }?;
        let mut guard = w.polled()?;
        let p = &mut *guard;
        p.scratch.clear();
        w.worker.poll(&mut p.scratch, cap)?;
        let n = p.scratch.len();
        if n > 0 {
            p.errors.clear();
        }
        for (slot, c) in out.iter_mut().zip(p.scratch.drain(..)) {
            *slot = kvo_completion {
                job_id: c.job_id,
                bytes: c.bytes,
                seconds: c.seconds,
                success: c.success as u32,
                reserved: 0,
            };
            if let Some(e) = c.error {
                p.errors.push((c.job_id, e));
            }
        }
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_n, n) };
        Ok(())
    })
}

/// Copies the message of a failed job into `buf` (NUL-terminated, truncated) and writes its full
/// length to `*out_len`. A failed job's message is kept with its completion until
/// `kvo_worker_poll` hands the completion out, and then until the next `kvo_worker_poll` that
/// hands out any job: read the messages of a poll's failed jobs before polling again (however
/// many failed).
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_NOT_FOUND` if `job_id` is not
/// a failed job of the latest poll that handed out jobs.
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
        let p = unsafe { worker(w) }?.polled()?;
        let msg = p
            .errors
            .iter()
            .rev()
            .find(|(id, _)| *id == job_id)
            .map(|(_, m)| m)
            .ok_or_else(|| {
                Failure::new(
                    kvo_status::NotFound,
                    format!("job_id: {job_id} is not a failed job of the latest poll"),
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

/// Blocks until every listed job has finished, or `timeout_ms` passes. Naming a store deferred
/// by `kvo_worker_submit_step` submits the deferred stores first (so wait only once the step's
/// forward pass has been issued). Completions remain to be polled; a job handed out by another
/// thread's `kvo_worker_poll` meanwhile counts as finished. Other calls on the worker proceed
/// while it waits. (`kvo_worker_submit_step` already waits for a plan's flush set.)
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
        let w = unsafe { worker(w) }?;
        w.worker.wait(ids, Duration::from_millis(timeout_ms))?;
        Ok(())
    })
}

/// Copies block `src_blocks[i]` of tensor `src_tensor` to block `dst_blocks[i]` of tensor
/// `dst_tensor` (indices into the registration; equal page sizes). With `as_job` non-zero the copy
/// is queued as job `job_id` and reported by `kvo_worker_poll`; otherwise it runs now and the call
/// returns when it is done.
///
/// Either way the copy is queued behind the jobs already submitted in its direction (a destination
/// tensor in device memory: behind the loads; in host memory: behind the stores), so a synchronous
/// swap also waits for those. Other calls on the worker proceed while it waits. The copies have
/// no order among themselves, so within one tensor a block may not be both a source and a
/// destination.
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
        let w = unsafe { worker(w) }?;
        let id = (as_job != 0).then_some(job_id);
        w.worker
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
        let (p, len) = unsafe { worker(w) }?.worker.host_buffer(tensor as usize)?;
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_ptr, p as *mut c_void) };
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_len, len) };
        Ok(())
    })
}

/// Writes the counters and gauges to `*out` (only `out->struct_size` bytes).
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` if
/// `out->struct_size` is smaller than `sizeof(size_t)`.
///
/// # Safety
/// `w` NULL or live; `out` NULL or `out->struct_size` writable bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_worker_get_stats(
    w: *const kvo_worker,
    out: *mut kvo_worker_stats,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let st = unsafe { worker(w) }?.worker.stats()?;
        let full = kvo_worker_stats {
            struct_size: size_of::<kvo_worker_stats>(),
            load: st.load.into(),
            store: st.store.into(),
            jobs_in_flight: st.jobs_in_flight,
        };
        // SAFETY: forwarded from the caller.
        unsafe { write_sized(out, full, "out") }
    })
}

/// Renders the worker's counters and gauges in the Prometheus text exposition format (0.0.4)
/// into `buf`, as `kvo_manager_metrics_text` does (same arguments, statuses and safety).
///
/// # Safety
/// As for `kvo_manager_metrics_text`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_worker_metrics_text(
    w: *const kvo_worker,
    prefix: *const c_char,
    labels: *const kvo_label,
    n_labels: usize,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { worker(w) }?;
        non_null(out_len, "out_len")?;
        // SAFETY: forwarded from the caller.
        let naming = unsafe { naming(prefix, labels, n_labels) }?;
        let stats = h.worker.stats()?;
        let mut text = String::new();
        crate::metrics::worker_text(&naming, &stats, &mut text)?;
        // SAFETY: forwarded from the caller.
        unsafe { write_text(&text, buf, cap, out_len) }
    })
}

/// Refuses new submissions from now on (`KVO_STATUS_INVALID_STATE`), then blocks until every job
/// in flight has finished. Other calls on the worker (polls) proceed while it waits. Completions
/// stay pollable.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_CUDA_ERROR`.
///
/// # Safety
/// `w` NULL or live.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_worker_shutdown(w: *mut kvo_worker) -> kvo_status {
    // SAFETY: forwarded from the caller.
    guard(|| Ok(unsafe { worker(w) }?.worker.shutdown()?))
}

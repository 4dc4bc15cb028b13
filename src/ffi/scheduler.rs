//! `kvo_scheduler_*`: the connector scheduler ([`crate::scheduler::Scheduler`]) behind a C handle.

use super::manager::{policy_from, semantics_from};
use super::metrics::{kvo_label, naming, write_text};
use super::{
    Failure, copy_events, free_handle, give, guard, handle, kvo_event, kvo_manager_stats,
    kvo_status, kvo_step, lock, non_null, read_config, slice, write, write_sized,
};
use crate::scheduler::{
    DeferReason, JobReport, Match, ScheduledRequest, Scheduler, SchedulerConfig,
};
use std::ffi::c_char;
use std::sync::{Mutex, MutexGuard};

/// "No limit" for `max_offload_tokens`.
pub const KVO_NO_LIMIT: u64 = u64::MAX;

/// Answers of `kvo_scheduler_match` (`kvo_match_result.kind`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvo_match {
    /// Nothing to load: compute the request normally.
    Miss = 0,
    /// `tokens` beyond the GPU hit can be loaded asynchronously.
    Hit = 1,
    /// Ask again on a later step; allocate nothing for the request now.
    Defer = 2,
}

/// Why a match was deferred (`kvo_match_result.defer_reason`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvo_defer_reason {
    /// Not deferred.
    None = 0,
    /// The request has jobs in flight (nothing was looked up).
    JobsInFlight = 1,
    /// A key of the hit has its store in flight.
    StoreInFlight = 2,
    /// A chunk of the hit is being loaded for another request.
    BeingLoaded = 3,
}

/// Configuration of a scheduler. Fill it with `kvo_scheduler_config_default`, then change fields.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvo_scheduler_config {
    /// `sizeof(kvo_scheduler_config)`, set by `kvo_scheduler_config_default`.
    pub struct_size: usize,
    /// Width of block hashes (offload keys) in bytes, 1..=64 (default 32).
    pub key_len: u32,
    /// Tokens per GPU block, >= 1 (default 16).
    pub gpu_block_size: u32,
    /// GPU blocks per offloaded chunk (host slot), >= 1 (default 1).
    pub block_size_factor: u32,
    /// A `kvo_policy` value (default `KVO_POLICY_LRU`).
    pub policy: u32,
    /// Host slots: below 2^32 - 1 for LRU, at most (2^32 - 1) / 5 for ARC (default 0).
    pub num_slots: u64,
    /// Worker reports that complete a job (GPU ranks), >= 1 (default 1).
    pub num_workers: u32,
    /// Non-zero: offload prompt tokens only (default 1).
    pub offload_prompt_only: u32,
    /// When >= 2, a chunk is stored only after this many lookups (0.24) or store offers (0.33)
    /// (default 0: off).
    pub store_threshold: u32,
    /// Non-zero: buffer events for `kvo_scheduler_take_events` (default 0), bounded as the
    /// manager's (`kvo_manager_config.enable_events`).
    pub enable_events: u32,
    /// Keys the store-threshold filter tracks, >= 1 (default 64000).
    pub max_tracker_size: u64,
    /// A `kvo_semantics` value (default `KVO_SEMANTICS_VLLM_0_24`). A caller built against a
    /// header without this field passes the shorter `struct_size` and gets the default.
    pub semantics: u32,
}

/// The answer of `kvo_scheduler_match`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvo_match_result {
    /// A `kvo_match` value.
    pub kind: u32,
    /// A `kvo_defer_reason` value (`KVO_DEFER_REASON_NONE` unless deferred).
    pub defer_reason: u32,
    /// Tokens to load for a hit, else 0.
    pub tokens: u64,
}

/// One request scheduled in a step (see `kvo_scheduler_build_step`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvo_scheduled_request {
    /// The request.
    pub request_id: u64,
    /// Tokens computed before this step.
    pub num_computed_tokens: u64,
    /// Tokens this step computes.
    pub num_scheduled_tokens: u64,
    /// Tokens of the request now (prompt + generated).
    pub num_tokens: u64,
    /// GPU block ids allocated since the last step (all of them when first scheduled or resumed);
    /// read during the call only. May be NULL when `n_new_block_ids` is 0.
    pub new_block_ids: *const u32,
    /// Entries of `new_block_ids`.
    pub n_new_block_ids: usize,
    /// Non-zero: resumed after preemption, `new_block_ids` replaces its block list.
    pub resumed: u32,
    /// Zero.
    pub reserved: u32,
}

/// One completion report (see `kvo_scheduler_complete_jobs`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvo_job_report {
    /// The job.
    pub job_id: u64,
    /// Workers reporting, >= 1.
    pub count: u32,
    /// Zero if any of those workers failed the job.
    pub success: u32,
}

/// Counters and gauges of a scheduler. Set `struct_size` before `kvo_scheduler_get_stats`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvo_scheduler_stats {
    /// `sizeof(kvo_scheduler_stats)` as the caller knows it; only that many bytes are written.
    pub struct_size: usize,
    /// Requests tracked (including finished ones with jobs in flight or, in 0.33 semantics, a
    /// final store due in the next step).
    pub requests: u64,
    /// Matches answered.
    pub matches: u64,
    /// Matches deferred: the request had jobs in flight.
    pub deferred_jobs_in_flight: u64,
    /// Matches deferred: a hit key's store was in flight.
    pub deferred_store_in_flight: u64,
    /// Matches deferred: a hit chunk was being loaded for another request.
    pub deferred_being_loaded: u64,
    /// Matches answering a hit.
    pub hits: u64,
    /// Tokens of those hits.
    pub hit_tokens: u64,
    /// Load jobs made.
    pub load_jobs: u64,
    /// Store jobs made.
    pub store_jobs: u64,
    /// Chunks those store jobs offload.
    pub stored_chunks: u64,
    /// Store attempts answered "no room" (retried later).
    pub store_no_room: u64,
    /// Jobs that completed with a failure.
    pub failed_jobs: u64,
    /// Load jobs in flight now.
    pub loads_in_flight: u64,
    /// Store jobs in flight now.
    pub stores_in_flight: u64,
    /// The tier's stats (its `struct_size` is `sizeof(kvo_manager_stats)`).
    pub manager: kvo_manager_stats,
}

/// The scheduler side of KV offloading. Opaque.
pub struct kvo_scheduler {
    inner: Mutex<Scheduler>,
}

impl kvo_scheduler {
    fn get(&self) -> Result<MutexGuard<'_, Scheduler>, Failure> {
        lock(&self.inner, "scheduler")
    }
}

const SCHEDULER: &str = "scheduler";

/// # Safety
/// `s` is NULL or a live handle.
unsafe fn sched<'a>(s: *const kvo_scheduler) -> Result<&'a kvo_scheduler, Failure> {
    // SAFETY: forwarded from the caller.
    unsafe { handle(s, SCHEDULER) }
}

/// Fills `out` with the defaults and `struct_size = sizeof(kvo_scheduler_config)`.
///
/// Returns `KVO_STATUS_OK` or `KVO_STATUS_NULL_ARGUMENT`.
///
/// # Safety
/// `out` is NULL or points to a writable `kvo_scheduler_config`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_config_default(
    out: *mut kvo_scheduler_config,
) -> kvo_status {
    guard(|| {
        non_null(out, "out")?;
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out, default_scheduler_config()) };
        Ok(())
    })
}

/// The library's default scheduler configuration, as C sees it.
fn default_scheduler_config() -> kvo_scheduler_config {
    let d = SchedulerConfig::default();
    kvo_scheduler_config {
        struct_size: size_of::<kvo_scheduler_config>(),
        key_len: d.key_len as u32,
        gpu_block_size: d.gpu_block_size,
        block_size_factor: d.block_size_factor,
        policy: 0,
        num_slots: d.num_slots as u64,
        num_workers: d.num_workers,
        offload_prompt_only: d.offload_prompt_only as u32,
        store_threshold: d.store_threshold,
        enable_events: d.enable_events as u32,
        max_tracker_size: d.max_tracker_size as u64,
        semantics: 0,
    }
}

fn to_config(c: &kvo_scheduler_config) -> Result<SchedulerConfig, Failure> {
    let policy = policy_from(c.policy)?;
    Ok(SchedulerConfig {
        key_len: c.key_len as usize,
        gpu_block_size: c.gpu_block_size,
        block_size_factor: c.block_size_factor,
        num_slots: usize::try_from(c.num_slots).map_err(|_| {
            Failure::invalid(format!("cfg->num_slots: {} is too large", c.num_slots))
        })?,
        policy,
        num_workers: c.num_workers,
        offload_prompt_only: c.offload_prompt_only != 0,
        store_threshold: c.store_threshold,
        max_tracker_size: usize::try_from(c.max_tracker_size).unwrap_or(usize::MAX),
        enable_events: c.enable_events != 0,
        semantics: semantics_from(c.semantics, "cfg->semantics")?,
    })
}

/// Creates a scheduler (and its tier). On success writes a new handle to `*out`, freed with
/// `kvo_scheduler_free`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` for a
/// `struct_size` too small, `key_len` outside 1..=64, a zero `gpu_block_size`,
/// `block_size_factor` or `num_workers`, an unknown policy, or a bad tier setting;
/// `KVO_STATUS_OUT_OF_MEMORY` if the tier's index for `num_slots` cannot be allocated.
///
/// # Safety
/// `cfg` is NULL or points to `cfg->struct_size` readable bytes; `out` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_new(
    cfg: *const kvo_scheduler_config,
    out: *mut *mut kvo_scheduler,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let c = unsafe {
            read_config(
                cfg,
                "cfg",
                &[std::mem::offset_of!(kvo_scheduler_config, semantics)],
                default_scheduler_config,
            )
        }?;
        non_null(out, "out")?;
        let s = Scheduler::new(to_config(&c)?).map_err(Failure::of_config)?;
        // SAFETY: `out`, checked non-NULL above, is writable (the contract).
        unsafe {
            give(
                out,
                kvo_scheduler {
                    inner: Mutex::new(s),
                },
            )
        };
        Ok(())
    })
}

/// Frees a scheduler. NULL is ignored. Must not race with other calls on the same handle.
///
/// # Safety
/// `s` is NULL or a handle from `kvo_scheduler_new` not freed yet.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvo_scheduler_free(s: *mut kvo_scheduler) {
    // SAFETY: forwarded from the caller.
    unsafe { free_handle(s) }
}

/// Starts tracking a request of `prompt_tokens` tokens; `max_offload_tokens` caps the tokens
/// offloaded for it (`KVO_NO_LIMIT`: none; 0: nothing is offloaded).
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_STATE` if the request
/// is already tracked.
///
/// # Safety
/// `s` is NULL or a live handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_add_request(
    s: *mut kvo_scheduler,
    request_id: u64,
    prompt_tokens: u64,
    max_offload_tokens: u64,
) -> kvo_status {
    guard(|| {
        let cap = (max_offload_tokens != KVO_NO_LIMIT).then_some(max_offload_tokens);
        // SAFETY: forwarded from the caller.
        Ok(unsafe { sched(s) }?
            .get()?
            .add_request(request_id, prompt_tokens, cap)?)
    })
}

/// Appends `n_hashes` block hashes (one per newly full GPU block, `key_len` bytes each, back to
/// back) and sets the request's token count to `num_tokens`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_NOT_FOUND` for an unknown
/// request; `KVO_STATUS_INVALID_STATE` if it is finished; `KVO_STATUS_INVALID_ARGUMENT` if the
/// hashes overflow or exceed the full blocks of `num_tokens`.
///
/// # Safety
/// `s` is NULL or live; `hashes` NULL or `n_hashes * key_len` readable bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_append_block_hashes(
    s: *mut kvo_scheduler,
    request_id: u64,
    hashes: *const u8,
    n_hashes: usize,
    num_tokens: u64,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let mut sc = unsafe { sched(s) }?.get()?;
        let kl = sc.config().key_len;
        let len = n_hashes.checked_mul(kl).ok_or_else(|| {
            Failure::invalid(format!(
                "n_hashes: {n_hashes} hashes of {kl} bytes overflow size_t"
            ))
        })?;
        // SAFETY: forwarded from the caller.
        let hashes = unsafe { slice(hashes, len, "hashes") }?;
        Ok(sc.append_block_hashes(request_id, hashes, num_tokens)?)
    })
}

/// Matches a waiting request against the tier; `num_computed_tokens` are its GPU prefix-cache
/// hit tokens. Clears the request's GPU block ids. While the request has jobs in flight the
/// answer is DEFER (`KVO_DEFER_REASON_JOBS_IN_FLIGHT`) and nothing is looked up or touched.
/// A HIT needs at least one full chunk beyond the GPU hit; the request's keys are then touched.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_NOT_FOUND` for an unknown
/// request; `KVO_STATUS_INVALID_STATE` if it is finished or its hashes do not cover its tokens.
///
/// # Safety
/// `s` is NULL or live; `out` NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_match(
    s: *mut kvo_scheduler,
    request_id: u64,
    num_computed_tokens: u64,
    out: *mut kvo_match_result,
) -> kvo_status {
    guard(|| {
        non_null(out, "out")?;
        // SAFETY: forwarded from the caller.
        let m = unsafe { sched(s) }?
            .get()?
            .match_request(request_id, num_computed_tokens)?;
        let (kind, reason, tokens) = match m {
            Match::Miss => (kvo_match::Miss, kvo_defer_reason::None, 0),
            Match::Hit(n) => (kvo_match::Hit, kvo_defer_reason::None, n),
            Match::Defer(r) => (
                kvo_match::Defer,
                match r {
                    DeferReason::JobsInFlight => kvo_defer_reason::JobsInFlight,
                    DeferReason::StoreInFlight => kvo_defer_reason::StoreInFlight,
                    DeferReason::BeingLoaded => kvo_defer_reason::BeingLoaded,
                },
                0,
            ),
        };
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe {
            write(
                out,
                kvo_match_result {
                    kind: kind as u32,
                    defer_reason: reason as u32,
                    tokens,
                },
            )
        };
        Ok(())
    })
}

/// Records the GPU blocks allocated to a matched request (`block_ids`: all its blocks) and, with
/// `num_external_tokens > 0` (the hit), makes its load job for the next step. Writes 1 and the job
/// id to `*out_has_job` / `*out_job_id`, or 0 (and leaves `*out_job_id`) without a load.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_NOT_FOUND` for an unknown
/// request or a key no longer stored; `KVO_STATUS_INVALID_STATE` if the request is finished, or,
/// with `num_external_tokens > 0`, has jobs in flight, or its last match was not a HIT of at least
/// that many tokens, or another request's load pinned the hit since (match again), or a key's
/// store is in flight; `KVO_STATUS_INVALID_ARGUMENT` if the
/// tokens exceed its offloaded chunks or `block_ids` is shorter than the tokens need. On failure
/// nothing changes.
///
/// # Safety
/// `s` is NULL or live; `block_ids` NULL or `n_block_ids` readable entries; outputs writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_on_alloc(
    s: *mut kvo_scheduler,
    request_id: u64,
    block_ids: *const u32,
    n_block_ids: usize,
    num_external_tokens: u64,
    out_has_job: *mut u32,
    out_job_id: *mut u64,
) -> kvo_status {
    guard(|| {
        non_null(out_has_job, "out_has_job")?;
        non_null(out_job_id, "out_job_id")?;
        // SAFETY: forwarded from the caller.
        let ids = unsafe { slice(block_ids, n_block_ids, "block_ids") }?;
        // SAFETY: forwarded from the caller.
        let job = unsafe { sched(s) }?
            .get()?
            .on_alloc(request_id, ids, num_external_tokens)?;
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_has_job, job.is_some() as u32) };
        if let Some(j) = job {
            // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
            unsafe { write(out_job_id, j) };
        }
        Ok(())
    })
}

/// Builds this step's plan into `step`: the load jobs made since the last step, the store jobs of
/// the scheduled requests' newly complete chunks, and the flush set: the jobs of `preempted`
/// requests, the in-flight jobs of requests that gave their GPU blocks back (finished, aborted,
/// re-matched, resumed on other blocks) touching a block allocated since the last step, and the
/// jobs of a reset. A preempted request's load not yet in a step is withdrawn (it never ships).
/// Call it once per engine step, after admissions (`kvo_scheduler_on_alloc`).
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_NOT_FOUND` for an unknown
/// request; `KVO_STATUS_INVALID_STATE` for a finished one or one whose load is in flight;
/// `KVO_STATUS_INVALID_ARGUMENT` for a request scheduled twice or both scheduled and preempted,
/// a token count overflow, or block ids that do not cover its tokens.
/// On failure nothing changes and `step` is not written.
///
/// # Safety
/// `s`, `step` NULL or live; `scheduled` NULL or `n_scheduled` entries whose block pointers are
/// valid as documented; `preempted` NULL or `n_preempted` entries.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_build_step(
    s: *mut kvo_scheduler,
    scheduled: *const kvo_scheduled_request,
    n_scheduled: usize,
    preempted: *const u64,
    n_preempted: usize,
    step: *mut kvo_step,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let sc = unsafe { sched(s) }?;
        // SAFETY: forwarded from the caller.
        let step = unsafe { handle(step, "step") }?;
        // SAFETY: forwarded from the caller.
        let reqs = unsafe { slice(scheduled, n_scheduled, "scheduled") }?;
        // SAFETY: forwarded from the caller.
        let preempted = unsafe { slice(preempted, n_preempted, "preempted") }?;
        let mut list = Vec::with_capacity(reqs.len());
        for (i, r) in reqs.iter().enumerate() {
            // SAFETY: forwarded from the caller.
            let ids = unsafe { slice(r.new_block_ids, r.n_new_block_ids, "new_block_ids") }
                .map_err(|f| f.prefixed(&format!("scheduled[{i}].")))?;
            list.push(ScheduledRequest {
                request_id: r.request_id,
                num_computed_tokens: r.num_computed_tokens,
                num_scheduled_tokens: r.num_scheduled_tokens,
                num_tokens: r.num_tokens,
                new_block_ids: ids,
                resumed: r.resumed != 0,
            });
        }
        let mut sc = sc.get()?;
        step.with_step(|st| sc.build_step(&list, preempted, st))??;
        Ok(())
    })
}

/// `kvo_scheduler_build_step` with the scheduled requests given as arrays (one entry per
/// request, `n_scheduled` entries each) instead of structs: request `i` is `request_ids[i]`,
/// with `num_computed_tokens[i]`, `num_scheduled_tokens[i]`, `num_tokens[i]`, the next
/// `n_new_block_ids[i]` ids of `block_ids` (the requests' new block ids back to back,
/// `n_block_ids` in all) and resumed when `resumed` is non-NULL and `resumed[i]` non-zero.
/// For hosts that keep their batch in arrays (Python, numpy): the same plan, one call.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT` for a NULL handle or a NULL array with
/// entries; `KVO_STATUS_INVALID_ARGUMENT` when an array's size overflows the address space or
/// the counts of `n_new_block_ids` do not add up to `n_block_ids`; otherwise as
/// `kvo_scheduler_build_step` (`KVO_STATUS_NOT_FOUND`, `KVO_STATUS_INVALID_STATE`,
/// `KVO_STATUS_INVALID_ARGUMENT`, naming `scheduled[i]` for request `i`). On failure nothing
/// changes and `step` is not written.
///
/// # Safety
/// `s`, `step` NULL or live; the five per-request arrays and `resumed` NULL or `n_scheduled`
/// readable entries; `block_ids` NULL or `n_block_ids` entries; `preempted` NULL or
/// `n_preempted` entries.
#[unsafe(no_mangle)]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvo_scheduler_build_step_arrays(
    s: *mut kvo_scheduler,
    n_scheduled: usize,
    request_ids: *const u64,
    num_computed_tokens: *const u64,
    num_scheduled_tokens: *const u64,
    num_tokens: *const u64,
    n_new_block_ids: *const u64,
    block_ids: *const u32,
    n_block_ids: usize,
    resumed: *const u8,
    preempted: *const u64,
    n_preempted: usize,
    step: *mut kvo_step,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let sc = unsafe { sched(s) }?;
        // SAFETY: forwarded from the caller.
        let step = unsafe { handle(step, "step") }?;
        let n = n_scheduled;
        // SAFETY (all five): forwarded from the caller.
        let ids = unsafe { slice(request_ids, n, "request_ids") }?;
        // SAFETY: as above.
        let computed = unsafe { slice(num_computed_tokens, n, "num_computed_tokens") }?;
        // SAFETY: as above.
        let sched_tokens = unsafe { slice(num_scheduled_tokens, n, "num_scheduled_tokens") }?;
        // SAFETY: as above.
        let tokens = unsafe { slice(num_tokens, n, "num_tokens") }?;
        // SAFETY: as above.
        let counts = unsafe { slice(n_new_block_ids, n, "n_new_block_ids") }?;
        // SAFETY: forwarded from the caller.
        let blocks = unsafe { slice(block_ids, n_block_ids, "block_ids") }?;
        let resumed = if resumed.is_null() {
            &[]
        } else {
            // SAFETY: forwarded from the caller.
            unsafe { slice(resumed, n, "resumed") }?
        };
        // SAFETY: forwarded from the caller.
        let preempted = unsafe { slice(preempted, n_preempted, "preempted") }?;
        counts
            .iter()
            .try_fold(0u64, |a, &c| a.checked_add(c))
            .filter(|&t| t == n_block_ids as u64)
            .ok_or_else(|| {
                Failure::invalid(format!(
                    "n_new_block_ids: the counts do not add up to n_block_ids ({n_block_ids})"
                ))
            })?;
        let mut list = Vec::with_capacity(n);
        let mut at = 0usize;
        for i in 0..n {
            let end = at + counts[i] as usize;
            list.push(ScheduledRequest {
                request_id: ids[i],
                num_computed_tokens: computed[i],
                num_scheduled_tokens: sched_tokens[i],
                num_tokens: tokens[i],
                new_block_ids: &blocks[at..end],
                resumed: resumed.get(i).is_some_and(|&r| r != 0),
            });
            at = end;
        }
        let mut sc = sc.get()?;
        step.with_step(|st| sc.build_step(&list, preempted, st))??;
        Ok(())
    })
}

/// Counts worker reports. A job completes once `num_workers` reports arrived (failed if any
/// failed): a store's chunks become ready (or are rolled back); a load's keys are unpinned (on
/// failure also dropped from the tier, and `kvo_scheduler_load_failure` tells what the request
/// must recompute). Reports of jobs from before a reset are ignored.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_NOT_FOUND` for a job id not in
/// flight (a withdrawn load included); `KVO_STATUS_INVALID_STATE` for a load made by
/// `kvo_scheduler_on_alloc` but not yet in a step; `KVO_STATUS_INVALID_ARGUMENT` for a zero count
/// or more reports than workers (stale job ids from before a reset included). On failure no
/// report is applied.
///
/// # Safety
/// `s` is NULL or live; `reports` NULL or `n_reports` readable entries.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_complete_jobs(
    s: *mut kvo_scheduler,
    reports: *const kvo_job_report,
    n_reports: usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let reps = unsafe { slice(reports, n_reports, "reports") }?;
        let list: Vec<JobReport> = reps
            .iter()
            .map(|r| JobReport {
                job_id: r.job_id,
                count: r.count,
                success: r.success != 0,
            })
            .collect();
        // SAFETY: forwarded from the caller.
        Ok(unsafe { sched(s) }?.get()?.complete_jobs(&list)?)
    })
}

/// Finishes or aborts a request; the host may reuse its GPU blocks at once. Its load not yet in a
/// step is withdrawn (never ships, its pins are released now). Without other jobs in flight its
/// state is dropped now; otherwise after its last job completes, and meanwhile the GPU blocks
/// those jobs touch (stores read them, loads write them) are fenced: the next step that
/// allocates one of them carries those jobs in its flush set.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_NOT_FOUND` for an unknown
/// request; `KVO_STATUS_INVALID_STATE` if it was already finished.
///
/// # Safety
/// `s` is NULL or a live handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_finish_request(
    s: *mut kvo_scheduler,
    request_id: u64,
) -> kvo_status {
    // SAFETY: forwarded from the caller.
    guard(|| Ok(unsafe { sched(s) }?.get()?.finish_request(request_id)?))
}

/// Tells whether the request's last load failed: writes 1 and the tokens to recompute
/// (`[*out_from_token, *out_to_token)`), or 0 (leaving the token outputs). Reported until the
/// request's next match.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_NOT_FOUND` for an unknown
/// request.
///
/// # Safety
/// `s` is NULL or live; outputs NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_load_failure(
    s: *const kvo_scheduler,
    request_id: u64,
    out_failed: *mut u32,
    out_from_token: *mut u64,
    out_to_token: *mut u64,
) -> kvo_status {
    guard(|| {
        non_null(out_failed, "out_failed")?;
        non_null(out_from_token, "out_from_token")?;
        non_null(out_to_token, "out_to_token")?;
        // SAFETY: forwarded from the caller.
        let f = unsafe { sched(s) }?.get()?.load_failure(request_id)?;
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_failed, f.is_some() as u32) };
        if let Some(r) = f {
            // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
            unsafe { write(out_from_token, r.from_token) };
            // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
            unsafe { write(out_to_token, r.to_token) };
        }
        Ok(())
    })
}

/// Drops the whole tier: in-flight jobs go into the next step's flush set and their later reports
/// are ignored; finished requests are dropped; live requests restart storing from their first
/// chunk with no job in flight.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_STATE` while load jobs
/// made since the last step are not in a step yet (build the step first).
///
/// # Safety
/// `s` is NULL or a live handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_reset(s: *mut kvo_scheduler) -> kvo_status {
    // SAFETY: forwarded from the caller.
    guard(|| Ok(unsafe { sched(s) }?.get()?.reset()?))
}

/// Takes the tier's buffered events; same contract as `kvo_manager_take_events`.
///
/// # Safety
/// As for `kvo_manager_take_events`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_take_events(
    s: *mut kvo_scheduler,
    out_events: *mut kvo_event,
    events_cap: usize,
    out_keys: *mut u8,
    keys_cap: usize,
    out_n_events: *mut usize,
    out_n_keys: *mut usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let mut sc = unsafe { sched(s) }?.get()?;
        let kl = sc.config().key_len;
        // SAFETY: forwarded from the caller.
        unsafe {
            copy_events(
                &sc.manager().events(),
                kl,
                out_events,
                events_cap,
                out_keys,
                keys_cap,
                out_n_events,
                out_n_keys,
            )
        }?;
        sc.take_events();
        Ok(())
    })
}

/// Writes the counters and gauges to `*out` (only `out->struct_size` bytes).
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` if
/// `out->struct_size` is smaller than `sizeof(size_t)`.
///
/// # Safety
/// `s` is NULL or live; `out` NULL or `out->struct_size` writable bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_get_stats(
    s: *const kvo_scheduler,
    out: *mut kvo_scheduler_stats,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let st = unsafe { sched(s) }?.get()?.stats();
        let full = kvo_scheduler_stats {
            struct_size: size_of::<kvo_scheduler_stats>(),
            requests: st.requests,
            matches: st.matches,
            deferred_jobs_in_flight: st.deferred_jobs_in_flight,
            deferred_store_in_flight: st.deferred_store_in_flight,
            deferred_being_loaded: st.deferred_being_loaded,
            hits: st.hits,
            hit_tokens: st.hit_tokens,
            load_jobs: st.load_jobs,
            store_jobs: st.store_jobs,
            stored_chunks: st.stored_chunks,
            store_no_room: st.store_no_room,
            failed_jobs: st.failed_jobs,
            loads_in_flight: st.loads_in_flight,
            stores_in_flight: st.stores_in_flight,
            manager: st.manager.into(),
        };
        // SAFETY: forwarded from the caller.
        unsafe { write_sized(out, full, "out") }
    })
}

/// Renders the scheduler's counters and gauges in the Prometheus text exposition format (0.0.4) into `buf`: every
/// metric named `<prefix>_<name>` (`prefix` may be empty: then `<name>`), every sample with the
/// `n_labels` constant labels, in order. README.md lists the metrics. They include its tier's (the
/// manager metrics): do not render that tier again. A constant label may not be named
/// `reason` (`deferred_matches_total` has it). Writes the
/// text NUL-terminated and its length without the NUL to `*out_len`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT` for a NULL handle, `prefix`, `out_len`,
/// label string, `labels` with `n_labels > 0` or `buf` with `cap > 0`;
/// `KVO_STATUS_INVALID_ARGUMENT` for a prefix that is not a metric name, a label name that is
/// not a label name, `le` or repeated, or a string that is not UTF-8;
/// `KVO_STATUS_BUFFER_TOO_SMALL` if `cap` is not above the length (only `*out_len` is written;
/// pass `cap` 0 to ask, and retry with room to spare: counters grow between calls).
///
/// # Safety
/// Handle NULL or live; `prefix` and the label strings NULL or NUL-terminated; `labels` NULL or
/// `n_labels` entries; `buf` NULL or `cap` writable bytes; `out_len` NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_metrics_text(
    s: *const kvo_scheduler,
    prefix: *const c_char,
    labels: *const kvo_label,
    n_labels: usize,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { sched(s) }?;
        non_null(out_len, "out_len")?;
        // SAFETY: forwarded from the caller.
        let naming = unsafe { naming(prefix, labels, n_labels) }?;
        let stats = h.get()?.stats();
        let mut text = String::new();
        crate::metrics::scheduler_text(&naming, &stats, &mut text)?;
        // SAFETY: forwarded from the caller.
        unsafe { write_text(&text, buf, cap, out_len) }
    })
}

/// Recounts the scheduler's and tier's state and compares it with their bookkeeping (jobs vs
/// requests, pins vs in-flight loads, fence). For tests and debug builds: O(state).
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INTERNAL` naming the broken
/// invariant.
///
/// # Safety
/// `s` is NULL or a live handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_scheduler_check_invariants(s: *const kvo_scheduler) -> kvo_status {
    // SAFETY: forwarded from the caller.
    guard(|| Ok(unsafe { sched(s) }?.get()?.check_invariants()?))
}

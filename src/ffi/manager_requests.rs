//! The request-scoped calls of a manager (vLLM 0.33 semantics): begin a request, load and
//! store for it with the keys' positions, finish it (its recency is committed then). With
//! `KVO_SEMANTICS_VLLM_0_24` the same calls are accepted and a request changes nothing.

use super::manager::{StoreOutputs, kvo_manager, with_keys};
use super::{FfiResult, guard, handle, kvo_status, non_null, slice, slice_mut, write};
use crate::manager::{Manager, RequestId};

/// Runs `f` on the manager with `keys` and their `positions` (NULL: none; else `n_keys`
/// values).
///
/// # Safety
/// As [`with_keys`]; `positions` is NULL or `n_keys` readable values.
unsafe fn with_positions(
    m: *mut kvo_manager,
    keys: *const u8,
    positions: *const u64,
    n_keys: usize,
    f: impl FnOnce(&mut Manager, &[u8], &[u64]) -> FfiResult,
) -> FfiResult {
    // SAFETY: forwarded from the caller.
    unsafe {
        with_keys(m, keys, n_keys, |mgr, k| {
            let p = if positions.is_null() {
                &[][..]
            } else {
                slice(positions, n_keys, "positions")?
            };
            f(mgr, k, p)
        })
    }
}

/// Begins a request (vLLM 0.33 `on_new_request`): its access record, valid until
/// `kvo_manager_finish_request`, is written to `*out_request`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT` if `m` or `out_request` is NULL.
///
/// # Safety
/// `m` is NULL or a live manager; `out_request` NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_begin_request(
    m: *mut kvo_manager,
    out_request: *mut u64,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let mut mgr = unsafe { handle(m, "manager") }?.get()?;
        non_null(out_request, "out_request")?;
        let r = mgr.begin_request();
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_request, r.0) };
        Ok(())
    })
}

/// Finishes request `request` (vLLM 0.33 `on_request_finished`): commits its recency to the
/// policy (LRU: its keys become the newest, its head newest of all; ARC: the keys it reused are
/// promoted), unless `kvo_manager_reset` came after its last use; the handle then ends. Loads
/// and stores already prepared for it may still be completed.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT` if `m` is NULL;
/// `KVO_STATUS_INVALID_ARGUMENT` if `request` is not an active request (nothing changed).
///
/// # Safety
/// `m` is NULL or a live manager.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_finish_request(
    m: *mut kvo_manager,
    request: u64,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let mut mgr = unsafe { handle(m, "manager") }?.get()?;
        Ok(mgr.finish_request(RequestId(request))?)
    })
}

/// `kvo_manager_prepare_load` for request `request`, with the keys' `positions` (tokens up to
/// the end of each key's block; NULL: none): the loaded keys are recorded as reused by the
/// request, and (LRU) ranked as its keys at those positions, never older than they were.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` for an
/// inactive `request`, a position equal to `UINT64_MAX`, or overflow;
/// `KVO_STATUS_BUFFER_TOO_SMALL` if `slots_cap < n_keys`; `KVO_STATUS_NOT_FOUND` if a key is not
/// stored; `KVO_STATUS_INVALID_STATE` if a key's store is in flight. On failure nothing changes.
///
/// # Safety
/// `keys` is NULL or `n_keys * key_len` readable bytes; `positions` NULL or `n_keys` readable
/// values; `out_slots` NULL or `slots_cap` writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_prepare_load_for(
    m: *mut kvo_manager,
    request: u64,
    keys: *const u8,
    positions: *const u64,
    n_keys: usize,
    out_slots: *mut u32,
    slots_cap: usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        unsafe {
            with_positions(m, keys, positions, n_keys, |mgr, k, p| {
                let out = slice_mut(out_slots, slots_cap, "out_slots")?;
                mgr.prepare_load_for(RequestId(request), k, p, out)?;
                Ok(())
            })
        }
    })
}

/// `kvo_manager_prepare_store` for request `request`, with the keys' `positions` (NULL: none).
/// With `KVO_SEMANTICS_VLLM_0_33` (vLLM 0.33 `prepare_store`): every key offered counts for the
/// store threshold; only keys not stored are candidates and only they are filtered by it; the
/// candidates this request has not offered before are reported to the policy (ARC adapts its
/// target on keys it remembers); the candidates and the ready keys (these as reused) are recorded
/// for the request; eviction never takes a key of the offer.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` for an
/// inactive `request`, a position equal to `UINT64_MAX`, or overflow (nothing changed);
/// `KVO_STATUS_BUFFER_TOO_SMALL` if `out_cap < n_keys` (writes `n_keys` to `*out_n_store`;
/// nothing changed); `KVO_STATUS_NO_ROOM` when not enough can be evicted now (a normal answer:
/// retry on a later step): in 0.33 semantics the offer's threshold counts, the policy's
/// adaptation and the request's record are kept, as vLLM 0.33 keeps them; nothing else changes.
///
/// # Safety
/// As `kvo_manager_prepare_store`; `positions` NULL or `n_keys` readable values.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_prepare_store_for(
    m: *mut kvo_manager,
    request: u64,
    keys: *const u8,
    positions: *const u64,
    n_keys: usize,
    out_indices: *mut u32,
    out_slots: *mut u32,
    out_evicted_keys: *mut u8,
    out_cap: usize,
    out_n_store: *mut usize,
    out_n_evicted: *mut usize,
) -> kvo_status {
    guard(|| {
        non_null(out_n_store, "out_n_store")?;
        non_null(out_n_evicted, "out_n_evicted")?;
        // SAFETY: forwarded from the caller.
        unsafe {
            with_positions(m, keys, positions, n_keys, |mgr, k, p| {
                let out = StoreOutputs {
                    indices: out_indices,
                    slots: out_slots,
                    evicted_keys: out_evicted_keys,
                    cap: out_cap,
                    n_store: out_n_store,
                    n_evicted: out_n_evicted,
                };
                out.fill(n_keys, mgr.key_len(), |idx, slots, ev| {
                    mgr.prepare_store_for_into(RequestId(request), k, p, idx, slots, ev)
                })
            })
        }
    })
}

//! `kvo_manager_*`: the offload tier index ([`crate::manager::Manager`]) behind a C handle.

use super::metrics::{kvo_label, naming, write_text};
use super::{
    Failure, FfiResult, copy_events, free_handle, give, guard, handle, kvo_status, lock, non_null,
    read_config, slice, slice_mut, write, write_sized,
};
use crate::manager::{Lookup, Manager, ManagerConfig, ManagerStats, Policy, Semantics};
use std::ffi::c_char;
use std::sync::Mutex;

/// Eviction policies (values of `kvo_manager_config.policy`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvo_policy {
    /// Least recently used first.
    Lru = 0,
    /// Adaptive replacement cache (vLLM's ARC arithmetic).
    Arc = 1,
}

/// Which vLLM release's semantics a manager or scheduler follows (see the README's table of
/// differences).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum kvo_semantics {
    /// vLLM 0.24, bit for bit (the default).
    VLLM_0_24 = 0,
    /// vLLM 0.33: request-scoped recency committed at request finish, tails evicted before
    /// heads, ARC's T1 fallback, the store threshold counting offers.
    VLLM_0_33 = 1,
}

/// Answers of `kvo_manager_lookup`.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvo_lookup {
    /// Not stored.
    Miss = 0,
    /// Stored and ready to load.
    Hit = 1,
    /// Its store is in flight: ask again later (`KVO_SEMANTICS_VLLM_0_24`).
    Retry = 2,
    /// Its store is in flight (`KVO_SEMANTICS_VLLM_0_33`).
    HitPending = 3,
}

/// Configuration of a manager. Fill it with `kvo_manager_config_default`, then change fields.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvo_manager_config {
    /// `sizeof(kvo_manager_config)`, set by `kvo_manager_config_default`.
    pub struct_size: usize,
    /// Width of every key in bytes, 1..=64 (default 32).
    pub key_len: u32,
    /// A `kvo_policy` value (default `KVO_POLICY_LRU`).
    pub policy: u32,
    /// Number of host slots: below 2^32 - 1 for LRU, at most (2^32 - 1) / 5 for ARC (default 0).
    pub num_slots: u64,
    /// When >= 2, a key is stored only after this many lookups (`KVO_SEMANTICS_VLLM_0_24`) or
    /// offers to a store (`KVO_SEMANTICS_VLLM_0_33`) (default 0: off).
    pub store_threshold: u32,
    /// Non-zero: buffer events for `kvo_manager_take_events` (default 0). The buffer holds at most
    /// max(4 * num_slots, 65536) keys: beyond that the oldest events are dropped (counted in
    /// `kvo_manager_stats.events_dropped`); the newest event is always kept whole.
    pub enable_events: u32,
    /// Keys the store-threshold filter tracks, >= 1 (default 64000).
    pub max_tracker_size: u64,
    /// A `kvo_semantics` value (default `KVO_SEMANTICS_VLLM_0_24`). A caller built against a
    /// header without this field passes the shorter `struct_size` and gets the default.
    pub semantics: u32,
}

/// Counters and gauges of a manager. Set `struct_size` before `kvo_manager_get_stats`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvo_manager_stats {
    /// `sizeof(kvo_manager_stats)` as the caller knows it; only that many bytes are written.
    pub struct_size: usize,
    /// Host slots.
    pub capacity: u64,
    /// Slots holding a key (ready or store in flight).
    pub used: u64,
    /// Slots whose key is ready to load.
    pub ready: u64,
    /// Ready slots not pinned by a load (what eviction may take).
    pub evictable: u64,
    /// Slots pinned by at least one load.
    pub pinned: u64,
    /// Slots whose store is in flight.
    pub stores_in_flight: u64,
    /// Keys looked up (cumulative).
    pub lookups: u64,
    /// Lookups answered "hit" (cumulative).
    pub hits: u64,
    /// Keys filtered out by the store threshold (cumulative).
    pub stores_skipped: u64,
    /// Keys evicted (cumulative).
    pub evictions: u64,
    /// Events dropped, oldest first, because the event buffer was full (cumulative; see
    /// `kvo_manager_config.enable_events`).
    pub events_dropped: u64,
    /// `kvo_manager_prepare_store*` calls that allocated slots, per number of keys to store,
    /// not cumulative: bucket `i` counts allocations of at most 1, 4, 16, 64, 256, 1024, 4096,
    /// 16384, 65536, 262144 keys (and above the bucket before); the last bucket counts larger
    /// ones (vLLM 0.33's `kv_offload_cpu_allocation_size` buckets). With
    /// `KVO_SEMANTICS_VLLM_0_33` a call that answered `KVO_STATUS_NO_ROOM` counts too, as in
    /// vLLM 0.33; with `KVO_SEMANTICS_VLLM_0_24` only calls that succeeded (cumulative).
    pub allocation_size_buckets: [u64; KVO_ALLOCATION_SIZE_BUCKETS],
    /// Keys of the allocations counted in `allocation_size_buckets` (cumulative).
    pub allocation_keys: u64,
}

/// Buckets of `kvo_manager_stats.allocation_size_buckets`.
pub const KVO_ALLOCATION_SIZE_BUCKETS: usize = 11;
const _: () = assert!(KVO_ALLOCATION_SIZE_BUCKETS == crate::manager::ALLOCATION_SIZE_BUCKETS);

impl From<ManagerStats> for kvo_manager_stats {
    fn from(s: ManagerStats) -> Self {
        Self {
            struct_size: size_of::<Self>(),
            capacity: s.capacity,
            used: s.used,
            ready: s.ready,
            evictable: s.evictable,
            pinned: s.pinned,
            stores_in_flight: s.stores_in_flight,
            lookups: s.lookups,
            hits: s.hits,
            stores_skipped: s.stores_skipped,
            evictions: s.evictions,
            events_dropped: s.events_dropped,
            allocation_size_buckets: s.allocation_size_buckets,
            allocation_keys: s.allocation_keys,
        }
    }
}

/// One event of `kvo_manager_take_events`: keys `first_key .. first_key + n_keys` of the keys
/// output.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvo_event {
    /// Index of the event's first key in the keys output.
    pub first_key: u64,
    /// Number of keys.
    pub n_keys: u64,
    /// 1: the keys were evicted (or their store failed); 0: the keys became ready (stored).
    pub removed: u32,
    /// 1: a removal of keys whose store failed, which never became readable
    /// (`KVO_SEMANTICS_VLLM_0_33` only); 0 otherwise.
    pub metadata_only: u32,
}

/// An offload tier index: keys, host slots, eviction. Opaque.
pub struct kvo_manager {
    inner: Mutex<Manager>,
}

impl kvo_manager {
    pub(super) fn get(&self) -> Result<std::sync::MutexGuard<'_, Manager>, Failure> {
        lock(&self.inner, "manager")
    }
}

const MANAGER: &str = "manager";

/// Fills `out` with the defaults and `struct_size = sizeof(kvo_manager_config)`.
///
/// Returns `KVO_STATUS_OK`, or `KVO_STATUS_NULL_ARGUMENT` if `out` is NULL.
///
/// # Safety
/// `out` is NULL or points to a writable `kvo_manager_config`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_config_default(out: *mut kvo_manager_config) -> kvo_status {
    guard(|| {
        non_null(out, "out")?;
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out, default_manager_config()) };
        Ok(())
    })
}

/// The library's default manager configuration, as C sees it.
fn default_manager_config() -> kvo_manager_config {
    let d = ManagerConfig::default();
    kvo_manager_config {
        struct_size: size_of::<kvo_manager_config>(),
        key_len: d.key_len as u32,
        policy: kvo_policy::Lru as u32,
        num_slots: d.num_slots as u64,
        store_threshold: d.store_threshold,
        enable_events: d.enable_events as u32,
        max_tracker_size: d.max_tracker_size as u64,
        semantics: kvo_semantics::VLLM_0_24 as u32,
    }
}

/// A `kvo_semantics` value from C (`what` names the field).
pub(crate) fn semantics_from(v: u32, what: &str) -> Result<Semantics, Failure> {
    match v {
        0 => Ok(Semantics::Vllm024),
        1 => Ok(Semantics::Vllm033),
        v => Err(Failure::invalid(format!(
            "{what}: {v} is not a kvo_semantics"
        ))),
    }
}

/// A `kvo_policy` value from C.
pub(crate) fn policy_from(p: u32) -> Result<Policy, Failure> {
    match p {
        0 => Ok(Policy::Lru),
        1 => Ok(Policy::Arc),
        p => Err(Failure::invalid(format!(
            "cfg->policy: {p} is not a kvo_policy"
        ))),
    }
}

fn to_config(c: &kvo_manager_config) -> Result<ManagerConfig, Failure> {
    let policy = policy_from(c.policy)?;
    let num_slots = usize::try_from(c.num_slots)
        .map_err(|_| Failure::invalid(format!("cfg->num_slots: {} is too large", c.num_slots)))?;
    Ok(ManagerConfig {
        key_len: c.key_len as usize,
        num_slots,
        policy,
        store_threshold: c.store_threshold,
        max_tracker_size: usize::try_from(c.max_tracker_size).unwrap_or(usize::MAX),
        enable_events: c.enable_events != 0,
        semantics: semantics_from(c.semantics, "cfg->semantics")?,
    })
}

/// Creates a manager. On success writes a new handle to `*out`, owned by the caller and freed with
/// `kvo_manager_free`; on failure `*out` is not written.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT` if `cfg` or `out` is NULL;
/// `KVO_STATUS_INVALID_ARGUMENT` for a `struct_size` too small, `key_len` outside 1..=64, an
/// unknown policy or semantics, `num_slots` too large, or `max_tracker_size` 0 with a store
/// threshold;
/// `KVO_STATUS_OUT_OF_MEMORY` if the tier's index for `num_slots` cannot be allocated.
///
/// # Safety
/// `cfg` is NULL or points to `cfg->struct_size` readable bytes; `out` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_new(
    cfg: *const kvo_manager_config,
    out: *mut *mut kvo_manager,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let c = unsafe {
            read_config(
                cfg,
                "cfg",
                &[std::mem::offset_of!(kvo_manager_config, semantics)],
                default_manager_config,
            )
        }?;
        non_null(out, "out")?;
        let m = Manager::new(to_config(&c)?).map_err(Failure::of_config)?;
        // SAFETY: `out`, checked non-NULL above, is writable (the contract).
        unsafe {
            give(
                out,
                kvo_manager {
                    inner: Mutex::new(m),
                },
            )
        };
        Ok(())
    })
}

/// Frees a manager. NULL is ignored. Must not race with any other call on the same handle.
///
/// # Safety
/// `m` is NULL or a handle from `kvo_manager_new` not freed yet.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvo_manager_free(m: *mut kvo_manager) {
    // SAFETY: forwarded from the caller.
    unsafe { free_handle(m) }
}

/// Borrows the handle and the `n_keys * key_len` bytes of `keys`, then runs `f`.
///
/// # Safety
/// As for the exported functions: `m` NULL or live, `keys` NULL or `n_keys * key_len` bytes.
pub(super) unsafe fn with_keys(
    m: *mut kvo_manager,
    keys: *const u8,
    n_keys: usize,
    f: impl FnOnce(&mut Manager, &[u8]) -> FfiResult,
) -> FfiResult {
    // SAFETY: forwarded from the caller.
    let h = unsafe { handle(m, MANAGER) }?;
    let mut mgr = h.get()?;
    let len = n_keys.checked_mul(mgr.key_len()).ok_or_else(|| {
        Failure::invalid(format!(
            "n_keys: {n_keys} keys of {} bytes overflow size_t",
            mgr.key_len()
        ))
    })?;
    // SAFETY: forwarded from the caller.
    let keys = unsafe { slice(keys, len, "keys") }?;
    f(&mut mgr, keys)
}

/// Looks up one key of `key_len` bytes and writes a `kvo_lookup` value to `*out_result`
/// (its store in flight: `KVO_LOOKUP_RETRY` with `KVO_SEMANTICS_VLLM_0_24`,
/// `KVO_LOOKUP_HIT_PENDING` with `KVO_SEMANTICS_VLLM_0_33`). With 0.24 semantics the lookup
/// counts for the store threshold. Does not change recency.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT` if `m`, `key` or `out_result` is NULL.
///
/// # Safety
/// `m` is NULL or live; `key` is NULL or `key_len` readable bytes; `out_result` NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_lookup(
    m: *mut kvo_manager,
    key: *const u8,
    out_result: *mut u32,
) -> kvo_status {
    guard(|| {
        non_null(key, "key")?;
        non_null(out_result, "out_result")?;
        // SAFETY: forwarded from the caller.
        unsafe {
            with_keys(m, key, 1, |mgr, k| {
                let r = match mgr.lookup(k)? {
                    Lookup::Miss => kvo_lookup::Miss,
                    Lookup::Hit => kvo_lookup::Hit,
                    Lookup::Retry => kvo_lookup::Retry,
                    Lookup::HitPending => kvo_lookup::HitPending,
                };
                write(out_result, r as u32);
                Ok(())
            })
        }
    })
}

/// Prefix lookup (the maximal-prefix rule): looks `keys` up in order until the first miss and
/// writes the number of leading stored keys to `*out_hits`. A key whose store is in flight counts
/// as a hit while scanning, and then `*out_retry` is 1: the answer must be retried later.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT` for a NULL `m`, `out_hits`, `out_retry`,
/// or `keys` with `n_keys > 0`; `KVO_STATUS_INVALID_ARGUMENT` if `n_keys * key_len` overflows.
///
/// # Safety
/// `keys` is NULL or `n_keys * key_len` readable bytes; the out-pointers NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_lookup_prefix(
    m: *mut kvo_manager,
    keys: *const u8,
    n_keys: usize,
    out_hits: *mut usize,
    out_retry: *mut u32,
) -> kvo_status {
    guard(|| {
        non_null(out_hits, "out_hits")?;
        non_null(out_retry, "out_retry")?;
        // SAFETY: forwarded from the caller.
        unsafe {
            with_keys(m, keys, n_keys, |mgr, k| {
                let r = mgr.lookup_prefix(k)?;
                write(out_hits, r.hits);
                write(out_retry, r.retry as u32);
                Ok(())
            })
        }
    })
}

/// Pins `keys` for a load and writes their slots, in input order, to `out_slots[0..n_keys]`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` on
/// `n_keys * key_len` overflow; `KVO_STATUS_BUFFER_TOO_SMALL` if `slots_cap < n_keys`;
/// `KVO_STATUS_NOT_FOUND` if a key is not stored; `KVO_STATUS_INVALID_STATE` if a key's store is
/// in flight. On failure nothing is pinned and `out_slots` is not written.
///
/// # Safety
/// `keys` is NULL or `n_keys * key_len` readable bytes; `out_slots` NULL or `slots_cap` writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_prepare_load(
    m: *mut kvo_manager,
    keys: *const u8,
    n_keys: usize,
    out_slots: *mut u32,
    slots_cap: usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        unsafe {
            with_keys(m, keys, n_keys, |mgr, k| {
                let out = slice_mut(out_slots, slots_cap, "out_slots")?;
                mgr.prepare_load(k, out)?;
                Ok(())
            })
        }
    })
}

/// Marks `keys` as used (LRU: the first key ends most recent; ARC: promotion and target
/// adaptation). Keys that are not stored are ignored on purpose.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` on
/// `n_keys * key_len` overflow.
///
/// # Safety
/// `keys` is NULL or `n_keys * key_len` readable bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_touch(
    m: *mut kvo_manager,
    keys: *const u8,
    n_keys: usize,
) -> kvo_status {
    // SAFETY: forwarded from the caller.
    guard(|| unsafe { with_keys(m, keys, n_keys, |mgr, k| Ok(mgr.touch(k)?)) })
}

/// Releases one load pin of each key (a key listed twice is released twice).
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` on
/// overflow; `KVO_STATUS_NOT_FOUND` if a key is not stored; `KVO_STATUS_INVALID_STATE` if a key is
/// not pinned (more often than it is pinned). On failure no pin is released.
///
/// # Safety
/// `keys` is NULL or `n_keys * key_len` readable bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_complete_load(
    m: *mut kvo_manager,
    keys: *const u8,
    n_keys: usize,
) -> kvo_status {
    // SAFETY: forwarded from the caller.
    guard(|| unsafe { with_keys(m, keys, n_keys, |mgr, k| Ok(mgr.complete_load(k)?)) })
}

/// Reserves host slots for the keys that are not stored yet; their stores are then in flight.
///
/// Keys below the store threshold and keys already stored (ready or in flight) are skipped; a key
/// listed twice is stored once. If free slots do not suffice, ready unpinned keys are evicted by
/// the policy, never a key named in this call (not even one the store threshold skips). Writes `*out_n_store` entries to `out_indices`
/// (indices into `keys`, input order) and `out_slots`, and `*out_n_evicted` keys to
/// `out_evicted_keys` (back to back, eviction order). Each output holds `out_cap` entries
/// (`out_evicted_keys`: `out_cap * key_len` bytes); `out_cap >= n_keys` always suffices.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` on
/// overflow; `KVO_STATUS_BUFFER_TOO_SMALL` if `out_cap < n_keys` (writes `n_keys` to
/// `*out_n_store`); `KVO_STATUS_NO_ROOM` when not enough can be evicted now (a normal answer:
/// retry on a later step). On any failure nothing changes, except that with
/// `KVO_SEMANTICS_VLLM_0_33` a `KVO_STATUS_NO_ROOM` answer keeps what
/// `kvo_manager_prepare_store_for` says. Without a request, a 0.33 store is one of its own.
///
/// With `KVO_POLICY_ARC`, `KVO_STATUS_NO_ROOM` can come while `kvo_manager_stats.evictable` is at
/// least the number of slots needed: like vLLM 0.24's ARC (deliberately copied, so that replays
/// match), eviction scans T1 only while T1 holds at least `int(target)` entries and takes the rest
/// from T2, so evictable keys left in T1 below that size are not taken.
///
/// # Safety
/// `keys` is NULL or `n_keys * key_len` readable bytes; outputs NULL or writable as described.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_prepare_store(
    m: *mut kvo_manager,
    keys: *const u8,
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
            with_keys(m, keys, n_keys, |mgr, k| {
                let out = StoreOutputs {
                    indices: out_indices,
                    slots: out_slots,
                    evicted_keys: out_evicted_keys,
                    cap: out_cap,
                    n_store: out_n_store,
                    n_evicted: out_n_evicted,
                };
                out.fill(n_keys, mgr.key_len(), |idx, slots, ev| {
                    mgr.prepare_store_into(k, idx, slots, ev)
                })
            })
        }
    })
}

/// The outputs of a `prepare_store` call, as the C caller passed them (the counts checked
/// non-NULL).
pub(super) struct StoreOutputs {
    pub indices: *mut u32,
    pub slots: *mut u32,
    pub evicted_keys: *mut u8,
    pub cap: usize,
    pub n_store: *mut usize,
    pub n_evicted: *mut usize,
}

impl StoreOutputs {
    /// Checks the outputs for `n_keys` keys of `key_len` bytes (a short `cap` is
    /// `BUFFER_TOO_SMALL` with `n_keys` written to `*n_store`), runs `store` on them and writes
    /// its counts.
    ///
    /// # Safety
    /// The pointers are NULL or writable as `kvo_manager_prepare_store` documents.
    pub(super) unsafe fn fill(
        self,
        n_keys: usize,
        key_len: usize,
        store: impl FnOnce(
            &mut [u32],
            &mut [u32],
            &mut [u8],
        ) -> crate::Result<crate::manager::StoreCounts>,
    ) -> FfiResult {
        // SAFETY: the caller's contract.
        unsafe {
            if self.cap < n_keys {
                write(self.n_store, n_keys);
                return Err(Failure::new(
                    kvo_status::BufferTooSmall,
                    format!("out_cap: {} entries, {n_keys} needed", self.cap),
                ));
            }
            let idx = slice_mut(self.indices, n_keys, "out_indices")?;
            let slots = slice_mut(self.slots, n_keys, "out_slots")?;
            let ev = slice_mut(self.evicted_keys, n_keys * key_len, "out_evicted_keys")?;
            let c = store(idx, slots, ev)?;
            write(self.n_store, c.stored);
            write(self.n_evicted, c.evicted);
        }
        Ok(())
    }
}

/// Ends the stores of `keys`: `success` non-zero makes the in-flight ones ready (one stored
/// event); zero drops them and frees their slots. Keys that are not stored or already ready are
/// ignored on purpose (as in vLLM), so a completion may be repeated safely.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` on overflow.
///
/// # Safety
/// `keys` is NULL or `n_keys * key_len` readable bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_complete_store(
    m: *mut kvo_manager,
    keys: *const u8,
    n_keys: usize,
    success: u32,
) -> kvo_status {
    // SAFETY: forwarded from the caller.
    guard(|| unsafe {
        with_keys(m, keys, n_keys, |mgr, k| {
            Ok(mgr.complete_store(k, success != 0)?)
        })
    })
}

/// [`kvo_manager_complete_store`] for keys whose slots the caller kept from
/// `kvo_manager_prepare_store` (`slots[i]` for `keys[i]`): a slot whose store is in flight and
/// holds the key is taken without a hash lookup; any other slot is only a wrong hint, and the key
/// is looked up. The fast way to complete a store job. `keys` and `slots` are only read during
/// the call (the caller keeps them); any thread may call it, serialized with the handle's other
/// calls.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` on
/// overflow or a slot not below `num_slots` (nothing changed).
///
/// # Safety
/// `keys` is NULL or `n_keys * key_len` readable bytes; `slots` NULL or `n_keys` readable values.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_complete_store_at(
    m: *mut kvo_manager,
    keys: *const u8,
    slots: *const u32,
    n_keys: usize,
    success: u32,
) -> kvo_status {
    // SAFETY: forwarded from the caller.
    guard(|| unsafe {
        with_keys(m, keys, n_keys, |mgr, k| {
            let slots = slice(slots, n_keys, "slots")?;
            Ok(mgr.complete_store_at(k, slots, success != 0)?)
        })
    })
}

/// Takes the buffered events (oldest first): writes `*out_n_events` records to `out_events` and
/// their keys, back to back, to `out_keys` (`*out_n_keys` keys of `key_len` bytes). The buffer is
/// bounded (see `kvo_manager_config.enable_events`): events not taken in time are dropped, oldest
/// first, and counted in `kvo_manager_stats.events_dropped`.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_BUFFER_TOO_SMALL` if
/// `events_cap` or `keys_cap` (in keys) is too small: then the needed counts are written to
/// `*out_n_events` and `*out_n_keys` and the events stay buffered.
///
/// # Safety
/// `out_events` NULL or `events_cap` writable records; `out_keys` NULL or `keys_cap * key_len`
/// writable bytes; counters NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_take_events(
    m: *mut kvo_manager,
    out_events: *mut kvo_event,
    events_cap: usize,
    out_keys: *mut u8,
    keys_cap: usize,
    out_n_events: *mut usize,
    out_n_keys: *mut usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let mut mgr = unsafe { handle(m, MANAGER) }?.get()?;
        let kl = mgr.key_len();
        // SAFETY: forwarded from the caller.
        unsafe {
            copy_events(
                &mgr.events(),
                kl,
                out_events,
                events_cap,
                out_keys,
                keys_cap,
                out_n_events,
                out_n_keys,
            )
        }?;
        mgr.take_events();
        Ok(())
    })
}

/// Writes the counters and gauges to `*out`; only `out->struct_size` bytes are written, so older
/// callers with a shorter struct stay safe.
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INVALID_ARGUMENT` if
/// `out->struct_size` is smaller than `sizeof(size_t)`.
///
/// # Safety
/// `out` is NULL or points to `out->struct_size` writable bytes.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_get_stats(
    m: *const kvo_manager,
    out: *mut kvo_manager_stats,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(m, MANAGER) }?;
        let full = kvo_manager_stats::from(h.get()?.stats());
        // SAFETY: forwarded from the caller.
        unsafe { write_sized(out, full, "out") }
    })
}

/// Renders the manager's counters and gauges in the Prometheus text exposition format (0.0.4) into `buf`: every
/// metric named `<prefix>_<name>` (`prefix` may be empty: then `<name>`), every sample with the
/// `n_labels` constant labels, in order. README.md lists the metrics. Writes the
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
pub unsafe extern "C" fn kvo_manager_metrics_text(
    m: *const kvo_manager,
    prefix: *const c_char,
    labels: *const kvo_label,
    n_labels: usize,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        let h = unsafe { handle(m, MANAGER) }?;
        non_null(out_len, "out_len")?;
        // SAFETY: forwarded from the caller.
        let naming = unsafe { naming(prefix, labels, n_labels) }?;
        let stats = h.get()?.stats();
        let mut text = String::new();
        crate::metrics::manager_text(&naming, &stats, &mut text)?;
        // SAFETY: forwarded from the caller.
        unsafe { write_text(&text, buf, cap, out_len) }
    })
}

/// Drops every key and frees every slot, without events. Completions of jobs from before the reset
/// must be discarded by the caller (the scheduler does). Cumulative counters are kept.
///
/// Returns `KVO_STATUS_OK` or `KVO_STATUS_NULL_ARGUMENT`.
///
/// # Safety
/// `m` is NULL or a live handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_reset(m: *mut kvo_manager) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        unsafe { handle(m, MANAGER) }?.get()?.reset();
        Ok(())
    })
}

/// Recounts the tier's state and compares it with its counters (slot accounting, reference
/// counts, policy lists). Meant for tests and debug builds of servers: O(slots).
///
/// Returns `KVO_STATUS_OK`; `KVO_STATUS_NULL_ARGUMENT`; `KVO_STATUS_INTERNAL` with a message
/// naming the broken invariant.
///
/// # Safety
/// `m` is NULL or a live handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn kvo_manager_check_invariants(m: *const kvo_manager) -> kvo_status {
    guard(|| {
        // SAFETY: forwarded from the caller.
        unsafe { handle(m, MANAGER) }?.get()?.check_invariants()?;
        Ok(())
    })
}

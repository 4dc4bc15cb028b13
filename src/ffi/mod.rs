//! The C ABI. Translation only: every argument is checked, errors become [`kvo_status`] codes
//! with a thread-local message, and every body runs inside one panic guard (`guard`).
//!
//! Thread-safety (stated once, also at the top of the header): every function may be called
//! from any thread; each handle serializes its own calls, except that a thread waiting for a
//! worker's jobs does not block other calls on that worker; `kvo_*_free` must not race with other
//! calls on the same handle. The library never calls back into the host.
#![allow(non_camel_case_types)]

mod manager;
mod manager_requests;
mod metrics;
mod scheduler;
mod status;
mod step;
mod worker;

pub use manager::*;
pub use manager_requests::*;
pub use metrics::kvo_label;
pub use scheduler::*;
pub use status::kvo_status;
pub use step::*;
pub use worker::*;

use crate::error::Error;
use std::cell::RefCell;
use std::ffi::c_char;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, MutexGuard};

/// Version of the C ABI; bumped on any incompatible change. Compare with `kvo_abi_version()`.
pub const KVO_ABI_VERSION: u32 = 1;

/// Longest key a manager accepts, in bytes (`kvo_manager_config.key_len`).
pub const KVO_MAX_KEY_LEN: u32 = 64;
const _: () = assert!(KVO_MAX_KEY_LEN as usize == crate::manager::MAX_KEY_LEN);

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// A failed call: its status and message.
pub(crate) struct Failure {
    status: kvo_status,
    message: String,
}

impl Failure {
    pub(crate) fn new(status: kvo_status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn null(arg: &str) -> Self {
        Self::new(kvo_status::NullArgument, format!("{arg}: NULL"))
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(kvo_status::InvalidArgument, message)
    }

    /// The same failure with `prefix` before its message (to name a field of an array element).
    pub(crate) fn prefixed(self, prefix: &str) -> Self {
        Self {
            status: self.status,
            message: format!("{prefix}{}", self.message),
        }
    }

    /// A failure of a `kvo_*_new(cfg, ..)`: a bad field names it under `cfg->`; memory that
    /// cannot be had is for the tier, whose size is `cfg->num_slots`.
    pub(crate) fn of_config(e: Error) -> Self {
        let prefix = match e {
            Error::InvalidArgument(_) => "cfg->",
            Error::OutOfMemory(_) => "cfg->num_slots: ",
            _ => "",
        };
        Self::from(e).prefixed(prefix)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Self {
            status: (&e).into(),
            message: e.to_string(),
        }
    }
}

pub(crate) type FfiResult = Result<(), Failure>;

fn set_last_error(message: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = message);
}

/// Runs an exported function's body: clears the last error, maps a failure to its status and
/// message, and turns a panic into `KVO_STATUS_PANIC` instead of unwinding into the host.
pub(crate) fn guard(f: impl FnOnce() -> FfiResult) -> kvo_status {
    LAST_ERROR.with(|e| e.borrow_mut().clear());
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => kvo_status::Ok,
        Ok(Err(fail)) => {
            set_last_error(fail.message);
            fail.status
        }
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown payload".into());
            set_last_error(format!("panic: {msg}"));
            kvo_status::Panic
        }
    }
}

/// Locks a handle's state; a handle poisoned by an earlier panic may only be freed.
pub(crate) fn lock<'a, T>(m: &'a Mutex<T>, name: &str) -> Result<MutexGuard<'a, T>, Failure> {
    m.lock().map_err(|_| {
        Failure::new(
            kvo_status::Panic,
            format!("{name}: unusable after an earlier panic; free it"),
        )
    })
}

/// A handle reference from a possibly NULL pointer.
///
/// # Safety
/// `p` is NULL or points to a live object of type `T`.
pub(crate) unsafe fn handle<'a, T>(p: *const T, name: &str) -> Result<&'a T, Failure> {
    // SAFETY: the caller guarantees `p` is NULL or valid.
    unsafe { p.as_ref() }.ok_or_else(|| Failure::null(name))
}

/// A slice of `n` elements at `p`; `p` may be NULL only when `n == 0`.
///
/// # Safety
/// When non-NULL, `p` points to `n` readable elements.
pub(crate) unsafe fn slice<'a, T>(p: *const T, n: usize, name: &str) -> Result<&'a [T], Failure> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Failure::null(name));
    }
    if n.checked_mul(size_of::<T>())
        .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(Failure::invalid(format!(
            "{name}: {n} elements overflow the address space"
        )));
    }
    // SAFETY: non-NULL, size checked, validity guaranteed by the caller.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// A mutable slice of `n` elements at `p`; `p` may be NULL only when `n == 0`.
///
/// # Safety
/// When non-NULL, `p` points to `n` writable elements not aliased by other arguments.
pub(crate) unsafe fn slice_mut<'a, T>(
    p: *mut T,
    n: usize,
    name: &str,
) -> Result<&'a mut [T], Failure> {
    if n == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(Failure::null(name));
    }
    if n.checked_mul(size_of::<T>())
        .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(Failure::invalid(format!(
            "{name}: {n} elements overflow the address space"
        )));
    }
    // SAFETY: non-NULL, size checked, validity guaranteed by the caller.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
}

/// Writes `v` through an out-pointer.
///
/// # Safety
/// `p` is non-NULL (checked by the caller before doing any work), aligned and writable: the
/// export's contract.
pub(crate) unsafe fn write<T>(p: *mut T, v: T) {
    // SAFETY: the caller's contract.
    unsafe { p.write(v) }
}

/// Hands a new handle owning `value` to the caller through `out`.
///
/// # Safety
/// As [`write`] for `out`.
pub(crate) unsafe fn give<T>(out: *mut *mut T, value: T) {
    // SAFETY: the caller's contract.
    unsafe { write(out, Box::into_raw(Box::new(value))) };
}

/// Frees a handle made by [`give`]; NULL is ignored.
///
/// # Safety
/// `p` is NULL or a handle from [`give`] not freed yet, used by no other call.
pub(crate) unsafe fn free_handle<T>(p: *mut T) {
    let _ = guard(|| {
        if !p.is_null() {
            // SAFETY: a live handle from `give`, freed once (the caller's contract).
            drop(unsafe { Box::from_raw(p) });
        }
        Ok(())
    });
}

/// Fails with `KVO_STATUS_NULL_ARGUMENT` if `p` is NULL.
pub(crate) fn non_null<T>(p: *const T, name: &str) -> FfiResult {
    if p.is_null() {
        Err(Failure::null(name))
    } else {
        Ok(())
    }
}

/// Reads a versioned config struct whose first field is `size_t struct_size`: the whole struct
/// when `struct_size >= sizeof(T)`, or, when `struct_size` is one of the `older` sizes (the
/// struct before fields were appended), that many bytes over `defaults()`.
///
/// # Safety
/// `p` is NULL or points to at least `struct_size` readable bytes.
pub(crate) unsafe fn read_config<T: Copy>(
    p: *const T,
    name: &str,
    older: &[usize],
    defaults: impl FnOnce() -> T,
) -> Result<T, Failure> {
    non_null(p, name)?;
    // SAFETY: non-NULL; every config starts with a size_t.
    let size = unsafe { (p as *const usize).read_unaligned() };
    if size >= size_of::<T>() {
        // SAFETY: at least size_of::<T>() bytes are readable.
        return Ok(unsafe { p.read_unaligned() });
    }
    if !older.contains(&size) {
        let older: Vec<String> = older.iter().map(usize::to_string).collect();
        let known = match older.is_empty() {
            true => String::new(),
            false => format!(" or the size of an older layout ({})", older.join(", ")),
        };
        return Err(Failure::invalid(format!(
            "{name}->struct_size: {size} is neither sizeof the struct ({}){known}; set it to sizeof",
            size_of::<T>()
        )));
    }
    let mut out = defaults();
    // SAFETY: `size` bytes are readable at `p` and `size < size_of::<T>()` fit in `out`; an
    // older struct is a prefix of the current one, so the bytes form valid fields.
    unsafe { std::ptr::copy_nonoverlapping(p as *const u8, &mut out as *mut T as *mut u8, size) };
    Ok(out)
}

/// Writes `value` to a caller struct whose first field is `size_t struct_size` (set by the
/// caller): only `min(struct_size, sizeof(T))` bytes are written, so callers built against an
/// older, shorter struct stay safe. `value.struct_size` must already hold `sizeof(T)`.
///
/// # Safety
/// `out` is NULL or points to `out->struct_size` writable bytes.
pub(crate) unsafe fn write_sized<T: Copy>(out: *mut T, value: T, name: &str) -> FfiResult {
    non_null(out, name)?;
    // SAFETY: non-NULL; the struct starts with a size_t.
    let size = unsafe { (out as *const usize).read_unaligned() };
    if size < size_of::<usize>() {
        return Err(Failure::invalid(format!(
            "{name}->struct_size: {size} is too small"
        )));
    }
    let n = size_of::<T>().min(size);
    // SAFETY: `out` holds `size >= n` bytes, `value` at least `n`; the first field is then
    // overwritten with the size actually written.
    unsafe {
        std::ptr::copy_nonoverlapping(&value as *const T as *const u8, out as *mut u8, n);
        (out as *mut usize).write_unaligned(n);
    }
    Ok(())
}

/// Copies the buffered events of `log` into the caller's buffers (see `kvo_manager_take_events`).
/// Returns Ok when they fit; the caller then drains the log.
///
/// # Safety
/// As for `kvo_manager_take_events`.
#[allow(clippy::too_many_arguments)] // mirrors the C signature
pub(crate) unsafe fn copy_events(
    log: &crate::manager::EventLog,
    key_len: usize,
    out_events: *mut kvo_event,
    events_cap: usize,
    out_keys: *mut u8,
    keys_cap: usize,
    out_n_events: *mut usize,
    out_n_keys: *mut usize,
) -> FfiResult {
    non_null(out_n_events, "out_n_events")?;
    non_null(out_n_keys, "out_n_keys")?;
    let (ne, nk) = (log.len(), log.num_keys());
    if events_cap < ne || keys_cap < nk {
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_n_events, ne) };
        // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
        unsafe { write(out_n_keys, nk) };
        let which = if events_cap < ne {
            "events_cap"
        } else {
            "keys_cap"
        };
        return Err(Failure::new(
            kvo_status::BufferTooSmall,
            format!("{which}: {ne} events with {nk} keys buffered"),
        ));
    }
    // SAFETY: forwarded from the caller.
    let evs = unsafe { slice_mut(out_events, ne, "out_events") }?;
    // SAFETY: forwarded from the caller.
    let keys = unsafe { slice_mut(out_keys, log.all_keys().len(), "out_keys") }?;
    keys.copy_from_slice(log.all_keys());
    let mut first = 0u64;
    for (slot, e) in evs.iter_mut().zip(log.iter()) {
        let n = (e.keys.len() / key_len) as u64;
        *slot = kvo_event {
            first_key: first,
            n_keys: n,
            removed: e.removed as u32,
            metadata_only: e.metadata_only as u32,
        };
        first += n;
    }
    // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
    unsafe { write(out_n_events, ne) };
    // SAFETY: the out-pointer, checked non-NULL above, is writable (the contract).
    unsafe { write(out_n_keys, nk) };
    Ok(())
}

/// Copies `msg` into `out` NUL-terminated, truncated to `out.len() - 1` bytes (nothing if `out`
/// is empty).
pub(crate) fn copy_c_string(msg: &str, out: &mut [u8]) {
    if let Some(room) = out.len().checked_sub(1) {
        let n = msg.len().min(room);
        out[..n].copy_from_slice(&msg.as_bytes()[..n]);
        out[n] = 0;
    }
}

/// Copies the calling thread's last error message into `buf` (NUL-terminated, truncated to
/// `len - 1` bytes) and returns the message's full length without the NUL, so a caller can size
/// its buffer. An empty message means the thread's last call succeeded. `buf` may be NULL when
/// `len` is 0. Never fails.
///
/// # Safety
/// `buf` is NULL or points to `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvo_last_error_message(buf: *mut c_char, len: usize) -> usize {
    catch_unwind(|| {
        LAST_ERROR.with(|e| {
            let msg = e.borrow();
            if !buf.is_null() {
                // SAFETY: `buf` holds `len` writable bytes.
                copy_c_string(&msg, unsafe {
                    std::slice::from_raw_parts_mut(buf as *mut u8, len)
                });
            }
            msg.len()
        })
    })
    .unwrap_or(0)
}

/// The ABI version the library was built with (`KVO_ABI_VERSION` of its header).
#[unsafe(no_mangle)]
pub extern "C" fn kvo_abi_version() -> u32 {
    KVO_ABI_VERSION
}

/// The library version, a static NUL-terminated string owned by the library.
#[unsafe(no_mangle)]
pub extern "C" fn kvo_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        let mut buf = [0 as c_char; 256];
        let n = unsafe { kvo_last_error_message(buf.as_mut_ptr(), buf.len()) };
        let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_str()
            .unwrap()
            .to_owned();
        assert_eq!(n, s.len());
        s
    }

    #[test]
    fn guard_turns_panic_into_status() {
        let st = guard(|| panic!("boom {}", 7));
        assert_eq!(st, kvo_status::Panic);
        assert_eq!(last_error(), "panic: boom 7");
        assert_eq!(guard(|| Ok(())), kvo_status::Ok);
        assert_eq!(last_error(), "");
    }

    #[test]
    fn last_error_truncates_and_reports_full_length() {
        guard(|| Err(Failure::invalid("0123456789")));
        let mut buf = [1 as c_char; 4];
        let n = unsafe { kvo_last_error_message(buf.as_mut_ptr(), 4) };
        assert_eq!(n, 10);
        assert_eq!(buf.map(|c| c as u8), *b"012\0");
        assert_eq!(
            unsafe { kvo_last_error_message(std::ptr::null_mut(), 0) },
            10
        );
    }

    #[test]
    fn version_strings() {
        assert_eq!(kvo_abi_version(), KVO_ABI_VERSION);
        let v = unsafe { std::ffi::CStr::from_ptr(kvo_version()) };
        assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }
}

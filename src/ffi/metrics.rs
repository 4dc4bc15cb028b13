//! What the `kvo_*_metrics_text` functions share: the constant label type, reading the prefix
//! and labels, and copying the rendered text out.

use super::{Failure, FfiResult, copy_c_string, kvo_status, non_null, slice, slice_mut, write};
use crate::metrics::Naming;
use std::ffi::{CStr, c_char};

/// One constant label of the metrics text: `name="value"` on every sample. Both are
/// NUL-terminated UTF-8, read during the call only.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvo_label {
    /// Label name (`[a-zA-Z_][a-zA-Z0-9_]*`, not `le`).
    pub name: *const c_char,
    /// Label value (any UTF-8; escaped in the output).
    pub value: *const c_char,
}

/// A NUL-terminated UTF-8 string argument.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string.
unsafe fn c_str<'a>(p: *const c_char, name: &str) -> Result<&'a str, Failure> {
    non_null(p, name)?;
    // SAFETY: non-NULL, NUL-terminated (the caller's contract).
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|e| Failure::invalid(format!("{name}: not UTF-8 ({e})")))
}

/// The checked prefix and labels of a `kvo_*_metrics_text` call.
///
/// # Safety
/// `prefix` is NULL or a NUL-terminated string; `labels` NULL or `n_labels` entries whose
/// strings are NULL or NUL-terminated.
pub(crate) unsafe fn naming(
    prefix: *const c_char,
    labels: *const kvo_label,
    n_labels: usize,
) -> Result<Naming, Failure> {
    // SAFETY: forwarded from the caller.
    let prefix = unsafe { c_str(prefix, "prefix") }?;
    // SAFETY: forwarded from the caller.
    let ls = unsafe { slice(labels, n_labels, "labels") }?;
    let mut pairs = Vec::with_capacity(ls.len());
    for (i, l) in ls.iter().enumerate() {
        // SAFETY: forwarded from the caller.
        let name = unsafe { c_str(l.name, &format!("labels[{i}].name")) }?;
        // SAFETY: forwarded from the caller.
        let value = unsafe { c_str(l.value, &format!("labels[{i}].value")) }?;
        pairs.push((name, value));
    }
    Ok(Naming::new(prefix, &pairs)?)
}

/// Copies `text` into `buf` (`cap` bytes) NUL-terminated and writes its length without the NUL
/// to `*out_len`; with `cap <= len` writes only `*out_len` and fails with
/// `KVO_STATUS_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `buf` is NULL or `cap` writable bytes; `out_len` is non-NULL (checked by the caller) and
/// writable.
pub(crate) unsafe fn write_text(
    text: &str,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> FfiResult {
    if cap <= text.len() {
        // SAFETY: `out_len` is non-NULL and writable (the caller's contract).
        unsafe { write(out_len, text.len()) };
        return Err(Failure::new(
            kvo_status::BufferTooSmall,
            format!(
                "cap: {cap} bytes, the text needs {} (with its NUL)",
                text.len() + 1
            ),
        ));
    }
    // SAFETY: forwarded from the caller.
    let out = unsafe { slice_mut(buf as *mut u8, cap, "buf") }?;
    copy_c_string(text, out);
    // SAFETY: as above.
    unsafe { write(out_len, text.len()) };
    Ok(())
}

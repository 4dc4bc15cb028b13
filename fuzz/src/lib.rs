//! Fuzz harnesses for kvoffload. Each module runs one kind of input against the library and
//! panics when a promise is broken; `fuzz_targets/` wraps them for libFuzzer, and
//! `tests/corpus.rs` replays the committed corpora through them on stable.

pub mod manager_ops;
pub mod scheduler_ops;
pub mod step_decode;
pub mod worker_jobs;

use kvoffload::ffi::{kvo_last_error_message, kvo_status};

/// The calling thread's last error message.
pub fn fail_message() -> String {
    let mut buf = vec![0u8; 512];
    // SAFETY: a writable buffer of its length.
    let n = unsafe { kvo_last_error_message(buf.as_mut_ptr() as *mut _, buf.len()) };
    buf.truncate(n.min(buf.len() - 1));
    String::from_utf8_lossy(&buf).into_owned()
}

/// A status and the last error message, for assertion messages.
pub fn status_name(st: kvo_status) -> String {
    format!("{st:?} ({})", fail_message())
}

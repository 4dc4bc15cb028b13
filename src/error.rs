//! The crate's error type. Every variant maps to one C status code (`ffi::status`).

/// What went wrong. The message names the argument or the object and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A value out of range or inconsistent with another.
    #[error("{0}")]
    InvalidArgument(String),
    /// An unknown request, job or key.
    #[error("{0}")]
    NotFound(String),
    /// The call is not valid in the current state.
    #[error("{0}")]
    InvalidState(String),
    /// The tier cannot take these blocks now; a normal answer, retry later.
    #[error("{0}")]
    NoRoom(String),
    /// An output buffer is too small; `needed` elements are required.
    #[error("{what} holds {got} elements, {needed} needed")]
    BufferTooSmall {
        /// The buffer's argument name.
        what: &'static str,
        /// Elements needed.
        needed: usize,
        /// Elements given.
        got: usize,
    },
    /// Serialized bytes that are truncated, corrupt or of another version.
    #[error("{0}")]
    CorruptData(String),
    /// No CUDA driver or device.
    #[error("{0}")]
    CudaUnavailable(String),
    /// A CUDA call failed; the message names the call and the driver's error.
    #[error("{0}")]
    Cuda(String),
    /// An operating-system call failed.
    #[error("{0}")]
    Io(String),
    /// A wait ran out of time.
    #[error("{0}")]
    Timeout(String),
    /// Memory could not be allocated.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// An invariant was found broken (a bug).
    #[error("internal error: {0}")]
    Internal(String),
}

/// Shorthand used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

macro_rules! invalid {
    ($($arg:tt)*) => { $crate::error::Error::InvalidArgument(format!($($arg)*)) };
}
pub(crate) use invalid;

//! Status codes of the C API. Values are never renumbered; new ones go at the end.

use crate::error::Error;

/// The result of every fallible C function. `KVO_STATUS_OK` is 0; details of any other value
/// are in `kvo_last_error_message`.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvo_status {
    /// Success.
    Ok = 0,
    /// A required pointer was NULL.
    NullArgument = 1,
    /// A value out of range or inconsistent with another.
    InvalidArgument = 2,
    /// An unknown request, job or key.
    NotFound = 3,
    /// The call is not valid now.
    InvalidState = 4,
    /// The tier cannot take these blocks now (a normal answer: retry on a later step).
    NoRoom = 5,
    /// An output buffer is too small; the needed size is written to its out-parameter.
    BufferTooSmall = 6,
    /// Serialized bytes that are truncated, corrupt or of another format version.
    CorruptData = 7,
    /// No CUDA driver or device.
    CudaUnavailable = 8,
    /// A CUDA call failed.
    CudaError = 9,
    /// An operating-system call failed.
    IoError = 10,
    /// A bug inside the library was caught at the boundary; the handle may only be freed.
    Panic = 11,
    /// An invariant was found broken.
    Internal = 12,
    /// A wait ran out of time before the jobs finished.
    Timeout = 13,
    /// Memory for the requested sizes could not be had (nothing was changed).
    OutOfMemory = 14,
}

impl From<&Error> for kvo_status {
    fn from(e: &Error) -> Self {
        match e {
            Error::InvalidArgument(_) => Self::InvalidArgument,
            Error::NotFound(_) => Self::NotFound,
            Error::InvalidState(_) => Self::InvalidState,
            Error::NoRoom(_) => Self::NoRoom,
            Error::BufferTooSmall { .. } => Self::BufferTooSmall,
            Error::CorruptData(_) => Self::CorruptData,
            Error::CudaUnavailable(_) => Self::CudaUnavailable,
            Error::Cuda(_) => Self::CudaError,
            Error::Io(_) => Self::IoError,
            Error::OutOfMemory(_) => Self::OutOfMemory,
            Error::Timeout(_) => Self::Timeout,
            Error::Internal(_) => Self::Internal,
        }
    }
}

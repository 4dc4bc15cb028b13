//! kvoffload: offload the KV cache of LLM inference servers from GPU memory to host memory and
//! bring it back.
//!
//! Layers (see `DESIGN.md`): [`manager`] indexes the offload tier (slots, LRU/ARC eviction,
//! events); [`ffi`] is the C ABI over it. The Rust API is the same set of operations without the
//! pointer checks.

pub mod error;
pub mod ffi;
pub mod manager;
pub mod replay;
pub mod scheduler;
pub mod transfer;

pub use error::{Error, Result};

//! kvoffload: offload the KV cache of LLM inference servers from GPU memory to host memory and
//! bring it back.
//!
//! Layers (see `docs/design.md` §1): [`manager`] indexes the offload tier (slots, LRU/ARC eviction,
//! events); [`scheduler`] decides what to load and store each step (matching, deferral, jobs,
//! step plans); [`transfer`] copies the bytes (host and CUDA backends); [`ffi`] is the C ABI over
//! them. The Rust API is the same set of operations without the pointer checks.

pub mod error;
pub mod ffi;
pub mod manager;
pub mod metrics;
pub mod plan;
pub mod scheduler;
pub mod transfer;

pub use error::{Error, Result};

//! Block copies: the worker side. Executes the load and store jobs of step plans on registered
//! KV tensors and host tier buffers, and reports completions (polled, in submission order per
//! direction). Knows nothing about prefixes or eviction.

pub mod backend;
pub mod copy_plan;
pub mod cuda;
pub mod host;
pub mod layout;
pub mod stats;
pub mod worker;

pub use backend::{Backend, Completion, CopyDesc};
pub use copy_plan::JobBlocks;
pub use layout::KvTensor;
pub use stats::{DirectionStats, SIZE_BUCKET_BOUNDS, SIZE_BUCKETS, WorkerStats};
pub use worker::{BackendKind, Worker, WorkerConfig};

#[cfg(test)]
mod tests;

//! Block copies: the worker side. Executes the load and store jobs of step plans on registered
//! KV tensors and host tier buffers, and reports completions (polled, in submission order per
//! direction). Knows nothing about prefixes or eviction.

pub mod backend;
pub mod cuda;

pub use backend::{Backend, Completion, CopyDesc, Direction};

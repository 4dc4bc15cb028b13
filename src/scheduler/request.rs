//! Per-request state of the scheduler.

use crate::manager::RequestId;

/// One tracked request.
#[derive(Debug, Clone, Default)]
pub(crate) struct Request {
    pub prompt_tokens: u64,
    /// Tokens of the request now (prompt + generated), as last reported.
    pub num_tokens: u64,
    pub max_offload_tokens: Option<u64>,
    /// Block hashes appended so far (one per full GPU block).
    pub num_hashes: u64,
    /// Offload keys: the hash of the last GPU block of each complete chunk, back to back.
    pub keys: Vec<u8>,
    /// The tier's hash of each key ([`crate::manager::Manager::key_hash`]), computed once.
    pub key_hashes: Vec<u64>,
    /// GPU block ids of the request (cleared at match and on resumption).
    pub block_ids: Vec<u32>,
    /// Next chunk to offload (chunks are offloaded in order).
    pub next_stored_chunk: u64,
    /// GPU prefix-cache hit tokens given to the last match.
    pub num_local_computed: u64,
    /// In-flight jobs: one load, or stores, never both.
    pub jobs: Vec<u64>,
    /// Finished or aborted; dropped once its last job completes.
    pub finished: bool,
    /// The hit of the last match, until `on_alloc` consumes it.
    pub matched_hit: Option<u64>,
    /// The last `build_step` call that scheduled it (duplicate detection).
    pub build_mark: u64,
    /// Tokens to recompute after a failed load: `[from, to)`; reported until the next match.
    pub recompute: Option<(u64, u64)>,
    /// vLLM 0.33: the request's access record in the tier, until it is committed (the step
    /// after the request finished, or a reset).
    pub record: Option<RequestId>,
    /// Tokens whose KV is computed after the last step that scheduled the request.
    pub computed: u64,
    /// vLLM 0.33: finished, and its final store jobs and commit are due in the next step.
    pub final_pending: bool,
}

impl Request {
    pub fn num_keys(&self, key_len: usize) -> u64 {
        (self.keys.len() / key_len) as u64
    }

    /// The position of chunk `c`'s key (vLLM 0.33 `set_offload_key_position`): the tokens up
    /// to the end of the chunk.
    pub fn position(c: u64, chunk_tokens: u64) -> u64 {
        (c + 1) * chunk_tokens
    }

    /// Keys of chunks `from..to`, back to back.
    pub fn keys_of(&self, key_len: usize, from: u64, to: u64) -> &[u8] {
        &self.keys[from as usize * key_len..to as usize * key_len]
    }

    /// The hashes of the keys of chunks `from..to`.
    pub fn hashes_of(&self, from: u64, to: u64) -> &[u64] {
        &self.key_hashes[from as usize..to as usize]
    }
}

/// A request finished since the last step (vLLM 0.33), due for its final store jobs and its
/// commit in the next one.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Finishing {
    /// Still tracked: a final store may come, or jobs are in flight.
    Tracked(u64),
    /// Dropped at its finish (no job in flight, no chunk left that a final store could
    /// offer): only its record is left to commit.
    Record(RequestId),
}

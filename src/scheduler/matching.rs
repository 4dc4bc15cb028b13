//! Matching a waiting request, and its load job after allocation.
//!
//! **The deferral rule** (the fix for the preemption / re-admission race of vLLM issue #46014):
//! while a request has any job in flight, [`Scheduler::match_request`] answers
//! `Defer(JobsInFlight)` at once, looking nothing up and touching nothing, and the request's GPU
//! blocks are given back (its jobs enter the reuse fence). An asynchronous host can re-admit a
//! preempted request while the stores flushed at its preemption are still running: matching it
//! then would load into blocks those stores still read, or count its own in-flight stores as
//! hits. The request is retried on a later step, after the completions arrive.
//!
//! Two further deferrals keep one prefix from being loaded twice or read half-written: a hit key
//! whose store is in flight (`Defer(StoreInFlight)`), and a hit chunk another request's load has
//! pinned (`Defer(BeingLoaded)`, checked again by [`Scheduler::on_alloc`], which refuses a load
//! of chunks pinned since the match).

use super::types::DeferReason;
use super::{Direction, Error, Job, Match, Request, Result, Scheduler, invalid, take_filled};
use crate::manager::Manager;

impl Scheduler {
    /// Matches a waiting request against the tier. `num_computed_tokens` are the tokens already
    /// hit in the GPU prefix cache (whole GPU blocks).
    ///
    /// Clears the request's GPU block ids (stale after a preemption). While the request has any
    /// job in flight it answers [`DeferReason::JobsInFlight`] at once, looking nothing up and
    /// touching nothing. Otherwise looks up the complete chunks after the GPU hit (a hit needs
    /// at least one full chunk), then (0.24 semantics) touches all the request's keys. In 0.33
    /// semantics nothing is touched, and every call (also one that defers) rewinds the next
    /// chunk to store to the first.
    ///
    /// Fails with [`Error::InvalidState`], changing nothing, if the request is finished or its
    /// block hashes do not cover its tokens.
    pub fn match_request(&mut self, id: u64, num_computed_tokens: u64) -> Result<Match> {
        let (kl, chunk_tokens, gbs) = (
            self.cfg.key_len,
            self.cfg.chunk_tokens(),
            self.cfg.gpu_block_size as u64,
        );
        let r = self.live_request(id)?;
        let in_flight = !r.jobs.is_empty();
        if !in_flight && r.num_hashes < r.num_tokens / gbs {
            return Err(Error::InvalidState(format!(
                "request_id: {id} has {} block hashes, its {} tokens need {} (append them first)",
                r.num_hashes,
                r.num_tokens,
                r.num_tokens / gbs
            )));
        }
        self.stats.matches += 1;
        if in_flight {
            // A request matched again has no GPU blocks: the ones its jobs touch are given back.
            self.release_blocks(id);
        }
        let v033 = self.v033();
        let r = self.requests.get_mut(&id).expect("checked");
        r.block_ids.clear();
        r.recompute = None;
        r.matched_hit = None;
        // Its new blocks will hold only the GPU prefix hit: a final store (0.33) of what it
        // computed before must not read them.
        r.computed = num_computed_tokens;
        if v033 {
            // vLLM 0.33: every match (also one that defers) offers the chunks again from the
            // first, so chunks evicted while the request waited are stored again.
            r.next_stored_chunk = 0;
        }
        if in_flight {
            self.stats.deferred_jobs_in_flight += 1;
            return Ok(Match::Defer(DeferReason::JobsInFlight));
        }
        r.num_local_computed = num_computed_tokens;
        let result = lookup(
            &mut self.manager,
            r,
            num_computed_tokens,
            chunk_tokens,
            kl,
            v033,
        )?;
        match result {
            Match::Defer(DeferReason::StoreInFlight) => self.stats.deferred_store_in_flight += 1,
            Match::Defer(_) => self.stats.deferred_being_loaded += 1,
            Match::Hit(n) => {
                r.matched_hit = Some(n);
                self.stats.hits += 1;
                self.stats.hit_tokens += n;
            }
            Match::Miss => {}
        }
        Ok(result)
    }

    /// Records the GPU blocks allocated to a request after a match, and with
    /// `num_external_tokens > 0` (the hit to load) makes its load job: pins the keys and queues
    /// the job for the next step. `block_ids` are all the request's GPU blocks. Returns the job
    /// id, or `None` when there is nothing to load.
    ///
    /// Fails, changing nothing: [`Error::InvalidState`] if the request is finished, or (with
    /// `num_external_tokens > 0`) has jobs in flight or its last match was not a hit of at least
    /// that many tokens, or another request's load pinned the hit since (match again);
    /// [`Error::InvalidArgument`] if the tokens exceed the offloaded chunks or
    /// `block_ids` is shorter than the tokens need; [`Error::NotFound`] /
    /// [`Error::InvalidState`] from the tier if a key is no longer ready.
    pub fn on_alloc(
        &mut self,
        id: u64,
        block_ids: &[u32],
        num_external_tokens: u64,
    ) -> Result<Option<u64>> {
        let (kl, chunk_tokens, gbs) = (
            self.cfg.key_len,
            self.cfg.chunk_tokens(),
            self.cfg.gpu_block_size as u64,
        );
        let r = self.live_request(id)?;
        if num_external_tokens == 0 {
            // Recorded even without a load (vLLM #46951): these blocks may be reused ones.
            self.allocated.extend_from_slice(block_ids);
            self.requests.get_mut(&id).expect("checked").matched_hit = None;
            return Ok(None);
        }
        if !r.jobs.is_empty() {
            return Err(Error::InvalidState(format!(
                "request_id: {id} has jobs in flight; match defers it until they complete"
            )));
        }
        if r.matched_hit.is_none_or(|hit| num_external_tokens > hit) {
            return Err(Error::InvalidState(format!(
                "num_external_tokens: {num_external_tokens} for request {id}, whose last match was not a hit of that many tokens ({:?})",
                r.matched_hit
            )));
        }
        let local = r.num_local_computed;
        let total = local
            .checked_add(num_external_tokens)
            .filter(|&t| t <= r.num_keys(kl) * chunk_tokens)
            .ok_or_else(|| {
                invalid!(
                    "num_external_tokens: {num_external_tokens} after {local} GPU-hit tokens exceeds the {} offloaded chunks",
                    r.num_keys(kl)
                )
            })?;
        let num_gpu = total.div_ceil(gbs);
        if (block_ids.len() as u64) < num_gpu {
            return Err(invalid!(
                "block_ids: {} ids, {num_gpu} needed for {total} tokens",
                block_ids.len()
            ));
        }
        let local_gpu = local / gbs;
        let num_chunks = total.div_ceil(chunk_tokens);
        let r = &self.requests[&id];
        let keys = r.keys_of(
            kl,
            local_gpu / self.cfg.block_size_factor as u64,
            num_chunks,
        );
        // Another request's load may have pinned these chunks since the match: loading them
        // twice is what `Defer(BeingLoaded)` prevents, so the host must match again.
        if being_loaded(&self.manager, keys, kl) {
            return Err(Error::InvalidState(format!(
                "request_id: {id}: its hit is being loaded by another request; match it again"
            )));
        }
        self.scratch_slots.resize(keys.len() / kl, 0);
        let first = local_gpu / self.cfg.block_size_factor as u64;
        match r.record {
            Some(record) => {
                let ct = chunk_tokens;
                self.scratch_positions.clear();
                self.scratch_positions
                    .extend((first..num_chunks).map(|c| Request::position(c, ct)));
                let positions = &self.scratch_positions;
                self.manager
                    .prepare_load_for(record, keys, positions, &mut self.scratch_slots)?
            }
            None => self.manager.prepare_load(keys, &mut self.scratch_slots)?,
        };
        let job_id = self.next_job_id;
        self.next_job_id += 1;
        let dst = &block_ids[local_gpu as usize..num_gpu as usize];
        self.pending_loads.push_job(
            job_id,
            Direction::Load,
            id,
            local_gpu as u32,
            &self.scratch_slots,
            dst,
        );
        let job = Job {
            request_id: id,
            kind: Direction::Load,
            pending: self.cfg.num_workers,
            failed: false,
            keys: take_filled(&mut self.spare_keys, keys),
            gpu_blocks: take_filled(&mut self.spare_blocks, dst),
            slots: Vec::new(),
            tokens: (local_gpu * gbs, total),
            first_chunk: local_gpu / self.cfg.block_size_factor as u64,
            released: false,
        };
        self.jobs.insert(job_id, job);
        let r = self.requests.get_mut(&id).expect("checked");
        r.jobs.push(job_id);
        r.next_stored_chunk = num_chunks;
        r.matched_hit = None;
        self.allocated.extend_from_slice(block_ids);
        self.stats.load_jobs += 1;
        Ok(Some(job_id))
    }
}

/// True when a key of `keys` is pinned by a load in flight (only loads pin keys).
fn being_loaded(m: &Manager, keys: &[u8], kl: usize) -> bool {
    m.stats().pinned > 0
        && keys
            .chunks_exact(kl)
            .any(|k| m.ref_count(k).is_some_and(|rc| rc > 0))
}

/// The lookup of vLLM `get_num_new_matched_tokens` for one full-attention group: the ready
/// chunks after the GPU hit of `c` tokens, capped by the request's tokens. In 0.24 semantics
/// then touches all the request's keys (in the same pass over the tier's index).
fn lookup(
    m: &mut Manager,
    r: &Request,
    c: u64,
    chunk_tokens: u64,
    kl: usize,
    v033: bool,
) -> Result<Match> {
    let nk = r.num_keys(kl);
    let max_hit = r.num_tokens.min(nk * chunk_tokens);
    if max_hit < c.saturating_add(chunk_tokens) {
        if !v033 {
            m.seed_hashes(&r.keys, &r.key_hashes);
            m.touch(&r.keys)?;
        }
        return Ok(Match::Miss);
    }
    let (start, end) = (c / chunk_tokens, max_hit.div_ceil(chunk_tokens).min(nk));
    let p = if v033 {
        let keys = r.keys_of(kl, start, end);
        m.seed_hashes(keys, r.hashes_of(start, end));
        m.lookup_prefix(keys)?
    } else {
        m.seed_hashes(&r.keys, &r.key_hashes);
        m.lookup_prefix_touch(&r.keys, start as usize..end as usize)?
    };
    if p.hits == 0 {
        return Ok(Match::Miss);
    }
    if p.retry {
        return Ok(Match::Defer(DeferReason::StoreInFlight));
    }
    let hit = max_hit.min(chunk_tokens * (start + p.hits as u64)) - c;
    if hit < chunk_tokens {
        return Ok(Match::Miss);
    }
    // Only loads pin keys: with none in flight nothing can be being loaded.
    Ok(
        if being_loaded(
            m,
            r.keys_of(kl, c / chunk_tokens, (c + hit).div_ceil(chunk_tokens)),
            kl,
        ) {
            Match::Defer(DeferReason::BeingLoaded)
        } else {
            Match::Hit(hit)
        },
    )
}

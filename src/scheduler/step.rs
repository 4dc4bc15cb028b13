//! Building a step's plan: the loads made since the last step, the store jobs of the scheduled
//! requests' newly complete chunks, and the flush set.

use super::{
    Direction, Error, Finishing, Job, Result, ScheduledRequest, Scheduler, SchedulerConfig, Step,
    invalid, take_cleared, take_filled,
};
use hashbrown::hash_map::Entry;

impl Scheduler {
    /// Builds the step plan into `step`: the load jobs made since the last step, the store jobs
    /// of the scheduled requests' newly complete chunks, and the flush set: the jobs of the
    /// preempted requests, the fenced jobs touching a GPU block allocated since the last step
    /// (see [`Self::finish_request`]), and the jobs of a reset. A preempted request's load not
    /// yet in a step is withdrawn (it never ships; its keys are unpinned).
    ///
    /// Fails, changing nothing: [`Error::NotFound`] for an unknown request,
    /// [`Error::InvalidState`] for a finished one or one whose load is in flight,
    /// [`Error::InvalidArgument`] for a request scheduled twice, scheduled and preempted at once,
    /// or whose block ids do not cover its computed tokens.
    pub fn build_step(
        &mut self,
        scheduled: &[ScheduledRequest<'_>],
        preempted: &[u64],
        step: &mut Step,
    ) -> Result<()> {
        let gbs = self.cfg.gpu_block_size as u64;
        // Each call marks its requests with a new number: a request met twice is a duplicate.
        self.build_calls += 1;
        let mark = self.build_calls;
        for (i, s) in scheduled.iter().enumerate() {
            let id = s.request_id;
            let r = match self.requests.get_mut(&id) {
                None => return Err(Error::NotFound(format!("request_id: {id} is not tracked"))),
                Some(r) if r.finished => {
                    return Err(Error::InvalidState(format!("request_id: {id} is finished")));
                }
                Some(r) => r,
            };
            if std::mem::replace(&mut r.build_mark, mark) == mark {
                return Err(invalid!(
                    "scheduled[{i}].request_id: {id} is scheduled twice"
                ));
            }
            if r.jobs.iter().any(|j| self.jobs[j].kind == Direction::Load) {
                return Err(Error::InvalidState(format!(
                    "scheduled[{i}].request_id: {} is still loading; schedule it after its load completes",
                    s.request_id
                )));
            }
            let after = s
                .num_computed_tokens
                .checked_add(s.num_scheduled_tokens)
                .ok_or_else(|| {
                    invalid!("scheduled[{i}]: num_computed_tokens + num_scheduled_tokens overflows")
                })?;
            let blocks = if s.resumed { 0 } else { r.block_ids.len() } + s.new_block_ids.len();
            if (blocks as u64).saturating_mul(gbs) < after.min(s.num_tokens) {
                return Err(invalid!(
                    "scheduled[{i}].new_block_ids: request {} would have {blocks} GPU blocks for {} tokens",
                    s.request_id,
                    after.min(s.num_tokens)
                ));
            }
        }
        for (i, &p) in preempted.iter().enumerate() {
            let r = self.request(p).map_err(|_| {
                Error::NotFound(format!("preempted[{i}]: request {p} is not tracked"))
            })?;
            if r.build_mark == mark {
                return Err(invalid!(
                    "preempted[{i}]: request {p} is also scheduled in this step"
                ));
            }
        }

        // Each request's state is updated and its offloadable chunks after this step counted;
        // on large tiers the index misses of every store candidate of the step start at once.
        self.scratch_chunks.clear();
        for s in scheduled {
            if s.resumed {
                self.release_blocks(s.request_id);
            }
            let r = self.requests.get_mut(&s.request_id).expect("validated");
            r.num_tokens = s.num_tokens;
            r.computed = s.num_computed_tokens + s.num_scheduled_tokens;
            if s.resumed {
                r.block_ids.clear();
            }
            r.block_ids.extend_from_slice(s.new_block_ids);
            self.allocated.extend_from_slice(s.new_block_ids);
            let n = limit_chunks(&self.cfg, r, r.computed.min(r.num_tokens));
            if n > r.next_stored_chunk {
                self.manager
                    .prefetch_hashed(r.hashes_of(r.next_stored_chunk, n));
            }
            self.scratch_chunks.push(n);
        }
        for &p in preempted {
            // The flush makes the worker finish these jobs before this step's copies and forward
            // pass, so whatever reuses the blocks from this step on is safe: no fence needed.
            self.withdraw_unshipped_load(p);
            // Its blocks are the host's again: nothing it computed is on the GPU any more (a
            // final store of a request finished while preempted must read nothing).
            let r = self.requests.get_mut(&p).expect("validated");
            r.block_ids.clear();
            r.computed = 0;
            for &j in &self.requests[&p].jobs {
                self.flush.push(j);
                self.jobs.get_mut(&j).expect("in flight").released = true;
            }
        }
        if self
            .finishing
            .iter()
            .any(|f| matches!(f, Finishing::Tracked(_)))
        {
            // Final stores leave out chunks on blocks given to another request since.
            self.scratch_allocated.clear();
            self.scratch_allocated.extend_from_slice(&self.allocated);
            self.scratch_allocated.sort_unstable();
        }
        if self.fence.is_empty() {
            self.allocated.clear();
        }
        for b in self.allocated.drain(..) {
            if let Some(jobs) = self.fence.get(&b) {
                self.flush.extend_from_slice(jobs);
            }
        }
        step.clear(self.cfg.block_size_factor);
        for j in self.pending_loads.jobs() {
            if self.jobs.contains_key(&j.id) {
                step.push_from(&self.pending_loads, j);
            }
        }
        self.pending_loads.clear(self.cfg.block_size_factor);
        let touches = !self.v033();
        for (i, s) in scheduled.iter().enumerate() {
            // The next storing request's keys are needed next: start their misses again now
            // (0.24: all its keys, which it touches; 0.33: its store candidates).
            if let Some(next) = scheduled.get(i + 1) {
                let (r, n) = (&self.requests[&next.request_id], self.scratch_chunks[i + 1]);
                if n > r.next_stored_chunk {
                    let hashes = match touches {
                        true => &r.key_hashes[..],
                        false => r.hashes_of(r.next_stored_chunk, n),
                    };
                    self.manager.prefetch_hashed(hashes);
                }
            }
            self.build_store_job(s.request_id, self.scratch_chunks[i], step);
        }
        self.finish_requests(step);
        step.set_flush(self.flush.drain(..));
        Ok(())
    }

    /// vLLM 0.33: the requests finished since the last step, in finish order, get their final
    /// store jobs, then their records are committed to the tier; a request without jobs left is
    /// dropped.
    fn finish_requests(&mut self, step: &mut Step) {
        let finishing = std::mem::take(&mut self.finishing);
        for &f in &finishing {
            if let Finishing::Tracked(id) = f
                && let Some(n) = self.final_chunks(id)
                && self.build_store_job(id, n, step)
            {
                // Its blocks are given back: the new job enters the reuse fence at once.
                self.release_blocks(id);
            }
        }
        for &f in &finishing {
            let id = match f {
                Finishing::Record(record) => {
                    self.commit_record(Some(record));
                    continue;
                }
                Finishing::Tracked(id) => id,
            };
            let Entry::Occupied(mut at) = self.requests.entry(id) else {
                unreachable!("request {id} is finishing")
            };
            let r = at.get_mut();
            r.final_pending = false;
            let record = r.record.take();
            let done = r.jobs.is_empty().then(|| at.remove());
            self.commit_record(record);
            if let Some(r) = done {
                self.keep_spare(r);
            }
        }
        self.finishing = finishing;
        self.finishing.clear();
    }

    /// The chunks a finished request may still offload (vLLM 0.33 `_build_store_jobs` of a
    /// finished request): those whose KV was computed by its last step, with the usual limits,
    /// up to the first chunk on a GPU block given to another request since the last step;
    /// `None` when that adds no chunk to those offered already.
    fn final_chunks(&self, id: u64) -> Option<u64> {
        let r = &self.requests[&id];
        let f = self.cfg.block_size_factor as usize;
        let n = final_limit(&self.cfg, r);
        let n = (r.next_stored_chunk..n)
            .find(|&c| {
                r.block_ids[c as usize * f..(c as usize + 1) * f]
                    .iter()
                    .any(|b| self.scratch_allocated.binary_search(b).is_ok())
            })
            .unwrap_or(n);
        (n > r.next_stored_chunk).then_some(n)
    }

    /// The store job of one request (vLLM `_get_reqs_to_store` / `_build_store_jobs`, one
    /// request): its complete chunks from `next_stored_chunk` to `n` (its offloadable chunks
    /// after this step) not yet in the tier, if the tier has room; then (0.24) all its keys are
    /// touched. Returns whether a job was made. Cannot fail: the keys are the request's own, of
    /// the tier's width.
    fn build_store_job(&mut self, id: u64, n: u64, step: &mut Step) -> bool {
        let (kl, f) = (self.cfg.key_len, self.cfg.block_size_factor as usize);
        let ct = self.cfg.chunk_tokens();
        let r = self.requests.get_mut(&id).expect("validated");
        let start = r.next_stored_chunk;
        if n <= start {
            // vLLM 0.33 never moves the index back here; 0.24 sets it.
            r.next_stored_chunk = if r.record.is_some() { start } else { n };
            return false;
        }
        let candidates = r.keys_of(kl, start, n);
        self.manager.seed_hashes(candidates, r.hashes_of(start, n));
        // The plan's buffers keep their longest length; the call's outputs are their fronts.
        let plan = &mut self.plan;
        let m = (n - start) as usize;
        if plan.indices.len() < m {
            plan.indices.resize(m, 0);
            plan.slots.resize(m, 0);
            plan.evicted.resize(m * kl, 0);
        }
        let (ix, slots, evicted) = (&mut plan.indices, &mut plan.slots, &mut plan.evicted);
        let stored = match r.record {
            Some(record) => {
                self.scratch_positions.clear();
                self.scratch_positions
                    .extend((start..n).map(|c| super::Request::position(c, ct)));
                let p = &self.scratch_positions;
                self.manager
                    .prepare_store_for_owned(record, candidates, p, ix, slots, evicted)
            }
            None => self
                .manager
                .prepare_store_into(candidates, ix, slots, evicted),
        };
        let stored_n = stored.as_ref().map_or(0, |c| c.stored);
        match stored {
            Err(Error::NoRoom(_)) => {
                self.stats.store_no_room += 1;
                return false;
            }
            Err(e) => unreachable!("prepare_store of a request's own keys: {e}"),
            Ok(c) if c.stored == 0 => {
                r.next_stored_chunk = n;
                return false;
            }
            Ok(_) => {}
        }
        if r.record.is_none() {
            self.manager.seed_hashes(&r.keys, &r.key_hashes);
            self.manager
                .touch(&r.keys)
                .expect("a request's keys have the tier's width");
        }
        // The stored chunks: usually one run (all but the already stored ones), copied at once.
        let (mut keys, mut blocks) = (
            take_cleared(&mut self.spare_keys),
            take_cleared(&mut self.spare_blocks),
        );
        let ix = &self.plan.indices[..stored_n];
        let (first, last) = (
            start as usize + ix[0] as usize,
            start as usize + ix[ix.len() - 1] as usize,
        );
        if last + 1 - first == ix.len() {
            keys.extend_from_slice(&r.keys[first * kl..(last + 1) * kl]);
            blocks.extend_from_slice(&r.block_ids[first * f..(last + 1) * f]);
        } else {
            for &i in ix {
                let chunk = start as usize + i as usize;
                keys.extend_from_slice(&r.keys[chunk * kl..(chunk + 1) * kl]);
                blocks.extend_from_slice(&r.block_ids[chunk * f..(chunk + 1) * f]);
            }
        }
        let job_id = self.next_job_id;
        self.next_job_id += 1;
        step.push_job(
            job_id,
            Direction::Store,
            id,
            (first * f) as u32,
            &blocks,
            &self.plan.slots[..stored_n],
        );
        r.jobs.push(job_id);
        r.next_stored_chunk = n;
        self.stats.store_jobs += 1;
        self.stats.stored_chunks += ix.len() as u64;
        let job = Job {
            request_id: id,
            kind: Direction::Store,
            pending: self.cfg.num_workers,
            failed: false,
            keys,
            gpu_blocks: blocks,
            slots: take_filled(&mut self.spare_blocks, &self.plan.slots[..stored_n]),
            tokens: (0, 0),
            first_chunk: first as u64,
            released: false,
        };
        self.jobs.insert(job_id, job);
        true
    }
}

/// The complete chunks of `tokens` that request `r` may offload: capped by its
/// `max_offload_tokens`, its prompt (with `offload_prompt_only`) and its keys.
fn limit_chunks(cfg: &SchedulerConfig, r: &super::Request, tokens: u64) -> u64 {
    let mut offloadable = tokens;
    if let Some(cap) = r.max_offload_tokens {
        offloadable = offloadable.min(cap);
    }
    if cfg.offload_prompt_only {
        offloadable = offloadable.min(r.prompt_tokens);
    }
    (offloadable / cfg.chunk_tokens()).min(r.num_keys(cfg.key_len))
}

/// The chunks finished request `r` may offload at most (vLLM 0.33 `_build_store_jobs` of a
/// finished request, before chunks on blocks given to another request are left out): those
/// whose KV its last step computed, with the usual limits, on its GPU blocks.
pub(super) fn final_limit(cfg: &SchedulerConfig, r: &super::Request) -> u64 {
    let f = cfg.block_size_factor as usize;
    let n = limit_chunks(cfg, r, r.computed.min(r.num_tokens));
    n.min((r.block_ids.len() / f) as u64)
}

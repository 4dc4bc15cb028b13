//! Job completion, finishing requests, the GPU-block reuse fence, and reset.
//!
//! **The reuse fence**: a request gives its GPU blocks back when it is finished or aborted,
//! matched again with jobs in flight, or resumed on other blocks. Its shipped jobs that still
//! touch them (a store reads its blocks, a load writes them) enter the fence, keyed by block;
//! the step that allocates a fenced block flushes those jobs, so the workers finish them before
//! that step's copies and forward pass. A job leaves the fence when its completion is reported.
//! Preemption flushes the request's jobs in the same step, which needs no fence; a load not yet
//! in a step is withdrawn instead (it never ships).

use super::{Direction, Error, Finishing, JobReport, Request, Result, Scheduler, invalid, recycle};
use crate::manager::RequestId;

impl Scheduler {
    /// Counts worker reports. A job completes once `num_workers` reports arrived; it failed if
    /// any report failed. On completion: a store's keys become ready (or are rolled back), a
    /// load's keys are unpinned (and on failure dropped from the tier, the request then reports
    /// the tokens to recompute). Ids from before a reset are ignored.
    ///
    /// Fails, changing nothing: [`Error::NotFound`] for an unknown job id,
    /// [`Error::InvalidState`] for a load not yet in a step, [`Error::InvalidArgument`] for a
    /// zero count or more reports than workers.
    pub fn complete_jobs(&mut self, reports: &[JobReport]) -> Result<()> {
        self.scratch_counts.clear();
        for (i, rep) in reports.iter().enumerate() {
            if rep.count == 0 {
                return Err(invalid!("reports[{i}].count: 0"));
            }
            if rep.job_id < self.stale_below {
                // From before a reset: ignored, but only if it could be a real report.
                if rep.count > self.cfg.num_workers {
                    return Err(invalid!(
                        "reports[{i}].count: {} reports for stale job {} but only {} workers",
                        rep.count,
                        rep.job_id,
                        self.cfg.num_workers
                    ));
                }
                continue;
            }
            let Some(job) = self.jobs.get(&rep.job_id) else {
                return Err(Error::NotFound(format!(
                    "reports[{i}].job_id: {} is not in flight",
                    rep.job_id
                )));
            };
            if self.pending_loads.jobs().iter().any(|j| j.id == rep.job_id) {
                return Err(Error::InvalidState(format!(
                    "reports[{i}].job_id: load {} is not in a step yet",
                    rep.job_id
                )));
            }
            let seen = self.scratch_counts.entry(rep.job_id).or_insert(0);
            *seen = seen.saturating_add(rep.count);
            if *seen > job.pending {
                return Err(invalid!(
                    "reports[{i}].count: job {} has {} reports pending, {} given",
                    rep.job_id,
                    job.pending,
                    *seen
                ));
            }
        }
        for rep in reports {
            if rep.job_id < self.stale_below {
                continue;
            }
            let job = self.jobs.get_mut(&rep.job_id).expect("validated");
            job.pending -= rep.count;
            job.failed |= !rep.success;
            if job.pending == 0 {
                self.finish_job(rep.job_id)?;
            }
        }
        Ok(())
    }

    fn finish_job(&mut self, job_id: u64) -> Result<()> {
        let job = self.jobs.remove(&job_id).expect("in flight");
        let r = self
            .requests
            .get_mut(&job.request_id)
            .expect("a job's request is tracked");
        if job.failed {
            self.stats.failed_jobs += 1;
            // Its chunks are not in the tier (rolled back or dropped): offer them again.
            r.next_stored_chunk = r.next_stored_chunk.min(job.first_chunk);
        }
        match job.kind {
            Direction::Store => {
                self.manager
                    .complete_store_at(&job.keys, &job.slots, !job.failed)?
            }
            Direction::Load => {
                self.manager.complete_load(&job.keys)?;
                if job.failed {
                    self.manager.discard(&job.keys)?;
                    r.recompute = Some(job.tokens);
                }
            }
        }
        if job.released {
            for b in &job.gpu_blocks {
                if let Some(jobs) = self.fence.get_mut(b) {
                    jobs.retain(|&j| j != job_id);
                    if jobs.is_empty() {
                        self.fence.remove(b);
                    }
                }
            }
        }
        r.jobs.retain(|&j| j != job_id);
        if r.finished && !r.final_pending && r.jobs.is_empty() {
            self.drop_request(job.request_id);
        }
        recycle(&mut self.spare_keys, job.keys);
        recycle(&mut self.spare_blocks, job.gpu_blocks);
        recycle(&mut self.spare_blocks, job.slots);
        Ok(())
    }

    /// Stops tracking `id`, keeping its buffers for a later request when they are small (at most
    /// 1024 requests of up to 16 KiB each are kept).
    pub(super) fn drop_request(&mut self, id: u64) {
        let Some(mut r) = self.requests.remove(&id) else {
            return;
        };
        self.commit_record(r.record.take());
        self.keep_spare(r);
    }

    /// Keeps a dropped request's buffers for a later request when they are small.
    pub(super) fn keep_spare(&mut self, r: Box<Request>) {
        let bytes = r.keys.capacity()
            + 8 * r.key_hashes.capacity()
            + 4 * r.block_ids.capacity()
            + 8 * r.jobs.capacity();
        if self.spare_requests.len() < 1024 && bytes <= 16 << 10 {
            self.spare_requests.push(r);
        }
    }

    /// Finishes (or aborts) a request; the host may reuse its GPU blocks at once. A load not yet
    /// in a step is withdrawn (it never ships; its keys are unpinned). In 0.33 semantics the
    /// next [`Self::build_step`] builds the request's final store jobs (the chunks its last step
    /// computed, except chunks on blocks given to another request since), then commits its
    /// recency to the tier; the rest below follows from there (a request with no such chunk
    /// is dropped now, and only its commit waits for that step). Without other jobs in
    /// flight the request's state is dropped now; otherwise when its last job completes, and
    /// until then the GPU blocks those jobs touch (stores read them, loads write them) are
    /// fenced: a step that allocates one of them flushes those jobs, so the worker finishes them
    /// before that step's copies and forward pass.
    ///
    /// Fails with [`Error::NotFound`] for an unknown request and [`Error::InvalidState`] for a
    /// finished one, changing nothing.
    pub fn finish_request(&mut self, id: u64) -> Result<()> {
        self.live_request(id)?;
        self.release_blocks(id);
        let v033 = self.v033();
        let r = self.requests.get_mut(&id).expect("checked");
        // 0.33: the next step builds its final store jobs from its blocks, then commits it.
        let final_store = v033 && super::step::final_limit(&self.cfg, r) > r.next_stored_chunk;
        if final_store || !r.jobs.is_empty() {
            (r.finished, r.final_pending) = (true, v033);
            if v033 {
                self.finishing.push(Finishing::Tracked(id));
            }
            return Ok(());
        }
        let mut r = self.requests.remove(&id).expect("checked");
        if let Some(record) = r.record.take() {
            // 0.33: dropped now, committed after the next step's stores all the same.
            self.finishing.push(Finishing::Record(record));
        }
        self.keep_spare(r);
        Ok(())
    }

    /// Commits request `id`'s record to the tier (vLLM 0.33 `on_request_finished`), once.
    pub(super) fn commit(&mut self, id: u64) {
        let record = self.requests.get_mut(&id).and_then(|r| r.record.take());
        self.commit_record(record);
    }

    /// Commits a record taken from its request (none: nothing to commit).
    pub(super) fn commit_record(&mut self, record: Option<RequestId>) {
        if let Some(record) = record {
            self.manager
                .finish_request(record)
                .expect("a request's record is active until its commit");
        }
    }

    /// The request gives its GPU blocks back while its jobs may still touch them: its load not
    /// yet in a step is withdrawn, and every shipped job not released yet enters the fence on
    /// the blocks it touches.
    pub(super) fn release_blocks(&mut self, id: u64) {
        self.withdraw_unshipped_load(id);
        for &j in &self.requests[&id].jobs {
            let job = self.jobs.get_mut(&j).expect("in flight");
            if !std::mem::replace(&mut job.released, true) {
                for &b in &job.gpu_blocks {
                    self.fence.entry(b).or_default().push(j);
                }
            }
        }
    }

    /// Withdraws the request's load job if it is not in a step yet: nothing has touched its
    /// blocks, so it is dropped (keys unpinned, chunks offered again) and never ships.
    pub(super) fn withdraw_unshipped_load(&mut self, id: u64) {
        let r = &self.requests[&id];
        let Some(&j) = r.jobs.first() else {
            return;
        };
        if self.jobs[&j].kind != Direction::Load
            || !self.pending_loads.jobs().iter().any(|p| p.id == j)
        {
            return;
        }
        let job = self.jobs.remove(&j).expect("in flight");
        self.manager
            .complete_load(&job.keys)
            .expect("a load's keys are pinned");
        let r = self.requests.get_mut(&id).expect("tracked");
        r.jobs.clear();
        r.next_stored_chunk = r.next_stored_chunk.min(job.first_chunk);
        recycle(&mut self.spare_keys, job.keys);
        recycle(&mut self.spare_blocks, job.gpu_blocks);
    }

    /// Drops the whole tier: every in-flight job goes into the next step's flush set and its
    /// later reports are ignored, finished requests are dropped, live requests restart storing
    /// from their first chunk and have no job in flight.
    ///
    /// Fails with [`Error::InvalidState`], changing nothing, while load jobs made since the last
    /// step are not yet in a step (call [`Self::build_step`] first).
    pub fn reset(&mut self) -> Result<()> {
        if self
            .pending_loads
            .jobs()
            .iter()
            .any(|j| self.jobs.contains_key(&j.id))
        {
            return Err(Error::InvalidState(
                "reset: load jobs made since the last step are not in a step yet; build the step first".into(),
            ));
        }
        self.flush.extend(self.jobs.keys().copied());
        // 0.33: requests finished since the last step are committed (their final stores never
        // happen).
        for f in std::mem::take(&mut self.finishing) {
            match f {
                Finishing::Tracked(id) => self.commit(id),
                Finishing::Record(record) => self.commit_record(Some(record)),
            }
        }
        self.requests.retain(|_, r| !r.finished);
        self.manager.reset();
        for r in self.requests.values_mut() {
            r.next_stored_chunk = 0;
            r.jobs.clear();
        }
        self.stale_below = self.next_job_id;
        self.jobs.clear();
        self.fence.clear();
        Ok(())
    }
}

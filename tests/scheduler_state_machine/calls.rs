//! Scheduler calls with their host-side bookkeeping, the workers' copies on the byte model,
//! and a step: its plan checked, its flush run, its forward pass and sampling.

use super::*;

impl Sim {
    /// Appends the hashes of blocks `hashed..to_block` and sets the token count.
    pub(super) fn append(&mut self, id: u64, to_block: u64, tokens: u64) -> R {
        let m = self.meta[&id];
        let from = self.reqs[&id].hashed;
        let bytes: Vec<u8> = (from..to_block)
            .flat_map(|i| m.hash(id, i).to_be_bytes())
            .collect();
        let res = self.s.append_block_hashes(id, &bytes, tokens);
        self.note(format!(
            "append_block_hashes({id}, blocks {from}..{to_block}, {tokens}) -> {res:?}"
        ));
        self.ok("append_block_hashes", res)?;
        let r = self.reqs.get_mut(&id).unwrap();
        r.hashed = to_block;
        r.tokens = tokens;
        self.check()
    }

    pub(super) fn finish(&mut self, id: u64) -> R {
        let res = self.s.finish_request(id);
        self.note(format!("finish_request({id}) -> {res:?}"));
        self.ok("finish_request", res)?;
        let unshipped = self.host_jobs(id).into_iter().find(|j| {
            let j = &self.jobs[j];
            j.kind == Direction::Load && j.step.is_none()
        });
        if let Some(j) = unshipped {
            // Not shipped yet: the scheduler withdraws it, so the blocks are free at once.
            self.withdraw(j);
        }
        let load = match self.reqs[&id].st {
            St::Loading(j) => self.jobs.get(&j).map(|job| (j, job.step.is_some())),
            _ => None,
        };
        if let (Some((j, true)), false) = (load, self.eager_free) {
            // The core keeps the blocks of an aborted loading request until its load is done.
            self.reqs.get_mut(&id).unwrap().st = St::Aborted(j);
            if self.cfg.semantics == Semantics::Vllm033 {
                self.finishing.insert(id, None);
            }
        } else {
            if let Some((j, true)) = load {
                // The host frees the blocks now: the fence must hold their reuse.
                self.jobs.get_mut(&j).unwrap().orphan = true;
            }
            let r = self.reqs.remove(&id).unwrap();
            self.free.extend(r.blocks.iter().copied());
            self.preempt_next.retain(|&p| p != id);
            if self.cfg.semantics == Semantics::Vllm033 {
                // Its final store jobs come with the next step, reading the blocks just freed
                // (or, preempted without the scheduler being told yet, the blocks it had).
                let mut r = r;
                if r.preempt_pending {
                    (r.blocks, r.nc) = std::mem::take(&mut r.before_preempt);
                }
                self.finishing.insert(id, Some(r));
            }
        }
        self.check()
    }

    /// The scheduler withdrew load `j` before it shipped: it never runs and is never reported.
    pub(super) fn withdraw(&mut self, j: u64) {
        self.jobs.remove(&j);
        self.cov.withdrawn_loads += 1;
        self.note(format!("(host) load {j} withdrawn"));
    }

    pub(super) fn preempt_host(&mut self, id: u64) {
        let r = self.reqs.get_mut(&id).unwrap();
        if let St::Loading(j) = r.st {
            // A shipped load keeps running: it is flushed by the step that names the preemption.
            // One not shipped yet is withdrawn by that step.
            if let Some(job) = self.jobs.get_mut(&j) {
                job.orphan = true;
                self.cov.preempted_loads += job.step.is_some() as u64;
            }
        }
        let r = self.reqs.get_mut(&id).unwrap();
        r.before_preempt = (r.blocks.clone(), r.nc);
        r.st = St::Waiting;
        r.nc = 0;
        r.sent = false;
        r.unsent = 0;
        r.gpu_hit = 0;
        r.resumed = true;
        let blocks = std::mem::take(&mut r.blocks);
        self.free.extend(blocks);
        self.note(format!("(host) preempt {id}: blocks freed"));
    }

    /// A worker runs the copies of job `id`.
    pub(super) fn execute(&mut self, id: u64) -> R {
        let f = self.f as usize;
        let j = &self.jobs[&id];
        let fails = j.fail_worker.is_some();
        let (kind, req, block_index) = (j.kind, j.req, j.block_index as usize);
        let (src, dst, expected) = (j.src.clone(), j.dst.clone(), j.expected.clone());
        match kind {
            Direction::Store => {
                for (s, &slot) in dst.iter().enumerate() {
                    let mut c = Vec::with_capacity(f);
                    for u in 0..f {
                        let b = src[s * f + u];
                        let got = self.gpu.get(&b).copied().unwrap_or(Content::Garbage);
                        let want = expected[s * f + u];
                        ensure!(
                            self,
                            got == want,
                            "store job {id} (request {}) reads GPU block {b} holding {got:?}, expected {want:?}: \
                             the block was overwritten before the store ran (missing flush)",
                            req
                        );
                        c.push(got);
                    }
                    let c = if fails { vec![Content::Garbage; f] } else { c };
                    self.cov.store_chunks_run += 1;
                    self.slots.insert(slot, c);
                }
            }
            Direction::Load => {
                let m = self.meta[&req];
                let skip = block_index % f;
                self.cov.loads_run += 1;
                self.cov.partial_first_chunk_loads += (skip != 0) as u64;
                for (t, &b) in dst.iter().enumerate() {
                    let q = skip + t;
                    let slot = src[q / f];
                    let got = self.slots.get(&slot).map_or(Content::Garbage, |v| v[q % f]);
                    let want = Content::Full(m.hash(req, (block_index + t) as u64));
                    ensure!(
                        self,
                        got == want,
                        "load job {id} (request {req}) reads slot {slot}[{}] holding {got:?}, expected {want:?}",
                        q % f
                    );
                    self.gpu
                        .insert(b, if fails { Content::Garbage } else { got });
                }
            }
        }
        self.note(format!("(worker) run job {id}"));
        self.jobs.get_mut(&id).unwrap().executed = true;
        Ok(())
    }

    /// Reports `reps` in one `complete_jobs` call and handles the jobs it completes.
    pub(super) fn complete(&mut self, reps: &[JobReport]) -> R {
        let res = self.s.complete_jobs(reps);
        self.note(format!("complete_jobs({reps:?}) -> {res:?}"));
        self.ok("complete_jobs", res)?;
        let mut done = Vec::new();
        for rep in reps {
            let j = self.jobs.get_mut(&rep.job_id).unwrap();
            self.cov.stale_reports += j.stale as u64;
            self.cov.split_reports += (rep.count < self.cfg.num_workers) as u64;
            j.reported += rep.count;
            if j.reported == self.cfg.num_workers {
                done.push(rep.job_id);
            }
        }
        for id in done {
            self.on_complete(id)?;
        }
        self.check()
    }

    pub(super) fn on_complete(&mut self, id: u64) -> R {
        let j = self.jobs.remove(&id).unwrap();
        let failed = j.fail_worker.is_some();
        if failed && !j.stale {
            self.exp.failed_jobs += 1;
            match j.kind {
                Direction::Load => self.cov.failed_loads += 1,
                Direction::Store => self.cov.failed_stores += 1,
            }
        }
        if j.kind == Direction::Store {
            return Ok(());
        }
        if j.orphan {
            self.cov.aborted_loads += 1;
            return Ok(());
        }
        let st = self.reqs.get(&j.req).map(|r| r.st);
        match st {
            Some(St::Loading(x)) if x == id => {
                let (c, n) = j.range;
                if !j.stale {
                    let res = self.s.load_failure(j.req);
                    self.note(format!("load_failure({}) -> {res:?}", j.req));
                    let got = self.ok("load_failure", res)?;
                    let want = failed.then_some(Recompute {
                        from_token: c,
                        to_token: c + n,
                    });
                    ensure!(
                        self,
                        got == want,
                        "load_failure({}) = {got:?} after load {id} completed (failed: {failed}), want {want:?}",
                        j.req
                    );
                }
                let r = self.reqs.get_mut(&j.req).unwrap();
                r.st = St::Running;
                r.sent = false;
                r.gpu_hit = c;
                r.nc = if failed {
                    c
                } else if c + n >= r.tokens {
                    r.tokens - 1
                } else {
                    c + n
                };
            }
            Some(St::Aborted(x)) if x == id => {
                self.cov.aborted_loads += 1;
                let r = self.reqs.remove(&j.req).unwrap();
                self.free.extend(r.blocks);
            }
            other => {
                return Err(self.fail(format!(
                    "load job {id} of request {} completed with the request in host state {other:?}",
                    j.req
                )));
            }
        }
        Ok(())
    }

    /// Reports of the remaining workers of `ids`: one report per worker, or one per job.
    pub(super) fn reports_for(&self, ids: &[u64], rng: &mut Rng, partial: bool) -> Vec<JobReport> {
        let mut reps = Vec::new();
        for &id in ids {
            let j = &self.jobs[&id];
            let left = self.workers() - j.reported;
            let n = if partial && rng.chance(1, 2) {
                1 + rng.below(left as u64) as u32
            } else {
                left
            };
            let workers = j.reported..j.reported + n;
            if rng.chance(1, 2) {
                for w in workers {
                    reps.push(JobReport {
                        job_id: id,
                        count: 1,
                        success: j.fail_worker != Some(w),
                    });
                }
            } else {
                reps.push(JobReport {
                    job_id: id,
                    count: n,
                    success: !j.fail_worker.is_some_and(|w| workers.contains(&w)),
                });
            }
        }
        rng.shuffle(&mut reps);
        reps
    }

    /// Runs and reports `ids` completely (in one or two calls).
    pub(super) fn report_fully(&mut self, ids: &[u64], rng: &mut Rng) -> R {
        for &id in ids {
            if !self.jobs[&id].executed {
                self.execute(id)?;
            }
        }
        if ids.is_empty() {
            return Ok(());
        }
        let reps = self.reports_for(ids, rng, false);
        if reps.len() > 1 && rng.chance(1, 3) {
            let (a, b) = reps.split_at(reps.len() / 2);
            self.complete(a)?;
            self.complete(b)
        } else {
            self.complete(&reps)
        }
    }

    /// Jobs flushed by step `m - 2` or earlier: their completions came with that step's output,
    /// which the host must have processed before building step `m`.
    pub(super) fn report_overdue(&mut self, rng: &mut Rng) -> R {
        let m = self.step_no;
        let overdue: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.flushed_at.is_some_and(|f| f + 2 <= m))
            .map(|(&k, _)| k)
            .collect();
        self.report_fully(&overdue, rng)
    }

    /// Builds step `step_no` for `plan` (request, tokens to compute), runs the flush and the
    /// forward pass.
    pub(super) fn build(
        &mut self,
        plan: &[(u64, u64, u64)],
        preempted: &[u64],
        rng: &mut Rng,
    ) -> R {
        let m = self.step_no;
        let new_ids: Vec<Vec<u32>> = plan
            .iter()
            .map(|&(id, _, _)| {
                let r = &self.reqs[&id];
                if r.sent {
                    r.blocks[r.unsent..].to_vec()
                } else {
                    r.blocks.clone()
                }
            })
            .collect();
        let sched: Vec<ScheduledRequest<'_>> = plan
            .iter()
            .zip(&new_ids)
            .map(|(&(id, k, num_tokens), b)| {
                let r = &self.reqs[&id];
                ScheduledRequest {
                    request_id: id,
                    num_computed_tokens: r.nc,
                    num_scheduled_tokens: k,
                    num_tokens,
                    new_block_ids: b,
                    resumed: !r.sent && r.resumed,
                }
            })
            .collect();
        let res = self.s.build_step(&sched, preempted, &mut self.step);
        let desc: Vec<String> = sched
            .iter()
            .map(|s| {
                format!(
                    "{}:{}+{}/{}{}{:?}",
                    s.request_id,
                    s.num_computed_tokens,
                    s.num_scheduled_tokens,
                    s.num_tokens,
                    if s.resumed { " resumed " } else { " " },
                    s.new_block_ids
                )
            })
            .collect();
        drop(sched);
        let step = self.step.clone();
        let jobs_desc: Vec<String> = step
            .jobs()
            .iter()
            .map(|j| {
                format!(
                    "{:?} {} req {} @{} {:?}->{:?}",
                    j.kind,
                    j.id,
                    j.request_id,
                    j.block_index,
                    step.src(j),
                    step.dst(j)
                )
            })
            .collect();
        self.note(format!(
            "build_step#{m}(scheduled [{}], preempted {preempted:?}) -> {res:?}: jobs [{}], flush {:?}",
            desc.join(", "),
            jobs_desc.join("; "),
            step.flush()
        ));
        self.ok("build_step", res)?;
        self.allocated_since_step.extend(new_ids.iter().flatten());
        for &p in preempted {
            if let Some(r) = self.reqs.get_mut(&p) {
                r.preempt_pending = false;
            }
            for j in self.host_jobs(p) {
                if self.jobs[&j].kind == Direction::Load && self.jobs[&j].step.is_none() {
                    self.withdraw(j);
                }
            }
        }
        self.check_step_jobs(m, &step, plan, rng)?;
        // The finished requests' final stores are made: the scheduler dropped them, or keeps
        // them while their jobs are in flight.
        self.finishing.clear();
        self.check_flush(m, &step, preempted)?;
        self.forward_pass(m, plan)?;
        self.sample(plan)
    }

    /// The jobs of step `m`: exactly the loads made since the last step, and store jobs the
    /// host can account for.
    pub(super) fn check_step_jobs(
        &mut self,
        m: u64,
        step: &Step,
        plan: &[(u64, u64, u64)],
        rng: &mut Rng,
    ) -> R {
        let mut pending: BTreeSet<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.kind == Direction::Load && j.step.is_none())
            .map(|(&k, _)| k)
            .collect();
        let mut slots_in_use: HashSet<u32> = HashSet::new();
        for j in self.jobs.values().filter(|j| !j.stale && j.step.is_some()) {
            slots_in_use.extend(if j.kind == Direction::Load {
                &j.src
            } else {
                &j.dst
            });
        }
        for d in step.jobs() {
            match d.kind {
                Direction::Load => {
                    self.check_load_job(m, (step, d), &mut pending, &mut slots_in_use)?
                }
                Direction::Store => {
                    self.record_store_job(m, (step, d), plan, &mut slots_in_use, rng)?
                }
            }
            self.job_ids_seen = self.job_ids_seen.max(d.id + 1);
        }
        ensure!(
            self,
            pending.is_empty(),
            "step {m}: loads {pending:?} made by on_alloc are missing"
        );

        Ok(())
    }

    /// Checks a load job of step `m` against the load `on_alloc` made, and records its blocks.
    pub(super) fn check_load_job(
        &mut self,
        m: u64,
        (step, d): (&Step, &JobDesc),
        pending: &mut BTreeSet<u64>,
        slots_in_use: &mut HashSet<u32>,
    ) -> R {
        let (src, dst) = (step.src(d).to_vec(), step.dst(d).to_vec());
        let (f, obs) = (self.f, self.obs);
        ensure!(
            self,
            pending.remove(&d.id),
            "step {m}: load job {} was not made by on_alloc since the last step",
            d.id
        );
        let j = &self.jobs[&d.id];
        let (c, n) = j.range;
        let r = &self.reqs[&j.req];
        let (lo, hi) = ((c / GBS) as usize, (c + n).div_ceil(GBS) as usize);
        ensure!(
            self,
            j.req == d.request_id
                && d.block_index as usize == lo
                && dst == r.blocks[lo..hi]
                && src.len() as u64 == (c + n).div_ceil(obs) - lo as u64 / f
                && d.num_gpu_blocks as usize == dst.len(),
            "step {m}: load job {} of request {} (hit {c}+{n}, blocks {:?}) has block_index {}, src {src:?}, dst {dst:?}",
            d.id,
            j.req,
            r.blocks,
            d.block_index
        );
        for &sl in &src {
            ensure!(
                self,
                slots_in_use.insert(sl),
                "step {m}: load job {} reads slot {sl}, used by another job in flight",
                d.id
            );
        }
        let j = self.jobs.get_mut(&d.id).unwrap();
        j.step = Some(m);
        j.src = src;
        j.dst = dst;
        j.block_index = d.block_index;
        Ok(())
    }

    /// Checks a store job of step `m` (chunks of a scheduled request, in order, within its
    /// limits, to slots no other job uses) and records what its source blocks must hold.
    pub(super) fn record_store_job(
        &mut self,
        m: u64,
        (step, d): (&Step, &JobDesc),
        plan: &[(u64, u64, u64)],
        slots_in_use: &mut HashSet<u32>,
        rng: &mut Rng,
    ) -> R {
        let (src, dst) = (step.src(d).to_vec(), step.dst(d).to_vec());
        let (f, obs) = (self.f, self.obs);
        let id = d.request_id;
        ensure!(
            self,
            d.id >= self.job_ids_seen,
            "step {m}: store job id {} reused",
            d.id
        );
        let finishing = self.finishing.get(&id).is_some_and(|r| r.is_some());
        let (k, num_tokens) = match plan.iter().find(|p| p.0 == id) {
            Some(&(_, k, num_tokens)) => (k, num_tokens),
            // A 0.33 final store: at most what the request computed.
            None if finishing => (0, u64::MAX),
            None => {
                return Err(self.fail(format!(
                    "step {m}: store job {} for request {id}, not scheduled",
                    d.id
                )));
            }
        };
        let has_load = self
            .host_jobs(id)
            .iter()
            .any(|j| self.jobs[j].kind == Direction::Load);
        ensure!(
            self,
            !has_load,
            "step {m}: store job {} for request {id} while its load is in flight",
            d.id
        );
        let meta = self.meta[&id];
        let r = match self.finishing.get(&id) {
            Some(Some(r)) => r,
            _ => &self.reqs[&id],
        };
        let mut limit = (r.nc + k).min(num_tokens);
        if let Some(cap) = meta.max_offload {
            limit = limit.min(cap);
        }
        if self.cfg.offload_prompt_only {
            limit = limit.min(meta.prompt_tokens);
        }
        let limit_chunk = limit / obs;
        ensure!(
            self,
            !dst.is_empty()
                && src.len() == dst.len() * f as usize
                && d.num_gpu_blocks as usize == src.len(),
            "step {m}: store job {} has src {src:?}, dst {dst:?}",
            d.id
        );
        let mut prev = None;
        let mut expected = Vec::new();
        let mut keys = Vec::new();
        for (s, grp) in src.chunks(f as usize).enumerate() {
            let pos = r.blocks.iter().position(|&b| b == grp[0]);
            let ok = pos.is_some_and(|p| {
                p % f as usize == 0 && r.blocks.get(p..p + f as usize) == Some(grp)
            });
            ensure!(
                self,
                ok,
                "step {m}: store job {} reads GPU blocks {grp:?}, not a chunk of request {id} (blocks {:?})",
                d.id,
                r.blocks
            );
            let ch = (pos.unwrap() / f as usize) as u64;
            ensure!(
                self,
                ch < limit_chunk && prev.is_none_or(|p| p < ch),
                "step {m}: store job {} stores chunk {ch} of request {id} (offloadable {limit} tokens, previous chunk {prev:?})",
                d.id
            );
            if s == 0 {
                ensure!(
                    self,
                    d.block_index as u64 == ch * f,
                    "step {m}: store job {} has block_index {}, first chunk {ch}",
                    d.id,
                    d.block_index
                );
            }
            prev = Some(ch);
            keys.push(meta.hash(id, ch * f + f - 1));
            for u in 0..f {
                expected.push(Content::Full(meta.hash(id, ch * f + u)));
            }
        }
        for &sl in &dst {
            ensure!(
                self,
                slots_in_use.insert(sl),
                "step {m}: store job {} writes slot {sl}, used by another job in flight",
                d.id
            );
        }
        self.exp.store_jobs += 1;
        self.exp.stored_chunks += dst.len() as u64;
        self.cov.final_stores += finishing as u64;
        let fail_worker = self.fail_worker(rng, 12);
        self.jobs.insert(
            d.id,
            HJob {
                kind: Direction::Store,
                req: id,
                stale: false,
                step: Some(m),
                executed: false,
                fail_worker,
                reported: 0,
                flushed_at: None,
                src,
                dst,
                block_index: d.block_index,
                expected,
                keys,
                range: (0, 0),
                // A final store's blocks are the host's already: the fence must hold them.
                orphan: finishing,
            },
        );
        Ok(())
    }

    /// The flush set of step `m`: what the host is owed (preempted requests' jobs, a reset's,
    /// fenced jobs touching a reallocated block); the workers run it before the forward pass.
    pub(super) fn check_flush(&mut self, m: u64, step: &Step, preempted: &[u64]) -> R {
        let flush: BTreeSet<u64> = step.flush().iter().copied().collect();
        for &p in preempted {
            for j in self.host_jobs(p) {
                ensure!(
                    self,
                    flush.contains(&j),
                    "step {m}: job {j} of preempted request {p} not flushed"
                );
                self.cov.preempt_flushes += 1;
            }
        }
        for j in std::mem::take(&mut self.reset_flush) {
            ensure!(
                self,
                flush.contains(&j),
                "step {m}: job {j} in flight at the reset not flushed"
            );
        }
        // The reuse fence: a shipped job whose request gave its GPU blocks back (finished,
        // aborted, preempted), not flushed before, must be flushed by the step that reallocates
        // one of them.
        let (mut fence, mut load_fence) = (0, 0);
        for (&jid, j) in &self.jobs {
            let released = match j.kind {
                Direction::Store => !self.live(j.req),
                Direction::Load => j.orphan,
            };
            if j.stale || !released || j.step.is_none() || j.flushed_at.is_some() {
                continue;
            }
            let touched = if j.kind == Direction::Load {
                &j.dst
            } else {
                &j.src
            };
            if let Some(b) = touched
                .iter()
                .find(|b| self.allocated_since_step.contains(b))
            {
                ensure!(
                    self,
                    flush.contains(&jid),
                    "step {m}: {:?} {jid} of request {} (given back) touches GPU block {b}, reallocated, but is not flushed",
                    j.kind,
                    j.req
                );
                match j.kind {
                    Direction::Store => fence += 1,
                    Direction::Load => load_fence += 1,
                }
            }
        }
        self.cov.fence_flushes += fence;
        self.cov.load_fence_flushes += load_fence;
        for &id in &flush {
            ensure!(
                self,
                id < self.job_ids_seen,
                "step {m}: flush names unknown job {id}"
            );
            let Some(j) = self.jobs.get(&id) else {
                continue; // already reported
            };
            ensure!(
                self,
                j.step.is_some_and(|s| s < m),
                "step {m}: flushed job {id} is not from an earlier step"
            );
            let executed = j.executed;
            self.jobs.get_mut(&id).unwrap().flushed_at.get_or_insert(m);
            if !executed {
                self.execute(id)?;
            }
        }
        self.allocated_since_step.clear();
        self.step_no += 1;
        self.check()?;
        Ok(())
    }

    /// The forward pass of step `m`: each scheduled request's blocks must hold its computed
    /// tokens; then it writes the tokens it computes.
    pub(super) fn forward_pass(&mut self, m: u64, plan: &[(u64, u64, u64)]) -> R {
        for &(id, k, _) in plan {
            let meta = self.meta[&id];
            let (blocks, nc, gpu_hit) = {
                let r = &self.reqs[&id];
                (r.blocks.clone(), r.nc, r.gpu_hit)
            };
            for (i, &b) in blocks.iter().enumerate().take((gpu_hit / GBS) as usize) {
                self.gpu.insert(b, Content::Full(meta.hash(id, i as u64)));
            }
            for (i, &b) in blocks.iter().enumerate().take((nc / GBS) as usize) {
                let got = self.gpu.get(&b).copied().unwrap_or(Content::Garbage);
                let want = Content::Full(meta.hash(id, i as u64));
                ensure!(
                    self,
                    got == want,
                    "step {m}: request {id} computed block {i} (GPU block {b}) holds {got:?}, want {want:?}: its KV data was lost"
                );
            }
            let end = nc + k;
            for i in nc / GBS..end.div_ceil(GBS) {
                let c = if (i + 1) * GBS <= end {
                    Content::Full(meta.hash(id, i))
                } else {
                    Content::Partial(id, i)
                };
                self.gpu.insert(blocks[i as usize], c);
            }
            let r = self.reqs.get_mut(&id).unwrap();
            r.nc = end;
            r.sent = true;
            r.unsent = r.blocks.len();
            r.resumed = false;
            r.gpu_hit = 0;
        }
        Ok(())
    }

    /// Sampling: a request that computed all its tokens gets one more, or finishes.
    pub(super) fn sample(&mut self, plan: &[(u64, u64, u64)]) -> R {
        for &(id, _, _) in plan {
            let r = &self.reqs[&id];
            if r.nc < r.tokens {
                continue;
            }
            if r.tokens >= r.max_tokens {
                self.finish(id)?;
            } else {
                let t = r.tokens + 1;
                self.append(id, t / GBS, t)?;
            }
        }
        Ok(())
    }
}

//! The random operations of the simulated server, and the final drain.

use super::*;

impl Sim {
    pub(super) fn op(&mut self, op: u8, rng: &mut Rng) -> R {
        match op % 100 {
            0..=9 => self.op_add(rng),
            10..=29 => self.op_admit(rng),
            30..=51 => self.op_step(rng),
            52..=67 => self.op_execute(rng),
            68..=83 => self.op_report(rng),
            84..=88 => self.op_preempt(rng),
            89..=94 => self.op_finish(rng),
            95..=96 => self.op_reset(rng),
            _ => self.op_report_all(rng),
        }
    }

    pub(super) fn op_add(&mut self, rng: &mut Rng) -> R {
        if self.reqs.keys().filter(|&&k| self.live(k)).count() >= 8 {
            return Ok(());
        }
        let id = self.next_id;
        self.next_id += 1;
        let m = ReqMeta {
            family: rng.below(3),
            variant: rng.below(2),
            diverge: rng.below(14),
            prompt_tokens: 1 + rng.below(48),
            max_offload: rng.chance(1, 8).then(|| rng.below(4) * self.obs),
        };
        let decode = rng.below(13);
        let res = self.s.add_request(id, m.prompt_tokens, m.max_offload);
        self.note(format!(
            "add_request({id}, {m:?}, decode {decode}) -> {res:?}"
        ));
        self.ok("add_request", res)?;
        self.meta.insert(id, m);
        self.reqs.insert(
            id,
            HReq {
                st: St::Waiting,
                tokens: m.prompt_tokens,
                max_tokens: m.prompt_tokens + decode,
                hashed: 0,
                blocks: Vec::new(),
                unsent: 0,
                sent: false,
                nc: 0,
                gpu_hit: 0,
                resumed: false,
                preempt_pending: false,
                before_preempt: (Vec::new(), 0),
            },
        );
        self.check()?;
        let full = m.prompt_tokens / GBS;
        if full > 0 && rng.chance(1, 3) {
            self.append(id, rng.below(full + 1), m.prompt_tokens)?;
        }
        self.append(id, full, m.prompt_tokens)
    }

    /// Matches a waiting request; on a hit or a miss allocates its blocks and calls `on_alloc`
    /// (in split mode possibly in a later operation).
    pub(super) fn op_admit(&mut self, rng: &mut Rng) -> R {
        let cands: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| {
                (r.st == St::Waiting && !r.preempt_pending) || matches!(r.st, St::Matched(..))
            })
            .map(|(&k, _)| k)
            .collect();
        let Some(id) = rng.pick(&cands) else {
            return Ok(());
        };
        if let St::Matched(c, n) = self.reqs[&id].st {
            return self.allocate(id, c, n, rng);
        }
        let tokens = self.reqs[&id].tokens;
        let c = if rng.chance(1, 2) {
            0
        } else {
            rng.below((tokens - 1) / GBS + 1) * GBS
        };
        let res = self.s.match_request(id, c);
        self.note(format!("match_request({id}, {c}) -> {res:?}"));
        let m = self.ok("match_request", res)?;
        let jobs = self.host_jobs(id);
        ensure!(
            self,
            (m == Match::Defer(DeferReason::JobsInFlight)) != jobs.is_empty(),
            "match_request({id}) = {m:?}, but the host expects completions of {jobs:?} for it"
        );
        self.exp.matches += 1;
        match m {
            Match::Defer(DeferReason::JobsInFlight) => {
                self.exp.deferred_jobs_in_flight += 1;
                self.cov.window_defers +=
                    jobs.iter().all(|j| self.jobs[j].flushed_at.is_some()) as u64;
            }
            Match::Defer(DeferReason::StoreInFlight) => self.exp.deferred_store_in_flight += 1,
            Match::Defer(DeferReason::BeingLoaded) => self.exp.deferred_being_loaded += 1,
            Match::Hit(n) => {
                self.exp.hits += 1;
                self.exp.hit_tokens += n;
                ensure!(
                    self,
                    n > 0 && (c + n).is_multiple_of(self.obs) && c + n <= tokens,
                    "match_request({id}, {c}) = Hit({n}) for {tokens} tokens"
                );
            }
            Match::Miss => {}
        }
        self.check()?;
        let n = match m {
            Match::Defer(_) => return Ok(()),
            Match::Miss => 0,
            Match::Hit(n) => n,
        };
        if self.split && rng.chance(1, 2) {
            self.note(format!("(host) {id} matched, allocation later"));
            self.reqs.get_mut(&id).unwrap().st = St::Matched(c, n);
            return Ok(());
        }
        self.allocate(id, c, n, rng)
    }

    /// Allocates GPU blocks for a request matched with GPU hit `c` and hit `n` (0: miss), and
    /// calls `on_alloc`.
    pub(super) fn allocate(&mut self, id: u64, c: u64, n: u64, rng: &mut Rng) -> R {
        let tokens = self.reqs[&id].tokens;
        self.reqs.get_mut(&id).unwrap().st = St::Waiting;
        let jobs = self.host_jobs(id);
        if rng.chance(1, 6) {
            self.note(format!("(host) allocation for {id} fails: stays waiting"));
            return Ok(());
        }
        let Some(blocks) = self.alloc(tokens.div_ceil(GBS) as usize) else {
            self.note(format!("(host) no GPU blocks for {id}: stays waiting"));
            return Ok(());
        };
        let meta = self.meta[&id];
        let f = self.f;
        let keys: Vec<u64> = if n == 0 {
            Vec::new()
        } else {
            ((c / GBS) / f..(c + n) / self.obs)
                .map(|ch| meta.hash(id, ch * f + f - 1))
                .collect()
        };
        // With operations between the match and `on_alloc`, the hit may have gone: the tier's
        // state of the hit keys now says which answers are legal.
        let states: Vec<Option<i32>> = keys
            .iter()
            .map(|k| self.s.manager().ref_count(&k.to_be_bytes()))
            .collect();
        let res = self.s.on_alloc(id, &blocks, n);
        self.note(format!(
            "on_alloc({id}, {blocks:?}, {n}) -> {res:?} (hit keys' ref counts {states:?})"
        ));
        let legal_error = match &res {
            Err(Error::NotFound(_)) => states.contains(&None),
            Err(Error::InvalidState(_)) => states.iter().any(|s| s.is_some_and(|r| r != 0)),
            _ => false,
        };
        if legal_error {
            self.free.extend(blocks);
            return self.check();
        }
        let job = self.ok("on_alloc", res)?;
        self.allocated_since_step.extend(&blocks);
        ensure!(
            self,
            states.iter().all(|s| s.is_some_and(|r| r >= 0)),
            "on_alloc({id}, .., {n}) made a load of keys not ready (ref counts {states:?})"
        );
        match (n, job) {
            (0, None) => {
                let r = self.reqs.get_mut(&id).unwrap();
                r.st = St::Running;
                r.nc = c;
                r.gpu_hit = c;
                r.sent = false;
                r.blocks = blocks;
            }
            (n, Some(j)) if n > 0 => {
                ensure!(
                    self,
                    jobs.is_empty() && j >= self.job_ids_seen,
                    "on_alloc({id}) made load {j} while the host expects completions of {jobs:?}"
                );
                self.job_ids_seen = j + 1;
                self.exp.load_jobs += 1;
                let fail_worker = self.fail_worker(rng, 10);
                self.jobs.insert(
                    j,
                    HJob {
                        kind: Direction::Load,
                        req: id,
                        stale: false,
                        step: None,
                        executed: false,
                        fail_worker,
                        reported: 0,
                        flushed_at: None,
                        src: Vec::new(),
                        dst: Vec::new(),
                        block_index: 0,
                        expected: Vec::new(),
                        keys,
                        range: (c, n),
                        orphan: false,
                    },
                );
                let r = self.reqs.get_mut(&id).unwrap();
                r.st = St::Loading(j);
                r.gpu_hit = c;
                r.blocks = blocks;
            }
            _ => {
                return Err(self.fail(format!("on_alloc({id}, .., {n}) returned {job:?}")));
            }
        }
        self.check()
    }

    pub(super) fn op_step(&mut self, rng: &mut Rng) -> R {
        self.report_overdue(rng)?;
        let mut preempted = std::mem::take(&mut self.preempt_next);
        let running: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.st == St::Running)
            .map(|(&k, _)| k)
            .collect();
        let mut plan: Vec<(u64, u64, u64)> = Vec::new();
        for id in running {
            if self.reqs.get(&id).is_none_or(|r| r.st != St::Running) || rng.chance(1, 6) {
                continue;
            }
            let (nc, tokens) = (self.reqs[&id].nc, self.reqs[&id].tokens);
            let left = tokens - nc;
            let k = if rng.chance(1, 3) {
                1 + rng.below(left)
            } else {
                left
            };
            let need = (nc + k).div_ceil(GBS) as usize;
            let mut go = true;
            loop {
                let have = self.reqs[&id].blocks.len();
                if have >= need {
                    break;
                }
                if let Some(b) = self.alloc(need - have) {
                    self.reqs.get_mut(&id).unwrap().blocks.extend(b);
                    break;
                }
                // Out of GPU blocks: preempt the newest running request not yet scheduled.
                let victim = self
                    .reqs
                    .iter()
                    .rev()
                    .find(|(v, r)| r.st == St::Running && !plan.iter().any(|p| p.0 == **v))
                    .map(|(&v, _)| v);
                match victim {
                    Some(v) if rng.chance(3, 4) => {
                        self.preempt_host(v);
                        preempted.push(v);
                        self.cov.forced_preemptions += 1;
                        if v == id {
                            go = false;
                            break;
                        }
                    }
                    _ => {
                        go = false;
                        break;
                    }
                }
            }
            if go {
                // Async scheduling: the token sampled by the last step may not be counted yet.
                let lagging = nc + 1 == tokens && tokens > self.meta[&id].prompt_tokens;
                let num_tokens = tokens - (lagging && rng.chance(1, 2)) as u64;
                plan.push((id, k, num_tokens));
            }
        }
        self.build(&plan, &preempted, rng)
    }

    pub(super) fn op_execute(&mut self, rng: &mut Rng) -> R {
        let cands: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.step.is_some() && !j.executed)
            .map(|(&k, _)| k)
            .collect();
        for _ in 0..1 + rng.below(3) {
            if let Some(id) = rng.pick(&cands)
                && !self.jobs[&id].executed
            {
                self.execute(id)?;
            }
        }
        Ok(())
    }

    /// Reports some executed jobs, possibly only some of their workers, in random order.
    pub(super) fn op_report(&mut self, rng: &mut Rng) -> R {
        let cands: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.executed)
            .map(|(&k, _)| k)
            .collect();
        let mut ids = BTreeSet::new();
        for _ in 0..1 + rng.below(3) {
            if let Some(id) = rng.pick(&cands) {
                ids.insert(id);
            }
        }
        if ids.is_empty() {
            return Ok(());
        }
        let ids: Vec<u64> = ids.into_iter().collect();
        let reps = self.reports_for(&ids, rng, true);
        self.complete(&reps)
    }

    /// Synchronous mode for a moment: every job in a step runs and is reported.
    pub(super) fn op_report_all(&mut self, rng: &mut Rng) -> R {
        let ids: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.step.is_some())
            .map(|(&k, _)| k)
            .collect();
        self.report_fully(&ids, rng)
    }

    pub(super) fn op_preempt(&mut self, rng: &mut Rng) -> R {
        // Now and then a loading request: its blocks go back while its load may be in flight.
        let loading = rng.chance(1, 3);
        let cands: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.st == St::Running || (loading && matches!(r.st, St::Loading(_))))
            .map(|(&k, _)| k)
            .collect();
        if let Some(id) = rng.pick(&cands) {
            self.preempt_host(id);
            let r = self.reqs.get_mut(&id).unwrap();
            r.preempt_pending = true;
            self.preempt_next.push(id);
        }
        Ok(())
    }

    pub(super) fn op_finish(&mut self, rng: &mut Rng) -> R {
        let cands: Vec<u64> = self
            .reqs
            .keys()
            .copied()
            .filter(|&k| self.live(k))
            .collect();
        match rng.pick(&cands) {
            Some(id) => self.finish(id),
            None => Ok(()),
        }
    }

    pub(super) fn op_reset(&mut self, rng: &mut Rng) -> R {
        let unshipped = self
            .jobs
            .values()
            .any(|j| j.kind == Direction::Load && j.step.is_none());
        let res = self.s.reset();
        self.note(format!("reset() -> {res:?}"));
        match res {
            Err(Error::InvalidState(_)) if unshipped => {
                self.op_step(rng)?;
                let res = self.s.reset();
                self.note(format!("reset() -> {res:?}"));
                self.ok("reset after build_step", res)?;
                self.cov.resets_after_building += 1;
            }
            Err(e) => {
                return Err(self.fail(format!("reset() failed with every load in a step: {e:?}")));
            }
            Ok(()) => ensure!(
                self,
                !unshipped,
                "reset() succeeded with load jobs not in a step"
            ),
        }
        // Requests finished since the last step are dropped; their final stores never happen.
        self.finishing.clear();
        self.reset_flush = self
            .jobs
            .iter()
            .filter(|(_, j)| !j.stale)
            .map(|(&k, _)| k)
            .collect();
        for j in self.jobs.values_mut() {
            j.stale = true;
        }
        self.cov.resets += 1;
        self.check()
    }

    /// Runs and reports everything, builds steps, and checks that nothing stays in flight.
    pub(super) fn drain(&mut self) -> R {
        self.note("-- drain --".into());
        let mut rng = Rng::new(7);
        self.report_overdue(&mut rng)?;
        let pre = std::mem::take(&mut self.preempt_next);
        self.build(&[], &pre, &mut rng)?;
        let ids: Vec<u64> = self.jobs.keys().copied().collect();
        self.report_fully(&ids, &mut rng)?;
        ensure!(
            self,
            self.jobs.is_empty(),
            "jobs left after the drain: {:?}",
            self.jobs.keys()
        );
        self.build(&[], &[], &mut rng)?;
        let st = self.s.stats();
        ensure!(
            self,
            st.manager.pinned == 0
                && st.loads_in_flight == 0
                && st.stores_in_flight == 0
                && st.manager.stores_in_flight == 0,
            "after the drain: {st:?}"
        );
        let live = self.reqs.keys().filter(|&&k| self.live(k)).count() as u64;
        ensure!(
            self,
            st.requests == live,
            "after the drain {} requests tracked, {live} live",
            st.requests
        );
        // Liveness: with nothing in flight, no waiting request is deferred.
        let waiting: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| matches!(r.st, St::Waiting | St::Matched(..)))
            .map(|(&k, _)| k)
            .collect();
        for id in waiting {
            let res = self.s.match_request(id, 0);
            self.note(format!("match_request({id}, 0) -> {res:?}"));
            let m = self.ok("match_request", res)?;
            ensure!(
                self,
                !matches!(m, Match::Defer(_)),
                "request {id} deferred ({m:?}) with nothing in flight"
            );
            self.exp.matches += 1;
            if let Match::Hit(n) = m {
                self.exp.hits += 1;
                self.exp.hit_tokens += n;
            }
            self.check()?;
        }
        let held: usize = self.reqs.values().map(|r| r.blocks.len()).sum();
        let distinct: HashSet<u32> = self.free.iter().copied().collect();
        ensure!(
            self,
            held + self.free.len() == self.total_blocks && distinct.len() == self.free.len(),
            "GPU blocks: {held} held + {} free of {}",
            self.free.len(),
            self.total_blocks
        );
        Ok(())
    }
}

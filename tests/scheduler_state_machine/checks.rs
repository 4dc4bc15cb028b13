//! The checks run after every scheduler call: invariants, stats against the host's recount,
//! jobs in flight, counters.

use super::*;

impl Sim {
    pub(super) fn check(&self) -> R {
        if let Err(e) = self.s.check_invariants() {
            return Err(self.fail(format!("check_invariants: {e}")));
        }
        let st = self.s.stats();
        let mut loads = 0u64;
        let mut stores = 0u64;
        let mut load_keys: HashSet<u64> = HashSet::new();
        let mut store_keys = HashSet::new();
        let mut finished_with_jobs = BTreeSet::new();
        let mut per_req: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        for (id, j) in self.jobs.iter().filter(|(_, j)| !j.stale) {
            let e = per_req.entry(j.req).or_default();
            match j.kind {
                Direction::Load => {
                    loads += 1;
                    e.0 += 1;
                    // Keys shared by two loads are `check_invariants`'s to judge.
                    load_keys.extend(&j.keys);
                }
                Direction::Store => {
                    stores += 1;
                    e.1 += 1;
                    for &k in &j.keys {
                        ensure!(
                            self,
                            store_keys.insert(k),
                            "key {k:#x} stored by two jobs ({id})"
                        );
                    }
                }
            }
            if !self.live(j.req) {
                finished_with_jobs.insert(j.req);
            }
        }
        for (&id, &(l, s)) in &per_req {
            ensure!(
                self,
                l == 0 || l + s == 1,
                "request {id} has {l} loads and {s} stores in flight at once (host view)"
            );
        }
        let live = self.reqs.keys().filter(|&&id| self.live(id)).count() as u64;
        ensure!(
            self,
            (st.loads_in_flight, st.stores_in_flight) == (loads, stores),
            "stats: {} loads and {} stores in flight, host expects completions of {loads} and {stores}",
            st.loads_in_flight,
            st.stores_in_flight
        );
        // A request finished since the last step is tracked until then unless it had no job in
        // flight and nothing left for a final store (the host does not follow which chunks were
        // offered, so it allows either).
        let most = live
            + finished_with_jobs
                .union(&self.finishing.keys().copied().collect())
                .count() as u64;
        ensure!(
            self,
            (live + finished_with_jobs.len() as u64..=most).contains(&st.requests),
            "stats: {} requests tracked, host recounts {live} live + {} finished with jobs in flight {:?} (finishing {:?}, live {:?})",
            st.requests,
            finished_with_jobs.len(),
            finished_with_jobs,
            self.finishing.keys().collect::<Vec<_>>(),
            self.reqs
                .keys()
                .filter(|&&id| self.live(id))
                .collect::<Vec<_>>()
        );
        ensure!(
            self,
            (st.manager.pinned, st.manager.stores_in_flight)
                == (load_keys.len() as u64, store_keys.len() as u64),
            "tier: {} pinned and {} storing keys, in-flight jobs hold {} and {}",
            st.manager.pinned,
            st.manager.stores_in_flight,
            load_keys.len(),
            store_keys.len()
        );
        for &id in self.reqs.keys() {
            if !self.live(id) {
                continue;
            }
            let got = self.ok("has_jobs_in_flight", self.s.has_jobs_in_flight(id))?;
            let want = per_req.contains_key(&id);
            ensure!(
                self,
                got == want,
                "has_jobs_in_flight({id}) = {got}, host view: {:?}",
                self.host_jobs(id)
            );
        }
        let e = &self.exp;
        let got = Counters {
            matches: st.matches,
            deferred_jobs_in_flight: st.deferred_jobs_in_flight,
            deferred_store_in_flight: st.deferred_store_in_flight,
            deferred_being_loaded: st.deferred_being_loaded,
            hits: st.hits,
            hit_tokens: st.hit_tokens,
            load_jobs: st.load_jobs,
            store_jobs: st.store_jobs,
            stored_chunks: st.stored_chunks,
            failed_jobs: st.failed_jobs,
        };
        ensure!(
            self,
            format!("{got:?}") == format!("{e:?}"),
            "stats counters {got:?}\n  host recount  {e:?}"
        );
        Ok(())
    }
}

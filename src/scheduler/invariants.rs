//! The scheduler's invariants, checked on demand (tests, debug builds, `kvo_scheduler_check_invariants`).

use super::{Direction, Error, Result, Scheduler};

impl Scheduler {
    /// Checks the invariants: jobs and requests agree; a request never has a load and stores in
    /// flight at once; the pinned keys are exactly those of in-flight loads and the in-flight
    /// stores exactly those of store jobs; the fence names only released in-flight jobs, on
    /// blocks they touch; a finished request's jobs are all released.
    pub fn check_invariants(&self) -> Result<()> {
        self.manager.check_invariants()?;
        let bad = |m: String| Err(Error::Internal(m));
        let kl = self.cfg.key_len;
        for (&id, r) in &self.requests {
            let loads = r
                .jobs
                .iter()
                .filter(|&j| self.jobs.get(j).is_some_and(|j| j.kind == Direction::Load))
                .count();
            if loads > 0 && r.jobs.len() > 1 {
                return bad(format!(
                    "request {id} has a load and other jobs in flight: {:?}",
                    r.jobs
                ));
            }
            if r.finished && !r.final_pending && r.jobs.is_empty() {
                return bad(format!(
                    "finished request {id} without jobs is still tracked"
                ));
            }
        }
        let mut pinned = hashbrown::HashSet::new();
        let mut storing = hashbrown::HashSet::new();
        for (&jid, j) in &self.jobs {
            if !self
                .requests
                .get(&j.request_id)
                .is_some_and(|r| r.jobs.contains(&jid))
            {
                return bad(format!(
                    "job {jid} is not listed by its request {}",
                    j.request_id
                ));
            }
            for key in j.keys.chunks_exact(kl) {
                let rc = self.manager.ref_count(key);
                let ok = match j.kind {
                    Direction::Load => rc > Some(0) && pinned.insert(key),
                    Direction::Store => rc == Some(-1) && storing.insert(key),
                };
                if !ok {
                    return bad(format!(
                        "job {jid} ({:?}) key in state {rc:?} or shared",
                        j.kind
                    ));
                }
            }
        }
        let m = self.manager.stats();
        if (m.pinned, m.stores_in_flight) != (pinned.len() as u64, storing.len() as u64) {
            return bad(format!(
                "tier pins {} and stores {} keys, jobs hold {} and {}",
                m.pinned,
                m.stores_in_flight,
                pinned.len(),
                storing.len()
            ));
        }
        for (b, jobs) in &self.fence {
            for j in jobs {
                let ok = self
                    .jobs
                    .get(j)
                    .is_some_and(|j| j.released && j.gpu_blocks.contains(b));
                if !ok {
                    return bad(format!(
                        "fence on block {b} names job {j}, not a released job touching it"
                    ));
                }
            }
        }
        for (&jid, j) in &self.jobs {
            if self.requests[&j.request_id].finished && !j.released {
                return bad(format!(
                    "job {jid} of finished request {} still holds its blocks",
                    j.request_id
                ));
            }
        }
        Ok(())
    }
}

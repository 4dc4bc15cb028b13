//! The manager's self-check: recounts its state from scratch and compares it with the
//! counters kept incrementally and with the policy's lists.

use super::{IN_FLIGHT, Manager, NO_ID};
use crate::error::{Error, Result};

impl Manager {
    /// Recounts everything from scratch and compares it with the incremental state.
    pub fn check_invariants(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Internal(m));
        let used = self.pool.num_used();
        let ghosts = self.policy.num_remembered();
        if self.keys.len() != used + ghosts {
            return bad(format!(
                "{} keys but {used} used slots and {ghosts} ghosts",
                self.keys.len()
            ));
        }
        let (mut in_flight, mut idle, mut pinned) = (0u64, 0u64, 0u64);
        let mut occupied = vec![false; self.cfg.num_slots];
        for s in self.occupied_slots() {
            occupied[s as usize] = true;
            match self.slots[s as usize].ref_cnt {
                IN_FLIGHT => in_flight += 1,
                0 => idle += 1,
                r if r > 0 => pinned += 1,
                r => return bad(format!("slot {s}: ref count {r}")),
            }
        }
        if let Some(s) =
            (0..self.cfg.num_slots).find(|&s| !occupied[s] && self.slots[s].entry != NO_ID)
        {
            return bad(format!("free slot {s} names a key-table entry"));
        }
        let st = &self.stats;
        if (in_flight, idle, pinned) != (st.stores_in_flight, st.evictable, st.pinned) {
            return bad(format!(
                "recount (in flight, evictable, pinned) = {:?}, counters {:?}",
                (in_flight, idle, pinned),
                (st.stores_in_flight, st.evictable, st.pinned)
            ));
        }
        self.records
            .check(self.cfg.key_len, &self.keys)
            .or_else(bad)?;
        self.policy
            .check(&self.slots, &occupied, used, idle)
            .or_else(bad)
    }

    fn occupied_slots(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.cfg.num_slots as u32).filter(|&s| {
            let e = self.entry_of_slot(s);
            e != NO_ID && self.find(self.keys.key(e)) == Some(s)
        })
    }
}

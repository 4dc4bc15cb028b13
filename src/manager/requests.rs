//! Request-scoped calls (vLLM 0.33 `on_new_request`, the context argument of `prepare_load`
//! and `prepare_store`, and `on_request_finished`): a request records the keys it observes, in
//! first-observation order with their positions, which of them it inserted and which it
//! reused; when it finishes, its record is committed to the policy head to tail (LRU: fresh
//! ranks, head newest; ARC: promotion of the reused keys).
//!
//! In 0.24 semantics the same calls are accepted and the record is not kept: a request
//! changes nothing (vLLM 0.24 `on_request_finished` is a no-op for the CPU manager).

use super::keys::key_eq;
use super::record::{INSERTED, NO_POS, REUSED, Run, group_of};
use super::{Manager, NO_ID, RequestId, StorePlan};
use crate::error::{Error, Result, invalid};

impl Manager {
    /// Begins a request (vLLM 0.33 `on_new_request`): an empty access record, valid until
    /// [`Self::finish_request`].
    pub fn begin_request(&mut self) -> RequestId {
        self.records.begin(self.generation)
    }

    /// Requests begun and not finished.
    pub fn num_active_requests(&self) -> usize {
        self.records.num_active()
    }

    /// Finishes request `req` (vLLM 0.33 `on_request_finished`): its record is committed to
    /// the policy, unless a [`Self::reset`] came after its last use (then nothing is), and the
    /// handle ends. Fails with [`Error::InvalidArgument`], changing nothing, if `req` is not an
    /// active request.
    pub fn finish_request(&mut self, req: RequestId) -> Result<()> {
        let i = self.records.index(req)?;
        if self.v033() && self.records.get(i).generation == self.generation {
            self.commit(i);
        }
        self.records.end(i);
        Ok(())
    }

    /// [`Self::prepare_load`] for request `req`, with the keys' `positions` (tokens up to the
    /// end of each key's block; empty: none): in 0.33 semantics the loaded keys are recorded
    /// as reused (unless the request inserted them). Fails as `prepare_load` does, or with
    /// [`Error::InvalidArgument`] for a bad `req` or `positions`, changing nothing.
    pub fn prepare_load_for(
        &mut self,
        req: RequestId,
        keys: &[u8],
        positions: &[u64],
        out_slots: &mut [u32],
    ) -> Result<usize> {
        let i = self.records.index(req)?;
        let n = self.check_keys(keys, "keys")?;
        check_positions(positions, n)?;
        let n = self.prepare_load(keys, out_slots)?;
        if self.v033() {
            self.record_loads(i, keys, positions, n);
        }
        Ok(n)
    }

    /// [`Self::prepare_store`] for request `req`, with the keys' `positions` (empty: none). In
    /// 0.33 semantics the request's record and its store misses are kept even when the answer
    /// is [`Error::NoRoom`] (as vLLM 0.33 keeps them); a bad argument changes nothing.
    pub fn prepare_store_for(
        &mut self,
        req: RequestId,
        keys: &[u8],
        positions: &[u64],
        plan: &mut StorePlan,
    ) -> Result<super::StoreCounts> {
        let i = self.records.index(req)?;
        let n = self.check_keys(keys, "keys")?;
        check_positions(positions, n)?;
        plan.indices.resize(n, 0);
        plan.slots.resize(n, 0);
        plan.evicted.resize(n * self.cfg.key_len, 0);
        let r = self.prepare_store_checked(
            Some(i),
            keys,
            positions,
            &mut plan.indices,
            &mut plan.slots,
            &mut plan.evicted,
        );
        let c = r.as_ref().copied().unwrap_or_default();
        plan.indices.truncate(c.stored);
        plan.slots.truncate(c.stored);
        plan.evicted.truncate(c.evicted * self.cfg.key_len);
        r
    }

    /// [`Self::prepare_store_into`] for request `req` with `positions` (see
    /// [`Self::prepare_store_for`]).
    pub fn prepare_store_for_into(
        &mut self,
        req: RequestId,
        keys: &[u8],
        positions: &[u64],
        out_indices: &mut [u32],
        out_slots: &mut [u32],
        out_evicted: &mut [u8],
    ) -> Result<super::StoreCounts> {
        let i = self.records.index(req)?;
        let n = self.check_keys(keys, "keys")?;
        check_positions(positions, n)?;
        self.prepare_store_checked(
            Some(i),
            keys,
            positions,
            out_indices,
            out_slots,
            out_evicted,
        )
    }

    /// [`Self::prepare_store_for_into`] for a caller whose arguments are right by construction
    /// (the scheduler's requests and keys): `req` active, `keys` whole keys, one position per
    /// key, none [`NO_POS`], each output as long as the keys. Checked in debug builds only.
    #[inline]
    pub(crate) fn prepare_store_for_owned(
        &mut self,
        req: RequestId,
        keys: &[u8],
        positions: &[u64],
        out_indices: &mut [u32],
        out_slots: &mut [u32],
        out_evicted: &mut [u8],
    ) -> Result<super::StoreCounts> {
        debug_assert!(self.records.index(req).is_ok(), "{req:?} is not active");
        debug_assert!(self.check_keys(keys, "keys").is_ok());
        let n = keys.len() / self.cfg.key_len;
        debug_assert!(check_positions(positions, n).is_ok() && positions.len() == n);
        debug_assert!(out_indices.len() >= n && out_slots.len() >= n);
        debug_assert!(out_evicted.len() >= n * self.cfg.key_len);
        let i = self.records.index_of(req);
        self.prepare_store_sized(
            Some(i),
            keys,
            positions,
            out_indices,
            out_slots,
            out_evicted,
        )
    }

    /// Records the `n` resolved keys of a load by record `i` as observed and reused. The keys
    /// new to the record, `scratch_new[recorded..]`, are recorded as one run before any other
    /// key is recorded or looked up past the filter, and after the loop.
    fn record_loads(&mut self, i: usize, keys: &[u8], positions: &[u64], n: usize) {
        let kl = self.cfg.key_len;
        let (access_ids, access_pos) = (&mut self.scratch_access_ids, &mut self.scratch_access_pos);
        let new = &mut self.scratch_new;
        access_ids.clear();
        access_pos.clear();
        new.clear();
        let rec = self.records.current(i, self.generation);
        let (hashes, ids) = (&self.scratch_hash[..n], &self.scratch_ids[..n]);
        let run = Run {
            keys,
            key_len: kl,
            hashes,
            ids,
            positions,
        };
        let (mut accessed, mut recorded) = (false, 0);
        for (k, key) in keys.chunks_exact(kl).enumerate().take(n) {
            let (h, id) = (hashes[k], ids[k]);
            let p = positions.get(k).copied().unwrap_or(NO_POS);
            // Every loaded key is stored.
            let new_key = if rec.claim(h) {
                new.push(k as u32);
                true
            } else {
                rec.append_pending(run, new, &mut recorded, REUSED, 0);
                let seen = rec.find(h, key);
                let (j, new_key) = rec.observe(seen, h, key, id, p);
                let f = &mut rec.entries[j as usize].flags;
                if *f & INSERTED == 0 {
                    *f |= REUSED;
                }
                new_key
            };
            if new_key && p != NO_POS {
                access_ids.push(id);
                access_pos.push(p);
            }
            accessed |= new_key;
        }
        rec.append_pending(run, new, &mut recorded, REUSED, 0);
        if accessed {
            let rank = &mut rec.rank;
            self.policy.on_request_access(
                &self.scratch_access_ids,
                &self.scratch_access_pos,
                rank,
                &self.keys,
            );
        }
    }

    /// Commits record `i` (current): its keys head to tail — by position when every key has
    /// one, else by group (the key's last four bytes, big-endian), each group by position when
    /// all its keys have one and by first observation otherwise — with their flags, to the
    /// policy (vLLM 0.33 `on_request_finished` and `order_request_keys`).
    fn commit(&mut self, i: usize) {
        let kl = self.cfg.key_len;
        let rec = self.records.get(i);
        let mut n = rec.len();
        #[cfg(test)]
        let shortcut = !self.commit_general_only;
        #[cfg(not(test))]
        let shortcut = true;
        if shortcut && rec.ascending {
            if self.policy.commit_in_anchor_order(rec.rank, n) {
                #[cfg(test)]
                {
                    self.commit_shortcuts += 1;
                }
                return;
            }
            // Keys recorded with ascending positions are committed in their order, tail first:
            // the keys the last store inserted, when they are the last recorded, come first.
            if let Some(tail) = rec.inserted_tail()
                && self
                    .policy
                    .commit_inserted_tail(rec.inserted_version, tail.len())
            {
                n = tail.start as usize;
                #[cfg(test)]
                {
                    self.commit_shortcuts += 1;
                }
            }
        }
        self.scratch_order.clear();
        self.scratch_order.extend(0..n as u32);
        // Keys recorded with ascending positions are in commit order already.
        if !rec.ascending {
            let order = &mut self.scratch_order;
            let group = |j: &u32| group_of(rec.key(*j as usize, kl));
            if !order.is_sorted_by_key(group) {
                order.sort_by_key(group);
            }
            let position = |j: &u32| rec.entries[*j as usize].position;
            if rec.unpositioned == 0 {
                if !order.is_sorted_by_key(position) {
                    order.sort_by_key(position);
                }
            } else {
                // vLLM 0.33 sorts each group whose keys all have a position.
                for run in order.chunk_by_mut(|a, b| group(a) == group(b)) {
                    if run
                        .iter()
                        .all(|&j| rec.entries[j as usize].position != NO_POS)
                    {
                        run.sort_by_key(position);
                    }
                }
            }
        }
        self.scratch_access_ids.clear();
        self.scratch_flags.clear();
        for &j in &self.scratch_order {
            let (key, e) = (rec.key(j as usize, kl), &rec.entries[j as usize]);
            let (id, hash) = (e.id, e.hash);
            let kept = self
                .slots
                .get(id as usize)
                .is_some_and(|st| st.entry != NO_ID && key_eq(self.keys.key(st.entry), key));
            let id = if kept {
                id
            } else {
                self.keys
                    .find_hashed(hash, key)
                    .map_or(NO_ID, |e| self.policy.id_of_entry(e))
            };
            self.scratch_access_ids.push(id);
            self.scratch_flags.push(e.flags);
        }
        self.policy.on_request_finished(
            &self.scratch_access_ids,
            &self.scratch_flags,
            &self.slots,
            rec.rank,
        );
    }

    /// Begins the anonymous request of a 0.33 call made without one (vLLM: a fresh context
    /// per call); [`Self::end_anonymous`] ends it without a commit.
    pub(super) fn begin_anonymous(&mut self) -> usize {
        let id = self.records.begin(self.generation);
        self.records.index(id).expect("a request just begun")
    }

    /// Ends anonymous request `i`, releasing the policy rank it may have taken (it has no
    /// positioned key, so nothing is ranked by it).
    pub(super) fn end_anonymous(&mut self, i: usize) {
        let rank = self.records.get(i).rank;
        if rank != NO_ID {
            self.policy.on_request_finished(&[], &[], &self.slots, rank);
        }
        self.records.end(i);
    }
}

/// Checks that `positions` is empty or gives one position per key, none `u64::MAX`.
fn check_positions(positions: &[u64], n: usize) -> Result<()> {
    if !positions.is_empty() && positions.len() != n {
        return Err(invalid!(
            "positions: {} positions for {n} keys",
            positions.len()
        ));
    }
    // Every position compared without a branch (the usual answer: none is reserved), then the
    // first reserved one found.
    if positions.iter().fold(false, |any, &p| any | (p == NO_POS))
        && let Some(i) = positions.iter().position(|&p| p == NO_POS)
    {
        return Err(Error::InvalidArgument(format!(
            "positions[{i}]: {} is reserved for \"no position\"",
            NO_POS
        )));
    }
    Ok(())
}

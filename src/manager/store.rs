//! Stores: `prepare_store` (the threshold filter, protection of the keys named, eviction by
//! the policy, slots for the new keys) in the order of vLLM 0.24 or 0.33, `complete_store`,
//! and `discard`.

use super::keys::{self, key_eq};
use super::policy::NewKeys;
use super::record::{INSERTED, NO_POS, REUSED, Record, Run, STORE_MISS};
use super::{IN_FLIGHT, Manager, NO_ID, SlotState, StoreCounts, StorePlan};
use crate::error::{Error, Result, invalid};

impl Manager {
    /// [`Self::prepare_store_into`] with owned, reusable outputs.
    pub fn prepare_store(&mut self, keys: &[u8], plan: &mut StorePlan) -> Result<StoreCounts> {
        let n = self.check_keys(keys, "keys")?;
        plan.indices.resize(n, 0);
        plan.slots.resize(n, 0);
        plan.evicted.resize(n * self.cfg.key_len, 0);
        let (indices, slots, evicted) = (&mut plan.indices, &mut plan.slots, &mut plan.evicted);
        let r = self.prepare_store_checked(None, keys, &[], indices, slots, evicted);
        let c = r.as_ref().copied().unwrap_or_default();
        plan.indices.truncate(c.stored);
        plan.slots.truncate(c.stored);
        plan.evicted.truncate(c.evicted * self.cfg.key_len);
        r
    }

    /// Reserves slots for the keys that are not stored yet (their stores are then in flight).
    ///
    /// Keys filtered by the store threshold and keys already stored (ready or in flight) are
    /// skipped; a key listed twice is stored once. When the free slots do not suffice, evicts
    /// ready, unpinned keys by the policy, never a key named in this call. Writes the input
    /// indices and slots of the keys to store, and the evicted keys (back to back, eviction
    /// order). Each output must hold as many entries as there are keys.
    ///
    /// Fails with [`Error::NoRoom`] when not enough can be evicted now, changing nothing in
    /// 0.24 semantics; in 0.33 semantics the store-threshold counts and the policy's store-miss
    /// adaptation are kept, as vLLM 0.33 keeps them.
    ///
    /// In 0.33 semantics (vLLM 0.33 `prepare_store`): the threshold counts offers, every key
    /// offered counts; only absent keys are candidates and only they are filtered; the whole
    /// offer is protected from eviction; a call without a request is one of its own (see
    /// [`Self::prepare_store_for`]).
    pub fn prepare_store_into(
        &mut self,
        keys: &[u8],
        out_indices: &mut [u32],
        out_slots: &mut [u32],
        out_evicted: &mut [u8],
    ) -> Result<StoreCounts> {
        self.check_keys(keys, "keys")?;
        self.prepare_store_checked(None, keys, &[], out_indices, out_slots, out_evicted)
    }

    /// A store of request record `req` (`None`: none) with checked `keys` and `positions`.
    #[inline(always)]
    pub(super) fn prepare_store_checked(
        &mut self,
        req: Option<usize>,
        keys: &[u8],
        positions: &[u64],
        out_indices: &mut [u32],
        out_slots: &mut [u32],
        out_evicted: &mut [u8],
    ) -> Result<StoreCounts> {
        let kl = self.cfg.key_len;
        let n = keys.len() / kl;
        if out_indices.len() < n {
            return Err(Error::BufferTooSmall {
                what: "out_indices",
                needed: n,
                got: out_indices.len(),
            });
        }
        if out_slots.len() < n {
            return Err(Error::BufferTooSmall {
                what: "out_slots",
                needed: n,
                got: out_slots.len(),
            });
        }
        if out_evicted.len() < n * kl {
            return Err(Error::BufferTooSmall {
                what: "out_evicted",
                needed: n,
                got: out_evicted.len() / kl,
            });
        }
        self.prepare_store_sized(req, keys, positions, out_indices, out_slots, out_evicted)
    }

    /// [`Self::prepare_store_checked`] with outputs known to hold as many entries as there are
    /// keys.
    #[inline(always)]
    pub(super) fn prepare_store_sized(
        &mut self,
        req: Option<usize>,
        keys: &[u8],
        positions: &[u64],
        out_indices: &mut [u32],
        out_slots: &mut [u32],
        out_evicted: &mut [u8],
    ) -> Result<StoreCounts> {
        if !self.v033() {
            return self.store_024(keys, out_indices, out_slots, out_evicted);
        }
        let i = req.unwrap_or_else(|| self.begin_anonymous());
        let r = self.store_033(i, keys, positions, out_indices, out_slots, out_evicted);
        if req.is_none() {
            self.end_anonymous(i);
        }
        r
    }

    /// vLLM 0.24 `prepare_store` (arguments checked).
    fn store_024(
        &mut self,
        keys: &[u8],
        out_indices: &mut [u32],
        out_slots: &mut [u32],
        out_evicted: &mut [u8],
    ) -> Result<StoreCounts> {
        let n = self.resolve(keys);
        let kl = self.cfg.key_len;
        // Protect every present key named in the call (before the threshold filter: vLLM 0.24
        // protects only the keys that pass it), filter by the threshold, collect the absent
        // keys that pass (deduplicated).
        self.next_epoch();
        self.scratch_new.clear();
        let mut skipped = 0;
        let (ids, hashes, epoch) = (&self.scratch_ids[..n], &self.scratch_hash[..n], self.epoch);
        let (slots, new, num_slots) = (&mut self.slots, &mut self.scratch_new, self.cfg.num_slots);
        for (i, (key, &id)) in keys.chunks_exact(kl).zip(ids).enumerate() {
            let present = (id as usize) < num_slots;
            if present {
                slots[id as usize].stamp = epoch;
            }
            if let Some(t) = &self.tracker
                && !t.passes(hashes[i], key)
            {
                skipped += 1;
                continue;
            }
            if !present {
                new.push(i as u32);
            }
        }
        self.dedupe_new(keys);
        let to_store = self.scratch_new.len();
        if to_store == 0 {
            self.stats.stores_skipped += skipped;
            return Ok(StoreCounts::default());
        }
        self.make_room(to_store, out_evicted)?;
        self.stats.stores_skipped += skipped;
        self.stats.record_allocation(to_store);
        let mut no_rank = NO_ID;
        self.insert_new(keys, &[], out_indices, out_slots, &mut no_rank)
    }

    /// vLLM 0.33 `prepare_store` for record `i` (arguments checked), in its order: count the
    /// offer; candidates = the absent keys (deduplicated), filtered by the threshold; report
    /// the candidates not reported before by this request as store misses; record the
    /// candidates and the ready keys (these as reused); evict with the whole offer protected;
    /// insert.
    ///
    /// One pass over the offer classifies, deduplicates and records: a repeated absent key
    /// finds its first listing in the record (stamped with this offer) and is left out.
    fn store_033(
        &mut self,
        i: usize,
        keys: &[u8],
        positions: &[u64],
        out_indices: &mut [u32],
        out_slots: &mut [u32],
        out_evicted: &mut [u8],
    ) -> Result<StoreCounts> {
        let n = self.resolve(keys);
        let kl = self.cfg.key_len;
        if let Some(t) = &mut self.tracker {
            t.count_offer(&self.scratch_hash[..n], keys, kl);
        }
        self.next_epoch();
        let (epoch, num_slots) = (self.epoch, self.cfg.num_slots);
        let want_misses = self.policy.observes_store_misses();
        let rec = self.records.current(i, self.generation);
        let offer = rec.begin_offer();
        let (new, entries, misses, filtered) = (
            &mut self.scratch_new,
            &mut self.scratch_entries,
            &mut self.scratch_misses,
            &mut self.scratch_filtered,
        );
        let (access_ids, access_pos) = (&mut self.scratch_access_ids, &mut self.scratch_access_pos);
        for v in [
            &mut *new,
            &mut *entries,
            &mut *misses,
            &mut *filtered,
            &mut *access_ids,
        ] {
            v.clear();
        }
        access_pos.clear();
        let (hashes, ids, slots, tracker) = (
            &self.scratch_hash[..n],
            &self.scratch_ids[..n],
            &mut self.slots,
            &self.tracker,
        );
        let run = Run {
            keys,
            key_len: kl,
            hashes,
            ids,
            positions,
        };
        // The candidates new to the record, `new[recorded..]`, are recorded as one run before
        // any other key is recorded or looked up past the filter, and after the loop.
        let (mut accessed, mut recorded) = (false, 0);
        let record_candidates =
            |rec: &mut Record, new: &[u32], recorded: &mut usize, entries: &mut Vec<u32>| {
                let (base, any) = rec.append_pending(run, new, recorded, STORE_MISS, offer);
                if any {
                    entries.extend(base..rec.len() as u32);
                }
                any
            };
        for (k, key) in keys.chunks_exact(kl).enumerate() {
            let (h, id) = (hashes[k], ids[k]);
            let present = (id as usize) < num_slots;
            if !present && rec.claim(h) {
                // Neither recorded nor offered before in this call.
                if tracker.as_ref().is_some_and(|t| !t.passes(h, key)) {
                    rec.leave_out();
                    filtered.push(k as u32);
                    continue;
                }
                if want_misses {
                    misses.push(id);
                }
                new.push(k as u32);
                continue;
            }
            let seen = if present {
                let st = &mut slots[id as usize];
                st.stamp = epoch;
                if st.ref_cnt == IN_FLIGHT {
                    continue;
                }
                let seen = rec.find(h, key);
                if seen.is_none() {
                    accessed |= record_candidates(rec, new, &mut recorded, entries);
                }
                seen
            } else {
                accessed |= record_candidates(rec, new, &mut recorded, entries);
                let seen = rec.find(h, key);
                let flags = seen
                    .map(|j| rec.entries[j as usize])
                    .map(|e| (e.offer, e.flags));
                if flags.is_some_and(|(o, _)| o == offer) {
                    continue; // listed before in this offer
                }
                if tracker.as_ref().is_some_and(|t| !t.passes(h, key)) {
                    filtered.push(k as u32);
                    continue;
                }
                if want_misses && flags.is_none_or(|(_, f)| f & STORE_MISS == 0) {
                    misses.push(id);
                }
                seen
            };
            let p = positions.get(k).copied().unwrap_or(NO_POS);
            let (j, is_new) = rec.observe(seen, h, key, id, p);
            if is_new && present && p != NO_POS {
                access_ids.push(id);
                access_pos.push(p);
            }
            accessed |= is_new;
            let e = &mut rec.entries[j as usize];
            if present {
                if e.flags & INSERTED == 0 {
                    e.flags |= REUSED;
                }
            } else {
                e.flags |= STORE_MISS;
                e.offer = offer;
                new.push(k as u32);
                entries.push(j);
                recorded = new.len();
            }
        }
        // The candidates after the last key recorded, `new[tail..]`, are recorded once the
        // store has failed or inserted them (then with their slots, as inserted).
        let tail = recorded;
        accessed |= tail < new.len();
        if !self.scratch_misses.is_empty() {
            self.policy.on_store_miss(&self.scratch_misses);
        }
        // A request rank the access would take only because the request has none is taken by
        // the insertion of the first new key instead (every key has a position, and nothing in
        // between takes a rank), or after the call if nothing is inserted.
        let rank_pending = accessed
            && self.scratch_access_ids.is_empty()
            && (rec.rank != NO_ID || !positions.is_empty());
        if accessed && !rank_pending {
            self.policy.on_request_access(
                &self.scratch_access_ids,
                &self.scratch_access_pos,
                &mut rec.rank,
                &self.keys,
            );
        }
        if self.scratch_filtered.len() > 1 {
            // A key filtered twice counts once.
            std::mem::swap(&mut self.scratch_new, &mut self.scratch_filtered);
            self.dedupe_new(keys);
            std::mem::swap(&mut self.scratch_new, &mut self.scratch_filtered);
        }
        self.stats.stores_skipped += self.scratch_filtered.len() as u64;
        let to_store = self.scratch_new.len();
        let rec = self.records.get_mut(i);
        if to_store == 0 {
            if rank_pending && rec.rank == NO_ID {
                self.policy
                    .on_request_access(&[], &[], &mut rec.rank, &self.keys);
            }
            return Ok(StoreCounts::default());
        }
        self.stats.record_allocation(to_store);
        let mut rank = rec.rank;
        let counts = self
            .make_room(to_store, out_evicted)
            .and_then(|_| self.insert_new(keys, positions, out_indices, out_slots, &mut rank));
        if rank_pending && rank == NO_ID {
            self.policy
                .on_request_access(&[], &[], &mut rank, &self.keys);
        }
        let rec = self.records.get_mut(i);
        let run = Run {
            keys,
            key_len: kl,
            hashes: &self.scratch_hash[..n],
            ids: &self.scratch_ids[..n],
            positions,
        };
        let tail_keys = &self.scratch_new[tail..];
        rec.rank = rank;
        let counts = match counts {
            Ok(c) => c,
            Err(e) => {
                rec.append(run, tail_keys, STORE_MISS, offer);
                return Err(e);
            }
        };
        for (&j, &slot) in self.scratch_entries.iter().zip(&out_slots[..tail]) {
            let e = &mut rec.entries[j as usize];
            e.flags |= INSERTED;
            e.id = slot;
        }
        let tail_slots = &out_slots[tail..to_store];
        let flags = STORE_MISS | INSERTED;
        let base = rec.append_inserted(run, tail_keys, tail_slots, flags, offer);
        let version = self.policy.order_version();
        if version != 0 {
            let entries = &mut self.scratch_entries;
            entries.extend(base..rec.len() as u32);
            rec.note_inserted(entries, version);
        }
        Ok(counts)
    }

    /// Evicts (by the policy, none of this epoch's protected slots) what `to_store` new keys
    /// need beyond the free slots, writing the evicted keys to `out_evicted`; returns their
    /// number. Fails with [`Error::NoRoom`], changing nothing, when not enough can be evicted.
    fn make_room(&mut self, to_store: usize, out_evicted: &mut [u8]) -> Result<usize> {
        self.scratch_victims.clear();
        let need = to_store.saturating_sub(self.pool.num_free());
        if need == 0 {
            return Ok(0);
        }
        let no_room = || Error::NoRoom(format!("need {need} evictable slots for {to_store} keys"));
        if need as u64 > self.stats.evictable {
            return Err(no_room());
        }
        let slots = &self.slots;
        if !self
            .policy
            .pick_victims(need, slots, self.epoch, &mut self.scratch_victims)
        {
            return Err(no_room());
        }
        let entries = self
            .scratch_victims
            .iter()
            .map(|&s| slots[s as usize].entry);
        self.keys.prefetch_entries(entries);
        self.evict_victims(&mut out_evicted[..need * self.cfg.key_len]);
        Ok(need)
    }

    /// Stores the keys `scratch_new` names (indices into `keys`), each in a new in-flight slot,
    /// with `positions` (empty: none) and the storing request's policy `rank`.
    fn insert_new(
        &mut self,
        keys: &[u8],
        positions: &[u64],
        out_indices: &mut [u32],
        out_slots: &mut [u32],
        rank: &mut u32,
    ) -> Result<StoreCounts> {
        let to_store = self.scratch_new.len();
        let evicted = self.scratch_victims.len();
        out_indices[..to_store].copy_from_slice(&self.scratch_new);
        let (new, hashes, ids) = (&self.scratch_new[..], &self.scratch_hash, &self.scratch_ids);
        let new = NewKeys {
            indices: new,
            keys,
            key_len: self.cfg.key_len,
            hashes,
            ids,
            positions,
        };
        let (pool, slots, table) = (&mut self.pool, &mut self.slots, &mut self.keys);
        let out = &mut out_slots[..to_store];
        self.policy.insert_all(new, pool, slots, table, out, rank);
        self.stats.stores_in_flight += to_store as u64;
        Ok(StoreCounts {
            stored: to_store,
            evicted,
        })
    }

    /// Evicts `scratch_victims`: copies their keys out, frees their slots, records the event.
    fn evict_victims(&mut self, out_evicted: &mut [u8]) {
        let kl = self.cfg.key_len;
        for (out, &s) in out_evicted.chunks_exact_mut(kl).zip(&self.scratch_victims) {
            let key = self.keys.key(self.entry_of_slot(s));
            keys::copy_key(out, key);
            if self.cfg.enable_events {
                self.events.push_key(key);
            }
        }
        if self.cfg.enable_events {
            self.events.end_record(true);
        }
        self.policy
            .evict(&self.scratch_victims, &mut self.slots, &mut self.keys);
        for &s in &self.scratch_victims {
            self.slots[s as usize].entry = NO_ID;
            self.pool.release(s);
        }
        let n = self.scratch_victims.len() as u64;
        self.stats.evictable -= n;
        self.stats.evictions += n;
    }

    /// Drops slot `s`'s key from the policy and the index and frees the slot.
    fn free_slot(&mut self, s: u32) {
        self.policy.remove(s, &mut self.slots, &mut self.keys);
        self.slots[s as usize].entry = NO_ID;
        self.pool.release(s);
    }

    fn next_epoch(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.slots.iter_mut().for_each(|s| s.stamp = 0);
            self.epoch = 1;
        }
    }

    /// Ends the stores of `keys`. Success makes the in-flight ones ready (one "stored" event);
    /// failure drops the in-flight ones and frees their slots (in 0.33 semantics with one
    /// metadata-only "removed" event, see [`Self::take_events`]). Keys that are unknown or already
    /// ready are ignored on purpose (as by vLLM 0.24 `CPUOffloadingManager.complete_store`).
    pub fn complete_store(&mut self, keys: &[u8], success: bool) -> Result<()> {
        self.complete_store_at(keys, &[], success)
    }

    /// [`Self::complete_store`], given the slots `prepare_store` gave the keys (`slots[i]` for
    /// `keys[i]`, or empty): a slot whose store is in flight and holds the key is taken without
    /// a hash lookup; any other slot is only a wrong hint and the key is looked up. Fails with
    /// [`Error::InvalidArgument`], changing nothing, if `slots` is neither empty nor as long as
    /// `keys` or names a slot beyond the tier.
    pub fn complete_store_at(&mut self, keys: &[u8], slots: &[u32], success: bool) -> Result<()> {
        let n = self.check_keys(keys, "keys")?;
        if !slots.is_empty() && slots.len() != n {
            return Err(invalid!("slots: {} slots for {n} keys", slots.len()));
        }
        if let Some(i) = slots.iter().position(|&s| s as usize >= self.cfg.num_slots) {
            return Err(invalid!(
                "slots[{i}]: {} is not below num_slots {}",
                slots[i],
                self.cfg.num_slots
            ));
        }
        let mut ended = 0;
        for (j, key) in keys.chunks_exact(self.cfg.key_len).enumerate() {
            let in_flight = |st: &SlotState| st.ref_cnt == IN_FLIGHT;
            let s = match slots.get(j) {
                Some(&s) if in_flight(&self.slots[s as usize]) && key_eq(self.slot_key(s), key) => {
                    s
                }
                _ => match self.slot(self.find(key)) {
                    Some(s) if in_flight(&self.slots[s as usize]) => s,
                    _ => continue,
                },
            };
            self.slots[s as usize].ref_cnt = 0;
            ended += 1;
            if success {
                self.policy.on_ready(s);
            } else {
                self.free_slot(s);
            }
            if self.cfg.enable_events && (success || self.v033()) {
                self.events.push_key(key);
            }
        }
        self.stats.stores_in_flight -= ended;
        if success {
            self.stats.evictable += ended;
        }
        if self.cfg.enable_events {
            match success {
                true => self.events.end_record(false),
                false if self.v033() => self.events.end_record_metadata_only(),
                false => {}
            }
        }
        Ok(())
    }

    /// Drops `keys` from the tier (their data is known bad, e.g. a failed load): keys that are
    /// ready and not pinned are removed and their slots freed, with one "removed" event. Keys
    /// that are absent, in flight or still pinned by another load are left alone. Returns the
    /// number of keys dropped.
    pub fn discard(&mut self, keys: &[u8]) -> Result<usize> {
        self.check_keys(keys, "keys")?;
        let mut dropped = 0;
        for key in keys.chunks_exact(self.cfg.key_len) {
            let Some(s) = self.slot(self.find(key)) else {
                continue;
            };
            if self.slots[s as usize].ref_cnt != 0 {
                continue;
            }
            if self.cfg.enable_events {
                self.events.push_key(key);
            }
            self.free_slot(s);
            self.stats.evictable -= 1;
            dropped += 1;
        }
        if self.cfg.enable_events {
            self.events.end_record(true);
        }
        Ok(dropped)
    }
}

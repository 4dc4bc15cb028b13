//! Stores: `prepare_store` (the threshold filter, protection of the keys named, eviction by
//! the policy, slots for the new keys), `complete_store`, and `discard`.

use super::keys::{self, key_eq};
use super::policy::NewKeys;
use super::{IN_FLIGHT, Manager, SlotState, StoreCounts, StorePlan};
use crate::error::{Error, Result, invalid};

impl Manager {
    /// [`Self::prepare_store_into`] with owned, reusable outputs.
    pub fn prepare_store(&mut self, keys: &[u8], plan: &mut StorePlan) -> Result<StoreCounts> {
        let n = self.check_keys(keys, "keys")?;
        plan.indices.resize(n, 0);
        plan.slots.resize(n, 0);
        plan.evicted.resize(n * self.cfg.key_len, 0);
        let r =
            self.prepare_store_into(keys, &mut plan.indices, &mut plan.slots, &mut plan.evicted);
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
    /// Fails with [`Error::NoRoom`], changing nothing, when not enough can be evicted now.
    pub fn prepare_store_into(
        &mut self,
        keys: &[u8],
        out_indices: &mut [u32],
        out_slots: &mut [u32],
        out_evicted: &mut [u8],
    ) -> Result<StoreCounts> {
        let n = self.check_keys(keys, "keys")?;
        let kl = self.cfg.key_len;
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
        self.resolve(keys);
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
        let need = to_store.saturating_sub(self.pool.num_free());
        if need > 0 {
            let no_room =
                || Error::NoRoom(format!("need {need} evictable slots for {to_store} keys"));
            if need as u64 > self.stats.evictable {
                return Err(no_room());
            }
            self.scratch_victims.clear();
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
            self.evict_victims(&mut out_evicted[..need * kl]);
        }
        self.stats.stores_skipped += skipped;
        out_indices[..to_store].copy_from_slice(&self.scratch_new);
        let (new, hashes, ids) = (&self.scratch_new[..], &self.scratch_hash, &self.scratch_ids);
        let new = NewKeys {
            indices: new,
            keys,
            key_len: kl,
            hashes,
            ids,
        };
        let (pool, slots, table) = (&mut self.pool, &mut self.slots, &mut self.keys);
        let out = &mut out_slots[..to_store];
        self.policy.insert_all(new, pool, slots, table, out);
        self.stats.stores_in_flight += to_store as u64;
        Ok(StoreCounts {
            stored: to_store,
            evicted: need,
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
            self.pool.release(s);
        }
        let n = self.scratch_victims.len() as u64;
        self.stats.evictable -= n;
        self.stats.evictions += n;
    }

    /// Drops slot `s`'s key from the policy and the index and frees the slot.
    fn free_slot(&mut self, s: u32) {
        self.policy.remove(s, &mut self.slots, &mut self.keys);
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
    /// failure drops the in-flight ones and frees their slots. Keys that are unknown or already
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
            if !success {
                self.free_slot(s);
                continue;
            }
            self.policy.on_ready(s);
            if self.cfg.enable_events {
                self.events.push_key(key);
            }
        }
        self.stats.stores_in_flight -= ended;
        if success {
            self.stats.evictable += ended;
        }
        if success && self.cfg.enable_events {
            self.events.end_record(false);
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

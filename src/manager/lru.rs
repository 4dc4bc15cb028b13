//! LRU policy (vLLM 0.24 `LRUCachePolicy`): one list of the evictable slots (ready, not pinned),
//! least recently used first. A slot's key-table entry is the slot itself, and the policy names
//! no key beyond the stored ones.

use super::keys::KeyTable;
use super::list::{Links, List};
use super::policy::{EvictionPolicy, NewKey};
use super::{NO_ID, SlotState};

#[derive(Debug, Clone)]
pub(crate) struct LruPolicy {
    links: Links,
    list: List,
}

impl LruPolicy {
    /// A "use": appends `slot` at the MRU end unless it is already listed (then it keeps its place).
    #[inline]
    fn mark_evictable(&mut self, slot: u32) {
        if !self.links.is_linked(slot) {
            self.links.push_back(&mut self.list, slot);
        }
    }

    #[inline]
    fn mark_non_evictable(&mut self, slot: u32) {
        if self.links.is_linked(slot) {
            self.links.unlink(&mut self.list, slot);
        }
    }

    /// Listed slots, LRU first (tests and invariant checks).
    pub fn order(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.list.len);
        let mut c = self.list.head;
        while c != NO_ID {
            out.push(c);
            c = self.links.next(c);
        }
        out
    }
}

impl EvictionPolicy for LruPolicy {
    const MAX_SLOTS: usize = u32::MAX as usize - 1;

    fn new(num_slots: usize, _keys: &mut KeyTable) -> crate::Result<Self> {
        Ok(Self {
            links: Links::with_capacity(num_slots)?,
            list: List::default(),
        })
    }

    #[inline]
    fn id_of_entry(&self, e: u32) -> u32 {
        e
    }

    #[inline]
    fn insert(&mut self, new: NewKey<'_>, keys: &mut KeyTable, _rank: &mut u32) -> u32 {
        keys.insert_hashed(new.hash, new.slot, new.key);
        new.slot
    }

    #[inline]
    fn on_pinned(&mut self, slot: u32) {
        self.mark_non_evictable(slot);
    }

    #[inline]
    fn on_ready(&mut self, slot: u32) {
        self.mark_evictable(slot);
    }

    /// Moves the evictable slots among `ids` to the MRU end; others are unaffected.
    #[inline]
    fn touch(&mut self, ids: &[u32], _slots: &[SlotState]) {
        for &s in ids.iter().rev().filter(|&&s| s != NO_ID) {
            if self.links.is_linked(s) {
                self.links.move_to_back(&mut self.list, s);
            }
        }
    }

    /// The first `n` listed slots, LRU first, skipping protected ones (every listed slot is
    /// ready and idle).
    #[inline]
    fn pick_victims(&self, n: usize, slots: &[SlotState], epoch: u32, out: &mut Vec<u32>) -> bool {
        let mut c = self.list.head;
        while out.len() < n && c != NO_ID {
            if !slots[c as usize].is_protected(epoch) {
                out.push(c);
            }
            c = self.links.next(c);
        }
        out.len() == n
    }

    #[inline]
    fn evict(&mut self, victims: &[u32], _slots: &mut [SlotState], keys: &mut KeyTable) {
        for &s in victims {
            self.mark_non_evictable(s);
            keys.remove_id(s);
        }
    }

    #[inline]
    fn remove(&mut self, slot: u32, _slots: &mut [SlotState], keys: &mut KeyTable) {
        self.mark_non_evictable(slot);
        keys.remove_id(slot);
    }

    fn clear(&mut self, _slots: &mut [SlotState]) {
        self.links.clear(&mut self.list);
    }

    fn num_remembered(&self) -> usize {
        0
    }

    fn check(
        &self,
        slots: &[SlotState],
        occupied: &[bool],
        _used: usize,
        idle: u64,
    ) -> Result<(), String> {
        let order = self.order();
        if order.len() as u64 != idle
            || order
                .iter()
                .any(|&s| !occupied[s as usize] || slots[s as usize].ref_cnt != 0)
        {
            return Err("LRU list is not the set of evictable slots".into());
        }
        Ok(())
    }
}

//! LRU policy (vLLM 0.24 `LRUCachePolicy`): one list of the evictable slots (ready, not pinned),
//! least recently used first.

use super::list::{Links, List, NIL};

#[derive(Debug, Clone)]
pub(crate) struct Lru {
    links: Links,
    list: List,
}

impl Lru {
    pub fn new(num_slots: usize) -> crate::Result<Self> {
        Ok(Self {
            links: Links::with_len(num_slots)?,
            list: List::default(),
        })
    }

    /// A "use": appends `slot` at the MRU end unless it is already listed (then it keeps its place).
    #[inline]
    pub fn mark_evictable(&mut self, slot: u32) {
        if !self.links.is_linked(slot) {
            self.links.push_back(&mut self.list, slot);
        }
    }

    #[inline]
    pub fn mark_non_evictable(&mut self, slot: u32) {
        if self.links.is_linked(slot) {
            self.links.unlink(&mut self.list, slot);
        }
    }

    /// Moves an evictable slot to the MRU end; others are unaffected.
    #[inline]
    pub fn touch(&mut self, slot: u32) {
        if self.links.is_linked(slot) {
            self.links.move_to_back(&mut self.list, slot);
        }
    }

    pub fn remove(&mut self, slot: u32) {
        self.mark_non_evictable(slot);
    }

    /// Picks `n` evictable slots, LRU first, skipping `protected` ones, into `out`, changing
    /// nothing. Returns false when there are fewer than `n`.
    pub fn pick_victims(
        &self,
        n: usize,
        protected: impl Fn(u32) -> bool,
        out: &mut Vec<u32>,
    ) -> bool {
        let mut c = self.list.head;
        while out.len() < n && c != NIL {
            if !protected(c) {
                out.push(c);
            }
            c = self.links.next(c);
        }
        out.len() == n
    }

    pub fn clear(&mut self) {
        self.links.clear(&mut self.list);
    }

    /// Listed slots, LRU first (tests and invariant checks).
    pub fn order(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.list.len);
        let mut c = self.list.head;
        while c != NIL {
            out.push(c);
            c = self.links.next(c);
        }
        out
    }
}

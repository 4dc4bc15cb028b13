//! The store-threshold filter (vLLM `FilterReusedOffloadingManager`): counts lookups per key in
//! an LRU-bounded table; only keys looked up at least `threshold` times are stored.

use super::keys::KeyTable;
use super::list::{Links, List};

#[derive(Clone)]
pub(crate) struct Tracker {
    pub threshold: u32,
    max_size: usize,
    keys: KeyTable,
    counts: Vec<u32>,
    links: Links,
    list: List,
}

impl Tracker {
    /// `keys` is the manager's key table, whose hasher the tracker shares.
    pub fn new(threshold: u32, max_size: usize, keys: &KeyTable) -> Self {
        let initial = max_size.min(1 << 16);
        Self {
            threshold,
            max_size,
            keys: keys.sibling(initial).expect("at most 64k keys"),
            counts: Vec::with_capacity(initial),
            links: Links::with_capacity(initial).expect("at most 64k links"),
            list: List::default(),
        }
    }

    /// One lookup of `key`: its count goes up and it becomes the most recent entry; a new key
    /// evicts the least recent entry when the tracker is full.
    pub fn record(&mut self, hash: u64, key: &[u8]) {
        if let Some(id) = self.keys.find_hashed(hash, key) {
            self.counts[id as usize] = self.counts[id as usize].saturating_add(1);
            self.links.move_to_back(&mut self.list, id);
            return;
        }
        let id = if self.list.len >= self.max_size {
            let old = self.list.head;
            self.links.unlink(&mut self.list, old);
            self.keys.remove_id(old);
            old
        } else {
            self.counts.push(0);
            self.links.grow_to(self.counts.len());
            self.counts.len() as u32 - 1
        };
        self.counts[id as usize] = 1;
        self.keys.insert_hashed(hash, id, key);
        self.links.push_back(&mut self.list, id);
    }

    #[inline]
    pub fn passes(&self, hash: u64, key: &[u8]) -> bool {
        self.keys
            .find_hashed(hash, key)
            .is_some_and(|id| self.counts[id as usize] >= self.threshold)
    }
}

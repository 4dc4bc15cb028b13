//! The store-threshold filter: counts per key, in an LRU-bounded table, the lookups (vLLM 0.24
//! `FilterReusedOffloadingManager`) or the store offers (vLLM 0.33 `count_offer`); only keys
//! counted at least `threshold` times are stored.

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
    /// Per entry: the offer that last counted it (distinct keys of one offer).
    stamps: Vec<u32>,
    offer: u32,
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
            stamps: Vec::with_capacity(initial),
            offer: 0,
        }
    }

    /// A new entry's id: a fresh one, or the least recent entry's, dropped (when full).
    fn new_entry(&mut self) -> u32 {
        if self.list.len >= self.max_size {
            let old = self.list.head;
            self.links.unlink(&mut self.list, old);
            self.keys.remove_id(old);
            old
        } else {
            self.counts.push(0);
            self.stamps.push(0);
            self.links.grow_to(self.counts.len());
            self.counts.len() as u32 - 1
        }
    }

    /// One store offer of `keys` (vLLM 0.33 `count_offer`, with `hashes` of the keys): each
    /// tracked key's count goes up (once per listing) and it becomes the most recent entry; then
    /// each untracked key is tracked with count 1, dropping the least recent entry when full but
    /// never an entry of this offer (a key that would need one stays untracked).
    pub fn count_offer(&mut self, hashes: &[u64], keys: &[u8], key_len: usize) {
        self.offer = self.offer.wrapping_add(1);
        if self.offer == 0 {
            self.stamps.iter_mut().for_each(|s| *s = 0);
            self.offer = 1;
        }
        let mut hit = 0;
        for (&h, key) in hashes.iter().zip(keys.chunks_exact(key_len)) {
            if let Some(id) = self.keys.find_hashed(h, key) {
                let i = id as usize;
                self.counts[i] = self.counts[i].saturating_add(1);
                self.links.move_to_back(&mut self.list, id);
                if self.stamps[i] != self.offer {
                    self.stamps[i] = self.offer;
                    hit += 1;
                }
            }
        }
        let mut spare = self.list.len - hit;
        for (&h, key) in hashes.iter().zip(keys.chunks_exact(key_len)) {
            if self.keys.find_hashed(h, key).is_some() {
                continue;
            }
            if self.list.len >= self.max_size {
                if spare == 0 {
                    continue;
                }
                spare -= 1;
            }
            let id = self.new_entry();
            self.counts[id as usize] = 1;
            self.stamps[id as usize] = self.offer;
            self.keys.insert_hashed(h, id, key);
            self.links.push_back(&mut self.list, id);
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
        let id = self.new_entry();
        self.counts[id as usize] = 1;
        self.keys.insert_hashed(hash, id, key);
        self.links.push_back(&mut self.list, id);
    }

    /// Whether `key` was counted at least `threshold` times.
    #[inline]
    pub fn passes(&self, hash: u64, key: &[u8]) -> bool {
        self.keys
            .find_hashed(hash, key)
            .is_some_and(|id| self.counts[id as usize] >= self.threshold)
    }
}

//! The simulated GPU KV cache: a pool of blocks with a prefix cache, as vLLM's block pool. A
//! computed full block keeps its hash after its request frees it, and another request with the
//! same prefix reuses it; free blocks are reallocated least recently freed first (a request frees
//! its blocks tail first, so its tail is reused before its head). With no capacity (0) there is
//! no prefix cache and no limit: blocks are taken from an unbounded pool.

use crate::fasthash::{FoldState, HashMap};

const NIL: u32 = u32::MAX;

/// The GPU block pool.
pub struct GpuCache {
    /// 0: unlimited, no prefix cache.
    capacity: u32,
    ref_cnt: Vec<u32>,
    hash: Vec<Option<u128>>,
    cached: HashMap<u128, u32>,
    /// Free blocks, doubly linked, least recently freed at `head`.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    free: u32,
    /// Unlimited pool: freed ids to reuse.
    spare: Vec<u32>,
    /// Changes with every call that may change what a lookup or [`Self::free_for`] answers.
    version: u64,
}

impl GpuCache {
    /// A pool of `capacity` blocks (0: unlimited, no prefix cache).
    pub fn new(capacity: u32) -> Self {
        let n = capacity as usize;
        let mut c = Self {
            capacity,
            ref_cnt: vec![0; n],
            hash: vec![None; n],
            cached: HashMap::with_capacity_and_hasher(n, FoldState::default()),
            prev: vec![NIL; n],
            next: vec![NIL; n],
            head: NIL,
            tail: NIL,
            free: 0,
            spare: Vec::new(),
            version: 0,
        };
        for b in 0..capacity {
            c.push_free(b);
        }
        c
    }

    /// A number that changes whenever the pool's blocks or cached hashes may have changed (equal
    /// versions: equal answers of [`Self::lookup_prefix`] and [`Self::free_for`]).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// True when blocks are limited (and cached).
    pub fn limited(&self) -> bool {
        self.capacity > 0
    }

    fn push_free(&mut self, b: u32) {
        let i = b as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.free += 1;
    }

    fn unlink(&mut self, b: u32) {
        let i = b as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.free -= 1;
    }

    /// Leading `hashes` cached on the GPU.
    pub fn lookup_prefix(&self, hashes: &[u128]) -> usize {
        if !self.limited() {
            return 0;
        }
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Blocks free now, for a request whose first `hits` hashes are cached: the free blocks less
    /// those of the hits (which the request takes as they are). `None`: unlimited.
    pub fn free_for(&self, hashes: &[u128]) -> Option<u32> {
        if !self.limited() {
            return None;
        }
        let hit_free = hashes
            .iter()
            .filter(|h| self.ref_cnt[self.cached[h] as usize] == 0)
            .count() as u32;
        Some(self.free - hit_free)
    }

    /// Takes the cached blocks of `hashes` (all cached: see [`Self::lookup_prefix`]) into `out`.
    pub fn take_cached(&mut self, hashes: &[u128], out: &mut Vec<u32>) {
        self.version += 1;
        for h in hashes {
            let b = self.cached[h];
            if self.ref_cnt[b as usize] == 0 {
                self.unlink(b);
            }
            self.ref_cnt[b as usize] += 1;
            out.push(b);
        }
    }

    /// Allocates `n` blocks into `out`, least recently freed first (dropping their cached
    /// hashes); false, allocating nothing, when fewer are free.
    pub fn allocate(&mut self, n: u32, out: &mut Vec<u32>) -> bool {
        self.version += 1;
        if !self.limited() {
            for _ in 0..n {
                let b = self.spare.pop().unwrap_or_else(|| {
                    self.ref_cnt.push(0);
                    self.ref_cnt.len() as u32 - 1
                });
                self.ref_cnt[b as usize] = 1;
                out.push(b);
            }
            return true;
        }
        if self.free < n {
            return false;
        }
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            if let Some(h) = self.hash[b as usize].take() {
                self.cached.remove(&h);
            }
            self.ref_cnt[b as usize] = 1;
            out.push(b);
        }
        true
    }

    /// Caches block `b`, now holding the KV of `hash`, unless another block already holds it.
    pub fn register(&mut self, b: u32, hash: u128) {
        self.version += 1;
        if self.limited()
            && self.hash[b as usize].is_none()
            && let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash)
        {
            e.insert(b);
            self.hash[b as usize] = Some(hash);
        }
    }

    /// Releases a request's blocks, tail first.
    pub fn free(&mut self, blocks: &[u32]) {
        self.version += 1;
        for &b in blocks.iter().rev() {
            let rc = &mut self.ref_cnt[b as usize];
            *rc -= 1;
            if *rc == 0 {
                if self.limited() {
                    self.push_free(b);
                } else {
                    self.spare.push(b);
                }
            }
        }
    }

    /// Blocks held by requests now.
    pub fn in_use(&self) -> u32 {
        if self.limited() {
            self.capacity - self.free
        } else {
            (self.ref_cnt.len() - self.spare.len()) as u32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_reuse_and_lru_reallocation() {
        let mut c = GpuCache::new(4);
        let mut a = Vec::new();
        assert!(c.allocate(3, &mut a));
        assert_eq!(a, [0, 1, 2]);
        for (i, &b) in a.iter().enumerate() {
            c.register(b, 10 + i as u128);
        }
        c.free(&a);
        assert_eq!(c.in_use(), 0);
        assert_eq!(c.lookup_prefix(&[10, 11, 99]), 2);
        assert_eq!(c.free_for(&[10, 11]), Some(2));
        let mut b = Vec::new();
        c.take_cached(&[10, 11], &mut b);
        assert_eq!(b, [0, 1]);
        // Free order now: 3 (never used), then 2 (freed first, being the tail).
        assert!(c.allocate(2, &mut b));
        assert_eq!(b, [0, 1, 3, 2]);
        assert_eq!(c.lookup_prefix(&[10, 11, 12]), 2, "block 2 was reallocated");
        assert!(!c.allocate(1, &mut b));
        c.free(&b);
        assert_eq!(c.in_use(), 0);
    }

    #[test]
    fn unlimited_pool_reuses_ids_and_caches_nothing() {
        let mut c = GpuCache::new(0);
        let mut a = Vec::new();
        assert!(c.allocate(3, &mut a));
        c.register(a[0], 1);
        assert_eq!(c.lookup_prefix(&[1]), 0);
        c.free(&a);
        let mut b = Vec::new();
        assert!(c.allocate(2, &mut b));
        assert!(b.iter().all(|x| a.contains(x)));
        assert_eq!(c.in_use(), 2);
    }
}

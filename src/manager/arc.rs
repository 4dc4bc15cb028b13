//! ARC policy (vLLM 0.24 `ARCCachePolicy`), with its exact target arithmetic and its eviction
//! quirk: recent list T1 and frequent list T2 hold every stored slot (LRU first); ghost lists
//! B1 and B2 remember evicted keys, each trimmed to the capacity.

use super::keys::KeyTable;
use super::list::{Links, List, NIL};

const NONE: u8 = 0;
const T1: u8 = 1;
const T2: u8 = 2;
const B1: u8 = 1;
const B2: u8 = 2;

#[derive(Clone)]
pub(crate) struct Arc {
    capacity: usize,
    /// vLLM's `target_t1_size`, a float as in the reference.
    target: f64,
    links: Links,
    tag: Vec<u8>,
    t1: List,
    t2: List,
    ghosts: Ghosts,
}

/// Evicted keys. They stay in the manager's key table under ids `capacity + g` (slots are
/// below `capacity`), so one lookup tells stored, ghost or unknown, and an eviction or a revival
/// only renames the entry. `g` indexes the links and tags below.
#[derive(Clone)]
struct Ghosts {
    base: u32,
    links: Links,
    tag: Vec<u8>,
    b1: List,
    b2: List,
    free: Vec<u32>,
}

impl Ghosts {
    fn list(&mut self, which: u8) -> &mut List {
        if which == B1 {
            &mut self.b1
        } else {
            &mut self.b2
        }
    }

    /// A free ghost index.
    fn alloc(&mut self) -> u32 {
        self.free.pop().unwrap_or_else(|| {
            self.tag.push(NONE);
            self.links.grow_to(self.tag.len());
            self.tag.len() as u32 - 1
        })
    }

    /// Unlinks ghost `g` and frees its index (its key-table entry is the caller's).
    fn release(&mut self, g: u32) {
        let which = std::mem::replace(&mut self.tag[g as usize], NONE);
        let list = if which == B1 {
            &mut self.b1
        } else {
            &mut self.b2
        };
        self.links.unlink(list, g);
        self.free.push(g);
    }

    fn trim(&mut self, which: u8, capacity: usize, keys: &mut KeyTable) {
        while self.list(which).len > capacity {
            let g = self.list(which).head;
            self.release(g);
            keys.remove_id(self.base + g);
        }
    }

    fn clear(&mut self) {
        self.links.clear(&mut self.b1);
        self.links.clear(&mut self.b2);
        self.tag.clear();
        self.free.clear();
    }
}

/// T1/T2 slots and B1/B2 keys (LRU first) and the target.
#[cfg(test)]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ArcSnapshot {
    pub t1: Vec<u32>,
    pub t2: Vec<u32>,
    pub b1: Vec<Vec<u8>>,
    pub b2: Vec<Vec<u8>>,
    pub target: f64,
}

impl Arc {
    /// ARC over slots `0..num_slots`; ghost ids in the key table start at `num_slots`.
    pub fn new(num_slots: usize) -> crate::Result<Self> {
        Ok(Self {
            capacity: num_slots,
            target: 0.0,
            links: Links::with_len(num_slots)?,
            tag: super::filled(num_slots, NONE, "ARC tags")?,
            t1: List::default(),
            t2: List::default(),
            ghosts: Ghosts {
                base: num_slots as u32,
                links: Links::default(),
                tag: Vec::new(),
                b1: List::default(),
                b2: List::default(),
                free: Vec::new(),
            },
        })
    }

    /// The ghost index of key-table id `id`, if `id` is a live ghost entry.
    fn ghost(&self, id: u32) -> Option<u32> {
        let g = id.checked_sub(self.ghosts.base)?;
        (self.ghosts.tag.get(g as usize).is_some_and(|&t| t != NONE)).then_some(g)
    }

    /// A new (in-flight) slot goes to the T1 MRU end. Its key enters the key table: `id` is
    /// what the table held for it before this call's evictions (a ghost id, or `u32::MAX`);
    /// a ghost entry still holding the key is renamed to `slot` and leaves the ghost lists.
    pub fn insert(&mut self, slot: u32, id: u32, hash: u64, key: &[u8], keys: &mut KeyTable) {
        self.tag[slot as usize] = T1;
        self.links.push_back(&mut self.t1, slot);
        match self.ghost(id) {
            Some(g) if keys.key(id) == key => {
                self.ghosts.release(g);
                keys.rename(id, slot);
            }
            _ => keys.insert_hashed(hash, slot, key),
        }
    }

    /// Drops a slot from T1/T2 without a ghost entry.
    pub fn remove(&mut self, slot: u32) {
        match std::mem::replace(&mut self.tag[slot as usize], NONE) {
            T1 => self.links.unlink(&mut self.t1, slot),
            T2 => self.links.unlink(&mut self.t2, slot),
            _ => {}
        }
    }

    /// One key of a touch (the manager walks the keys in reverse order): `id` is what the key
    /// table holds for the key (a slot, with its reference count, or a ghost id), if anything.
    pub fn touch(&mut self, id: Option<(u32, i32)>) {
        let Some((id, ref_cnt)) = id else {
            return;
        };
        if (id as usize) < self.capacity {
            let slot = id;
            match self.tag[slot as usize] {
                T1 if ref_cnt == -1 => self.links.move_to_back(&mut self.t1, slot),
                T1 => {
                    self.links.unlink(&mut self.t1, slot);
                    self.tag[slot as usize] = T2;
                    self.links.push_back(&mut self.t2, slot);
                }
                T2 => self.links.move_to_back(&mut self.t2, slot),
                _ => {}
            }
            return;
        }
        let Some(g) = self.ghost(id) else {
            return;
        };
        let (b1, b2) = (self.ghosts.b1.len as f64, self.ghosts.b2.len as f64);
        if self.ghosts.tag[g as usize] == B1 {
            let delta = f64::max(1.0, b2 / b1);
            self.target = f64::min(self.target + delta, self.capacity as f64);
            self.ghosts.links.move_to_back(&mut self.ghosts.b1, g);
        } else {
            let delta = f64::max(1.0, b1 / b2);
            self.target = f64::max(self.target - delta, 0.0);
            self.ghosts.links.move_to_back(&mut self.ghosts.b2, g);
        }
    }

    /// Picks `n` victims with the reference's rule, changing nothing; false when it cannot.
    /// While the simulated T1 size is below `int(target)`, T1 is not scanned at all (the quirk).
    /// `eligible`: ready, unpinned and not protected.
    pub fn pick_victims(
        &self,
        n: usize,
        eligible: impl Fn(u32) -> bool,
        out: &mut Vec<u32>,
    ) -> bool {
        let mut virtual_t1 = self.t1.len;
        let (mut c1, mut c2) = (self.t1.head, self.t2.head);
        for _ in 0..n {
            let mut picked = false;
            if virtual_t1 >= self.target as usize {
                while c1 != NIL {
                    let s = c1;
                    c1 = self.links.next(s);
                    if eligible(s) {
                        out.push(s);
                        virtual_t1 -= 1;
                        picked = true;
                        break;
                    }
                }
            }
            if !picked {
                while c2 != NIL {
                    let s = c2;
                    c2 = self.links.next(s);
                    if eligible(s) {
                        out.push(s);
                        picked = true;
                        break;
                    }
                }
            }
            if !picked {
                return false;
            }
        }
        true
    }

    /// Evicts picked victims: each moves to its ghost list (T1→B1, T2→B2), its key-table entry
    /// renamed to the ghost id; then both ghost lists are trimmed to the capacity.
    pub fn evict(&mut self, victims: &[u32], keys: &mut KeyTable) {
        for &s in victims {
            let which = if self.tag[s as usize] == T1 { B1 } else { B2 };
            self.remove(s);
            let g = self.ghosts.alloc();
            self.ghosts.tag[g as usize] = which;
            let list = if which == B1 {
                &mut self.ghosts.b1
            } else {
                &mut self.ghosts.b2
            };
            self.ghosts.links.push_back(list, g);
            keys.rename(s, self.ghosts.base + g);
        }
        self.ghosts.trim(B1, self.capacity, keys);
        self.ghosts.trim(B2, self.capacity, keys);
    }

    /// Empties every list (the manager clears the key table).
    pub fn clear(&mut self) {
        for t in &mut self.tag {
            *t = NONE;
        }
        self.links.clear(&mut self.t1);
        self.links.clear(&mut self.t2);
        self.ghosts.clear();
        self.target = 0.0;
    }

    /// The lists (LRU first) and the target, for tests.
    #[cfg(test)]
    pub fn snapshot(&self, keys: &KeyTable) -> ArcSnapshot {
        let walk = |links: &Links, l: &List| {
            let mut v = vec![];
            let mut c = l.head;
            while c != NIL {
                v.push(c);
                c = links.next(c);
            }
            v
        };
        let g = &self.ghosts;
        let gk = |ids: Vec<u32>| {
            ids.into_iter()
                .map(|i| keys.key(g.base + i).to_vec())
                .collect()
        };
        ArcSnapshot {
            t1: walk(&self.links, &self.t1),
            t2: walk(&self.links, &self.t2),
            b1: gk(walk(&g.links, &g.b1)),
            b2: gk(walk(&g.links, &g.b2)),
            target: self.target,
        }
    }

    #[cfg(test)]
    pub fn set_target(&mut self, target: f64) {
        self.target = target;
    }

    pub fn num_ghosts(&self) -> (usize, usize) {
        (self.ghosts.b1.len, self.ghosts.b2.len)
    }

    pub fn listed(&self) -> usize {
        self.t1.len + self.t2.len
    }
}

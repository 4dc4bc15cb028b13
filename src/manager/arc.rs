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

/// Evicted keys: their own ids, arena and lists.
#[derive(Clone)]
struct Ghosts {
    keys: KeyTable,
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

    fn push(&mut self, which: u8, hash: u64, key: &[u8]) {
        let id = self.free.pop().unwrap_or(self.tag.len() as u32);
        if id as usize == self.tag.len() {
            self.tag.push(NONE);
            self.links.grow_to(self.tag.len());
        }
        self.keys.insert_hashed(hash, id, key);
        self.tag[id as usize] = which;
        let list = if which == B1 {
            &mut self.b1
        } else {
            &mut self.b2
        };
        self.links.push_back(list, id);
    }

    fn remove(&mut self, id: u32) {
        let which = self.tag[id as usize];
        let list = if which == B1 {
            &mut self.b1
        } else {
            &mut self.b2
        };
        self.links.unlink(list, id);
        self.tag[id as usize] = NONE;
        self.keys.remove_id(id);
        self.free.push(id);
    }

    fn trim(&mut self, which: u8, capacity: usize) {
        while self.list(which).len > capacity {
            let head = self.list(which).head;
            self.remove(head);
        }
    }

    fn clear(&mut self) {
        self.keys.clear();
        self.tag.clear();
        self.free.clear();
        self.links.clear(&mut self.b1);
        self.links.clear(&mut self.b2);
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
    /// `keys` is the manager's key table, whose hasher the ghost table shares.
    pub fn new(num_slots: usize, keys: &KeyTable) -> crate::Result<Self> {
        Ok(Self {
            capacity: num_slots,
            target: 0.0,
            links: Links::with_len(num_slots)?,
            tag: super::filled(num_slots, NONE, "ARC tags")?,
            t1: List::default(),
            t2: List::default(),
            ghosts: Ghosts {
                keys: keys.sibling(0).expect("an empty table allocates nothing"),
                links: Links::default(),
                tag: Vec::new(),
                b1: List::default(),
                b2: List::default(),
                free: Vec::new(),
            },
        })
    }

    /// A new (in-flight) slot goes to the T1 MRU end; its key leaves the ghost lists.
    pub fn insert(&mut self, slot: u32, hash: u64, key: &[u8]) {
        self.tag[slot as usize] = T1;
        self.links.push_back(&mut self.t1, slot);
        if let Some(g) = self.ghosts.keys.find_hashed(hash, key) {
            self.ghosts.remove(g);
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

    /// One key of a touch (the manager walks the keys in reverse order).
    /// `slot` is the key's slot if stored, with its reference count.
    pub fn touch(&mut self, slot: Option<(u32, i32)>, hash: u64, key: &[u8]) {
        if let Some((slot, ref_cnt)) = slot {
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
        let Some(g) = self.ghosts.keys.find_hashed(hash, key) else {
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

    /// Evicts picked victims: each moves to its ghost list (T1→B1, T2→B2); then both ghost
    /// lists are trimmed to the capacity. `keys` still holds the victims' keys.
    pub fn evict(&mut self, victims: &[u32], keys: &KeyTable) {
        for &s in victims {
            let tag = self.tag[s as usize];
            self.remove(s);
            let key = keys.key(s);
            self.ghosts
                .push(if tag == T1 { B1 } else { B2 }, keys.stored_hash(s), key);
        }
        self.ghosts.trim(B1, self.capacity);
        self.ghosts.trim(B2, self.capacity);
    }

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
    pub fn snapshot(&self) -> ArcSnapshot {
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
        let gk = |ids: Vec<u32>| ids.into_iter().map(|i| g.keys.key(i).to_vec()).collect();
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

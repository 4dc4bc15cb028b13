//! ARC policy (vLLM 0.24 `ARCCachePolicy`), with its exact target arithmetic and its eviction
//! quirk: recent list T1 and frequent list T2 hold every stored slot (LRU first); ghost lists
//! B1 and B2 remember evicted keys, each trimmed to the capacity.

use super::keys::KeyTable;
use super::list::{Links, List, NIL};

/// List tags of an entry: none, the stored lists T1/T2, the ghost lists B1/B2 (a ghost's list
/// is its former stored list + 2).
const NONE: u8 = 0;
const T1: u8 = 1;
const T2: u8 = 2;
const B1: u8 = 3;

/// What ARC keeps about an entry beside its links: its slot (`NIL` for a ghost) and its list
/// (a tag, the index into [`Arc::lists`]).
#[derive(Debug, Clone, Copy)]
struct Entry {
    slot: u32,
    tag: u8,
}

impl Default for Entry {
    fn default() -> Self {
        Self {
            slot: NIL,
            tag: NONE,
        }
    }
}

/// An entry is one key the policy knows: stored in a slot (T1/T2) or remembered after its
/// eviction (B1/B2). Entries are the key-table ids, so an eviction or a revival only relinks
/// the entry and changes its slot, and the key table is left alone. The manager sees a stored
/// key as its slot and a ghost as `capacity + entry` (see [`Arc::id`]).
#[derive(Clone)]
pub(crate) struct Arc {
    capacity: usize,
    /// vLLM's `target_t1_size`, a float as in the reference.
    target: f64,
    /// Per entry: its links, and beside them its slot and list.
    links: Links<Entry>,
    /// Indexed by tag: `[unused, T1, T2, B1, B2]`, each LRU first.
    lists: [List; 5],
    /// Entries freed by trims and removals (reused first), and how many were ever handed out.
    free: Vec<u32>,
    used: u32,
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
    /// ARC over slots `0..num_slots`.
    pub fn new(num_slots: usize) -> crate::Result<Self> {
        Ok(Self {
            capacity: num_slots,
            target: 0.0,
            links: Links::with_len(num_slots)?,
            lists: [List::default(); 5],
            free: Vec::new(),
            used: 0,
        })
    }

    /// The manager's id of key-table entry `e`: its slot, or `capacity + e` for a ghost.
    #[inline]
    pub fn id(&self, e: u32) -> u32 {
        match self.links.data(e).slot {
            NIL => self.capacity as u32 + e,
            s => s,
        }
    }

    /// The ghost entry behind manager id `id`, if `id` names a live ghost.
    fn ghost(&self, id: u32) -> Option<u32> {
        let e = id.checked_sub(self.capacity as u32)?;
        ((e as usize) < self.links.len() && self.links.data(e).tag >= B1).then_some(e)
    }

    /// A free entry.
    fn alloc(&mut self) -> u32 {
        self.free.pop().unwrap_or_else(|| {
            let e = self.used;
            self.used += 1;
            self.links.grow_to(self.used as usize);
            e
        })
    }

    /// Moves entry `e` from its list to the tail of list `to`.
    #[inline]
    fn relink(&mut self, e: u32, to: u8) {
        let from = std::mem::replace(&mut self.links.data_mut(e).tag, to);
        self.links.unlink(&mut self.lists[from as usize], e);
        self.links.push_back(&mut self.lists[to as usize], e);
    }

    /// A new (in-flight) slot goes to the T1 MRU end with its key: `id` is what the manager
    /// resolved for the key before this call's evictions (a ghost, or anything else); a ghost
    /// that still holds the key is revived (it leaves its ghost list), else the key is added.
    /// Returns the key's entry (the manager keeps it with the slot).
    #[inline]
    pub fn insert(
        &mut self,
        slot: u32,
        id: u32,
        hash: u64,
        key: &[u8],
        keys: &mut KeyTable,
    ) -> u32 {
        let e = match self.ghost(id) {
            Some(e) if keys.key(e) == key => {
                keys.note_change();
                self.relink(e, T1);
                e
            }
            _ => {
                let e = self.alloc();
                keys.insert_hashed(hash, e, key);
                self.links.data_mut(e).tag = T1;
                self.links.push_back(&mut self.lists[T1 as usize], e);
                e
            }
        };
        self.links.data_mut(e).slot = slot;
        e
    }

    /// Unlinks entry `e`, drops its key and frees the entry: a stored key whose slot is freed
    /// without a ghost, or a trimmed ghost.
    pub fn remove(&mut self, e: u32, keys: &mut KeyTable) {
        let t = self.links.data(e).tag;
        self.links.unlink(&mut self.lists[t as usize], e);
        *self.links.data_mut(e) = Entry::default();
        keys.remove_id(e);
        self.free.push(e);
    }

    /// One stored key of a touch (the manager walks the keys in reverse order): entry `e`,
    /// whose slot has reference count `ref_cnt`.
    pub fn touch_stored(&mut self, e: u32, ref_cnt: i32) {
        match self.links.data(e).tag {
            T1 if ref_cnt == -1 => self.links.move_to_back(&mut self.lists[T1 as usize], e),
            T1 => self.relink(e, T2),
            T2 => self.links.move_to_back(&mut self.lists[T2 as usize], e),
            _ => {}
        }
    }

    /// One key of a touch that the manager knows by id `id` beyond the slots: a ghost adapts
    /// the target and becomes the most recent of its list.
    pub fn touch_ghost(&mut self, id: u32) {
        let Some(e) = self.ghost(id) else {
            return;
        };
        let (b1, b2) = self.num_ghosts();
        let (b1, b2) = (b1 as f64, b2 as f64);
        let t = self.links.data(e).tag;
        if t == B1 {
            let delta = f64::max(1.0, b2 / b1);
            self.target = f64::min(self.target + delta, self.capacity as f64);
        } else {
            let delta = f64::max(1.0, b1 / b2);
            self.target = f64::max(self.target - delta, 0.0);
        }
        self.links.move_to_back(&mut self.lists[t as usize], e);
    }

    /// Picks `n` victims (slots) with the reference's rule, changing nothing; false when it
    /// cannot. While the simulated T1 size is below `int(target)`, T1 is not scanned at all
    /// (the quirk). `eligible`: ready, unpinned and not protected.
    pub fn pick_victims(
        &self,
        n: usize,
        eligible: impl Fn(u32) -> bool,
        out: &mut Vec<u32>,
    ) -> bool {
        let mut virtual_t1 = self.lists[T1 as usize].len;
        let (mut c1, mut c2) = (self.lists[T1 as usize].head, self.lists[T2 as usize].head);
        let target = self.target as usize;
        for _ in 0..n {
            let mut picked = false;
            if virtual_t1 >= target {
                while c1 != NIL {
                    let s = self.links.data(c1).slot;
                    c1 = self.links.next(c1);
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
                    let s = self.links.data(c2).slot;
                    c2 = self.links.next(c2);
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

    /// Evicts the entries of picked victims: each moves to its ghost list (T1→B1, T2→B2)
    /// and loses its slot; then both ghost lists are trimmed to the capacity.
    pub fn evict(&mut self, entries: impl Iterator<Item = u32>, keys: &mut KeyTable) {
        for e in entries {
            let t = self.links.data(e).tag;
            self.relink(e, t + 2);
            self.links.data_mut(e).slot = NIL;
        }
        keys.note_change();
        for b in [B1, B1 + 1] {
            while self.lists[b as usize].len > self.capacity {
                let e = self.lists[b as usize].head;
                self.remove(e, keys);
            }
        }
    }

    /// Empties every list and frees every entry (the manager clears the key table).
    pub fn clear(&mut self) {
        for list in &mut self.lists {
            self.links.clear(list);
        }
        for e in 0..self.links.len() as u32 {
            *self.links.data_mut(e) = Entry::default();
        }
        self.free.clear();
        self.used = 0;
        self.target = 0.0;
    }

    /// The lists (LRU first) and the target, for tests.
    #[cfg(test)]
    pub fn snapshot(&self, keys: &KeyTable) -> ArcSnapshot {
        let walk = |t: u8| {
            let mut v = vec![];
            let mut c = self.lists[t as usize].head;
            while c != NIL {
                v.push(c);
                c = self.links.next(c);
            }
            v
        };
        let slots = |t| {
            walk(t)
                .into_iter()
                .map(|e| self.links.data(e).slot)
                .collect()
        };
        let ghosts = |t| walk(t).into_iter().map(|e| keys.key(e).to_vec()).collect();
        ArcSnapshot {
            t1: slots(T1),
            t2: slots(T2),
            b1: ghosts(B1),
            b2: ghosts(B1 + 1),
            target: self.target,
        }
    }

    #[cfg(test)]
    pub fn set_target(&mut self, target: f64) {
        self.target = target;
    }

    pub fn num_ghosts(&self) -> (usize, usize) {
        (self.lists[B1 as usize].len, self.lists[B1 as usize + 1].len)
    }

    pub fn listed(&self) -> usize {
        self.lists[T1 as usize].len + self.lists[T2 as usize].len
    }
}

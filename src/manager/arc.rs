//! ARC policy (vLLM 0.24 and 0.33 `ARCCachePolicy`), with its exact target arithmetic: recent
//! list T1 and frequent list T2 hold every stored slot (LRU first); ghost lists B1 and B2
//! remember evicted keys, each trimmed to the capacity. 0.24's eviction never scans T1 while
//! T1 is below the target, even when T2 has no candidate; 0.33's then falls back to T1, and
//! 0.33 also adapts the target on store misses of ghost keys and promotes a request's reused
//! keys when it finishes.

use super::keys::{KeyTable, key_eq};
use super::list::{Links, List};
use super::policy::{EvictionPolicy, NewKey};
use super::record::{INSERTED, REUSED};
use super::{NO_ID, SlotState};

/// List tags of an entry: none, the stored lists T1/T2, the ghost lists B1/B2 (a ghost's list
/// is its former stored list + 2).
const NONE: u8 = 0;
const T1: u8 = 1;
const T2: u8 = 2;
const B1: u8 = 3;

/// The [`ArcPolicy::pairs`] index of a tag's list: 0 for T1 and B1, 1 for T2 and B2.
#[inline]
fn pair(tag: u8) -> usize {
    usize::from(tag - 1) & 1
}

/// What ARC keeps about an entry beside its links: its slot (`NO_ID` for a ghost) and its list.
#[derive(Debug, Clone, Copy)]
struct Entry {
    slot: u32,
    tag: u8,
}

impl Default for Entry {
    fn default() -> Self {
        Self {
            slot: NO_ID,
            tag: NONE,
        }
    }
}

/// A ghost list and its stored list (B1 and T1, or B2 and T2) as one linked list: the ghosts,
/// LRU first, then the stored keys, LRU first, from `stored_head` on. An evicted key becomes
/// the most recent ghost, which for the least recent stored key (the usual victim) is only a
/// move of the boundary: no relinking.
#[derive(Debug, Clone, Copy)]
struct Pair {
    list: List,
    /// The least recent stored key (`NO_ID`: none).
    stored_head: u32,
    /// The stored keys; the rest of `list` are ghosts.
    stored: usize,
}

impl Pair {
    fn ghosts(&self) -> usize {
        self.list.len - self.stored
    }
}

impl Default for Pair {
    fn default() -> Self {
        Self {
            list: List::default(),
            stored_head: NO_ID,
            stored: 0,
        }
    }
}

/// An entry is one key the policy knows: stored in a slot (T1/T2) or remembered after its
/// eviction (B1/B2). Entries are the key-table ids, so an eviction or a revival only relinks
/// the entry and changes its slot, and the key table is left alone. The manager sees a stored
/// key as its slot and a ghost as `capacity + entry` (see [`ArcPolicy::id_of_entry`]).
#[derive(Clone)]
pub(crate) struct ArcPolicy {
    capacity: usize,
    /// vLLM's `target_t1_size`, a float as in vLLM.
    target: f64,
    /// Per entry: its links, and beside them its slot and list.
    links: Links<Entry>,
    /// B1 + T1, and B2 + T2.
    pairs: [Pair; 2],
    /// Entries freed by trims and removals (reused first), and how many were ever handed out.
    free: Vec<u32>,
    used: u32,
    /// vLLM 0.33: eviction takes from T1 when T2 has no candidate left.
    pub(super) fallback_to_t1: bool,
    /// Bumped by every change of the lists ([`EvictionPolicy::order_version`]).
    version: u64,
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

impl ArcPolicy {
    /// The ghost entry behind manager id `id`, if `id` names a live ghost.
    fn ghost(&self, id: u32) -> Option<u32> {
        let e = id.checked_sub(self.capacity as u32)?;
        ((e as usize) < self.links.capacity() && self.links.data(e).tag >= B1).then_some(e)
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

    /// Appends entry `e` (in no list) as the most recent stored key of pair `k`.
    #[inline]
    fn push_stored(&mut self, k: usize, e: u32, tag: u8) {
        let p = &mut self.pairs[k];
        self.links.push_back(&mut p.list, e);
        if p.stored_head == NO_ID {
            p.stored_head = e;
        }
        p.stored += 1;
        self.links.data_mut(e).tag = tag;
        self.version += 1;
    }

    /// Takes entry `e` out of its pair's list.
    #[inline]
    fn unlink(&mut self, e: u32) {
        let tag = self.links.data(e).tag;
        let p = &mut self.pairs[pair(tag)];
        if tag < B1 {
            if p.stored_head == e {
                p.stored_head = self.links.next(e);
            }
            p.stored -= 1;
        }
        self.links.unlink(&mut p.list, e);
        self.version += 1;
    }

    /// Makes `e`, which is in pair `k`'s list, its most recent ghost or stored key.
    #[inline]
    fn make_most_recent(&mut self, k: usize, e: u32, ghost: bool) {
        let p = &mut self.pairs[k];
        let before = if ghost { p.stored_head } else { NO_ID };
        if self.links.next(e) == before {
            return;
        }
        if p.stored_head == e {
            p.stored_head = self.links.next(e);
        }
        self.links.unlink(&mut p.list, e);
        match before {
            NO_ID => self.links.push_back(&mut p.list, e),
            at => self.links.insert_before(&mut p.list, at, e),
        }
        self.version += 1;
    }

    /// One stored key of a touch: entry `e`, whose slot has reference count `ref_cnt`.
    #[inline]
    fn touch_stored(&mut self, e: u32, ref_cnt: i32) {
        match self.links.data(e).tag {
            T1 if ref_cnt == -1 => self.make_most_recent(0, e, false),
            T1 => {
                self.unlink(e);
                self.push_stored(1, e, T2);
            }
            T2 => self.make_most_recent(1, e, false),
            _ => {}
        }
    }

    /// One key of a touch known by id `id` beyond the slots: a ghost adapts the target and
    /// becomes the most recent of its list.
    #[inline]
    fn touch_ghost(&mut self, id: u32) {
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
        self.make_most_recent(pair(t), e, true);
    }

    /// Appends to `out` the first `n` eligible slots of the stored entries from `from` on (LRU
    /// first); returns how many it found and the entry after the last one it examined.
    #[inline]
    fn take(
        &self,
        from: u32,
        n: usize,
        eligible: impl Fn(u32) -> bool,
        out: &mut Vec<u32>,
    ) -> (usize, u32) {
        let (mut c, mut found) = (from, 0);
        while found < n && c != NO_ID {
            let s = self.links.data(c).slot;
            c = self.links.next(c);
            if eligible(s) {
                out.push(s);
                found += 1;
            }
        }
        (found, c)
    }

    /// The stored entry of manager id `id`, if it is a slot.
    #[inline]
    fn stored_entry(id: u32, slots: &[SlotState]) -> Option<u32> {
        slots.get(id as usize).map(|st| st.entry)
    }

    /// Forgets the oldest ghosts of pair `k` beyond the capacity (they are the first entries of
    /// its list): detaches them at once, drops their keys and frees their entries.
    fn trim(&mut self, k: usize, keys: &mut KeyTable) {
        let excess = self.pairs[k].ghosts().saturating_sub(self.capacity);
        if excess == 0 {
            return;
        }
        let mut e = self.pairs[k].list.head;
        for _ in 0..excess {
            self.free.push(e);
            let next = self.links.next(e);
            self.links.reset(e);
            keys.remove_id(e);
            e = next;
        }
        self.links.detach_front(&mut self.pairs[k].list, excess, e);
        self.version += 1;
    }

    /// The lists (LRU first) and the target, for tests.
    #[cfg(test)]
    pub fn snapshot(&self, keys: &KeyTable) -> ArcSnapshot {
        let walk = |from: u32, to: u32| {
            let mut v = vec![];
            let mut c = from;
            while c != to {
                v.push(c);
                c = self.links.next(c);
            }
            v
        };
        let slots = |p: &Pair| {
            walk(p.stored_head, NO_ID)
                .into_iter()
                .map(|e| self.links.data(e).slot)
                .collect()
        };
        let ghosts = |p: &Pair| {
            walk(p.list.head, p.stored_head)
                .into_iter()
                .map(|e| keys.key(e).to_vec())
                .collect()
        };
        ArcSnapshot {
            t1: slots(&self.pairs[0]),
            t2: slots(&self.pairs[1]),
            b1: ghosts(&self.pairs[0]),
            b2: ghosts(&self.pairs[1]),
            target: self.target,
        }
    }

    #[cfg(test)]
    pub fn set_target(&mut self, target: f64) {
        self.target = target;
    }

    /// The ghosts in B1 and in B2.
    fn num_ghosts(&self) -> (usize, usize) {
        (self.pairs[0].ghosts(), self.pairs[1].ghosts())
    }

    /// The stored keys (T1 and T2).
    fn listed(&self) -> usize {
        self.pairs[0].stored + self.pairs[1].stored
    }
}

impl EvictionPolicy for ArcPolicy {
    /// ARC names up to 4n keys (n stored, 2n ghosts, n just evicted) by ids up to 5n.
    const MAX_SLOTS: usize = u32::MAX as usize / 5;

    /// Also reserves the key-table room of the ghost lists (two lists of at most `num_slots`
    /// keys each).
    fn new(num_slots: usize, keys: &mut KeyTable) -> crate::Result<Self> {
        keys.reserve_more(num_slots.saturating_mul(2))?;
        Ok(Self {
            capacity: num_slots,
            target: 0.0,
            links: Links::with_capacity(num_slots)?,
            pairs: [Pair::default(); 2],
            free: Vec::new(),
            used: 0,
            fallback_to_t1: false,
            version: 0,
        })
    }

    /// Its slot, or `capacity + e` for a ghost.
    #[inline]
    fn id_of_entry(&self, e: u32) -> u32 {
        match self.links.data(e).slot {
            NO_ID => self.capacity as u32 + e,
            s => s,
        }
    }

    /// The new (in-flight) slot goes to the T1 MRU end with its key: `new.id` is what the
    /// manager resolved for the key before this call's evictions (a ghost, or anything else);
    /// a ghost that still holds the key is revived (it leaves its ghost list), else the key is
    /// added.
    #[inline]
    fn insert(&mut self, new: NewKey<'_>, keys: &mut KeyTable, _rank: &mut u32) -> u32 {
        let e = match self.ghost(new.id) {
            Some(e) if key_eq(keys.key(e), new.key) => {
                keys.note_change();
                self.unlink(e);
                e
            }
            _ => {
                let e = self.alloc();
                keys.insert_hashed(new.hash, e, new.key);
                e
            }
        };
        self.push_stored(0, e, T1);
        self.links.data_mut(e).slot = new.slot;
        e
    }

    /// Nothing: ARC's lists hold pinned slots too.
    #[inline]
    fn on_pinned(&mut self, _slot: u32) {}

    /// Nothing: a slot is listed from its store on.
    #[inline]
    fn on_ready(&mut self, _slot: u32) {}

    /// A stored key in T1 moves to T2's MRU end (unless its store is in flight: then it
    /// stays in T1, as its MRU), one in T2 becomes its MRU; a ghost adapts the target and
    /// becomes the most recent of its list.
    #[inline]
    fn touch(&mut self, ids: &[u32], slots: &[SlotState]) {
        for &id in ids.iter().rev().filter(|&&id| id != NO_ID) {
            match slots.get(id as usize) {
                Some(st) => self.touch_stored(st.entry, st.ref_cnt),
                None => self.touch_ghost(id),
            }
        }
    }

    /// vLLM's rule: while the simulated T1 size is below `int(target)`, T1 is not scanned
    /// (0.24: at all; 0.33: until T2 has no candidate left).
    #[inline]
    fn pick_victims(&self, n: usize, slots: &[SlotState], epoch: u32, out: &mut Vec<u32>) -> bool {
        let eligible = |s: u32| slots[s as usize].is_evictable(epoch);
        // The simulated T1 size starts at T1's and drops with each T1 pick, so T1 gives the
        // first picks (up to its size minus the target, plus one) until it has no eligible
        // slot left, and T2 gives the rest; 0.33 then continues T1's scan where it stopped.
        let (t1, target) = (self.pairs[0].stored, self.target as usize);
        let t1_picks = if t1 >= target { t1 - target + 1 } else { 0 };
        let (from_t1, t1_cursor) =
            self.take(self.pairs[0].stored_head, n.min(t1_picks), eligible, out);
        let rest = n - from_t1;
        let (from_t2, _) = self.take(self.pairs[1].stored_head, rest, eligible, out);
        let rest = rest - from_t2;
        if rest == 0 {
            return true;
        }
        // A T1 scan that stopped because T1 had no eligible entry left stays exhausted.
        self.fallback_to_t1 && from_t1 == n.min(t1_picks) && {
            self.take(t1_cursor, rest, eligible, out).0 == rest
        }
    }

    const OBSERVES_STORE_MISSES: bool = true;

    /// Ghost adaptation for each key in reverse order (a ghost adapts the target and becomes
    /// the most recent of its list).
    fn on_store_miss(&mut self, ids: &[u32]) {
        for &id in ids.iter().rev() {
            self.touch_ghost(id);
        }
    }

    /// Walking the keys tail to head: a key the request only inserted becomes the most recent
    /// of its list; a reused key in T1 is promoted to T2's MRU end, one in T2 becomes its MRU.
    fn on_request_finished(&mut self, ids: &[u32], flags: &[u8], slots: &[SlotState], _rank: u32) {
        for (&id, &f) in ids.iter().zip(flags).rev() {
            let Some(e) = Self::stored_entry(id, slots) else {
                continue;
            };
            let tag = self.links.data(e).tag;
            if f & INSERTED != 0 && f & REUSED == 0 {
                self.make_most_recent(pair(tag), e, false);
            } else if f & REUSED != 0 {
                if tag == T1 {
                    self.unlink(e);
                    self.push_stored(1, e, T2);
                } else {
                    self.make_most_recent(1, e, false);
                }
            }
        }
    }

    #[inline]
    fn order_version(&self) -> u64 {
        self.version
    }

    /// The inserted keys are the last `keys` of T1 in insertion order (nothing changed since
    /// they were pushed there); walking them tail to head, each becomes T1's most recent: the
    /// run is reversed in place.
    fn commit_inserted_tail(&mut self, version: u64, keys: usize) -> bool {
        if version != self.version {
            return false;
        }
        let p = &mut self.pairs[0];
        debug_assert!(keys <= p.stored, "{keys} inserted keys, {} in T1", p.stored);
        let old_tail = p.list.tail;
        let first = self.links.reverse_tail(&mut p.list, keys);
        if p.stored_head == first {
            p.stored_head = old_tail;
        }
        self.version += 1;
        true
    }

    /// Each victim's entry becomes the most recent ghost of its pair (T1→B1, T2→B2) and loses
    /// its slot; then both ghost lists are trimmed to the capacity.
    fn evict(&mut self, victims: &[u32], slots: &mut [SlotState], keys: &mut KeyTable) {
        for &s in victims {
            let e = std::mem::replace(&mut slots[s as usize].entry, NO_ID);
            let data = self.links.data_mut(e);
            let k = pair(data.tag);
            (data.tag, data.slot) = (data.tag + 2, NO_ID);
            let p = &mut self.pairs[k];
            if p.stored_head == e {
                // The least recent stored key: it is next to the ghosts already.
                p.stored_head = self.links.next(e);
            } else {
                self.links.unlink(&mut p.list, e);
                self.links.insert_before(&mut p.list, p.stored_head, e);
            }
            p.stored -= 1;
        }
        self.version += 1;
        keys.note_change();
        for k in 0..2 {
            self.trim(k, keys);
        }
    }

    /// Unlinks the slot's entry, drops its key and frees the entry (no ghost).
    fn remove(&mut self, slot: u32, slots: &mut [SlotState], keys: &mut KeyTable) {
        let e = std::mem::replace(&mut slots[slot as usize].entry, NO_ID);
        self.unlink(e);
        *self.links.data_mut(e) = Entry::default();
        keys.remove_id(e);
        self.free.push(e);
    }

    /// Empties every list, frees every entry and resets the target.
    fn clear(&mut self, slots: &mut [SlotState]) {
        for p in &mut self.pairs {
            self.links.clear(&mut p.list);
            *p = Pair::default();
        }
        for e in 0..self.links.capacity() as u32 {
            *self.links.data_mut(e) = Entry::default();
        }
        self.free.clear();
        self.used = 0;
        self.target = 0.0;
        self.version += 1;
        slots.iter_mut().for_each(|s| s.entry = NO_ID);
    }

    /// The ghosts.
    fn num_remembered(&self) -> usize {
        let (b1, b2) = self.num_ghosts();
        b1 + b2
    }

    fn check(
        &self,
        _slots: &[SlotState],
        _occupied: &[bool],
        used: usize,
        _idle: u64,
    ) -> Result<(), String> {
        let (b1, b2) = self.num_ghosts();
        if self.listed() != used || b1 > self.capacity || b2 > self.capacity {
            return Err(format!(
                "ARC lists: {} listed, {used} used, ghosts {b1}/{b2}",
                self.listed()
            ));
        }
        Ok(())
    }
}

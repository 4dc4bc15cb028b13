//! LRU policy of vLLM 0.33 (`LRUCachePolicy`): every stored key (any state) has a logical rank
//! `(major, minor)`, and eviction takes the ready, idle, unprotected keys in ascending
//! `(major, minor, key bytes)` order. A fresh rank is `(n, 0)` for a new number `n` ("used
//! now"); a request takes one number `r` (its request rank) the first time it needs one, and
//! its keys get the provisional rank `(r, -position)`, so that a request's tail is evicted
//! before its head. Becoming ready or pinned changes no rank.
//!
//! vLLM keeps a lazily invalidated heap; this is one linked list in rank order instead, with
//! the same order, ties included. Numbers are handed out in increasing order and every number
//! goes to the back when it is taken, so the list is the order of the majors: a fresh rank is
//! a push to the back, and a request rank is an *anchor* (a pair of sentinel nodes pushed to
//! the back when the number is taken) between which the request's provisional keys are kept
//! sorted by `(minor, key bytes)`. Node ids are the slots, then the anchors' sentinels.
//!
//! An anchor taken by the store of its first key holds that key without sentinels: the key
//! lies where the sentinels would, at the back, marks the anchor's place and carries its
//! major. The sentinels are linked around it, with that major, when a second key comes or
//! before it leaves (the anchor keeps its place), so a request storing a single key (one
//! chunk) touches none.
//!
//! A request's commit gives its present keys fresh ranks tail first. When its positions are
//! distinct and its anchor was given every one of its keys and lost none (the usual request),
//! the anchor holds exactly those keys in that order: they take their ranks as they lie and
//! move to the back as one run, without a lookup per key.

use super::keys::KeyTable;
use super::list::{Links, List};
use super::policy::{EvictionPolicy, NewKey, NewKeys};
use super::pool::SlotPool;
use super::record::NO_POS;
use super::{NO_ID, SlotState, key_at};

/// A node's rank. The minor of a provisional rank is `u64::MAX - position` (the order of
/// `-position`); a fresh rank's is 0 (a fresh major is never a request's, so the two kinds of
/// minor are never compared).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Rank {
    major: u64,
    minor: u64,
}

/// A node's rank and the anchor whose keys it is among ([`NO_ID`]: none; sentinels are in
/// none).
#[derive(Debug, Clone, Copy)]
struct Ranked {
    rank: Rank,
    anchor: u32,
}

impl Default for Ranked {
    fn default() -> Self {
        Self {
            rank: Rank::default(),
            anchor: NO_ID,
        }
    }
}

/// Keys an anchor was given and keys that left it since it was taken (a commit can take the
/// anchor's keys as they lie when none left and it was given every key of its request), and
/// its only key while its sentinels are not linked ([`NO_ID`]: they are, or it is free).
#[derive(Debug, Clone, Copy)]
struct AnchorCount {
    placed: u32,
    left: u32,
    single: u32,
}

impl Default for AnchorCount {
    fn default() -> Self {
        Self {
            placed: 0,
            left: 0,
            single: NO_ID,
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct RankedLruPolicy {
    num_slots: u32,
    links: Links<Ranked>,
    list: List,
    /// The last number handed out (vLLM's `_next_rank`).
    counter: u64,
    /// Anchors (their first sentinel's id) free for reuse, and how many were ever made.
    free_anchors: Vec<u32>,
    anchors_made: u32,
    /// Per anchor (by [`Self::anchor_index`]).
    counts: Vec<AnchorCount>,
}

/// The provisional minor of `position`.
#[inline]
fn minor_of(position: u64) -> u64 {
    u64::MAX - position
}

impl RankedLruPolicy {
    #[inline]
    fn is_slot(&self, id: u32) -> bool {
        id < self.num_slots
    }

    /// The index of anchor `a` (its first sentinel) among the anchors.
    #[inline]
    fn anchor_index(&self, a: u32) -> usize {
        ((a - self.num_slots) / 2) as usize
    }

    /// Takes linked node `s` out of the list; if it was among an anchor's keys, counts it as
    /// left unless it stays in `staying` (the anchor it moves within).
    #[inline(always)]
    fn take_out(&mut self, s: u32, staying: u32) {
        let a = self.links.data(s).anchor;
        if a != NO_ID {
            let i = self.anchor_index(a);
            if self.counts[i].single != NO_ID {
                self.link_sentinels(a);
            }
            if a != staying {
                self.counts[i].left += 1;
            }
        }
        self.links.unlink(&mut self.list, s);
    }

    /// Links the sentinels of single-key anchor `a` around its key.
    #[inline(never)]
    fn link_sentinels(&mut self, a: u32) {
        let i = self.anchor_index(a);
        let s = std::mem::replace(&mut self.counts[i].single, NO_ID);
        let major = self.rank_of(s).major;
        self.rank_sentinels(a, Rank { major, minor: 0 });
        self.links.insert_before(&mut self.list, s, a);
        match self.links.next(s) {
            NO_ID => self.links.push_back(&mut self.list, a + 1),
            n => self.links.insert_before(&mut self.list, n, a + 1),
        }
    }

    #[inline]
    fn fresh(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    /// Gives slot `s` a fresh rank: it becomes the last of the list.
    #[inline]
    fn give_fresh(&mut self, s: u32) {
        let major = self.fresh();
        if self.links.is_linked(s) {
            self.take_out(s, NO_ID);
        }
        *self.links.data_mut(s) = Ranked {
            rank: Rank { major, minor: 0 },
            anchor: NO_ID,
        };
        self.links.push_back(&mut self.list, s);
    }

    /// A new anchor with a fresh number, at the back; returns its first sentinel.
    fn take_anchor(&mut self) -> u32 {
        let (a, rank) = self.new_anchor(AnchorCount::default());
        self.rank_sentinels(a, rank);
        for id in [a, a + 1] {
            self.links.push_back(&mut self.list, id);
        }
        a
    }

    /// A new anchor with a fresh number holding slot `s` (in no list; pushed to the back) at
    /// `minor`, its sentinels not linked; returns its first sentinel.
    fn take_anchor_with(&mut self, s: u32, minor: u64) -> u32 {
        let count = AnchorCount {
            placed: 1,
            left: 0,
            single: s,
        };
        let (a, Rank { major, .. }) = self.new_anchor(count);
        *self.links.data_mut(s) = Ranked {
            rank: Rank { major, minor },
            anchor: a,
        };
        self.links.push_back(&mut self.list, s);
        a
    }

    /// An anchor with a fresh number and `count`, its sentinels in no list and without their
    /// rank yet; returns its first sentinel and rank.
    #[inline]
    fn new_anchor(&mut self, count: AnchorCount) -> (u32, Rank) {
        let a = match self.free_anchors.pop() {
            Some(a) => a,
            None => {
                let a = self.num_slots + 2 * self.anchors_made;
                self.anchors_made += 1;
                self.links.grow_to(a as usize + 2);
                self.counts.push(AnchorCount::default());
                a
            }
        };
        let rank = Rank {
            major: self.fresh(),
            minor: 0,
        };
        let i = self.anchor_index(a);
        self.counts[i] = count;
        (a, rank)
    }

    /// The rank order of slots `a` and `b` with ranks `ra`, `rb` (key bytes break ties).
    #[inline]
    fn before(keys: &KeyTable, a: (u32, Rank), b: (u32, Rank)) -> bool {
        match a.1.cmp(&b.1) {
            std::cmp::Ordering::Equal => keys.key(a.0) < keys.key(b.0),
            o => o.is_lt(),
        }
    }

    /// Gives slot `s` the provisional rank `(major of anchor a, minor)`: it moves between the
    /// anchor's sentinels, at its place in `(minor, key bytes)` order.
    fn place(&mut self, s: u32, a: u32, minor: u64, keys: &KeyTable) {
        if !self.links.is_linked(s) {
            return self.place_unlinked(s, a, minor, keys);
        }
        let moved = self.links.data(s).anchor == a;
        self.take_out(s, a);
        if moved {
            let i = self.anchor_index(a);
            self.counts[i].placed -= 1;
        }
        self.place_unlinked(s, a, minor, keys);
    }

    /// [`Self::place`] of a slot in no list (a key being stored).
    #[inline(always)]
    fn place_unlinked(&mut self, s: u32, a: u32, minor: u64, keys: &KeyTable) {
        debug_assert!(!self.links.is_linked(s), "slot {s} is linked");
        let i = self.anchor_index(a);
        if self.counts[i].single != NO_ID {
            self.link_sentinels(a);
        }
        self.counts[i].placed += 1;
        let rank = Rank {
            major: self.links.data(a).rank.major,
            minor,
        };
        *self.links.data_mut(s) = Ranked { rank, anchor: a };
        let (first, end) = (self.links.next(a), a + 1);
        // Typical: a request records its keys head first, so each has the smallest minor.
        let at = if first == end || Self::before(keys, (s, rank), (first, self.rank_of(first))) {
            first
        } else {
            self.place_after_first(s, rank, first, end, keys)
        };
        self.links.insert_before(&mut self.list, at, s);
    }

    /// Links slot `s` (in no list) with `rank` in anchor `a`, just before `f`, the anchor's
    /// first key, which ranks after it (the caller counts the placement).
    #[inline(always)]
    fn link_in_front(&mut self, s: u32, f: u32, rank: Rank, a: u32) {
        *self.links.data_mut(s) = Ranked { rank, anchor: a };
        self.links.insert_before(&mut self.list, f, s);
    }

    /// Where slot `s` of `rank` goes among an anchor's keys `first..end`, not before `first`.
    #[inline(never)]
    fn place_after_first(&self, s: u32, rank: Rank, first: u32, end: u32, keys: &KeyTable) -> u32 {
        let last = self.links.prev(end);
        if Self::before(keys, (last, self.rank_of(last)), (s, rank)) {
            return end;
        }
        let mut c = self.links.next(first);
        while Self::before(keys, (c, self.rank_of(c)), (s, rank)) {
            c = self.links.next(c);
        }
        c
    }

    /// Whether anchor `rank` was given each of its request's `keys` keys and none left it.
    pub fn anchor_holds(&self, rank: u32, keys: usize) -> bool {
        let k = match rank {
            NO_ID => return false,
            a => self.counts[self.anchor_index(a)],
        };
        k.left == 0 && k.placed as usize == keys
    }

    /// Gives both sentinels of anchor `a` its `rank`.
    #[inline]
    fn rank_sentinels(&mut self, a: u32, rank: Rank) {
        for id in [a, a + 1] {
            self.links.data_mut(id).rank = rank;
        }
    }

    /// The major of anchor `a`: its sentinels' (their rank is set when they are linked), or
    /// its single key's while they are not.
    #[inline]
    fn anchor_major(&self, a: u32) -> u64 {
        match self.counts[self.anchor_index(a)].single {
            NO_ID => self.rank_of(a).major,
            s => self.rank_of(s).major,
        }
    }

    #[inline]
    fn rank_of(&self, id: u32) -> Rank {
        self.links.data(id).rank
    }

    /// Frees anchor `a`, whose keys have all left it.
    fn release_anchor(&mut self, a: u32) {
        let single = self.counts[self.anchor_index(a)].single;
        debug_assert_eq!(single, NO_ID, "anchor {a} still holds its key");
        debug_assert_eq!(self.links.next(a), a + 1, "anchor {a} still holds keys");
        for id in [a, a + 1] {
            self.links.unlink(&mut self.list, id);
        }
        self.free_anchors.push(a);
    }

    /// The commit of single-key anchor `a`: its key takes a fresh rank (it goes to the back)
    /// and the anchor is freed.
    #[inline(never)]
    fn commit_single(&mut self, a: u32) {
        let i = self.anchor_index(a);
        let s = std::mem::replace(&mut self.counts[i].single, NO_ID);
        let major = self.fresh();
        *self.links.data_mut(s) = Ranked {
            rank: Rank { major, minor: 0 },
            anchor: NO_ID,
        };
        self.links.move_to_back(&mut self.list, s);
        self.free_anchors.push(a);
    }

    /// The slots in rank order, oldest first (tests).
    #[cfg(test)]
    pub fn order(&self) -> Vec<u32> {
        let mut out = Vec::new();
        let mut c = self.list.head;
        while c != NO_ID {
            if self.is_slot(c) {
                out.push(c);
            }
            c = self.links.next(c);
        }
        out
    }

    /// The rank `(major, minor)` of slot `s` as vLLM writes it (`minor` = `-position` or 0).
    #[cfg(test)]
    pub fn rank(&self, s: u32) -> (u64, i128) {
        let r = self.rank_of(s);
        let minor = if r.minor == 0 {
            0
        } else {
            i128::from(r.minor) - i128::from(u64::MAX)
        };
        (r.major, minor)
    }
}

impl EvictionPolicy for RankedLruPolicy {
    /// Ids beyond the slots name anchors (two per active request).
    const MAX_SLOTS: usize = (u32::MAX / 2) as usize;

    fn new(num_slots: usize, _keys: &mut KeyTable) -> crate::Result<Self> {
        Ok(Self {
            num_slots: num_slots as u32,
            links: Links::with_capacity(num_slots)?,
            list: List::default(),
            counter: 0,
            free_anchors: Vec::new(),
            anchors_made: 0,
            counts: Vec::new(),
        })
    }

    #[inline]
    fn id_of_entry(&self, e: u32) -> u32 {
        e
    }

    /// A key with a position gets the request's provisional rank (the request rank taken now
    /// if the request has none); one without a fresh rank.
    #[inline]
    fn insert(&mut self, new: NewKey<'_>, keys: &mut KeyTable, rank: &mut u32) -> u32 {
        keys.insert_hashed(new.hash, new.slot, new.key);
        if new.position == NO_POS {
            self.give_fresh(new.slot);
        } else {
            if *rank == NO_ID {
                *rank = self.take_anchor();
            }
            self.place_unlinked(new.slot, *rank, minor_of(new.position), keys);
        }
        new.slot
    }

    /// [`Self::insert`] of each key in turn, except that a key ranking before the one this
    /// call just put first in the request's anchor (a request stores its keys head first: each
    /// has the smallest minor yet) is linked in front of it without reading the anchor again.
    #[inline(always)]
    fn insert_all(
        &mut self,
        new: NewKeys<'_>,
        pool: &mut SlotPool,
        slots: &mut [SlotState],
        keys: &mut KeyTable,
        out: &mut [u32],
        rank: &mut u32,
    ) {
        let kl = new.key_len;
        // The anchor's first key when this call put it there, with its rank, the keys linked
        // in front of it since (counted at the end), and whether the anchor was taken with it
        // (then its sentinels are linked when a second key comes).
        let (mut front, mut placed, mut single) = (None::<(u32, Rank)>, 0, false);
        for (out, &i) in out.iter_mut().zip(new.indices) {
            let slot = pool.alloc();
            keys.insert_hashed(new.hashes[i as usize], slot, key_at(new.keys, kl, i));
            match new.positions.get(i as usize) {
                None => self.give_fresh(slot),
                Some(&p) => {
                    let minor = minor_of(p);
                    front = match front {
                        Some((f, r)) if minor < r.minor => {
                            if std::mem::take(&mut single) {
                                self.link_sentinels(*rank);
                            }
                            let r = Rank { minor, ..r };
                            self.link_in_front(slot, f, r, *rank);
                            placed += 1;
                            Some((slot, r))
                        }
                        _ if *rank == NO_ID => {
                            *rank = self.take_anchor_with(slot, minor);
                            single = true;
                            Some((slot, self.rank_of(slot)))
                        }
                        _ => {
                            single = false;
                            self.place_unlinked(slot, *rank, minor, keys);
                            let first = self.links.next(*rank) == slot;
                            first.then(|| (slot, self.rank_of(slot)))
                        }
                    };
                }
            }
            slots[slot as usize].start_store(slot);
            *out = slot;
        }
        if placed > 0 {
            let a = self.anchor_index(*rank);
            self.counts[a].placed += placed;
        }
    }

    #[inline]
    fn on_pinned(&mut self, _slot: u32) {}

    #[inline]
    fn on_ready(&mut self, _slot: u32) {}

    /// Every stored key among `ids`, last first, gets a fresh rank (pinned and in-flight keys
    /// too): the first ends newest.
    #[inline]
    fn touch(&mut self, ids: &[u32], _slots: &[SlotState]) {
        for &s in ids.iter().rev() {
            if self.is_slot(s) {
                self.give_fresh(s);
            }
        }
    }

    /// Takes the request rank if the request has none (even when no key is given), then
    /// raises each key to the provisional rank if that is newer than its rank (a key never
    /// gets older).
    fn on_request_access(
        &mut self,
        ids: &[u32],
        positions: &[u64],
        rank: &mut u32,
        keys: &KeyTable,
    ) {
        if *rank == NO_ID {
            *rank = self.take_anchor();
        }
        let (a, major) = (*rank, self.anchor_major(*rank));
        // As in `insert_all`: the anchor's first key when this call put it there, and the keys
        // linked in front of it since (counted at the end).
        let (mut front, mut placed) = (None::<(u32, u64)>, 0);
        for (&s, &p) in ids.iter().zip(positions) {
            debug_assert!(self.is_slot(s) && p != NO_POS, "slot {s} at {p}");
            let provisional = Rank {
                major,
                minor: minor_of(p),
            };
            if provisional <= self.rank_of(s) {
                continue;
            }
            match front {
                Some((f, minor)) if provisional.minor < minor && self.links.data(s).anchor != a => {
                    self.take_out(s, NO_ID);
                    self.link_in_front(s, f, provisional, a);
                    placed += 1;
                    front = Some((s, provisional.minor));
                }
                _ => {
                    self.place(s, a, provisional.minor, keys);
                    front = (self.links.next(a) == s).then_some((s, provisional.minor));
                }
            }
        }
        if placed > 0 {
            let i = self.anchor_index(a);
            self.counts[i].placed += placed;
        }
    }

    /// The commit: the stored keys among `ids` (head to tail), tail first, get fresh ranks, so
    /// the request's head ends newest; the request's anchor is freed.
    fn on_request_finished(&mut self, ids: &[u32], _flags: &[u8], _slots: &[SlotState], rank: u32) {
        for &s in ids.iter().rev() {
            if self.is_slot(s) {
                self.give_fresh(s);
            }
        }
        if rank != NO_ID {
            self.release_anchor(rank);
        }
    }

    /// The commit without the keys, when the request's anchor was given each of its `keys`
    /// keys and none left it: the anchor then holds exactly the request's present keys, tail
    /// first (their positions are distinct, so key bytes never break a tie), which is the order
    /// of the commit's fresh ranks. They take them in that order and move to the back as one run.
    fn commit_in_anchor_order(&mut self, rank: u32, keys: usize) -> bool {
        if !self.anchor_holds(rank, keys) {
            return false;
        }
        if self.counts[self.anchor_index(rank)].single != NO_ID {
            self.commit_single(rank);
            return true;
        }
        let (first, end) = (self.links.next(rank), rank + 1);
        if first != end {
            let last = self.links.prev(end);
            let mut s = first;
            while s != end {
                let major = self.fresh();
                *self.links.data_mut(s) = Ranked {
                    rank: Rank { major, minor: 0 },
                    anchor: NO_ID,
                };
                s = self.links.next(s);
            }
            self.links.move_run_to_back(&mut self.list, first, last);
        }
        self.release_anchor(rank);
        true
    }

    /// The first `n` ready, idle, unprotected slots in rank order.
    #[inline]
    fn pick_victims(&self, n: usize, slots: &[SlotState], epoch: u32, out: &mut Vec<u32>) -> bool {
        let mut c = self.list.head;
        while out.len() < n && c != NO_ID {
            if self.is_slot(c) && slots[c as usize].is_evictable(epoch) {
                out.push(c);
            }
            c = self.links.next(c);
        }
        out.len() == n
    }

    #[inline]
    fn evict(&mut self, victims: &[u32], _slots: &mut [SlotState], keys: &mut KeyTable) {
        for &s in victims {
            self.take_out(s, NO_ID);
            keys.remove_id(s);
        }
    }

    #[inline]
    fn remove(&mut self, slot: u32, _slots: &mut [SlotState], keys: &mut KeyTable) {
        self.take_out(slot, NO_ID);
        keys.remove_id(slot);
    }

    /// Drops every key and anchor; numbers start again at 1.
    fn clear(&mut self, _slots: &mut [SlotState]) {
        self.links.clear(&mut self.list);
        self.free_anchors.clear();
        self.anchors_made = 0;
        self.counts.clear();
        self.counter = 0;
    }

    fn num_remembered(&self) -> usize {
        0
    }

    /// The list holds every occupied slot once, in strictly increasing `(rank, key)` order;
    /// each anchor's keys carry its major and name it, and number its placements less the keys
    /// that left it; no other key names an anchor.
    fn check(
        &self,
        _slots: &[SlotState],
        occupied: &[bool],
        used: usize,
        _idle: u64,
    ) -> Result<(), String> {
        let (mut c, mut keys_seen, mut last): (u32, usize, Option<Rank>) =
            (self.list.head, 0, None);
        // The anchor open at `c` and the keys seen in it.
        let mut open_anchor: Option<(u32, u32)> = None;
        while c != NO_ID {
            let Ranked { rank: r, anchor } = *self.links.data(c);
            if self.is_slot(c) {
                if !occupied[c as usize] {
                    return Err(format!("ranked LRU lists free slot {c}"));
                }
                keys_seen += 1;
                match &mut open_anchor {
                    Some((a, n)) if self.rank_of(*a).major == r.major && anchor == *a => *n += 1,
                    Some(_) => return Err(format!("slot {c} sits in another request's anchor")),
                    None if anchor != NO_ID => {
                        // A single-key anchor: its only key, of its major, its sentinels apart.
                        let k = self.counts[self.anchor_index(anchor)];
                        if k.single != c
                            || self.links.is_linked(anchor)
                            || k.placed.checked_sub(k.left) != Some(1)
                        {
                            return Err(format!("slot {c} names anchor {anchor} outside it"));
                        }
                    }
                    None => {}
                }
                if last.is_some_and(|l| l > r) {
                    return Err(format!("ranked LRU out of order at slot {c}"));
                }
                last = Some(r);
            } else {
                let first = (c - self.num_slots).is_multiple_of(2);
                match (first, open_anchor) {
                    (true, None) => open_anchor = Some((c, 0)),
                    (false, Some((a, n))) if a + 1 == c => {
                        let k = self.counts[self.anchor_index(a)];
                        if k.placed.checked_sub(k.left) != Some(n) {
                            return Err(format!(
                                "anchor {a} holds {n} keys, placed {} and left {}",
                                k.placed, k.left
                            ));
                        }
                        open_anchor = None;
                    }
                    _ => return Err(format!("anchor sentinel {c} out of place")),
                }
                if last.is_some_and(|l| l.major > r.major) {
                    return Err(format!("anchor {c} out of order"));
                }
                // What follows an anchor's start is of its major or newer; what follows its
                // end, newer.
                let minor = if first { 0 } else { u64::MAX };
                last = Some(Rank { minor, ..r });
            }
            c = self.links.next(c);
        }
        if keys_seen != used {
            return Err(format!("ranked LRU lists {keys_seen} keys, {used} used"));
        }
        // A single-key anchor is taken, and its key is listed and names it.
        for (i, k) in self.counts.iter().enumerate() {
            let a = self.num_slots + 2 * i as u32;
            let s = k.single;
            if s != NO_ID
                && (!self.is_slot(s)
                    || !self.links.is_linked(s)
                    || self.links.data(s).anchor != a
                    || self.free_anchors.contains(&a))
            {
                return Err(format!("single-key anchor {a}: its key {s} is not its own"));
            }
        }
        Ok(())
    }
}

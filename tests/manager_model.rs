//! Model-based tests of [`Manager`]: random operation sequences run on the real manager and on a
//! deliberately naive reference model written straight from vLLM 0.24's `CPUOffloadingManager`,
//! `LRUCachePolicy` and `ARCCachePolicy` as `docs/design.md` §3 states them, plus the
//! deviations documented in `src/manager/mod.rs`: a call that fails changes nothing (counters
//! included), duplicate keys in one `prepare_store` are stored once (at their first index),
//! "storage full" is `Error::NoRoom`, and the stats counters are cumulative.
//!
//! The model uses `Vec`s as Python `OrderedDict`s (LRU first, MRU last), a block list with
//! ref counts -1 / 0 / >0, a block pool with fresh-ids-first-then-LIFO allocation, the
//! store-threshold tracker (LRU-bounded list of lookup counts), and the event buffer.
//!
//! After every operation the test compares return values, `stats()`, the buffered events and
//! `check_invariants()`, and asserts safety properties (only ready, unpinned, unprotected keys
//! are evicted; slots are below the capacity and never held by two keys).

use kvoffload::Error;
use kvoffload::manager::{
    Lookup, Manager, ManagerConfig, ManagerStats, Policy, PrefixLookup, StorePlan,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::fmt;

const KEY_LEN: usize = 8;
/// Keys are drawn from `0..UNIVERSE`.
const UNIVERSE: u64 = 12;

fn enc(keys: &[u64]) -> Vec<u8> {
    keys.iter().flat_map(|k| k.to_be_bytes()).collect()
}

fn dec(bytes: &[u8]) -> Vec<u64> {
    assert_eq!(
        bytes.len() % KEY_LEN,
        0,
        "key bytes not a multiple of KEY_LEN"
    );
    bytes
        .chunks_exact(KEY_LEN)
        .map(|c| u64::from_be_bytes(c.try_into().unwrap()))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The reference model
// ---------------------------------------------------------------------------------------------

/// Error kinds the model predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ErrKind {
    NotFound,
    InvalidState,
    NoRoom,
    InvalidArgument,
}

fn kind_of(e: &Error) -> Option<ErrKind> {
    if matches!(e, Error::NotFound(_)) {
        Some(ErrKind::NotFound)
    } else if matches!(e, Error::InvalidState(_)) {
        Some(ErrKind::InvalidState)
    } else if matches!(e, Error::NoRoom(_)) {
        Some(ErrKind::NoRoom)
    } else if matches!(e, Error::InvalidArgument(_)) {
        Some(ErrKind::InvalidArgument)
    } else {
        None
    }
}

/// `BlockStatus` of one stored key.
#[derive(Debug, Clone, PartialEq)]
struct Block {
    key: u64,
    id: u32,
    /// -1: store in flight; 0: ready and idle; n > 0: pinned by n loads.
    ref_cnt: i32,
}

/// `OrderedDict` helpers on a `Vec` (front = LRU, back = MRU).
fn od_pos(v: &[u64], k: u64) -> Option<usize> {
    v.iter().position(|&x| x == k)
}

fn od_remove(v: &mut Vec<u64>, k: u64) -> bool {
    match od_pos(v, k) {
        Some(p) => {
            v.remove(p);
            true
        }
        None => false,
    }
}

/// `move_to_end(k)` if present; returns whether it was.
fn od_move_to_end(v: &mut Vec<u64>, k: u64) -> bool {
    if od_remove(v, k) {
        v.push(k);
        true
    } else {
        false
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Model {
    cap: usize,
    policy: Policy,
    threshold: u32,
    max_tracker: usize,
    /// Every stored key (unordered; the policies below hold the orders).
    blocks: Vec<Block>,
    // Block pool.
    num_allocated: usize,
    free_list: Vec<u32>,
    // LRU policy.
    evictable_blocks: Vec<u64>,
    // ARC policy.
    t1: Vec<u64>,
    t2: Vec<u64>,
    b1: Vec<u64>,
    b2: Vec<u64>,
    target_t1_size: f64,
    // Store-threshold tracker: (key, count), least recently looked up first.
    tracker: Vec<(u64, u32)>,
    // Events (always enabled in these tests): (removed, keys).
    events: Vec<(bool, Vec<u64>)>,
    // Cumulative counters.
    lookups: u64,
    hits: u64,
    stores_skipped: u64,
    allocation_size_buckets: [u64; 11],
    allocation_keys: u64,
    evictions: u64,
}

/// What a successful `prepare_store` returns: input indices, slots, evicted keys.
type StoreOut = (Vec<u32>, Vec<u32>, Vec<u64>);

impl Model {
    fn new(cap: usize, policy: Policy, threshold: u32, max_tracker: usize) -> Self {
        Self {
            cap,
            policy,
            threshold,
            max_tracker,
            blocks: Vec::new(),
            num_allocated: 0,
            free_list: Vec::new(),
            evictable_blocks: Vec::new(),
            t1: Vec::new(),
            t2: Vec::new(),
            b1: Vec::new(),
            b2: Vec::new(),
            target_t1_size: 0.0,
            tracker: Vec::new(),
            events: Vec::new(),
            lookups: 0,
            hits: 0,
            stores_skipped: 0,
            allocation_size_buckets: [0; 11],
            allocation_keys: 0,
            evictions: 0,
        }
    }

    fn tracker_on(&self) -> bool {
        self.threshold >= 2
    }

    fn block(&self, k: u64) -> Option<&Block> {
        self.blocks.iter().find(|b| b.key == k)
    }

    fn block_mut(&mut self, k: u64) -> Option<&mut Block> {
        self.blocks.iter_mut().find(|b| b.key == k)
    }

    fn ref_cnt(&self, k: u64) -> Option<i32> {
        self.block(k).map(|b| b.ref_cnt)
    }

    fn remove_block(&mut self, k: u64) -> Block {
        let p = self.blocks.iter().position(|b| b.key == k).unwrap();
        self.blocks.remove(p)
    }

    fn free(&self) -> usize {
        self.free_list.len() + self.cap - self.num_allocated
    }

    fn num_evictable(&self) -> usize {
        self.blocks.iter().filter(|b| b.ref_cnt == 0).count()
    }

    fn alloc(&mut self) -> u32 {
        if self.num_allocated < self.cap {
            self.num_allocated += 1;
            (self.num_allocated - 1) as u32
        } else {
            self.free_list.pop().expect("model: no free block")
        }
    }

    fn tracked_count(&self, k: u64) -> u32 {
        self.tracker.iter().find(|e| e.0 == k).map_or(0, |e| e.1)
    }

    /// Sorted keys whose block satisfies `f`.
    fn keys_where(&self, f: impl Fn(&Block) -> bool) -> Vec<u64> {
        let mut v: Vec<u64> = self.blocks.iter().filter(|b| f(b)).map(|b| b.key).collect();
        v.sort_unstable();
        v
    }

    // --- policy primitives (`docs/design.md` §3.4, §3.5) ---

    fn policy_insert(&mut self, k: u64) {
        match self.policy {
            // A fresh store has ref_cnt -1: not added to evictable_blocks.
            Policy::Lru => {}
            Policy::Arc => {
                self.t1.push(k);
                od_remove(&mut self.b1, k);
                od_remove(&mut self.b2, k);
            }
        }
    }

    fn policy_remove(&mut self, k: u64) {
        match self.policy {
            Policy::Lru => {
                od_remove(&mut self.evictable_blocks, k);
            }
            Policy::Arc => {
                if !od_remove(&mut self.t1, k) {
                    od_remove(&mut self.t2, k);
                }
            }
        }
    }

    fn mark_evictable(&mut self, k: u64) {
        if self.policy == Policy::Lru && od_pos(&self.evictable_blocks, k).is_none() {
            self.evictable_blocks.push(k);
        }
    }

    fn mark_non_evictable(&mut self, k: u64) {
        if self.policy == Policy::Lru {
            od_remove(&mut self.evictable_blocks, k);
        }
    }

    fn policy_touch(&mut self, keys: &[u64]) {
        for &k in keys.iter().rev() {
            match self.policy {
                Policy::Lru => {
                    od_move_to_end(&mut self.evictable_blocks, k);
                }
                Policy::Arc => {
                    if od_remove(&mut self.t1, k) {
                        if self.ref_cnt(k) == Some(-1) {
                            self.t1.push(k);
                        } else {
                            self.t2.push(k);
                        }
                    } else if od_move_to_end(&mut self.t2, k) {
                    } else if od_pos(&self.b1, k).is_some() {
                        let delta = f64::max(1.0, self.b2.len() as f64 / self.b1.len() as f64);
                        self.target_t1_size =
                            f64::min(self.target_t1_size + delta, self.cap as f64);
                        od_move_to_end(&mut self.b1, k);
                    } else if od_pos(&self.b2, k).is_some() {
                        let delta = f64::max(1.0, self.b1.len() as f64 / self.b2.len() as f64);
                        self.target_t1_size = f64::max(self.target_t1_size - delta, 0.0);
                        od_move_to_end(&mut self.b2, k);
                    }
                }
            }
        }
    }

    /// `policy.evict(n, protected)`: the victims in selection order, or `None` (no change).
    fn policy_evict(&mut self, n: usize, protected: &[u64]) -> Option<Vec<u64>> {
        if n == 0 {
            return Some(Vec::new());
        }
        let eligible = |m: &Model, k: u64, picks: &[u64]| {
            m.ref_cnt(k) == Some(0) && !protected.contains(&k) && !picks.contains(&k)
        };
        match self.policy {
            Policy::Lru => {
                let picks: Vec<u64> = self
                    .evictable_blocks
                    .iter()
                    .copied()
                    .filter(|k| !protected.contains(k))
                    .take(n)
                    .collect();
                if picks.len() < n {
                    return None;
                }
                for &k in &picks {
                    od_remove(&mut self.evictable_blocks, k);
                }
                Some(picks)
            }
            Policy::Arc => {
                let mut virtual_t1 = self.t1.len() as i64;
                // Python int(target): truncation toward zero (target >= 0).
                let int_target = self.target_t1_size.trunc() as i64;
                let mut picks: Vec<u64> = Vec::new();
                for _ in 0..n {
                    let mut picked = None;
                    if virtual_t1 >= int_target {
                        picked = self.t1.iter().copied().find(|&k| eligible(self, k, &picks));
                        if picked.is_some() {
                            virtual_t1 -= 1;
                        }
                    }
                    if picked.is_none() {
                        picked = self.t2.iter().copied().find(|&k| eligible(self, k, &picks));
                    }
                    picks.push(picked?);
                }
                for &k in &picks {
                    if od_remove(&mut self.t1, k) {
                        self.b1.push(k);
                    } else {
                        assert!(od_remove(&mut self.t2, k), "model: ARC victim not listed");
                        self.b2.push(k);
                    }
                }
                while self.b1.len() > self.cap {
                    self.b1.remove(0);
                }
                while self.b2.len() > self.cap {
                    self.b2.remove(0);
                }
                Some(picks)
            }
        }
    }

    // --- manager operations (`docs/design.md` §3.3); callers run fallible ones on a clone ---

    fn lookup(&mut self, k: u64) -> Lookup {
        if self.tracker_on() {
            if let Some(p) = self.tracker.iter().position(|e| e.0 == k) {
                let mut e = self.tracker.remove(p);
                e.1 += 1;
                self.tracker.push(e);
            } else {
                if self.tracker.len() >= self.max_tracker {
                    self.tracker.remove(0);
                }
                self.tracker.push((k, 1));
            }
        }
        self.lookups += 1;
        match self.ref_cnt(k) {
            None => Lookup::Miss,
            Some(-1) => Lookup::Retry,
            Some(_) => {
                self.hits += 1;
                Lookup::Hit
            }
        }
    }

    /// `_maximal_prefix_lookup`: stop at the first miss; in-flight counts as a hit + retry.
    fn lookup_prefix(&mut self, keys: &[u64]) -> PrefixLookup {
        let mut out = PrefixLookup::default();
        for &k in keys {
            match self.lookup(k) {
                Lookup::Miss => break,
                Lookup::Retry | Lookup::HitPending => out.retry = true,
                Lookup::Hit => {}
            }
            out.hits += 1;
        }
        out
    }

    fn prepare_load(&mut self, keys: &[u64]) -> Result<Vec<u32>, ErrKind> {
        let mut slots = Vec::new();
        for &k in keys {
            let Some(b) = self.block(k) else {
                return Err(ErrKind::NotFound);
            };
            if b.ref_cnt < 0 {
                return Err(ErrKind::InvalidState);
            }
            if b.ref_cnt == 0 {
                self.mark_non_evictable(k);
            }
            let b = self.block_mut(k).unwrap();
            b.ref_cnt += 1;
            slots.push(b.id);
        }
        Ok(slots)
    }

    fn complete_load(&mut self, keys: &[u64]) -> Result<(), ErrKind> {
        for &k in keys {
            let Some(b) = self.block_mut(k) else {
                return Err(ErrKind::NotFound);
            };
            if b.ref_cnt <= 0 {
                return Err(ErrKind::InvalidState);
            }
            b.ref_cnt -= 1;
            if b.ref_cnt == 0 {
                self.mark_evictable(k);
            }
        }
        Ok(())
    }

    /// Step 1 of prepare_store: the (index, key) pairs that pass the store-threshold filter.
    fn filtered(&self, keys: &[u64]) -> Vec<(u32, u64)> {
        keys.iter()
            .enumerate()
            .filter(|&(_, &k)| !self.tracker_on() || self.tracked_count(k) >= self.threshold)
            .map(|(i, &k)| (i as u32, k))
            .collect()
    }

    fn prepare_store(&mut self, keys: &[u64]) -> Result<StoreOut, ErrKind> {
        let filtered = self.filtered(keys);
        let skipped = (keys.len() - filtered.len()) as u64;
        let mut to_store: Vec<(u32, u64)> = Vec::new();
        for &(i, k) in &filtered {
            if self.block(k).is_none() && !to_store.iter().any(|e| e.1 == k) {
                to_store.push((i, k));
            }
        }
        if to_store.is_empty() {
            self.stores_skipped += skipped;
            return Ok((Vec::new(), Vec::new(), Vec::new()));
        }
        let mut evicted = Vec::new();
        let free = self.free();
        if to_store.len() > free {
            let need = to_store.len() - free;
            if need > self.num_evictable() {
                return Err(ErrKind::NoRoom);
            }
            // Every key named in the call is protected, whether it passes the threshold or not
            // (vLLM 0.24 protects only the keys after the filter).
            evicted = self.policy_evict(need, keys).ok_or(ErrKind::NoRoom)?;
            for &k in &evicted {
                let b = self.remove_block(k);
                self.free_list.push(b.id);
            }
            self.evictions += evicted.len() as u64;
            self.events.push((true, evicted.clone()));
        }
        self.stores_skipped += skipped;
        // vLLM 0.33's allocation-size buckets (0.24 semantics: successful allocations only).
        let bounds = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144];
        self.allocation_size_buckets[bounds.iter().filter(|&&b| b < to_store.len()).count()] += 1;
        self.allocation_keys += to_store.len() as u64;
        let mut indices = Vec::new();
        let mut slots = Vec::new();
        for (i, k) in to_store {
            let id = self.alloc();
            self.blocks.push(Block {
                key: k,
                id,
                ref_cnt: -1,
            });
            self.policy_insert(k);
            indices.push(i);
            slots.push(id);
        }
        Ok((indices, slots, evicted))
    }

    fn complete_store(&mut self, keys: &[u64], success: bool) {
        if success {
            let mut collected = Vec::new();
            for &k in keys {
                if let Some(b) = self.block_mut(k)
                    && b.ref_cnt == -1
                {
                    b.ref_cnt = 0;
                    self.mark_evictable(k);
                    collected.push(k);
                }
            }
            if !collected.is_empty() {
                self.events.push((false, collected));
            }
        } else {
            for &k in keys {
                if self.ref_cnt(k) == Some(-1) {
                    self.policy_remove(k);
                    let b = self.remove_block(k);
                    self.free_list.push(b.id);
                }
            }
        }
    }

    fn reset(&mut self) {
        self.blocks.clear();
        self.free_list.clear();
        self.num_allocated = 0;
        self.evictable_blocks.clear();
        self.t1.clear();
        self.t2.clear();
        self.b1.clear();
        self.b2.clear();
        self.target_t1_size = 0.0;
    }

    fn stats(&self) -> ManagerStats {
        let count = |f: fn(i32) -> bool| self.blocks.iter().filter(|b| f(b.ref_cnt)).count() as u64;
        ManagerStats {
            capacity: self.cap as u64,
            used: self.blocks.len() as u64,
            ready: count(|r| r >= 0),
            evictable: count(|r| r == 0),
            pinned: count(|r| r > 0),
            stores_in_flight: count(|r| r == -1),
            lookups: self.lookups,
            hits: self.hits,
            stores_skipped: self.stores_skipped,
            evictions: self.evictions,
            events_dropped: 0,
            allocation_size_buckets: self.allocation_size_buckets,
            allocation_keys: self.allocation_keys,
        }
    }

    /// The model's own consistency (guards against a wrong model, not a wrong manager).
    fn self_check(&self) -> Result<(), String> {
        let mut ids: Vec<u32> = self.blocks.iter().map(|b| b.id).collect();
        ids.extend(&self.free_list);
        let n = ids.len();
        ids.sort_unstable();
        ids.dedup();
        if ids.len() != n || ids.iter().any(|&i| i as usize >= self.num_allocated) {
            return Err(format!("model: bad block ids / free list {self:?}"));
        }
        if self.blocks.len() + self.free() != self.cap {
            return Err("model: blocks + free != capacity".into());
        }
        match self.policy {
            Policy::Lru => {
                let mut e = self.evictable_blocks.clone();
                e.sort_unstable();
                if e != self.keys_where(|b| b.ref_cnt == 0) {
                    return Err("model: evictable_blocks != ready idle blocks".into());
                }
            }
            Policy::Arc => {
                let mut t: Vec<u64> = self.t1.iter().chain(&self.t2).copied().collect();
                t.sort_unstable();
                if t != self.keys_where(|_| true) {
                    return Err("model: T1 + T2 != stored keys".into());
                }
                if self.b1.len() > self.cap
                    || self.b2.len() > self.cap
                    || self
                        .b1
                        .iter()
                        .chain(&self.b2)
                        .any(|&k| self.block(k).is_some())
                {
                    return Err("model: bad ghost lists".into());
                }
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Operations and their generation
// ---------------------------------------------------------------------------------------------

/// A key chosen when the operation runs, from the model's state at that time (so that
/// generation can aim at ready / pinned / in-flight / ghost keys); falls back to `idx % UNIVERSE`.
#[derive(Debug, Clone, Copy)]
enum Sel {
    Any(u64),
    Ready(usize),
    Pinned(usize),
    InFlight(usize),
    Ghost(usize),
}

#[derive(Debug, Clone)]
enum Op {
    Lookup(Sel),
    LookupPrefix(Vec<Sel>),
    /// `lookup_prefix_touch(keys, from..)`: a prefix lookup of the keys from `from` (clamped),
    /// then a touch of all (as a scheduler's match).
    LookupPrefixTouch(Vec<Sel>, usize),
    PrepareLoad(Vec<Sel>),
    Touch(Vec<Sel>),
    CompleteLoad(Vec<Sel>),
    PrepareStore(Vec<Sel>),
    CompleteStore(Vec<Sel>, bool),
    /// Touch every ready key (sorted, rotated left by the number), as a request's lookup does.
    TouchReady(usize),
    /// `lookup` of each key, then `prepare_store(keys)` and `complete_store(keys, true)` (the
    /// connector's flow; repeated, it gets keys past the store threshold).
    LookupStore(Vec<Sel>),
    /// `prepare_store(keys)` then `complete_store(keys, true)` (drives the tier to full).
    StoreCompleted(Vec<Sel>),
    TakeEvents,
    Reset,
    /// A call with a key buffer that is not a whole number of keys: `InvalidArgument`.
    Malformed(u8),
}

/// An operation with its keys resolved against the model: one manager call.
#[derive(Debug, Clone)]
enum Call {
    Lookup(u64),
    LookupPrefix(Vec<u64>),
    LookupPrefixTouch(Vec<u64>, usize),
    PrepareLoad(Vec<u64>),
    Touch(Vec<u64>),
    CompleteLoad(Vec<u64>),
    PrepareStore(Vec<u64>),
    CompleteStore(Vec<u64>, bool),
    TakeEvents,
    Reset,
    Malformed(u8),
}

impl Op {
    fn resolve(&self, model: &Model) -> Vec<Call> {
        let all = |sels: &[Sel]| resolve_all(model, sels);
        match self {
            Op::Lookup(s) => vec![Call::Lookup(resolve(model, *s))],
            Op::LookupPrefix(s) => vec![Call::LookupPrefix(all(s))],
            Op::LookupPrefixTouch(s, from) => {
                let ks = all(s);
                let from = (*from).min(ks.len());
                vec![Call::LookupPrefixTouch(ks, from)]
            }
            Op::PrepareLoad(s) => vec![Call::PrepareLoad(all(s))],
            Op::Touch(s) => vec![Call::Touch(all(s))],
            Op::TouchReady(r) => {
                let mut ks = model.keys_where(|b| b.ref_cnt >= 0);
                if !ks.is_empty() {
                    let n = ks.len();
                    ks.rotate_left(r % n);
                }
                vec![Call::Touch(ks)]
            }
            Op::CompleteLoad(s) => vec![Call::CompleteLoad(all(s))],
            Op::PrepareStore(s) => vec![Call::PrepareStore(all(s))],
            Op::CompleteStore(s, ok) => vec![Call::CompleteStore(all(s), *ok)],
            Op::LookupStore(s) => {
                let ks = all(s);
                let mut calls: Vec<Call> = ks.iter().map(|&k| Call::Lookup(k)).collect();
                calls.push(Call::PrepareStore(ks.clone()));
                calls.push(Call::CompleteStore(ks, true));
                calls
            }
            Op::StoreCompleted(s) => {
                let ks = all(s);
                vec![
                    Call::PrepareStore(ks.clone()),
                    Call::CompleteStore(ks, true),
                ]
            }
            Op::TakeEvents => vec![Call::TakeEvents],
            Op::Reset => vec![Call::Reset],
            Op::Malformed(w) => vec![Call::Malformed(*w)],
        }
    }
}

fn resolve(model: &Model, s: Sel) -> u64 {
    let pick = |v: Vec<u64>, i: usize| {
        if v.is_empty() {
            i as u64 % UNIVERSE
        } else {
            v[i % v.len()]
        }
    };
    match s {
        Sel::Any(k) => k,
        Sel::Ready(i) => pick(model.keys_where(|b| b.ref_cnt >= 0), i),
        // Nothing pinned: a ready key instead (complete_load of it is the InvalidState case).
        Sel::Pinned(i) if model.blocks.iter().any(|b| b.ref_cnt > 0) => {
            pick(model.keys_where(|b| b.ref_cnt > 0), i)
        }
        Sel::Pinned(i) => pick(model.keys_where(|b| b.ref_cnt >= 0), i),
        Sel::InFlight(i) => pick(model.keys_where(|b| b.ref_cnt == -1), i),
        Sel::Ghost(i) => pick(model.b1.iter().chain(&model.b2).copied().collect(), i),
    }
}

fn resolve_all(model: &Model, sels: &[Sel]) -> Vec<u64> {
    sels.iter().map(|&s| resolve(model, s)).collect()
}

fn any_key() -> BoxedStrategy<Sel> {
    (0..UNIVERSE).prop_map(Sel::Any).boxed()
}
fn ready() -> BoxedStrategy<Sel> {
    (0..8usize).prop_map(Sel::Ready).boxed()
}
fn pinned() -> BoxedStrategy<Sel> {
    (0..8usize).prop_map(Sel::Pinned).boxed()
}
fn in_flight() -> BoxedStrategy<Sel> {
    (0..8usize).prop_map(Sel::InFlight).boxed()
}
fn ghost() -> BoxedStrategy<Sel> {
    (0..8usize).prop_map(Sel::Ghost).boxed()
}

fn op_strategy(lookup_weight: u32) -> impl Strategy<Value = Op> {
    let lookup_sel = prop_oneof![3 => any_key(), 2 => ready(), 1 => in_flight()];
    let prefix_sel = prop_oneof![3 => any_key(), 3 => ready(), 1 => in_flight()];
    let load_sel = prop_oneof![8 => ready(), 1 => any_key(), 1 => in_flight(), 1 => pinned()];
    let touch_sel = prop_oneof![
        2 => any_key(),
        2 => ready(),
        1 => pinned(),
        1 => in_flight(),
        3 => ghost()
    ];
    let complete_load_sel = prop_oneof![8 => pinned(), 1 => ready(), 1 => any_key()];
    let store_sel = || prop_oneof![6 => any_key(), 1 => ready(), 1 => in_flight(), 2 => ghost()];
    let complete_store_sel = prop_oneof![6 => in_flight(), 1 => any_key(), 1 => ready()];
    // Two thirds of the universe, so that keys come back (and pass the store threshold).
    let hot_sel = prop_oneof![3 => (0..UNIVERSE * 2 / 3).prop_map(Sel::Any), 1 => ready()];
    let keys = |s: BoxedStrategy<Sel>, max: usize| prop::collection::vec(s, 0..=max);
    prop_oneof![
        lookup_weight => lookup_sel.prop_map(Op::Lookup),
        2 => keys(prefix_sel.boxed(), 4).prop_map(Op::LookupPrefix),
        2 => (keys(touch_sel.clone().boxed(), 5), 0..3usize).prop_map(|(k, f)| Op::LookupPrefixTouch(k, f)),
        2 => keys(load_sel.boxed(), 3).prop_map(Op::PrepareLoad),
        4 => keys(touch_sel.boxed(), 4).prop_map(Op::Touch),
        2 => (0..6usize).prop_map(Op::TouchReady),
        3 => keys(complete_load_sel.boxed(), 3).prop_map(Op::CompleteLoad),
        3 => keys(store_sel().boxed(), 4).prop_map(Op::PrepareStore),
        4 => (keys(complete_store_sel.boxed(), 4), prop::bool::weighted(0.8))
            .prop_map(|(k, ok)| Op::CompleteStore(k, ok)),
        6 => prop::collection::vec(store_sel(), 1..=4).prop_map(Op::StoreCompleted),
        lookup_weight => prop::collection::vec(hot_sel, 1..=3).prop_map(Op::LookupStore),
        1 => Just(Op::TakeEvents),
        1 => Just(Op::Reset),
        1 => (0..7u8).prop_map(Op::Malformed),
    ]
}

#[derive(Debug, Clone, Copy)]
struct Setup {
    policy: Policy,
    cap: usize,
    threshold: u32,
    max_tracker: usize,
}

// ---------------------------------------------------------------------------------------------
// The runner
// ---------------------------------------------------------------------------------------------

/// The resolved calls run so far with their answers, printed on failure.
struct Trace<'a>(&'a Setup, &'a [String]);

impl fmt::Display for Trace<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "\n(left = manager, right = model)\nsetup: {:?}\ncalls:",
            self.0
        )?;
        for (i, s) in self.1.iter().enumerate() {
            writeln!(f, "  {i:>3}: {s}")?;
        }
        Ok(())
    }
}

fn events_of(m: &Manager) -> Vec<(bool, Vec<u64>)> {
    m.events()
        .iter()
        .map(|e| (e.removed, dec(e.keys)))
        .collect()
}

struct Harness {
    setup: Setup,
    m: Manager,
    model: Model,
    trace: Vec<String>,
    plan: StorePlan,
}

impl Harness {
    fn new(setup: Setup) -> Self {
        let m = Manager::new(ManagerConfig {
            key_len: KEY_LEN,
            num_slots: setup.cap,
            policy: setup.policy,
            store_threshold: setup.threshold,
            max_tracker_size: setup.max_tracker,
            enable_events: true,
            ..Default::default()
        })
        .unwrap();
        let model = Model::new(setup.cap, setup.policy, setup.threshold, setup.max_tracker);
        Self {
            setup,
            m,
            model,
            trace: Vec::new(),
            plan: StorePlan::default(),
        }
    }

    fn tr(&self) -> Trace<'_> {
        Trace(&self.setup, &self.trace)
    }

    fn note(&mut self, s: String) {
        *self.trace.last_mut().unwrap() += &s;
    }

    /// Compares a fallible call: the same Ok (the model then takes `next`) or the same error
    /// kind (the model stays as it was). Returns whether both succeeded.
    fn fallible<T: fmt::Debug, U: fmt::Debug>(
        &mut self,
        real: &Result<T, Error>,
        next: Model,
        expect: &Result<U, ErrKind>,
    ) -> Result<bool, TestCaseError> {
        match (real, expect) {
            (Ok(_), Ok(_)) => {
                self.model = next;
                Ok(true)
            }
            (Err(e), Err(k)) => {
                prop_assert_eq!(kind_of(e), Some(*k), "error kind{}", self.tr());
                Ok(false)
            }
            _ => Err(TestCaseError::fail(format!(
                "manager {real:?} but model {expect:?}{}",
                self.tr()
            ))),
        }
    }

    fn step(&mut self, call: Call) -> Result<(), TestCaseError> {
        let before = self.model.clone();
        self.trace.push(format!("{call:?}"));
        match call {
            Call::Lookup(k) => {
                let real = self.m.lookup(&enc(&[k])).unwrap();
                let expect = self.model.lookup(k);
                self.note(format!(" -> {real:?}"));
                prop_assert_eq!(real, expect, "lookup{}", self.tr());
            }
            Call::LookupPrefix(ks) => {
                let real = self.m.lookup_prefix(&enc(&ks)).unwrap();
                let expect = self.model.lookup_prefix(&ks);
                self.note(format!(" -> {real:?}"));
                prop_assert_eq!(real, expect, "lookup_prefix{}", self.tr());
            }
            Call::LookupPrefixTouch(ks, from) => {
                let real = self
                    .m
                    .lookup_prefix_touch(&enc(&ks), from..ks.len())
                    .unwrap();
                let expect = self.model.lookup_prefix(&ks[from..]);
                self.model.policy_touch(&ks);
                self.note(format!(" -> {real:?}"));
                prop_assert_eq!(real, expect, "lookup_prefix_touch{}", self.tr());
            }
            Call::PrepareLoad(ks) => {
                let mut out = vec![u32::MAX; ks.len()];
                let real = self.m.prepare_load(&enc(&ks), &mut out);
                let mut next = before.clone();
                let expect = next.prepare_load(&ks);
                self.note(format!(" -> {real:?} {out:?}"));
                if self.fallible(&real, next, &expect)? {
                    prop_assert_eq!(real.unwrap(), ks.len(), "prepare_load count{}", self.tr());
                    prop_assert_eq!(&out, &expect.unwrap(), "prepare_load slots{}", self.tr());
                    for (&k, &s) in ks.iter().zip(&out) {
                        prop_assert!((s as usize) < self.setup.cap, "slot range{}", self.tr());
                        prop_assert_eq!(before.block(k).map(|b| b.id), Some(s), "{}", self.tr());
                    }
                }
            }
            Call::Touch(ks) => {
                self.m.touch(&enc(&ks)).unwrap();
                self.model.policy_touch(&ks);
            }
            Call::CompleteLoad(ks) => {
                let real = self.m.complete_load(&enc(&ks));
                let mut next = before.clone();
                let expect = next.complete_load(&ks);
                self.note(format!(" -> {real:?}"));
                self.fallible(&real, next, &expect)?;
            }
            Call::PrepareStore(ks) => {
                let real = self.m.prepare_store(&enc(&ks), &mut self.plan);
                let mut next = before.clone();
                let expect = next.prepare_store(&ks);
                let plan = self.plan.clone();
                let evicted = dec(&plan.evicted);
                self.note(match &real {
                    Ok(_) => format!(
                        " -> indices {:?} slots {:?} evicted {evicted:?}",
                        plan.indices, plan.slots
                    ),
                    Err(e) => format!(" -> Err({e:?})"),
                });
                if !self.fallible(&real, next, &expect)? {
                    prop_assert!(plan == StorePlan::default(), "plan after Err{}", self.tr());
                    return self.check_all();
                }
                let c = real.unwrap();
                let (indices, slots, ev) = expect.unwrap();
                prop_assert_eq!(c.stored, plan.indices.len(), "{}", self.tr());
                prop_assert_eq!(c.evicted, evicted.len(), "{}", self.tr());
                prop_assert_eq!(&plan.indices, &indices, "store indices{}", self.tr());
                prop_assert_eq!(&plan.slots, &slots, "store slots{}", self.tr());
                prop_assert_eq!(&evicted, &ev, "evicted keys{}", self.tr());
                // Safety, judged on the manager's own answer against the state before the call.
                for &k in &evicted {
                    prop_assert_eq!(
                        before.ref_cnt(k),
                        Some(0),
                        "evicted key {} was not ready and idle{}",
                        k,
                        self.tr()
                    );
                    prop_assert!(!ks.contains(&k), "evicted input key {}{}", k, self.tr());
                }
                for (j, &s) in plan.slots.iter().enumerate() {
                    prop_assert!((s as usize) < self.setup.cap, "slot range{}", self.tr());
                    prop_assert!(
                        !plan.slots[..j].contains(&s),
                        "slot {} twice{}",
                        s,
                        self.tr()
                    );
                    let holder = before.blocks.iter().find(|b| b.id == s);
                    prop_assert!(
                        holder.is_none_or(|b| evicted.contains(&b.key)),
                        "slot {} still held by {:?}{}",
                        s,
                        holder,
                        self.tr()
                    );
                }
            }
            Call::CompleteStore(ks, ok) => {
                // Slot hints (checked by the manager, never trusted): none, the true slots, or
                // in-range slots that are mostly wrong (other keys, free slots, stale bytes).
                let cap = self.model.cap as u64;
                let hints: Vec<u32> = match ks.iter().sum::<u64>() % 3 {
                    _ if cap == 0 => vec![],
                    0 => vec![],
                    1 => ks
                        .iter()
                        .map(|&k| {
                            self.model
                                .blocks
                                .iter()
                                .find(|b| b.key == k)
                                .map_or((k % cap) as u32, |b| b.id)
                        })
                        .collect(),
                    _ => ks.iter().map(|&k| ((k * 7 + 3) % cap) as u32).collect(),
                };
                self.m.complete_store_at(&enc(&ks), &hints, ok).unwrap();
                self.model.complete_store(&ks, ok);
            }
            Call::TakeEvents => {
                let log = self.m.take_events();
                let real: Vec<(bool, Vec<u64>)> =
                    log.iter().map(|e| (e.removed, dec(e.keys))).collect();
                let expect = std::mem::take(&mut self.model.events);
                prop_assert_eq!(log.len(), real.len());
                let n: usize = real.iter().map(|e| e.1.len()).sum();
                prop_assert_eq!(log.num_keys(), n);
                prop_assert_eq!(real, expect, "take_events{}", self.tr());
            }
            Call::Reset => {
                self.m.reset();
                self.model.reset();
            }
            Call::Malformed(which) => {
                let bad = [0u8; KEY_LEN - 1];
                let m = &mut self.m;
                let r = match which {
                    0 => m.lookup(&bad).map(|_| ()),
                    1 => m.lookup_prefix(&bad).map(|_| ()),
                    2 => m.prepare_load(&bad, &mut [0; 4]).map(|_| ()),
                    3 => m.touch(&bad),
                    4 => m.complete_load(&bad),
                    5 => m.prepare_store(&bad, &mut self.plan).map(|_| ()),
                    _ => m.complete_store(&bad, true),
                };
                prop_assert!(
                    matches!(r, Err(Error::InvalidArgument(_))),
                    "malformed call gave {:?}{}",
                    r,
                    self.tr()
                );
            }
        }
        self.check_all()
    }

    /// After every call: stats, buffered events, invariants on both sides.
    fn check_all(&self) -> Result<(), TestCaseError> {
        prop_assert_eq!(self.m.stats(), self.model.stats(), "stats{}", self.tr());
        prop_assert_eq!(
            events_of(&self.m),
            self.model.events.clone(),
            "events{}",
            self.tr()
        );
        let inv = self.m.check_invariants();
        prop_assert!(inv.is_ok(), "check_invariants: {:?}{}", inv, self.tr());
        let own = self.model.self_check();
        prop_assert!(own.is_ok(), "{:?}{}", own, self.tr());
        Ok(())
    }
}

fn run_case(setup: Setup, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut h = Harness::new(setup);
    for op in ops {
        for call in op.resolve(&h.model) {
            h.step(call)?;
        }
    }
    // Final probe of every key (a lookup changes the tracker and counters alike on both sides).
    for k in 0..UNIVERSE {
        h.step(Call::Lookup(k))?;
    }
    Ok(())
}

/// `cases` unless `PROPTEST_CASES` says otherwise (for longer runs by hand).
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(cases),
        // Only tests/manager_model.rs is ours: no regression files next to it.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Capacity 0..=6, mostly 3..=6.
fn capacity() -> impl Strategy<Value = usize> {
    prop_oneof![1 => Just(0usize), 2 => 1usize..=2, 6 => 3usize..=6]
}

fn ops(lookup_weight: u32) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op_strategy(lookup_weight), 1..=60)
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn lru_matches_model(cap in capacity(), threshold in prop_oneof![3 => Just(0u32), 1 => Just(1u32)], ops in ops(3)) {
        run_case(Setup { policy: Policy::Lru, cap, threshold, max_tracker: 64 }, &ops)?;
    }

    #[test]
    fn arc_matches_model(cap in capacity(), threshold in prop_oneof![3 => Just(0u32), 1 => Just(1u32)], ops in ops(3)) {
        run_case(Setup { policy: Policy::Arc, cap, threshold, max_tracker: 64 }, &ops)?;
    }

    #[test]
    fn threshold_filter_matches_model(
        policy in prop_oneof![Just(Policy::Lru), Just(Policy::Arc)],
        cap in capacity(),
        max_tracker in prop_oneof![Just(1usize), Just(3), Just(64)],
        ops in ops(8),
    ) {
        run_case(Setup { policy, cap, threshold: 2, max_tracker }, &ops)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Deterministic ARC facts (`docs/design.md` §3.5) through the public API
// ---------------------------------------------------------------------------------------------

fn arc(cap: usize) -> Manager {
    Manager::new(ManagerConfig {
        key_len: KEY_LEN,
        num_slots: cap,
        policy: Policy::Arc,
        enable_events: true,
        ..ManagerConfig::default()
    })
    .unwrap()
}

fn store(m: &mut Manager, keys: &[u64]) -> (Vec<u32>, Vec<u64>) {
    let mut plan = StorePlan::default();
    m.prepare_store(&enc(keys), &mut plan).unwrap();
    (plan.slots.clone(), dec(&plan.evicted))
}

fn store_ok(m: &mut Manager, keys: &[u64]) -> (Vec<u32>, Vec<u64>) {
    let r = store(m, keys);
    m.complete_store(&enc(keys), true).unwrap();
    r
}

/// A failed store after an eviction keeps the evicted key's ghost (B1) entry: touching that key
/// afterwards raises the target, which changes which key the next eviction takes.
#[test]
fn arc_failed_store_keeps_ghost_effect() {
    let run = |touch_ghost: bool| {
        let mut m = arc(2);
        assert_eq!(store_ok(&mut m, &[1, 2]), (vec![0, 1], vec![]));
        // T1 = [1, 2], target 0: storing 3 evicts the T1 LRU (1) into B1 and takes its slot.
        assert_eq!(store(&mut m, &[3]), (vec![0], vec![1]));
        m.complete_store(&enc(&[3]), false).unwrap();
        assert_eq!(m.lookup(&enc(&[3])).unwrap(), Lookup::Miss);
        assert_eq!(m.lookup(&enc(&[1])).unwrap(), Lookup::Miss);
        if touch_ghost {
            // 1 is in B1: delta = max(1, 0/1) = 1 per touch; target 0 -> 1 -> 2 (= capacity).
            m.touch(&enc(&[1, 1])).unwrap();
        }
        // 4 takes the freed slot; touching 2 promotes it to T2: T1 = [4], T2 = [2].
        assert_eq!(store_ok(&mut m, &[4]), (vec![0], vec![]));
        m.touch(&enc(&[2])).unwrap();
        let (slots, evicted) = store(&mut m, &[5]);
        m.check_invariants().unwrap();
        (slots, evicted)
    };
    // target 0: len(T1) = 1 >= 0, so T1's LRU (4, slot 0) goes.
    assert_eq!(run(false), (vec![0], vec![4]));
    // target 2: len(T1) = 1 < 2, so T1 is not scanned and T2's LRU (2, slot 1) goes.
    assert_eq!(run(true), (vec![1], vec![2]));
}

/// The quirk: while len(T1) < int(target), T1 is not scanned at all, so the store fails when
/// every T2 block is pinned even though T1 holds evictable blocks; nothing changes.
#[test]
fn arc_eviction_skips_t1_below_target() {
    let mut m = arc(3);
    store_ok(&mut m, &[1, 2, 3]);
    assert_eq!(store_ok(&mut m, &[4]), (vec![0], vec![1])); // 1 -> B1
    m.touch(&enc(&[1, 1, 1])).unwrap(); // target 0 -> 3 (capped at capacity)
    m.touch(&enc(&[2])).unwrap(); // T1 = [3, 4], T2 = [2]
    assert_eq!(m.prepare_load(&enc(&[2]), &mut [0]).unwrap(), 1);
    let before = m.stats();
    assert_eq!(before.evictable, 2);
    let mut plan = StorePlan::default();
    let r = m.prepare_store(&enc(&[5]), &mut plan);
    assert!(matches!(r, Err(Error::NoRoom(_))), "{r:?}");
    assert_eq!(m.stats(), before);
    m.check_invariants().unwrap();
    // Once 2 is unpinned, T2 has a candidate and it is the one evicted (T1 still skipped).
    m.complete_load(&enc(&[2])).unwrap();
    assert_eq!(store(&mut m, &[5]), (vec![1], vec![2]));
    m.check_invariants().unwrap();
}

/// Exact float arithmetic of the target: with |B1| = 2 and |B2| = 3 a B1 hit adds
/// delta = 3/2 = 1.5 (integer division would add 1), and eviction compares with int(target)
/// (truncation, not rounding).
#[test]
fn arc_target_uses_float_delta() {
    // Both runs: T2 = [4, 3, 2, 1] after the touch (reverse order); with T1 empty the store of
    // 5, 6, 7 evicts T2's LRU side into B2 = [4, 3, 2]; then 8, 9 evict T1's LRU (target 0) into
    // B1 = [5, 6]. T1 = [7, 8, 9], T2 = [1].
    let setup = || {
        let mut m = arc(4);
        store_ok(&mut m, &[1, 2, 3, 4]);
        m.touch(&enc(&[1, 2, 3, 4])).unwrap();
        assert_eq!(store_ok(&mut m, &[5, 6, 7]).1, vec![4, 3, 2]);
        assert_eq!(store_ok(&mut m, &[8, 9]).1, vec![5, 6]);
        m
    };

    // Two B1 hits: target 1.5 then 3.0. T1 = [7, 8] (9 promoted): 2 < 3, T1 is skipped and T2's
    // LRU (1) goes. (With integer deltas the target would be 2 and 7 would go.)
    let mut m = setup();
    m.touch(&enc(&[5])).unwrap();
    m.touch(&enc(&[5])).unwrap();
    m.touch(&enc(&[9])).unwrap();
    assert_eq!(store(&mut m, &[10]).1, vec![1]);
    m.check_invariants().unwrap();

    // One B1 hit: target 1.5, int(1.5) = 1. T1 = [7] (8, 9 promoted): 1 >= 1, so T1's LRU (7)
    // goes. (Rounding the target to 2 would skip T1 and evict 1.)
    let mut m = setup();
    m.touch(&enc(&[5])).unwrap();
    m.touch(&enc(&[8, 9])).unwrap();
    assert_eq!(store(&mut m, &[10]).1, vec![7]);
    m.check_invariants().unwrap();
}

/// An input key that is stored but no longer passes the store threshold (the bounded tracker
/// forgot its count) is still protected: `prepare_store` never evicts a key named in the call
/// (vLLM 0.24 protects only the keys that pass the filter, and evicts it). The scenario: 2 slots,
/// K1 stored, K2 and K3 eligible, the tracker has forgotten K1; storing [K1, K2, K3] needs K1's
/// slot, so the answer is "no room", with nothing changed.
#[test]
fn threshold_filtered_input_key_is_protected() {
    for policy in [Policy::Lru, Policy::Arc] {
        let mut m = Manager::new(ManagerConfig {
            key_len: KEY_LEN,
            num_slots: 2,
            policy,
            store_threshold: 2,
            max_tracker_size: 2,
            enable_events: true,
            ..Default::default()
        })
        .unwrap();
        let look = |m: &mut Manager, k: u64| m.lookup(&enc(&[k])).unwrap();
        look(&mut m, 1);
        look(&mut m, 1);
        assert_eq!(store_ok(&mut m, &[1]), (vec![0], vec![]));
        for k in [2, 2, 3, 3] {
            look(&mut m, k); // the tracker (size 2) drops key 1's count
        }
        let before = m.stats();
        let mut plan = StorePlan::default();
        let r = m.prepare_store(&enc(&[1, 2, 3]), &mut plan);
        assert!(matches!(r, Err(Error::NoRoom(_))), "{policy:?}: {r:?}");
        assert_eq!(
            m.stats(),
            before,
            "{policy:?}: a refused call changes nothing"
        );
        assert_eq!(m.ref_count(&enc(&[1])), Some(0), "{policy:?}: K1 kept");
        // With a free slot for K2 alone the call stores it and still keeps K1.
        let c = m.prepare_store(&enc(&[1, 2]), &mut plan).unwrap();
        assert_eq!((c.stored, c.evicted), (1, 0), "{policy:?}");
        assert_eq!(plan.indices, vec![1], "{policy:?}");
        assert_eq!(m.ref_count(&enc(&[1])), Some(0), "{policy:?}: K1 kept");
        m.check_invariants().unwrap();
    }
}

/// The same scenario through the model harness (each call checked against the model, which
/// protects every key named in the call), in both policies.
#[test]
fn threshold_forgotten_stored_key_is_protected_model() {
    use Sel::Any;
    for policy in [Policy::Lru, Policy::Arc] {
        let ops = [
            Op::LookupStore(vec![Any(1)]),
            Op::LookupStore(vec![Any(1)]),
            Op::Lookup(Any(2)),
            Op::Lookup(Any(2)),
            Op::Lookup(Any(3)),
            Op::Lookup(Any(3)),
            Op::PrepareStore(vec![Any(1), Any(2), Any(3)]),
            Op::PrepareStore(vec![Any(1), Any(2)]),
        ];
        let setup = Setup {
            policy,
            cap: 2,
            threshold: 2,
            max_tracker: 2,
        };
        run_case(setup, &ops).unwrap();
    }
}

//! Model-based tests of [`Manager`] in vLLM 0.33 semantics: random interleavings of requests
//! (begin, loads, stores, completions, finish), calls without a request, touches and resets run
//! on the real manager and on a deliberately naive reference model written straight from vLLM
//! 0.33's `CPUOffloadingManager`, `LRUCachePolicy` (ranks `(major, minor)` compared with the key
//! bytes, victims by sorting) and `ARCCachePolicy` (T1, T2, B1, B2 as vectors, the monotonic
//! victim scan with the fallback to T1), with each request's access record (first observations,
//! inserted, reused, store misses) and its commit at finish.
//!
//! Each request has a prompt of distinct keys; key `i` of the prompt has position `16 (i + 1)`,
//! as the 0.33 scheduler gives them. After every call the test compares the answers (lookups of
//! every key, load slots, store indices, slots and evicted keys, or no room), the buffered
//! events (metadata-only removals reduced to the keys still absent) and `check_invariants()`.

use kvoffload::Error;
use kvoffload::manager::{Lookup, Manager, ManagerConfig, Policy, RequestId, Semantics, StorePlan};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::collections::{BTreeMap, HashSet};
use std::fmt;

const KEY_LEN: usize = 8;
/// Keys are drawn from `0..UNIVERSE`.
const UNIVERSE: u64 = 8;
/// Requests that may be active at once.
const REQUESTS: usize = 3;

fn enc(keys: &[u64]) -> Vec<u8> {
    keys.iter().flat_map(|k| k.to_be_bytes()).collect()
}

fn dec(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(KEY_LEN)
        .map(|c| u64::from_be_bytes(c.try_into().unwrap()))
        .collect()
}

fn position(i: usize) -> u64 {
    16 * (i as u64 + 1)
}

// ---------------------------------------------------------------------------------------------
// The reference model
// ---------------------------------------------------------------------------------------------

/// vLLM 0.33 `_RequestCacheAccess`, with the request's LRU rank (`_RequestRank`).
#[derive(Debug, Clone, Default)]
struct Record {
    /// First-observation order (every key of a request has a position, so the commit order is
    /// the order of positions).
    order: Vec<u64>,
    inserted: HashSet<u64>,
    reused: HashSet<u64>,
    store_miss: HashSet<u64>,
    lru_rank: Option<u64>,
}

/// A call's context: a request's record and key positions, or none (a fresh one per call).
struct Ctx<'a> {
    rec: &'a mut Record,
    positions: &'a BTreeMap<u64, u64>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Chunk {
    slot: u32,
    /// -1: store in flight; 0: ready and idle; > 0: pinned by loads.
    ref_cnt: i32,
}

#[derive(Debug, Clone)]
struct Model {
    cap: usize,
    policy: Policy,
    threshold: u32,
    max_tracker: usize,
    chunks: BTreeMap<u64, Chunk>,
    free: Vec<u32>,
    allocated: u32,
    /// Offer counts, oldest first.
    tracker: Vec<(u64, u32)>,
    // LRU
    rank: BTreeMap<u64, (u64, i128)>,
    counter: u64,
    // ARC (oldest first)
    t1: Vec<u64>,
    t2: Vec<u64>,
    b1: Vec<u64>,
    b2: Vec<u64>,
    target: f64,
    /// (removed, metadata_only, keys)
    events: Vec<(bool, bool, Vec<u64>)>,
}

fn remove_from(v: &mut Vec<u64>, k: u64) -> bool {
    match v.iter().position(|&x| x == k) {
        Some(i) => {
            v.remove(i);
            true
        }
        None => false,
    }
}

impl Model {
    fn new(s: &Setup) -> Self {
        Self {
            cap: s.cap,
            policy: s.policy,
            threshold: s.threshold,
            max_tracker: s.max_tracker,
            chunks: BTreeMap::new(),
            free: Vec::new(),
            allocated: 0,
            tracker: Vec::new(),
            rank: BTreeMap::new(),
            counter: 0,
            t1: Vec::new(),
            t2: Vec::new(),
            b1: Vec::new(),
            b2: Vec::new(),
            target: 0.0,
            events: Vec::new(),
        }
    }

    fn lookup(&self, k: u64) -> Lookup {
        match self.chunks.get(&k) {
            None => Lookup::Miss,
            Some(c) if c.ref_cnt < 0 => Lookup::HitPending,
            Some(_) => Lookup::Hit,
        }
    }

    fn fresh(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    fn request_rank(&mut self, rec: &mut Record) -> u64 {
        match rec.lru_rank {
            Some(r) => r,
            None => {
                let r = self.fresh();
                rec.lru_rank = Some(r);
                r
            }
        }
    }

    /// vLLM 0.33 `record(keys, ctx, reused)`.
    fn record(&mut self, keys: &[u64], ctx: &mut Ctx<'_>, reused: &[u64]) {
        let mut new = Vec::new();
        for &k in keys {
            if !ctx.rec.order.contains(&k) {
                ctx.rec.order.push(k);
                new.push(k);
            }
        }
        if !new.is_empty() && self.policy == Policy::Lru {
            // LRUCachePolicy.on_request_access
            let r = self.request_rank(ctx.rec);
            for k in new {
                if let (Some(&p), true) = (ctx.positions.get(&k), self.chunks.contains_key(&k)) {
                    let provisional = (r, -i128::from(p));
                    if provisional > self.rank[&k] {
                        self.rank.insert(k, provisional);
                    }
                }
            }
        }
        for &k in reused {
            if !ctx.rec.inserted.contains(&k) {
                ctx.rec.reused.insert(k);
            }
        }
    }

    fn prepare_load(&mut self, keys: &[u64], ctx: &mut Ctx<'_>) -> Vec<u32> {
        let slots = keys
            .iter()
            .map(|k| {
                let c = self.chunks.get_mut(k).expect("loaded keys are ready");
                assert!(c.ref_cnt >= 0);
                c.ref_cnt += 1;
                c.slot
            })
            .collect();
        self.record(keys, ctx, keys);
        slots
    }

    fn complete_load(&mut self, keys: &[u64]) {
        for k in keys {
            let c = self.chunks.get_mut(k).expect("pinned");
            assert!(c.ref_cnt > 0);
            c.ref_cnt -= 1;
        }
    }

    fn count_offer(&mut self, keys: &[u64]) {
        let mut hit = HashSet::new();
        for &k in keys {
            if let Some(i) = self.tracker.iter().position(|e| e.0 == k) {
                let (k, n) = self.tracker.remove(i);
                self.tracker.push((k, n + 1));
                hit.insert(k);
            }
        }
        let mut spare = self.tracker.len() - hit.len();
        for &k in keys {
            if self.tracker.iter().any(|e| e.0 == k) {
                continue;
            }
            if self.tracker.len() >= self.max_tracker {
                if spare == 0 {
                    continue;
                }
                self.tracker.remove(0);
                spare -= 1;
            }
            self.tracker.push((k, 1));
        }
    }

    fn ghost_hit(&mut self, k: u64) {
        let (n1, n2) = (self.b1.len() as f64, self.b2.len() as f64);
        if remove_from(&mut self.b1, k) {
            let delta = (n2 / n1).max(1.0);
            self.target = (self.target + delta).min(self.cap as f64);
            self.b1.push(k);
        } else if remove_from(&mut self.b2, k) {
            let delta = (n1 / n2).max(1.0);
            self.target = (self.target - delta).max(0.0);
            self.b2.push(k);
        }
    }

    fn touch(&mut self, keys: &[u64]) {
        for &k in keys.iter().rev() {
            match self.policy {
                Policy::Lru => {
                    if self.chunks.contains_key(&k) {
                        let r = (self.fresh(), 0);
                        self.rank.insert(k, r);
                    }
                }
                _ => {
                    if remove_from(&mut self.t1, k) {
                        if self.chunks[&k].ref_cnt < 0 {
                            self.t1.push(k);
                        } else {
                            self.t2.push(k);
                        }
                    } else if remove_from(&mut self.t2, k) {
                        self.t2.push(k);
                    } else {
                        self.ghost_hit(k);
                    }
                }
            }
        }
    }

    /// `policy.evict(n, protected)`: the victims in order, or `None` (nothing changes).
    fn evict(&mut self, n: usize, protected: &[u64]) -> Option<Vec<u64>> {
        let eligible = |m: &Self, k: u64| m.chunks[&k].ref_cnt == 0 && !protected.contains(&k);
        match self.policy {
            Policy::Lru => {
                let mut c: Vec<u64> = self
                    .chunks
                    .keys()
                    .copied()
                    .filter(|&k| eligible(self, k))
                    .collect();
                c.sort_by_key(|k| (self.rank[k], *k));
                if c.len() < n {
                    return None;
                }
                c.truncate(n);
                for k in &c {
                    self.rank.remove(k);
                }
                Some(c)
            }
            _ => {
                let (mut c1, mut c2, mut vt1) = (0, 0, self.t1.len() as i64);
                let mut picks: Vec<(u64, bool)> = Vec::new();
                let next = |m: &Self, list: &[u64], c: &mut usize| {
                    while *c < list.len() && !eligible(m, list[*c]) {
                        *c += 1;
                    }
                    (*c < list.len()).then(|| {
                        *c += 1;
                        list[*c - 1]
                    })
                };
                for _ in 0..n {
                    let mut pick = None;
                    if vt1 >= self.target as i64 {
                        pick = next(self, &self.t1, &mut c1).map(|k| (k, true));
                    }
                    if pick.is_none() {
                        pick = next(self, &self.t2, &mut c2).map(|k| (k, false));
                    }
                    if pick.is_none() {
                        pick = Some((next(self, &self.t1, &mut c1)?, true));
                    }
                    let p = pick.unwrap();
                    if p.1 {
                        vt1 -= 1;
                    }
                    picks.push(p);
                }
                for &(k, from_t1) in &picks {
                    if from_t1 {
                        remove_from(&mut self.t1, k);
                        self.b1.push(k);
                    } else {
                        remove_from(&mut self.t2, k);
                        self.b2.push(k);
                    }
                }
                while self.b1.len() > self.cap {
                    self.b1.remove(0);
                }
                while self.b2.len() > self.cap {
                    self.b2.remove(0);
                }
                Some(picks.into_iter().map(|p| p.0).collect())
            }
        }
    }

    /// vLLM 0.33 `prepare_store`: `None` is the no-room answer (with what it keeps).
    fn prepare_store(
        &mut self,
        keys: &[u64],
        ctx: &mut Ctx<'_>,
    ) -> Option<(Vec<u32>, Vec<u32>, Vec<u64>)> {
        let tracking = self.threshold >= 2;
        if tracking {
            self.count_offer(keys);
        }
        let mut candidates: Vec<u64> = keys
            .iter()
            .copied()
            .filter(|k| !self.chunks.contains_key(k))
            .collect();
        let ready: Vec<u64> = keys
            .iter()
            .copied()
            .filter(|k| self.chunks.get(k).is_some_and(|c| c.ref_cnt >= 0))
            .collect();
        if tracking {
            let count = |k: &u64| self.tracker.iter().find(|e| e.0 == *k).map_or(0, |e| e.1);
            candidates.retain(|k| count(k) >= self.threshold);
        }
        let misses: Vec<u64> = candidates
            .iter()
            .copied()
            .filter(|k| !ctx.rec.store_miss.contains(k))
            .collect();
        if !misses.is_empty() {
            if self.policy == Policy::Arc {
                for &k in misses.iter().rev() {
                    self.ghost_hit(k);
                }
            }
            ctx.rec.store_miss.extend(&misses);
        }
        let observed: Vec<u64> = keys
            .iter()
            .copied()
            .filter(|k| candidates.contains(k) || ready.contains(k))
            .collect();
        self.record(&observed, ctx, &ready);
        if candidates.is_empty() {
            return Some((vec![], vec![], vec![]));
        }
        let free = self.free.len() + self.cap - self.allocated as usize;
        let mut victims = Vec::new();
        if candidates.len() > free {
            let need = candidates.len() - free;
            let evictable = self.chunks.values().filter(|c| c.ref_cnt == 0).count();
            if need > evictable {
                return None;
            }
            victims = self.evict(need, keys)?;
            for k in &victims {
                let c = self.chunks.remove(k).unwrap();
                self.free.push(c.slot);
            }
            self.events.push((true, false, victims.clone()));
        }
        let mut slots = Vec::new();
        for &k in &candidates {
            let slot = if (self.allocated as usize) < self.cap {
                self.allocated += 1;
                self.allocated - 1
            } else {
                self.free.pop().unwrap()
            };
            self.chunks.insert(k, Chunk { slot, ref_cnt: -1 });
            match self.policy {
                Policy::Lru => {
                    let r = match ctx.positions.get(&k) {
                        Some(&p) => (self.request_rank(ctx.rec), -i128::from(p)),
                        None => (self.fresh(), 0),
                    };
                    self.rank.insert(k, r);
                }
                _ => {
                    self.t1.push(k);
                    remove_from(&mut self.b1, k);
                    remove_from(&mut self.b2, k);
                }
            }
            ctx.rec.inserted.insert(k);
            slots.push(slot);
        }
        let indices = candidates
            .iter()
            .map(|k| keys.iter().position(|x| x == k).unwrap() as u32)
            .collect();
        Some((indices, slots, victims))
    }

    fn complete_store(&mut self, keys: &[u64], success: bool) {
        let mut done = Vec::new();
        for &k in keys {
            if self.chunks.get(&k).is_some_and(|c| c.ref_cnt < 0) {
                if success {
                    self.chunks.get_mut(&k).unwrap().ref_cnt = 0;
                } else {
                    let c = self.chunks.remove(&k).unwrap();
                    self.free.push(c.slot);
                    self.rank.remove(&k);
                    let _ = remove_from(&mut self.t1, k) || remove_from(&mut self.t2, k);
                }
                done.push(k);
            }
        }
        if !done.is_empty() {
            self.events.push((!success, !success, done));
        }
    }

    /// vLLM 0.33 `on_request_finished`: the record's keys head to tail (by position).
    fn finish(&mut self, rec: &Record, positions: &BTreeMap<u64, u64>) {
        let mut order = rec.order.clone();
        order.sort_by_key(|k| positions[k]);
        for &k in order.iter().rev() {
            match self.policy {
                Policy::Lru => {
                    if self.chunks.contains_key(&k) {
                        let r = (self.fresh(), 0);
                        self.rank.insert(k, r);
                    }
                }
                _ => {
                    let inserted_only = rec.inserted.contains(&k) && !rec.reused.contains(&k);
                    if inserted_only {
                        if remove_from(&mut self.t1, k) {
                            self.t1.push(k);
                        } else if remove_from(&mut self.t2, k) {
                            self.t2.push(k);
                        }
                    } else if rec.reused.contains(&k)
                        && (remove_from(&mut self.t1, k) || remove_from(&mut self.t2, k))
                    {
                        self.t2.push(k);
                    }
                }
            }
        }
    }

    fn reset(&mut self) {
        self.chunks.clear();
        self.free.clear();
        self.allocated = 0;
        self.rank.clear();
        self.counter = 0;
        self.t1.clear();
        self.t2.clear();
        self.b1.clear();
        self.b2.clear();
        self.target = 0.0;
    }

    /// The buffered events as `take_events` would yield them now.
    fn visible_events(&self) -> Vec<(bool, bool, Vec<u64>)> {
        self.events
            .iter()
            .filter_map(|(removed, meta, keys)| {
                let keys: Vec<u64> = match meta {
                    true => keys
                        .iter()
                        .copied()
                        .filter(|k| !self.chunks.contains_key(k))
                        .collect(),
                    false => keys.clone(),
                };
                (!keys.is_empty()).then_some((*removed, *meta, keys))
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    /// Begins request `r` (if it is not active) with this prompt (deduplicated).
    Begin(usize, Vec<u64>),
    /// Loads the ready keys among prompt keys `a..b` of request `r`.
    Load(usize, usize, usize),
    /// Offers prompt keys `a..b` of request `r` to a store.
    Store(usize, usize, usize),
    /// A store without a request (no positions).
    StoreAlone(Vec<u64>),
    /// Completes the `i`-th outstanding load.
    CompleteLoad(usize),
    /// Completes the `i`-th outstanding store, with success or failure.
    CompleteStore(usize, bool),
    Finish(usize),
    Touch(Vec<u64>),
    Reset,
}

fn keys(max: usize) -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(0..UNIVERSE, 1..=max)
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let r = 0..REQUESTS;
    let range = || (0..6usize, 1..7usize);
    prop_oneof![
        3 => (r.clone(), keys(6)).prop_map(|(r, k)| Op::Begin(r, k)),
        3 => (r.clone(), range()).prop_map(|(r, (a, b))| Op::Load(r, a, b)),
        6 => (r.clone(), range()).prop_map(|(r, (a, b))| Op::Store(r, a, b)),
        2 => keys(3).prop_map(Op::StoreAlone),
        3 => (0..4usize).prop_map(Op::CompleteLoad),
        5 => (0..4usize, prop::bool::weighted(0.85)).prop_map(|(i, ok)| Op::CompleteStore(i, ok)),
        3 => r.prop_map(Op::Finish),
        1 => keys(3).prop_map(Op::Touch),
        1 => Just(Op::Reset),
    ]
}

#[derive(Debug, Clone, Copy)]
struct Setup {
    policy: Policy,
    cap: usize,
    threshold: u32,
    max_tracker: usize,
}

/// One active request on both sides.
#[derive(Debug)]
struct Active {
    id: RequestId,
    prompt: Vec<u64>,
    positions: BTreeMap<u64, u64>,
    rec: Record,
}

struct Harness {
    setup: Setup,
    m: Manager,
    model: Model,
    requests: Vec<Option<Active>>,
    /// Loads and stores in flight (their keys), oldest first.
    loads: Vec<Vec<u64>>,
    stores: Vec<Vec<u64>>,
    plan: StorePlan,
    trace: Vec<String>,
}

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

impl Harness {
    fn new(setup: Setup) -> Self {
        let m = Manager::new(ManagerConfig {
            key_len: KEY_LEN,
            num_slots: setup.cap,
            policy: setup.policy,
            store_threshold: setup.threshold,
            max_tracker_size: setup.max_tracker,
            enable_events: true,
            semantics: Semantics::Vllm033,
        })
        .unwrap();
        Self {
            setup,
            m,
            model: Model::new(&setup),
            requests: (0..REQUESTS).map(|_| None).collect(),
            loads: Vec::new(),
            stores: Vec::new(),
            plan: StorePlan::default(),
            trace: Vec::new(),
        }
    }

    fn tr(&self) -> Trace<'_> {
        Trace(&self.setup, &self.trace)
    }

    /// The prompt keys `a..b` of active request `r` with their positions.
    fn slice(&self, r: usize, a: usize, b: usize) -> Option<(Vec<u64>, Vec<u64>)> {
        let q = self.requests[r].as_ref()?;
        let b = b.min(q.prompt.len());
        let ks: Vec<u64> = q.prompt.get(a..b)?.to_vec();
        let ps = ks.iter().map(|k| q.positions[k]).collect();
        (!ks.is_empty()).then_some((ks, ps))
    }

    fn store(&mut self, keys: &[u64], positions: &[u64], r: Option<usize>) -> TestResult {
        let mut alone = (Record::default(), BTreeMap::new());
        let real = match r {
            Some(r) => {
                let id = self.requests[r].as_ref().unwrap().id;
                self.m
                    .prepare_store_for(id, &enc(keys), positions, &mut self.plan)
            }
            None => self.m.prepare_store(&enc(keys), &mut self.plan),
        };
        let mut ctx = match r {
            Some(r) => {
                let q = self.requests[r].as_mut().unwrap();
                Ctx {
                    rec: &mut q.rec,
                    positions: &q.positions,
                }
            }
            None => Ctx {
                rec: &mut alone.0,
                positions: &alone.1,
            },
        };
        let expect = self.model.prepare_store(keys, &mut ctx);
        let evicted = dec(&self.plan.evicted);
        let got = match &real {
            Ok(_) => Some((self.plan.indices.clone(), self.plan.slots.clone(), evicted)),
            Err(Error::NoRoom(_)) => None,
            Err(e) => {
                return Err(TestCaseError::fail(format!(
                    "prepare_store: {e}{}",
                    self.tr()
                )));
            }
        };
        *self.trace.last_mut().unwrap() += &format!(" -> {got:?}");
        prop_assert_eq!(&got, &expect, "prepare_store{}", self.tr());
        if let Some((indices, _, _)) = got
            && !indices.is_empty()
        {
            self.stores
                .push(indices.iter().map(|&i| keys[i as usize]).collect());
        }
        Ok(())
    }

    fn finish(&mut self, r: usize) -> TestResult {
        if let Some(q) = self.requests[r].take() {
            self.m.finish_request(q.id).unwrap();
            self.model.finish(&q.rec, &q.positions);
        }
        Ok(())
    }

    fn step(&mut self, op: &Op) -> TestResult {
        self.trace.push(format!("{op:?}"));
        match op {
            Op::Begin(r, prompt) => {
                if self.requests[*r].is_none() {
                    let mut p = Vec::new();
                    for &k in prompt {
                        if !p.contains(&k) {
                            p.push(k);
                        }
                    }
                    let positions = p
                        .iter()
                        .enumerate()
                        .map(|(i, &k)| (k, position(i)))
                        .collect();
                    self.requests[*r] = Some(Active {
                        id: self.m.begin_request(),
                        prompt: p,
                        positions,
                        rec: Record::default(),
                    });
                }
            }
            Op::Load(r, a, b) => {
                let Some((ks, ps)) = self.slice(*r, *a, *b) else {
                    return Ok(());
                };
                let ready = |k: &u64| self.model.chunks.get(k).is_some_and(|c| c.ref_cnt >= 0);
                let (ks, ps): (Vec<u64>, Vec<u64>) =
                    ks.into_iter().zip(ps).filter(|(k, _)| ready(k)).unzip();
                if ks.is_empty() {
                    return Ok(());
                }
                let q = self.requests[*r].as_mut().unwrap();
                let mut out = vec![u32::MAX; ks.len()];
                self.m
                    .prepare_load_for(q.id, &enc(&ks), &ps, &mut out)
                    .unwrap();
                let mut ctx = Ctx {
                    rec: &mut q.rec,
                    positions: &q.positions,
                };
                let expect = self.model.prepare_load(&ks, &mut ctx);
                *self.trace.last_mut().unwrap() += &format!(" {ks:?} -> {out:?}");
                prop_assert_eq!(out, expect, "prepare_load slots{}", self.tr());
                self.loads.push(ks);
            }
            Op::Store(r, a, b) => {
                if let Some((ks, ps)) = self.slice(*r, *a, *b) {
                    *self.trace.last_mut().unwrap() += &format!(" {ks:?}");
                    self.store(&ks, &ps, Some(*r))?;
                }
            }
            Op::StoreAlone(ks) => {
                let mut d = Vec::new();
                for &k in ks {
                    if !d.contains(&k) {
                        d.push(k);
                    }
                }
                self.store(&d, &[], None)?;
            }
            Op::CompleteLoad(i) => {
                if !self.loads.is_empty() {
                    let ks = self.loads.remove(i % self.loads.len());
                    self.m.complete_load(&enc(&ks)).unwrap();
                    self.model.complete_load(&ks);
                }
            }
            Op::CompleteStore(i, ok) => {
                if !self.stores.is_empty() {
                    let ks = self.stores.remove(i % self.stores.len());
                    self.m.complete_store(&enc(&ks), *ok).unwrap();
                    self.model.complete_store(&ks, *ok);
                }
            }
            Op::Finish(r) => self.finish(*r)?,
            Op::Touch(ks) => {
                let mut d = Vec::new();
                for &k in ks {
                    if !d.contains(&k) {
                        d.push(k);
                    }
                }
                self.m.touch(&enc(&d)).unwrap();
                self.model.touch(&d);
            }
            Op::Reset => {
                self.m.reset();
                self.model.reset();
                // The host discards the completions of jobs from before the reset; records
                // start again empty at their next use.
                self.loads.clear();
                self.stores.clear();
                for q in self.requests.iter_mut().flatten() {
                    q.rec = Record::default();
                }
            }
        }
        self.check_all()
    }

    fn check_all(&mut self) -> TestResult {
        for k in 0..UNIVERSE {
            let real = self.m.lookup(&enc(&[k])).unwrap();
            prop_assert_eq!(real, self.model.lookup(k), "lookup of {}{}", k, self.tr());
        }
        let real: Vec<(bool, bool, Vec<u64>)> = self
            .m
            .events()
            .iter()
            .map(|e| (e.removed, e.metadata_only, dec(e.keys)))
            .collect();
        prop_assert_eq!(real, self.model.visible_events(), "events{}", self.tr());
        let inv = self.m.check_invariants();
        prop_assert!(inv.is_ok(), "check_invariants: {:?}{}", inv, self.tr());
        Ok(())
    }
}

type TestResult = Result<(), TestCaseError>;

fn run_case(setup: Setup, ops: &[Op]) -> TestResult {
    let mut h = Harness::new(setup);
    for op in ops {
        h.step(op)?;
    }
    // Every request finishes; then stores of every key tell the final eviction order.
    for r in 0..REQUESTS {
        h.trace.push(format!("Finish({r}) (end)"));
        h.finish(r)?;
        h.check_all()?;
    }
    for k in 0..UNIVERSE {
        h.trace.push(format!("StoreAlone([{k}]) (end)"));
        h.store(&[k], &[], None)?;
        h.check_all()?;
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
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn capacity() -> impl Strategy<Value = usize> {
    prop_oneof![1 => 1usize..=2, 6 => 3usize..=6]
}

fn threshold() -> impl Strategy<Value = u32> {
    prop_oneof![3 => Just(0u32), 1 => Just(2u32)]
}

proptest! {
    #![proptest_config(config(2048))]

    #[test]
    fn lru_033_matches_model(
        cap in capacity(),
        threshold in threshold(),
        max_tracker in prop_oneof![Just(2usize), Just(64)],
        ops in prop::collection::vec(op_strategy(), 1..=80),
    ) {
        run_case(Setup { policy: Policy::Lru, cap, threshold, max_tracker }, &ops)?;
    }

    #[test]
    fn arc_033_matches_model(
        cap in capacity(),
        threshold in threshold(),
        max_tracker in prop_oneof![Just(2usize), Just(64)],
        ops in prop::collection::vec(op_strategy(), 1..=80),
    ) {
        run_case(Setup { policy: Policy::Arc, cap, threshold, max_tracker }, &ops)?;
    }
}

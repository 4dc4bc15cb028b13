//! Unit tests of vLLM 0.33 semantics: the worked examples of vLLM 0.33's
//! `CPUOffloadingManager`, `LRUCachePolicy` and `ARCCachePolicy`, and each difference from 0.24
//! as one sequence of calls with both releases' answers.
//!
//! Keys are vLLM's `OffloadKey` layout: a 4-byte hash then the 4-byte group index, both
//! big-endian (`K(7)` is group 0, `g(7, 1)` group 1). Contexts are named: each name is one
//! request (begun at its first use, like vLLM's get-or-create), and `""` is a call without a
//! request (vLLM: a fresh context per call).

use super::*;
use std::collections::HashMap;

const V024: Semantics = Semantics::Vllm024;
const V033: Semantics = Semantics::Vllm033;

fn g(id: u32, group: u32) -> u64 {
    u64::from(id) << 32 | u64::from(group)
}

fn key(k: u64) -> [u8; 8] {
    k.to_be_bytes()
}

fn flat(ks: &[u64]) -> Vec<u8> {
    ks.iter().flat_map(|&k| key(k)).collect()
}

fn unflat(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| u64::from_be_bytes(c.try_into().unwrap()))
        .collect()
}

/// Group-0 keys of `ids`.
fn ks(ids: &[u32]) -> Vec<u64> {
    ids.iter().map(|&i| g(i, 0)).collect()
}

/// The answer of a store: keys stored, their slots, keys evicted.
type Stored = (Vec<u64>, Vec<u32>, Vec<u64>);

struct T {
    m: Manager,
    reqs: HashMap<&'static str, RequestId>,
    positions: HashMap<&'static str, HashMap<u64, u64>>,
}

impl T {
    fn new(semantics: Semantics, policy: Policy, num_slots: usize) -> Self {
        Self::with(ManagerConfig {
            key_len: 8,
            num_slots,
            policy,
            enable_events: true,
            semantics,
            ..Default::default()
        })
    }

    fn with(cfg: ManagerConfig) -> Self {
        Self {
            m: Manager::new(cfg).unwrap(),
            reqs: HashMap::new(),
            positions: HashMap::new(),
        }
    }

    /// Request `c` (begun now if it is not active).
    fn req(&mut self, c: &'static str) -> RequestId {
        *self.reqs.entry(c).or_insert_with(|| self.m.begin_request())
    }

    /// Gives request `c` positions for keys (vLLM `set_offload_key_position`).
    fn pos(&mut self, c: &'static str, kp: &[(u64, u64)]) {
        self.req(c);
        self.positions
            .entry(c)
            .or_default()
            .extend(kp.iter().copied());
    }

    /// The positions of `keys` in `c`: all of them, or none.
    fn positions_of(&self, c: &str, keys: &[u64]) -> Vec<u64> {
        let map = self.positions.get(c);
        let p: Vec<u64> = keys
            .iter()
            .filter_map(|k| map.and_then(|m| m.get(k)).copied())
            .collect();
        assert!(
            p.is_empty() || p.len() == keys.len(),
            "some keys lack a position"
        );
        p
    }

    fn ps(&mut self, c: &'static str, keys: &[u64]) -> Option<Stored> {
        let mut plan = StorePlan::default();
        let r = if c.is_empty() {
            self.m.prepare_store(&flat(keys), &mut plan)
        } else {
            let (r, p) = (self.req(c), self.positions_of(c, keys));
            self.m.prepare_store_for(r, &flat(keys), &p, &mut plan)
        };
        self.m.check_invariants().unwrap();
        match r {
            Ok(_) => {
                let stored = plan.indices.iter().map(|&i| keys[i as usize]).collect();
                Some((stored, plan.slots, unflat(&plan.evicted)))
            }
            Err(Error::NoRoom(_)) => None,
            Err(e) => panic!("prepare_store: {e}"),
        }
    }

    fn pl(&mut self, c: &'static str, keys: &[u64]) -> Vec<u32> {
        let mut out = vec![0; keys.len()];
        if c.is_empty() {
            self.m.prepare_load(&flat(keys), &mut out).unwrap();
        } else {
            let (r, p) = (self.req(c), self.positions_of(c, keys));
            self.m
                .prepare_load_for(r, &flat(keys), &p, &mut out)
                .unwrap();
        }
        self.m.check_invariants().unwrap();
        out
    }

    fn cs(&mut self, keys: &[u64], success: bool) {
        self.m.complete_store(&flat(keys), success).unwrap();
        self.m.check_invariants().unwrap();
    }

    fn cl(&mut self, keys: &[u64]) {
        self.m.complete_load(&flat(keys)).unwrap();
        self.m.check_invariants().unwrap();
    }

    fn lk(&mut self, k: u64) -> Lookup {
        self.m.lookup(&key(k)).unwrap()
    }

    fn touch(&mut self, keys: &[u64]) {
        self.m.touch(&flat(keys)).unwrap();
        self.m.check_invariants().unwrap();
    }

    /// vLLM `on_request_finished`.
    fn finish(&mut self, c: &'static str) {
        let r = self.req(c);
        self.m.finish_request(r).unwrap();
        self.reqs.remove(c);
        self.positions.remove(c);
        self.m.check_invariants().unwrap();
    }

    fn key_of_slot(&self, s: u32) -> u64 {
        u64::from_be_bytes(self.m.slot_key(s).try_into().unwrap())
    }

    /// The evictable keys in the order eviction takes them (LRU of either release).
    fn eviction_order(&self) -> Vec<u64> {
        let order = match (self.m.policy.lru(), self.m.policy.ranked_lru()) {
            (Some(l), _) => l.order(),
            (_, Some(l)) => l.order(),
            _ => panic!("not LRU"),
        };
        order
            .into_iter()
            .filter(|&s| self.m.slots[s as usize].ref_cnt == 0)
            .map(|s| self.key_of_slot(s))
            .collect()
    }

    /// 0.33 LRU rank `(major, minor)` of a stored key.
    fn rank(&self, k: u64) -> (u64, i128) {
        let s = self.m.slot(self.m.find(&key(k))).expect("stored");
        self.m.policy.ranked_lru().expect("0.33 LRU").rank(s)
    }

    /// ARC's T1, T2 (keys, LRU first), B1, B2 and target.
    fn arc(&self) -> (Vec<u64>, Vec<u64>, Vec<u64>, Vec<u64>, f64) {
        let s = self.m.policy.arc().expect("ARC").snapshot(&self.m.keys);
        let slots = |v: &[u32]| v.iter().map(|&s| self.key_of_slot(s)).collect();
        let ghosts = |v: &[Vec<u8>]| v.iter().map(|k| unflat(k)[0]).collect();
        (
            slots(&s.t1),
            slots(&s.t2),
            ghosts(&s.b1),
            ghosts(&s.b2),
            s.target,
        )
    }

    /// Drained events: (removed, metadata_only, keys).
    fn events(&mut self) -> Vec<(bool, bool, Vec<u64>)> {
        self.m
            .take_events()
            .iter()
            .map(|e| (e.removed, e.metadata_only, unflat(e.keys)))
            .collect()
    }
}

fn sto(ids: &[u32]) -> (bool, bool, Vec<u64>) {
    (false, false, ks(ids))
}

fn rem(ids: &[u32]) -> (bool, bool, Vec<u64>) {
    (true, false, ks(ids))
}

fn stored(keys: &[u32], slots: &[u32], evicted: &[u32]) -> Option<Stored> {
    Some((ks(keys), slots.to_vec(), ks(evicted)))
}

// ---- Manager worked examples (vLLM 0.33 `CPUOffloadingManager`) ----

/// The 0.24 unit-test sequence (`test_cpu_manager`) in both releases (differences row L-6).
#[test]
fn the_vllm_024_unit_test_sequence_in_both_releases() {
    for sem in [V024, V033] {
        let v033 = sem == V033;
        let mut t = T::new(sem, Policy::Lru, 4);
        let a = "a";
        assert_eq!(t.ps(a, &ks(&[1, 2])), stored(&[1, 2], &[0, 1], &[]));
        let pending = if v033 {
            Lookup::HitPending
        } else {
            Lookup::Retry
        };
        assert_eq!((t.lk(g(1, 0)), t.lk(g(2, 0))), (pending, pending));
        t.cs(&ks(&[1, 2]), true);
        assert_eq!(t.events(), vec![sto(&[1, 2])]);
        assert_eq!(
            t.ps(a, &ks(&[2, 3, 4, 5])),
            stored(&[3, 4, 5], &[2, 3, 0], &[1])
        );
        assert_eq!(t.ps(a, &ks(&[1, 6])), None);
        t.cs(&ks(&[2, 3, 4, 5]), true);
        assert_eq!(t.pl(a, &ks(&[2, 3])), vec![1, 2]);
        assert_eq!(t.ps(a, &ks(&[6, 7, 8])), None);
        t.cl(&ks(&[2, 3]));
        if v033 {
            assert_eq!(t.eviction_order(), ks(&[2, 3, 4, 5]));
            assert_eq!(
                t.ps(a, &ks(&[6, 7, 8])),
                stored(&[6, 7, 8], &[3, 2, 1], &[2, 3, 4])
            );
        } else {
            assert_eq!(t.eviction_order(), ks(&[4, 5, 2, 3]));
            assert_eq!(
                t.ps(a, &ks(&[6, 7, 8])),
                stored(&[6, 7, 8], &[1, 0, 3], &[4, 5, 2])
            );
        }
        t.cs(&ks(&[6, 7, 8]), true);
        t.touch(&ks(&[3, 6, 7]));
        if v033 {
            assert_eq!(t.eviction_order(), ks(&[5, 8, 7, 6]));
            assert_eq!(t.ps(a, &ks(&[9])), stored(&[9], &[0], &[5]));
        } else {
            assert_eq!(t.eviction_order(), ks(&[8, 7, 6, 3]));
            assert_eq!(t.ps(a, &ks(&[9])), stored(&[9], &[3], &[8]));
        }
        t.cs(&ks(&[7, 9]), false);
        assert_eq!((t.lk(g(7, 0)), t.lk(g(9, 0))), (Lookup::Hit, Lookup::Miss));
        let mut want = vec![rem(&[1]), sto(&[3, 4, 5])];
        if v033 {
            want.extend([rem(&[2, 3, 4]), sto(&[6, 7, 8]), rem(&[5])]);
            want.push((true, true, ks(&[9])));
        } else {
            want.extend([rem(&[4, 5, 2]), sto(&[6, 7, 8]), rem(&[8])]);
        }
        assert_eq!(t.events(), want, "{sem:?}");
    }
}

/// The store threshold counts offers, every key offered, and never drops a key of the current
/// offer from the tracker.
#[test]
fn the_threshold_counts_offers_and_keeps_the_offer_tracked() {
    let mut t = T::with(ManagerConfig {
        key_len: 8,
        num_slots: 8,
        store_threshold: 2,
        max_tracker_size: 3,
        semantics: V033,
        ..Default::default()
    });
    let skipped = |t: &T| t.m.stats().stores_skipped;
    assert_eq!(t.ps("a", &ks(&[1, 2, 3])), stored(&[], &[], &[]));
    assert_eq!(skipped(&t), 3);
    assert_eq!(t.ps("a", &ks(&[4, 1])), stored(&[1], &[0], &[]));
    assert_eq!(skipped(&t), 4);
    assert_eq!(t.ps("a", &ks(&[5, 6, 7, 8])), stored(&[], &[], &[]));
    assert_eq!(skipped(&t), 8);
    // 1 is pending: not a candidate; 4 and 9 start again at 1.
    assert_eq!(t.ps("a", &ks(&[1, 4, 9])), stored(&[], &[], &[]));
    assert_eq!(skipped(&t), 10);
}

/// vLLM 0.33 `get_stats`: the allocation-size histogram counts every `prepare_store` that
/// reached allocation, the no-room answers included; usage, write and read gauges.
#[test]
fn allocation_sizes_and_usage_gauges() {
    let mut t = T::with(ManagerConfig {
        key_len: 8,
        num_slots: 3,
        store_threshold: 2,
        semantics: V033,
        ..Default::default()
    });
    let gauges = |t: &T| {
        let n = crate::metrics::Naming::new("p", &[]).unwrap();
        let mut out = String::new();
        crate::metrics::manager_text(&n, &t.m.stats(), &mut out).unwrap();
        let value = |name: &str| {
            let line = out.lines().find(|l| l.starts_with(&format!("p_{name} ")));
            line.unwrap_or_else(|| panic!("{name} in {out}"))[name.len() + 3..].to_string()
        };
        [
            "cpu_cache_usage_perc",
            "cpu_cache_write_usage_perc",
            "cpu_cache_read_usage_perc",
        ]
        .map(value)
    };
    let buckets = |t: &T| t.m.stats().allocation_size_buckets;
    assert_eq!(t.ps("a", &ks(&[1, 2])), stored(&[], &[], &[]));
    assert_eq!(buckets(&t), [0; 11]);
    assert_eq!(t.ps("a", &ks(&[1, 2, 3])), stored(&[1, 2], &[0, 1], &[]));
    let mut want = [0; 11];
    want[1] = 1; // 2 keys: the bucket of at most 4
    assert_eq!((buckets(&t), t.m.stats().allocation_keys), (want, 2));
    let two_thirds = "0.6666666666666666".to_string();
    assert_eq!(
        gauges(&t),
        [two_thirds.clone(), two_thirds.clone(), "0".into()]
    );
    t.cs(&ks(&[1]), true);
    t.pl("a", &ks(&[1]));
    assert_eq!(t.ps("a", &ks(&[4, 5])), stored(&[], &[], &[]));
    assert_eq!(t.ps("a", &ks(&[4, 5])), None);
    want[1] = 2; // the no-room answer counts
    assert_eq!((buckets(&t), t.m.stats().allocation_keys), (want, 4));
    let third = "0.3333333333333333".to_string();
    assert_eq!(gauges(&t), [two_thirds, third.clone(), third]);
    // Capacity 0: every allocation answers no room, and counts; the gauges are 0.
    let mut z = T::new(V033, Policy::Lru, 0);
    assert_eq!(z.ps("a", &ks(&[1])), None);
    let mut want = [0; 11];
    want[0] = 1;
    assert_eq!(buckets(&z), want);
    assert_eq!(gauges(&z), ["0", "0", "0"].map(String::from));
    // 0.24 semantics counts only the allocations that succeeded.
    let mut z = T::new(V024, Policy::Lru, 0);
    assert_eq!(z.ps("", &ks(&[1])), None);
    assert_eq!(buckets(&z), [0; 11]);
}

/// A failed store emits a metadata-only removal; draining drops the keys stored again since.
#[test]
fn a_failed_store_is_a_metadata_only_removal_of_the_keys_still_absent() {
    let mut t = T::new(V033, Policy::Lru, 4);
    assert_eq!(
        t.ps("a", &ks(&[1, 2, 3])),
        stored(&[1, 2, 3], &[0, 1, 2], &[])
    );
    t.cs(&ks(&[1]), true);
    t.cs(&ks(&[1, 2]), false);
    // A fresh slot is preferred over the freed slot 1.
    assert_eq!(t.ps("b", &ks(&[2])), stored(&[2], &[3], &[]));
    t.cs(&ks(&[3]), false);
    assert_eq!(t.events(), vec![sto(&[1]), (true, true, ks(&[3]))]);
    assert_eq!(
        (t.lk(g(2, 0)), t.lk(g(3, 0))),
        (Lookup::HitPending, Lookup::Miss)
    );
}

/// A reset makes older request records stale: a stale record starts again empty at its next
/// use, and finishing a request whose record is stale commits nothing.
#[test]
fn a_reset_starts_request_records_again() {
    let mut t = T::new(V033, Policy::Lru, 4);
    t.pos("A", &[(g(1, 0), 16), (g(2, 0), 32)]);
    assert_eq!(t.ps("A", &ks(&[1, 2])), stored(&[1, 2], &[0, 1], &[]));
    t.cs(&ks(&[1, 2]), true);
    t.m.reset();
    assert_eq!(t.lk(g(1, 0)), Lookup::Miss);
    assert_eq!(t.events(), vec![sto(&[1, 2])]);
    assert_eq!(t.ps("A", &ks(&[2])), stored(&[2], &[0], &[]));
    // Numbers start again: A takes rank 1 for its new record.
    assert_eq!(t.rank(g(2, 0)), (1, -32));
    t.finish("A");
    assert_eq!(t.rank(g(2, 0)), (2, 0));
    // B is begun, then a reset, then B's finish: nothing is committed.
    t.pos("B", &[(g(2, 0), 16)]);
    t.pl("B", &ks(&[]));
    t.m.reset();
    assert_eq!(t.ps("", &ks(&[5])), stored(&[5], &[0], &[]));
    let before = t.rank(g(5, 0));
    t.finish("B");
    assert_eq!(t.rank(g(5, 0)), before);
    assert_eq!(t.m.num_active_requests(), 0);
}

/// A finished request's handle ends: using it again is refused and changes nothing.
#[test]
fn a_finished_request_is_refused() {
    let mut t = T::new(V033, Policy::Lru, 4);
    let r = t.req("a");
    t.finish("a");
    let mut plan = StorePlan::default();
    let e = t.m.prepare_store_for(r, &flat(&ks(&[1])), &[], &mut plan);
    assert!(matches!(e, Err(Error::InvalidArgument(ref m)) if m.starts_with("request")));
    assert!(t.m.finish_request(r).is_err());
    assert_eq!(t.m.stats().used, 0);
    // Positions must match the keys, and u64::MAX is reserved.
    let r = t.req("b");
    let e =
        t.m.prepare_store_for(r, &flat(&ks(&[1, 2])), &[16], &mut plan);
    assert!(matches!(e, Err(Error::InvalidArgument(ref m)) if m.starts_with("positions")));
    let e =
        t.m.prepare_store_for(r, &flat(&ks(&[1])), &[u64::MAX], &mut plan);
    assert!(matches!(e, Err(Error::InvalidArgument(ref m)) if m.starts_with("positions[0]")));
    assert_eq!(t.m.stats().used, 0);
}

// ---- LRU worked examples (vLLM 0.33 `LRUCachePolicy`) ----

#[test]
fn lru_three_requests_with_positions_and_commits() {
    let mut t = T::new(V033, Policy::Lru, 5);
    t.pos("A", &[(g(1, 0), 16), (g(2, 0), 32), (g(3, 0), 48)]);
    t.pos("B", &[(g(4, 0), 16), (g(5, 0), 32)]);
    t.pos("C", &[(g(1, 0), 16), (g(2, 0), 32), (g(6, 0), 48)]);
    assert_eq!(t.lk(g(1, 0)), Lookup::Miss);
    assert_eq!(t.ps("A", &ks(&[1, 2])), stored(&[1, 2], &[0, 1], &[]));
    t.cs(&ks(&[1, 2]), true);
    assert_eq!((t.rank(g(1, 0)), t.rank(g(2, 0))), ((1, -16), (1, -32)));
    assert_eq!(t.ps("A", &ks(&[3])), stored(&[3], &[2], &[]));
    t.cs(&ks(&[3]), true);
    assert_eq!(t.rank(g(3, 0)), (1, -48));
    assert_eq!(t.eviction_order(), ks(&[3, 2, 1]));
    assert_eq!(t.ps("B", &ks(&[4, 5])), stored(&[4, 5], &[3, 4], &[]));
    t.cs(&ks(&[4, 5]), true);
    assert_eq!((t.rank(g(4, 0)), t.rank(g(5, 0))), ((2, -16), (2, -32)));
    assert_eq!(t.eviction_order(), ks(&[3, 2, 1, 5, 4]));
    t.finish("A");
    let r: Vec<_> = [3, 2, 1].iter().map(|&i| t.rank(g(i, 0))).collect();
    assert_eq!(r, vec![(3, 0), (4, 0), (5, 0)]);
    assert_eq!(t.eviction_order(), ks(&[5, 4, 3, 2, 1]));
    let l = [1, 2, 6].map(|i| t.lk(g(i, 0)));
    assert_eq!(l, [Lookup::Hit, Lookup::Hit, Lookup::Miss]);
    assert_eq!(t.pl("C", &ks(&[1, 2])), vec![0, 1]);
    assert_eq!((t.rank(g(1, 0)), t.rank(g(2, 0))), ((6, -16), (6, -32)));
    assert_eq!(t.eviction_order(), ks(&[5, 4, 3]));
    assert_eq!(t.ps("C", &ks(&[6])), stored(&[6], &[4], &[5]));
    assert_eq!(t.rank(g(6, 0)), (6, -48));
    t.cl(&ks(&[1, 2]));
    assert_eq!(t.eviction_order(), ks(&[4, 3, 2, 1]));
    t.cs(&ks(&[6]), true);
    assert_eq!(t.eviction_order(), ks(&[4, 3, 6, 2, 1]));
    t.finish("C");
    let r: Vec<_> = [6, 2, 1].iter().map(|&i| t.rank(g(i, 0))).collect();
    assert_eq!(r, vec![(7, 0), (8, 0), (9, 0)]);
    assert_eq!(t.eviction_order(), ks(&[4, 3, 6, 2, 1]));
    t.finish("B");
    assert_eq!(t.rank(g(4, 0)), (10, 0));
    assert_eq!(t.eviction_order(), ks(&[3, 6, 2, 1, 4]));
    let want = vec![sto(&[1, 2]), sto(&[3]), sto(&[4, 5]), rem(&[5]), sto(&[6])];
    assert_eq!(t.events(), want);
}

/// The commit ranks a request's key where it is stored at finish, not where the request saw
/// it: here key 1 is evicted from slot 0, key 3 takes that slot, and key 1 comes back in slot 1
/// (each call without a request takes a request number, as a vLLM 0.33 context does).
#[test]
fn lru_commit_follows_a_key_stored_again_elsewhere() {
    let mut t = T::new(V033, Policy::Lru, 2);
    t.pos("A", &[(g(1, 0), 16)]);
    assert_eq!(t.ps("A", &ks(&[1])), stored(&[1], &[0], &[]));
    t.cs(&ks(&[1]), true);
    assert_eq!(t.ps("", &ks(&[2])), stored(&[2], &[1], &[]));
    t.cs(&ks(&[2]), true);
    assert_eq!(t.ps("", &ks(&[3])), stored(&[3], &[0], &[1]));
    t.cs(&ks(&[3]), true);
    assert_eq!(t.ps("", &ks(&[1])), stored(&[1], &[1], &[2]));
    t.cs(&ks(&[1]), true);
    assert_eq!(t.eviction_order(), ks(&[3, 1]));
    t.finish("A");
    assert_eq!(t.eviction_order(), ks(&[3, 1]));
    assert_eq!(t.rank(g(3, 0)), (5, 0));
    assert_eq!(t.rank(g(1, 0)), (8, 0));
}

#[test]
fn lru_request_rank_is_lazy_and_never_makes_a_key_older() {
    let mut t = T::new(V033, Policy::Lru, 4);
    t.pos("D", &[(g(1, 0), 16), (g(2, 0), 32)]);
    t.pos("E", &[(g(1, 0), 16)]);
    assert_eq!(t.ps("E", &ks(&[1])), stored(&[1], &[0], &[]));
    t.cs(&ks(&[1]), true);
    assert_eq!(t.rank(g(1, 0)), (1, -16));
    // D takes its rank (2) now; 9 has no position in D: a fresh rank.
    assert_eq!(t.ps("D", &ks(&[9])), stored(&[9], &[1], &[]));
    assert_eq!(t.rank(g(9, 0)), (3, 0));
    t.finish("E");
    assert_eq!(t.rank(g(1, 0)), (4, 0));
    t.pl("D", &ks(&[1]));
    assert_eq!(t.rank(g(1, 0)), (4, 0));
    t.cl(&ks(&[1]));
    t.pos("F", &[(g(2, 0), 16)]);
    assert_eq!(t.ps("F", &ks(&[2])), stored(&[2], &[2], &[]));
    assert_eq!(t.rank(g(2, 0)), (5, -16));
    assert_eq!(t.eviction_order(), ks(&[1]));
}

/// A request's first offer takes its rank even when the store finds no room: its keys stored
/// later rank by that number, before the keys of requests ranked after it.
#[test]
fn lru_request_rank_is_taken_by_an_offer_that_finds_no_room() {
    let mut t = T::new(V033, Policy::Lru, 2);
    t.pos("P", &[(g(1, 0), 16), (g(2, 0), 32)]);
    assert_eq!(t.ps("P", &ks(&[1, 2])), stored(&[1, 2], &[0, 1], &[]));
    assert_eq!(t.rank(g(1, 0)), (1, -16));
    // Both slots are in flight: no room; A takes rank 2 all the same.
    t.pos("A", &[(g(3, 0), 16)]);
    assert_eq!(t.ps("A", &ks(&[3])), None);
    t.cs(&ks(&[1, 2]), true);
    t.finish("P");
    assert_eq!((t.rank(g(1, 0)), t.rank(g(2, 0))), ((4, 0), (3, 0)));
    assert_eq!(t.ps("A", &ks(&[3])), stored(&[3], &[1], &[2]));
    assert_eq!(t.rank(g(3, 0)), (2, -16));
    t.cs(&ks(&[3]), true);
    assert_eq!(t.eviction_order(), ks(&[3, 1]));
}

/// A request that stores one key holds it in its anchor without sentinels; the anchor keeps its
/// place when a second key comes later, when the key is evicted, and when another request's
/// access moves the key; its commit gives the key a fresh rank.
#[test]
fn lru_a_single_key_anchor_keeps_its_place() {
    // A second key in a later call ranks beside the first, before a later request's keys.
    let mut t = T::new(V033, Policy::Lru, 4);
    t.pos("A", &[(g(1, 0), 16), (g(2, 0), 32)]);
    assert!(t.ps("A", &ks(&[1])).is_some());
    t.pos("B", &[(g(3, 0), 16)]);
    assert!(t.ps("B", &ks(&[3])).is_some());
    assert!(t.ps("A", &ks(&[2])).is_some());
    t.cs(&ks(&[1, 2, 3]), true);
    assert_eq!((t.rank(g(1, 0)), t.rank(g(2, 0))), ((1, -16), (1, -32)));
    assert_eq!(t.eviction_order(), ks(&[2, 1, 3]));
    t.finish("A");
    assert_eq!(t.eviction_order(), ks(&[3, 2, 1]));

    // The only key evicted: the request's next key still ranks by its number.
    let mut t = T::new(V033, Policy::Lru, 2);
    t.pos("A", &[(g(1, 0), 16), (g(5, 0), 32)]);
    assert_eq!(t.ps("A", &ks(&[1])), stored(&[1], &[0], &[]));
    t.pos("B", &[(g(2, 0), 16)]);
    assert_eq!(t.ps("B", &ks(&[2])), stored(&[2], &[1], &[]));
    t.cs(&ks(&[1, 2]), true);
    assert_eq!(t.ps("", &ks(&[3])), stored(&[3], &[0], &[1]));
    t.cs(&ks(&[3]), true);
    assert_eq!(t.ps("A", &ks(&[5])), stored(&[5], &[1], &[2]));
    t.cs(&ks(&[5]), true);
    assert_eq!(t.rank(g(5, 0)), (1, -32));
    assert_eq!(t.eviction_order(), ks(&[5, 3]));

    // The only key raised into a later request's anchor: the anchor stays, empty, at its place.
    let mut t = T::new(V033, Policy::Lru, 4);
    t.pos("A", &[(g(1, 0), 16), (g(4, 0), 32)]);
    assert!(t.ps("A", &ks(&[1])).is_some());
    t.cs(&ks(&[1]), true);
    t.pos("C", &[(g(1, 0), 16), (g(2, 0), 32)]);
    assert!(t.ps("C", &ks(&[2])).is_some());
    t.pl("C", &ks(&[1]));
    t.cl(&ks(&[1]));
    assert_eq!(t.rank(g(1, 0)), (2, -16));
    assert!(t.ps("A", &ks(&[4])).is_some());
    t.cs(&ks(&[2, 4]), true);
    assert_eq!(t.eviction_order(), ks(&[4, 2, 1]));
    // A's commit: the key that left is committed again, after the anchor's own.
    t.finish("A");
    assert_eq!(t.eviction_order(), ks(&[2, 4, 1]));

    // The commit of a single key: a fresh rank, newest.
    let mut t = T::new(V033, Policy::Lru, 4);
    t.pos("A", &[(g(1, 0), 16)]);
    assert!(t.ps("A", &ks(&[1])).is_some());
    t.pos("B", &[(g(2, 0), 16)]);
    assert!(t.ps("B", &ks(&[2])).is_some());
    t.cs(&ks(&[1, 2]), true);
    t.finish("A");
    assert_eq!(t.rank(g(1, 0)), (3, 0));
    assert_eq!(t.eviction_order(), ks(&[2, 1]));
}

#[test]
fn lru_equal_ranks_are_ordered_by_key_bytes() {
    let mut t = T::new(V033, Policy::Lru, 4);
    let (a, b, c) = (g(7, 1), g(7, 0), g(3, 1));
    t.pos("G", &[(a, 16), (b, 16), (c, 16)]);
    assert!(t.ps("G", &[a, b, c]).is_some());
    t.cs(&[a, b, c], true);
    assert_eq!(t.eviction_order(), vec![c, b, a]);
    assert_eq!(t.ps("H", &ks(&[11, 12])).unwrap().2, vec![c]);
}

/// Keys recorded in any order keep the anchor sorted: tails first, whatever the order.
#[test]
fn lru_a_request_recording_tail_first_ranks_like_head_first() {
    for order in [[1u32, 2, 3, 4], [4, 3, 2, 1], [2, 4, 1, 3]] {
        let mut t = T::new(V033, Policy::Lru, 8);
        let kp: Vec<(u64, u64)> = (1..=4).map(|i| (g(i, 0), u64::from(i) * 16)).collect();
        t.pos("A", &kp);
        for i in order {
            t.ps("A", &ks(&[i])).unwrap();
        }
        t.cs(&ks(&[1, 2, 3, 4]), true);
        assert_eq!(t.eviction_order(), ks(&[4, 3, 2, 1]), "{order:?}");
    }
}

/// vLLM 0.33 `on_request_finished` sorts each group whose keys all have positions, even when
/// another group's keys have none (then the groups are concatenated in ascending order).
#[test]
fn lru_commit_sorts_a_fully_positioned_group_beside_an_unpositioned_one() {
    let mut t = T::new(V033, Policy::Lru, 8);
    t.pos("A", &[(g(1, 0), 16), (g(2, 0), 32)]);
    for k in [g(2, 0), g(1, 0), g(4, 1), g(3, 1)] {
        assert!(t.ps("A", &[k]).is_some());
        t.cs(&[k], true);
    }
    t.finish("A");
    // Head to tail: group 0 by position [1, 2], group 1 as observed [4, 3].
    assert_eq!(t.eviction_order(), vec![g(3, 1), g(4, 1), g(2, 0), g(1, 0)]);
}

// ---- ARC worked examples (vLLM 0.33 `ARCCachePolicy`) ----

#[test]
fn arc_promotion_at_finish_and_store_miss_adaptation() {
    let mut t = T::new(V033, Policy::Arc, 2);
    t.pos("A", &[(g(1, 0), 16), (g(2, 0), 32)]);
    t.pos("B", &[(g(1, 0), 16), (g(3, 0), 32)]);
    t.pos("C", &[(g(2, 0), 16), (g(4, 0), 32)]);
    assert_eq!(t.ps("A", &ks(&[1, 2])), stored(&[1, 2], &[0, 1], &[]));
    t.cs(&ks(&[1, 2]), true);
    assert_eq!(t.arc().0, ks(&[1, 2]));
    t.finish("A");
    assert_eq!(t.arc().0, ks(&[2, 1]));
    assert_eq!((t.lk(g(1, 0)), t.lk(g(3, 0))), (Lookup::Hit, Lookup::Miss));
    assert_eq!(t.pl("B", &ks(&[1])), vec![0]);
    t.cl(&ks(&[1]));
    assert_eq!(t.arc().0, ks(&[2, 1]));
    assert_eq!(t.ps("B", &ks(&[3])), stored(&[3], &[1], &[2]));
    let (t1, _, b1, _, _) = t.arc();
    assert_eq!((t1, b1), (ks(&[1, 3]), ks(&[2])));
    t.cs(&ks(&[3]), true);
    t.finish("B");
    let (t1, t2, ..) = t.arc();
    assert_eq!((t1, t2), (ks(&[3]), ks(&[1])));
    assert_eq!(t.lk(g(2, 0)), Lookup::Miss);
    assert_eq!(t.ps("C", &ks(&[2, 4])), stored(&[2, 4], &[0, 1], &[3, 1]));
    let (t1, t2, b1, b2, target) = t.arc();
    assert_eq!(
        (t1, t2, b1, b2, target),
        (ks(&[2, 4]), vec![], ks(&[3]), ks(&[1]), 1.0)
    );
    assert_eq!(t.ps("C", &ks(&[2, 4])), stored(&[], &[], &[]));
    assert_eq!(t.arc().4, 1.0);
    t.cs(&ks(&[2, 4]), true);
    t.finish("C");
    assert_eq!(t.arc().0, ks(&[4, 2]));
    let want = vec![
        sto(&[1, 2]),
        rem(&[2]),
        sto(&[3]),
        rem(&[3, 1]),
        sto(&[2, 4]),
    ];
    assert_eq!(t.events(), want);
}

/// A request of its own that loads `ids` (positions 16, 32, ...), completes and finishes.
fn reuse(t: &mut T, ids: &[u32]) {
    let kp: Vec<(u64, u64)> = ids
        .iter()
        .zip(1..)
        .map(|(&i, n)| (g(i, 0), n * 16))
        .collect();
    t.pos("reuse", &kp);
    t.pl("reuse", &ks(ids));
    t.cl(&ks(ids));
    t.finish("reuse");
}

/// A store of its own, completed at once.
fn ps_done(t: &mut T, ids: &[u32]) -> Option<Stored> {
    let r = t.ps("", &ks(ids));
    if let Some((k, _, _)) = &r {
        t.cs(k, true);
    }
    r
}

#[test]
fn arc_fractional_delta_target_steering_and_once_per_request_adaptation() {
    let mut t = T::new(V033, Policy::Arc, 3);
    ps_done(&mut t, &[1, 2, 3]);
    reuse(&mut t, &[1, 2, 3]);
    assert_eq!(t.arc().1, ks(&[3, 2, 1]));
    assert_eq!(ps_done(&mut t, &[4, 5]).unwrap().2, ks(&[3, 2]));
    assert_eq!(ps_done(&mut t, &[6]).unwrap().2, ks(&[4]));
    reuse(&mut t, &[5, 6]);
    assert_eq!(t.arc().1, ks(&[1, 6, 5]));
    assert_eq!(ps_done(&mut t, &[7, 8]).unwrap().2, ks(&[1, 6]));
    assert_eq!(
        t.arc(),
        (ks(&[7, 8]), ks(&[5]), ks(&[4]), ks(&[2, 1, 6]), 0.0)
    );
    assert_eq!(ps_done(&mut t, &[9]), stored(&[9], &[1], &[7]));
    let (t1, _, b1, _, _) = t.arc();
    assert_eq!((t1, b1), (ks(&[8, 9]), ks(&[4, 7])));
    assert_eq!(ps_done(&mut t, &[4]), stored(&[4], &[0], &[8]));
    let (t1, _, b1, _, target) = t.arc();
    assert_eq!((t1, b1, target), (ks(&[9, 4]), ks(&[7, 8]), 1.5));
    assert_eq!(ps_done(&mut t, &[7]), stored(&[7], &[2], &[5]));
    assert_eq!(
        t.arc(),
        (ks(&[9, 4, 7]), vec![], ks(&[8]), ks(&[1, 6, 5]), 3.0)
    );
    assert_eq!(ps_done(&mut t, &[10]), stored(&[10], &[1], &[9]));
    let (t1, _, b1, _, _) = t.arc();
    assert_eq!((t1, b1), (ks(&[4, 7, 10]), ks(&[8, 9])));
    // Adaptation once per key per request, kept when the store finds no room.
    t.pl("", &ks(&[4, 7, 10]));
    assert_eq!(t.ps("D", &ks(&[5])), None);
    assert_eq!(t.arc().4, 2.0);
    assert_eq!(t.ps("D", &ks(&[5])), None);
    assert_eq!(t.arc().4, 2.0);
    assert_eq!(t.ps("E", &ks(&[5])), None);
    assert_eq!(t.arc().4, 1.0);
}

mod commit;
mod differences;

//! Unit tests of the manager: worked examples of vLLM 0.24's `LRUCachePolicy` and
//! `ARCCachePolicy`, and cases of vLLM's manager tests (`tests/v1/kv_offload`), written from
//! their descriptions.

use super::*;

fn k(i: u64) -> [u8; 8] {
    i.to_be_bytes()
}

fn keys(ids: &[u64]) -> Vec<u8> {
    ids.iter().flat_map(|&i| k(i)).collect()
}

fn ids(flat: &[u8]) -> Vec<u64> {
    flat.chunks_exact(8)
        .map(|c| u64::from_be_bytes(c.try_into().unwrap()))
        .collect()
}

fn mgr(num_slots: usize, policy: Policy) -> Manager {
    Manager::new(ManagerConfig {
        key_len: 8,
        num_slots,
        policy,
        enable_events: true,
        ..Default::default()
    })
    .unwrap()
}

/// Prepares a store; returns (indices, slots, evicted ids).
fn store(m: &mut Manager, ks: &[u64]) -> Result<(Vec<u32>, Vec<u32>, Vec<u64>)> {
    let mut plan = StorePlan::default();
    m.prepare_store(&keys(ks), &mut plan)?;
    m.check_invariants().unwrap();
    Ok((plan.indices, plan.slots, ids(&plan.evicted)))
}

fn load(m: &mut Manager, ks: &[u64]) -> Result<Vec<u32>> {
    let mut out = vec![0; ks.len()];
    m.prepare_load(&keys(ks), &mut out)?;
    Ok(out)
}

fn look(m: &mut Manager, i: u64) -> Lookup {
    m.lookup(&k(i)).unwrap()
}

fn events(m: &mut Manager) -> Vec<(bool, Vec<u64>)> {
    m.take_events()
        .iter()
        .map(|e| (e.removed, ids(e.keys)))
        .collect()
}

#[test]
fn lru_worked_example() {
    let mut m = mgr(4, Policy::Lru);
    assert_eq!(
        store(&mut m, &[1, 2]).unwrap(),
        (vec![0, 1], vec![0, 1], vec![])
    );
    assert_eq!(
        (look(&mut m, 1), look(&mut m, 2)),
        (Lookup::Retry, Lookup::Retry)
    );
    m.complete_store(&keys(&[1, 2]), true).unwrap();
    assert_eq!(
        (look(&mut m, 1), look(&mut m, 2)),
        (Lookup::Hit, Lookup::Hit)
    );
    assert_eq!(events(&mut m), vec![(false, vec![1, 2])]);

    assert_eq!(
        store(&mut m, &[2, 3, 4, 5]).unwrap(),
        (vec![1, 2, 3], vec![2, 3, 0], vec![1])
    );
    assert!(matches!(store(&mut m, &[1, 6]), Err(Error::NoRoom(_))));
    m.complete_store(&keys(&[2, 3, 4, 5]), true).unwrap();
    assert_eq!(load(&mut m, &[2, 3]).unwrap(), vec![1, 2]);
    assert!(matches!(store(&mut m, &[6, 7, 8]), Err(Error::NoRoom(_))));
    m.complete_load(&keys(&[2, 3])).unwrap();
    assert_eq!(
        store(&mut m, &[6, 7, 8]).unwrap(),
        (vec![0, 1, 2], vec![1, 0, 3], vec![4, 5, 2])
    );
    m.complete_store(&keys(&[6, 7, 8]), true).unwrap();
    m.touch(&keys(&[3, 6, 7])).unwrap();
    assert_eq!(store(&mut m, &[9]).unwrap(), (vec![0], vec![3], vec![8]));
    m.complete_store(&keys(&[7, 9]), false).unwrap();
    assert_eq!(
        (look(&mut m, 7), look(&mut m, 9)),
        (Lookup::Hit, Lookup::Miss)
    );
    assert_eq!(
        events(&mut m),
        vec![
            (true, vec![1]),
            (false, vec![3, 4, 5]),
            (true, vec![4, 5, 2]),
            (false, vec![6, 7, 8]),
            (true, vec![8])
        ]
    );
    m.check_invariants().unwrap();
}

#[test]
fn already_stored_input_key_survives_eviction() {
    for policy in [Policy::Lru, Policy::Arc] {
        let mut m = mgr(4, policy);
        store(&mut m, &[1, 2]).unwrap();
        m.complete_store(&keys(&[1, 2]), true).unwrap();
        // Key 2 is the only other evictable key besides 1 and is least recently used after 1.
        assert_eq!(
            store(&mut m, &[2, 3, 4, 5]).unwrap(),
            (vec![1, 2, 3], vec![2, 3, 0], vec![1]),
            "{policy:?}"
        );
        assert_eq!(look(&mut m, 2), Lookup::Hit);
    }
}

#[test]
fn protected_keys_make_room_fail_without_change() {
    let mut m = mgr(2, Policy::Lru);
    store(&mut m, &[1, 2]).unwrap();
    m.complete_store(&keys(&[1, 2]), true).unwrap();
    let before = m.stats();
    // 1 and 2 are named in the call, so neither can be evicted for 3.
    assert!(matches!(store(&mut m, &[1, 2, 3]), Err(Error::NoRoom(_))));
    assert_eq!(m.stats(), before);
    assert_eq!(store(&mut m, &[2, 3]).unwrap(), (vec![1], vec![0], vec![1]));
}

#[test]
fn prepare_load_preserves_key_order_and_pins() {
    let mut m = mgr(8, Policy::Lru);
    store(&mut m, &[10, 11, 12, 13]).unwrap();
    m.complete_store(&keys(&[10, 11, 12, 13]), true).unwrap();
    assert_eq!(load(&mut m, &[13, 10, 12]).unwrap(), vec![3, 0, 2]);
    assert_eq!(load(&mut m, &[13]).unwrap(), vec![3]);
    let s = m.stats();
    assert_eq!((s.pinned, s.evictable, s.ready), (3, 1, 4));
    m.complete_load(&keys(&[13, 13, 10, 12])).unwrap();
    assert_eq!(m.stats().pinned, 0);
    assert!(matches!(
        m.complete_load(&keys(&[10])),
        Err(Error::InvalidState(_))
    ));
    m.check_invariants().unwrap();
}

#[test]
fn failed_calls_change_nothing() {
    let mut m = mgr(4, Policy::Lru);
    store(&mut m, &[1, 2, 3]).unwrap();
    m.complete_store(&keys(&[1, 2]), true).unwrap();
    load(&mut m, &[1]).unwrap();
    let before = (m.stats(), m.lru_order());
    // Missing key after a valid one: nothing pinned.
    assert!(matches!(load(&mut m, &[2, 9]), Err(Error::NotFound(m)) if m.contains("keys[1]")));
    // In-flight key.
    assert!(matches!(load(&mut m, &[2, 3]), Err(Error::InvalidState(_))));
    // Released more often than pinned, after a valid release: nothing released.
    assert!(
        matches!(m.complete_load(&keys(&[1, 1])), Err(Error::InvalidState(m)) if m.contains("keys[1]"))
    );
    assert!(matches!(
        m.complete_load(&keys(&[2])),
        Err(Error::InvalidState(_))
    ));
    assert!(matches!(
        m.complete_load(&keys(&[7])),
        Err(Error::NotFound(_))
    ));
    // Output too small.
    let mut small = [0u32; 1];
    assert!(matches!(
        m.prepare_load(&keys(&[1, 2]), &mut small),
        Err(Error::BufferTooSmall { needed: 2, .. })
    ));
    // Wrong key widths.
    assert!(matches!(m.lookup(&[0; 7]), Err(Error::InvalidArgument(_))));
    assert!(matches!(m.touch(&[0; 9]), Err(Error::InvalidArgument(_))));
    assert_eq!((m.stats(), m.lru_order()), before);
    m.check_invariants().unwrap();
}

#[test]
fn config_is_validated() {
    for (cfg, field) in [
        (
            ManagerConfig {
                key_len: 0,
                ..Default::default()
            },
            "key_len",
        ),
        (
            ManagerConfig {
                key_len: 65,
                ..Default::default()
            },
            "key_len",
        ),
        (
            ManagerConfig {
                store_threshold: 2,
                max_tracker_size: 0,
                ..Default::default()
            },
            "max_tracker_size",
        ),
        (
            ManagerConfig {
                num_slots: u32::MAX as usize,
                ..Default::default()
            },
            "num_slots",
        ),
        (
            ManagerConfig {
                num_slots: u32::MAX as usize / 5 + 1,
                policy: Policy::Arc,
                ..Default::default()
            },
            "num_slots",
        ),
    ] {
        assert!(
            matches!(Manager::new(cfg), Err(Error::InvalidArgument(m)) if m.starts_with(field))
        );
    }
    assert!(
        Manager::new(ManagerConfig {
            key_len: 64,
            num_slots: 0,
            ..Default::default()
        })
        .is_ok()
    );
}

#[test]
fn zero_capacity_never_stores() {
    let mut m = mgr(0, Policy::Arc);
    assert!(matches!(store(&mut m, &[1]), Err(Error::NoRoom(_))));
    assert_eq!(store(&mut m, &[]).unwrap(), (vec![], vec![], vec![]));
}

/// A manager of `num_slots` slots in `semantics` (LRU, events on).
fn mgr_in(semantics: Semantics, num_slots: usize) -> Manager {
    Manager::new(ManagerConfig {
        key_len: 8,
        num_slots,
        enable_events: true,
        semantics,
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn duplicate_keys_in_one_store_are_stored_once() {
    for semantics in [Semantics::Vllm024, Semantics::Vllm033] {
        let mut m = mgr_in(semantics, 4);
        assert_eq!(
            store(&mut m, &[5, 5, 6, 5]).unwrap(),
            (vec![0, 2], vec![0, 1], vec![]),
            "{semantics:?}"
        );
        assert_eq!(m.stats().stores_in_flight, 2);
        // Offered again while in flight: nothing to store.
        assert_eq!(store(&mut m, &[6, 5, 6]).unwrap(), (vec![], vec![], vec![]));
    }
}

/// Below the store threshold a key listed twice in one offer counts as skipped per listing in
/// 0.24 (the filter comes before the dedupe) and once in 0.33 (after it); once it passes it is
/// stored once, at its first listing.
#[test]
fn duplicate_keys_below_the_threshold_are_skipped_once() {
    for semantics in [Semantics::Vllm024, Semantics::Vllm033] {
        let mut m = Manager::new(ManagerConfig {
            key_len: 8,
            num_slots: 8,
            store_threshold: 2,
            semantics,
            ..Default::default()
        })
        .unwrap();
        let skipped = match semantics {
            Semantics::Vllm024 => 4,
            Semantics::Vllm033 => 2,
        };
        assert_eq!(store(&mut m, &[1, 1, 2, 1]).unwrap().0, Vec::<u32>::new());
        assert_eq!(m.stats().stores_skipped, skipped, "{semantics:?}");
        // 0.24 counts lookups, 0.33 offers.
        if semantics == Semantics::Vllm024 {
            for i in [1, 2, 1, 2] {
                look(&mut m, i);
            }
        }
        let stored = store(&mut m, &[3, 1, 2, 1, 2]).unwrap().0;
        assert_eq!(stored, vec![1, 2], "{semantics:?}");
        assert_eq!(m.stats().stores_skipped, skipped + 1, "{semantics:?}");
    }
}

/// Every size and repeat pattern goes through the same dedupe: few repeats (filter, clash
/// check) and repeats en masse (the sorted fallback) keep exactly the first occurrences.
#[test]
fn duplicate_keys_dedupe_matches_a_naive_first_occurrence_filter() {
    let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for (n, distinct) in [
        (2, 1),
        (30, 28),
        (300, 290),
        (300, 40),
        (1000, 3),
        (5000, 4000),
    ] {
        let ks: Vec<u64> = (0..n).map(|_| next() % distinct).collect();
        let mut seen = std::collections::HashSet::new();
        let first: Vec<u32> = (0..n as u32)
            .filter(|&i| seen.insert(ks[i as usize]))
            .collect();
        for semantics in [Semantics::Vllm024, Semantics::Vllm033] {
            let mut m = mgr_in(semantics, n);
            let (indices, slots, evicted) = store(&mut m, &ks).unwrap();
            assert_eq!(indices, first, "n={n} distinct={distinct} {semantics:?}");
            assert_eq!(slots, (0..first.len() as u32).collect::<Vec<_>>());
            assert!(evicted.is_empty());
        }
    }
}

#[test]
fn failed_store_frees_only_in_flight_keys() {
    let mut m = mgr(4, Policy::Lru);
    store(&mut m, &[7]).unwrap();
    m.complete_store(&keys(&[7]), true).unwrap();
    store(&mut m, &[9]).unwrap();
    m.complete_store(&keys(&[7, 9, 42]), false).unwrap();
    assert_eq!(
        (look(&mut m, 7), look(&mut m, 9)),
        (Lookup::Hit, Lookup::Miss)
    );
    // Slot 1 went back to the free list and is reused first (LIFO) once fresh slots run out.
    assert_eq!(store(&mut m, &[20, 21, 22]).unwrap().1, vec![2, 3, 1]);
    assert!(
        events(&mut m)
            .iter()
            .all(|(removed, ks)| !removed && ks != &vec![9])
    );
}

/// Slots given to `complete_store_at` are hints: right ones are used, stale or wrong ones fall
/// back to a lookup (a freed slot still holds its old key bytes), bad ones fail unchanged.
#[test]
fn complete_store_at_uses_right_slots_and_survives_wrong_ones() {
    let mut m = mgr(4, Policy::Lru);
    let (_, slots, _) = store(&mut m, &[1, 2]).unwrap();
    m.complete_store_at(&keys(&[1, 2]), &slots, true).unwrap();
    assert_eq!(
        (look(&mut m, 1), look(&mut m, 2)),
        (Lookup::Hit, Lookup::Hit)
    );
    m.check_invariants().unwrap();

    // Key 3 goes to slot 2 and fails: slot 2 is free but still holds 3's bytes. Stored again,
    // 3 lands in slot 3 (fresh first); the stale hint 2 must not hide it.
    let (_, s3, _) = store(&mut m, &[3]).unwrap();
    assert_eq!(s3, vec![2]);
    m.complete_store_at(&keys(&[3]), &s3, false).unwrap();
    assert_eq!(store(&mut m, &[3]).unwrap().1, vec![3]);
    m.complete_store_at(&keys(&[3]), &[2], true).unwrap();
    assert_eq!(look(&mut m, 3), Lookup::Hit);
    // Swapped hints: each key still finds its own slot.
    let (_, s45, _) = store(&mut m, &[4]).unwrap();
    m.complete_store_at(&keys(&[4]), &[0], true).unwrap();
    assert_eq!((look(&mut m, 4), s45), (Lookup::Hit, vec![2]));
    m.check_invariants().unwrap();

    // Bad slots: the call fails naming them, and changes nothing.
    let (_, s5, _) = store(&mut m, &[5]).unwrap();
    let before = m.stats();
    let err = m.complete_store_at(&keys(&[5]), &[0, 1], true).unwrap_err();
    assert!(err.to_string().contains("slots"), "{err}");
    let err = m.complete_store_at(&keys(&[5]), &[4], true).unwrap_err();
    assert!(err.to_string().contains("slots[0]"), "{err}");
    assert_eq!(m.stats(), before);
    assert_eq!(look(&mut m, 5), Lookup::Retry);
    m.complete_store_at(&keys(&[5]), &s5, true).unwrap();
    assert_eq!(look(&mut m, 5), Lookup::Hit);
    m.check_invariants().unwrap();
}

#[test]
fn evictable_count_follows_every_transition() {
    let mut m = mgr(3, Policy::Lru);
    let ev = |m: &Manager| m.stats().evictable;
    store(&mut m, &[1, 2]).unwrap();
    assert_eq!(ev(&m), 0);
    m.complete_store(&keys(&[1, 2]), true).unwrap();
    assert_eq!(ev(&m), 2);
    load(&mut m, &[1]).unwrap();
    load(&mut m, &[1]).unwrap();
    assert_eq!(ev(&m), 1, "two loads of one key pin it once");
    m.complete_load(&keys(&[1])).unwrap();
    assert_eq!(ev(&m), 1);
    m.complete_load(&keys(&[1])).unwrap();
    assert_eq!(ev(&m), 2);
    store(&mut m, &[3, 4]).unwrap(); // evicts one
    assert_eq!(ev(&m), 1);
    m.complete_store(&keys(&[3, 4]), false).unwrap();
    assert_eq!(ev(&m), 1);
    m.reset();
    assert_eq!(ev(&m), 0);
    // Nothing evictable: fails fast.
    store(&mut m, &[1, 2, 3]).unwrap();
    assert!(matches!(store(&mut m, &[4]), Err(Error::NoRoom(_))));
}

#[test]
fn usage_gauge_counts_slots_held_by_transfers() {
    let mut m = mgr(4, Policy::Lru);
    let usage = |m: &Manager| {
        let s = m.stats();
        (s.used - s.evictable) as f64 / s.capacity as f64
    };
    assert_eq!(usage(&m), 0.0);
    store(&mut m, &[1, 2]).unwrap();
    assert_eq!(usage(&m), 0.5);
    store(&mut m, &[3, 4]).unwrap();
    assert_eq!(usage(&m), 1.0);
    m.complete_store(&keys(&[1, 2]), true).unwrap();
    assert_eq!(usage(&m), 0.5);
    m.complete_store(&keys(&[3, 4]), true).unwrap();
    assert_eq!(usage(&m), 0.0);
}

#[test]
fn store_threshold_filters_until_looked_up_enough() {
    let cfg = ManagerConfig {
        key_len: 8,
        num_slots: 8,
        store_threshold: 2,
        max_tracker_size: 3,
        ..Default::default()
    };
    let mut m = Manager::new(cfg).unwrap();
    assert_eq!(store(&mut m, &[1, 2, 3]).unwrap().0, Vec::<u32>::new());
    assert_eq!(m.stats().stores_skipped, 3);
    look(&mut m, 1);
    assert_eq!(
        store(&mut m, &[1]).unwrap().0,
        Vec::<u32>::new(),
        "one lookup is not enough"
    );
    look(&mut m, 1);
    assert_eq!(store(&mut m, &[1, 2]).unwrap().0, vec![0]);
    assert_eq!(m.stats().stores_skipped, 5);
    // The tracker holds 3 keys: looking up 2, 3, 4 drops 1's count.
    look(&mut m, 2);
    look(&mut m, 3);
    look(&mut m, 4);
    look(&mut m, 2);
    assert_eq!(store(&mut m, &[2]).unwrap().0, vec![0]);
    look(&mut m, 1);
    look(&mut m, 5);
    look(&mut m, 6);
    look(&mut m, 7); // 1 dropped again; its count restarts
    look(&mut m, 1);
    m.complete_store(&keys(&[1]), false).unwrap(); // free 1's slot so it could be stored again
    assert_eq!(store(&mut m, &[1]).unwrap().0, Vec::<u32>::new());
}

/// The fused lookup + touch answers like `lookup_prefix` on its range and leaves the LRU order
/// of `touch` on all keys; a range beyond the keys fails and changes nothing.
#[test]
fn lookup_prefix_touch_is_lookup_then_touch() {
    let mut a = mgr(8, Policy::Lru);
    let mut b = mgr(8, Policy::Lru);
    for m in [&mut a, &mut b] {
        stored(m, &[1, 2, 3, 4]);
        store(m, &[5]).unwrap();
    }
    let ks = keys(&[9, 2, 3, 5, 4, 1]);
    let fused = a.lookup_prefix_touch(&ks, 1..5).unwrap();
    let split = b.lookup_prefix(&ks[8..40]).unwrap();
    b.touch(&ks).unwrap();
    assert_eq!(fused, split);
    assert_eq!(
        fused,
        PrefixLookup {
            hits: 4,
            retry: true
        }
    );
    assert_eq!(a.lru_order(), b.lru_order());
    assert_eq!(a.stats(), b.stats());
    let before = a.stats();
    let order = a.lru_order();
    assert!(matches!(
        a.lookup_prefix_touch(&ks, 2..7),
        Err(Error::InvalidArgument(m)) if m.contains("lookup")
    ));
    assert_eq!((a.stats(), a.lru_order()), (before, order));
}

/// Calls on the same keys (or a prefix) reuse the last resolution only while the key table is
/// unchanged: every insert, removal, eviction, revival and reset invalidates it.
#[test]
fn reused_resolutions_follow_every_change_of_the_index() {
    for policy in [Policy::Lru, Policy::Arc] {
        let mut m = mgr(4, policy);
        let ks = keys(&[1, 2, 3]);
        m.touch(&ks).unwrap();
        assert_eq!(store(&mut m, &[1, 2, 3]).unwrap().1, vec![0, 1, 2]);
        assert!(matches!(
            m.prepare_load(&ks[..8], &mut [0]),
            Err(Error::InvalidState(_))
        ));
        m.complete_store(&ks, true).unwrap();
        let p = m.lookup_prefix_touch(&ks, 0..3).unwrap();
        assert_eq!(p.hits, 3);
        assert_eq!(m.discard(&ks[8..16]).unwrap(), 1);
        assert!(matches!(
            m.prepare_load(&ks, &mut [0; 3]),
            Err(Error::NotFound(e)) if e.contains("keys[1]")
        ));
        // Evictions (ARC: the keys become ghosts) change the index too.
        m.touch(&ks).unwrap();
        stored(&mut m, &[4, 5, 6]);
        m.touch(&ks).unwrap();
        let p = m.lookup_prefix_touch(&ks, 0..3).unwrap();
        let fresh = ks
            .chunks(8)
            .take_while(|k| m.ref_count(k).is_some())
            .count();
        assert_eq!(m.stats().evictions, 1);
        assert_eq!(p.hits, fresh, "{policy:?}");
        m.reset();
        assert_eq!(m.lookup_prefix_touch(&keys(&[4]), 0..1).unwrap().hits, 0);
        m.check_invariants().unwrap();
    }
}

/// An ARC ghost revived into a free slot (no eviction, no key added) changes what the key is:
/// a later call on the same keys sees its store in flight, not a ghost.
#[test]
fn reused_resolution_follows_an_arc_revival() {
    let mut m = mgr(2, Policy::Arc);
    stored(&mut m, &[1, 2]);
    stored(&mut m, &[3]);
    assert_eq!(arc_state(&m).b1, vec![keys(&[1])]);
    assert_eq!(m.discard(&keys(&[3])).unwrap(), 1);
    let one = keys(&[1]);
    assert_eq!(m.lookup_prefix_touch(&one, 0..1).unwrap().hits, 0);
    assert_eq!(store(&mut m, &[1]).unwrap().2, Vec::<u64>::new());
    assert!(matches!(
        m.prepare_load(&one, &mut [0]),
        Err(Error::InvalidState(e)) if e.contains("in flight")
    ));
    m.check_invariants().unwrap();
}

#[test]
fn prefix_lookup_maximal_prefix_rule() {
    let mut m = mgr(8, Policy::Lru);
    store(&mut m, &[1, 2, 3, 4]).unwrap();
    m.complete_store(&keys(&[1, 2, 4]), true).unwrap();
    let p = |m: &mut Manager, ks: &[u64]| m.lookup_prefix(&keys(ks)).unwrap();
    assert_eq!(
        p(&mut m, &[1, 2]),
        PrefixLookup {
            hits: 2,
            retry: false
        }
    );
    assert_eq!(
        p(&mut m, &[9, 1]),
        PrefixLookup {
            hits: 0,
            retry: false
        }
    );
    assert_eq!(
        p(&mut m, &[1, 9, 2]),
        PrefixLookup {
            hits: 1,
            retry: false
        }
    );
    assert_eq!(
        p(&mut m, &[]),
        PrefixLookup {
            hits: 0,
            retry: false
        }
    );
    assert_eq!(
        p(&mut m, &[3]),
        PrefixLookup {
            hits: 1,
            retry: true
        }
    );
    assert_eq!(
        p(&mut m, &[1, 3, 4]),
        PrefixLookup {
            hits: 3,
            retry: true
        }
    );
    // Stops at the miss: 1, 3, 9 looked up, 4 is not.
    let before = m.stats().lookups;
    assert_eq!(
        p(&mut m, &[1, 3, 9, 4]),
        PrefixLookup {
            hits: 2,
            retry: true
        }
    );
    assert_eq!(m.stats().lookups - before, 3);
}

// ---- ARC (vLLM 0.24 `ARCCachePolicy`) ----

fn arc_state(m: &Manager) -> arc::ArcSnapshot {
    m.policy.arc().expect("not ARC").snapshot(&m.keys)
}

impl Manager {
    fn lru_order(&self) -> Vec<u32> {
        match self.policy.lru() {
            Some(l) => l.order(),
            None => arc_state(self).t1,
        }
    }

    fn set_arc_target(&mut self, t: f64) {
        if let Some(a) = self.policy.arc_mut() {
            a.set_target(t);
        }
    }
}

fn stored(m: &mut Manager, ks: &[u64]) {
    store(m, ks).unwrap();
    m.complete_store(&keys(ks), true).unwrap();
}

/// `lookup_prefix` resolves its keys in windows (8, then up to 24, 56, ...): the answer is the
/// maximal prefix wherever the first miss lies, each key before it and the miss itself are
/// counted once, a key in flight past the first window asks for a retry, and a load of the hits
/// that follows gets each hit's own slot.
#[test]
fn prefix_lookup_answers_alike_in_every_window() {
    let mut m = mgr(128, Policy::Lru);
    let all: Vec<u64> = (0..100).collect();
    let (_, slots, _) = store(&mut m, &all).unwrap();
    m.complete_store(&keys(&all), true).unwrap();
    for miss in [0, 1, 7, 8, 9, 23, 24, 25, 55, 56, 57, 99, 100] {
        let mut ks = all.clone();
        if let Some(k) = ks.get_mut(miss) {
            *k = 1000;
        }
        let before = m.stats().lookups;
        let p = m.lookup_prefix(&keys(&ks)).unwrap();
        assert_eq!((p.hits, p.retry), (miss, false), "miss at {miss}");
        assert_eq!(m.stats().lookups - before, (miss + 1).min(100) as u64);
        let hits = load(&mut m, &ks[..miss]).unwrap();
        assert_eq!(hits, slots[..miss], "miss at {miss}");
        m.complete_load(&keys(&ks[..miss])).unwrap();
    }
    store(&mut m, &[200]).unwrap();
    let mut ks = all.clone();
    ks[40] = 200;
    let p = m.lookup_prefix(&keys(&ks)).unwrap();
    assert_eq!((p.hits, p.retry), (100, true));
    m.check_invariants().unwrap();
}

#[test]
fn arc_new_blocks_land_in_t1_and_touch_promotes() {
    let mut m = mgr(4, Policy::Arc);
    stored(&mut m, &[1, 2]);
    assert_eq!(arc_state(&m).t1, vec![0, 1]);
    m.touch(&keys(&[1])).unwrap();
    let s = arc_state(&m);
    assert_eq!((s.t1, s.t2), (vec![1], vec![0]));
    m.touch(&keys(&[2, 1])).unwrap(); // reverse order: 1 then 2 → T2 = [1, 2]... 2 most recent
    let s = arc_state(&m);
    assert_eq!((s.t1, s.t2), (vec![], vec![0, 1]));
    // A touched in-flight block stays in T1 (moved to its MRU end).
    store(&mut m, &[3, 4]).unwrap();
    m.touch(&keys(&[3])).unwrap();
    assert_eq!(arc_state(&m).t1, vec![3, 2]);
}

#[test]
fn arc_eviction_goes_to_ghost_and_ghost_hit_raises_target() {
    let mut m = mgr(2, Policy::Arc);
    stored(&mut m, &[1, 2]);
    assert_eq!(store(&mut m, &[3]).unwrap().2, vec![1]);
    assert_eq!(arc_state(&m).b1, vec![k(1).to_vec()]);
    m.touch(&keys(&[1])).unwrap();
    assert!(arc_state(&m).target > 0.0);
    assert_eq!(arc_state(&m).target, 1.0);
}

/// Ghost entries share the key table with stored keys: a stored-again ghost leaves its list
/// (revived in place), and one trimmed by the same call's evictions is stored afresh.
#[test]
fn arc_ghosts_revive_or_vanish_within_one_store() {
    let ids_of = |b: Vec<Vec<u8>>| ids(&b.concat());
    let mut m = mgr(2, Policy::Arc);
    stored(&mut m, &[1, 2]);
    stored(&mut m, &[3]); // evicts 1 → B1 [1]
    // Storing 1 evicts 2 (B1 [1, 2], within capacity), then revives 1: B1 [2].
    assert_eq!(store(&mut m, &[1]).unwrap().2, vec![2]);
    assert_eq!(ids_of(arc_state(&m).b1), vec![2]);
    assert_eq!(look(&mut m, 1), Lookup::Retry);
    assert_eq!(look(&mut m, 2), Lookup::Miss);
    m.complete_store(&keys(&[1]), true).unwrap();
    m.check_invariants().unwrap();

    let mut m = mgr(2, Policy::Arc);
    stored(&mut m, &[1, 2]);
    stored(&mut m, &[3, 4]); // B1 [1, 2]
    // Storing 1 and 5 evicts 3 and 4: B1 [1, 2, 3, 4] is trimmed to [3, 4], which drops 1's
    // ghost before 1 is stored again.
    assert_eq!(store(&mut m, &[1, 5]).unwrap().2, vec![3, 4]);
    assert_eq!(ids_of(arc_state(&m).b1), vec![3, 4]);
    assert_eq!(
        (look(&mut m, 1), look(&mut m, 5)),
        (Lookup::Retry, Lookup::Retry)
    );
    m.check_invariants().unwrap();
    // Ghost hits still adapt the target; stored keys are not ghosts.
    m.touch(&keys(&[3])).unwrap();
    assert_eq!(arc_state(&m).target, 1.0);
    m.complete_store(&keys(&[1, 5]), true).unwrap();
    m.touch(&keys(&[1])).unwrap();
    assert_eq!(arc_state(&m).target, 1.0);
    m.check_invariants().unwrap();
}

#[test]
fn arc_t1_t2_eviction_choice_and_failed_store() {
    let mut m = mgr(4, Policy::Arc);
    stored(&mut m, &[1, 2, 3, 4]);
    m.touch(&keys(&[3, 4])).unwrap();
    let s = arc_state(&m);
    assert_eq!((s.t1.len(), s.t2.len()), (2, 2));
    m.set_arc_target(1.0);
    assert_eq!(store(&mut m, &[5]).unwrap().2, vec![1]);
    m.complete_store(&keys(&[5]), false).unwrap();
    let s = arc_state(&m);
    assert_eq!(s.b1, vec![k(1).to_vec()], "the evicted block stays a ghost");
    assert_eq!(s.t1.len() + s.t2.len(), 3);
    assert_eq!(look(&mut m, 5), Lookup::Miss);
}

#[test]
fn arc_touch_ordering() {
    let mut m = mgr(3, Policy::Arc);
    stored(&mut m, &[1, 2, 3]);
    m.touch(&keys(&[1])).unwrap();
    assert_eq!(store(&mut m, &[4]).unwrap(), (vec![0], vec![1], vec![2]));
}

#[test]
fn arc_adaptive_target_goes_down_on_b2_hit() {
    let mut m = mgr(2, Policy::Arc);
    stored(&mut m, &[1, 2]);
    m.touch(&keys(&[1, 2])).unwrap(); // both in T2
    assert_eq!(
        store(&mut m, &[3]).unwrap().2,
        vec![2],
        "T2 LRU: 2 (touched first in reverse)"
    );
    m.complete_store(&keys(&[3]), true).unwrap();
    assert_eq!(arc_state(&m).b2, vec![k(2).to_vec()]);
    m.set_arc_target(1.5);
    m.touch(&keys(&[2])).unwrap(); // B2 hit: delta = max(1, 0/1) = 1
    assert_eq!(arc_state(&m).target, 0.5);
    m.touch(&keys(&[2])).unwrap();
    assert_eq!(arc_state(&m).target, 0.0);
}

#[test]
fn arc_quirk_t1_not_scanned_below_target() {
    let mut m = mgr(2, Policy::Arc);
    stored(&mut m, &[1, 2]);
    m.touch(&keys(&[2])).unwrap(); // T1 = [1], T2 = [2]
    load(&mut m, &[2]).unwrap(); // T2's only block pinned
    m.set_arc_target(2.0); // virtual T1 (1) < int(target) (2): T1 is not scanned
    assert!(matches!(store(&mut m, &[3]), Err(Error::NoRoom(_))));
    m.set_arc_target(1.0);
    assert_eq!(store(&mut m, &[3]).unwrap().2, vec![1]);
}

#[test]
fn arc_ghost_lists_stay_bounded() {
    let mut m = mgr(3, Policy::Arc);
    for i in 0..50u64 {
        stored(&mut m, &[i]);
        if i % 3 == 0 {
            m.touch(&keys(&[i])).unwrap();
        }
        let s = arc_state(&m);
        assert!(s.b1.len() <= 3 && s.b2.len() <= 3);
        m.check_invariants().unwrap();
    }
}

#[test]
fn reset_drops_everything_and_restarts_slots() {
    for policy in [Policy::Lru, Policy::Arc] {
        let mut m = mgr(4, policy);
        stored(&mut m, &[1, 2]);
        load(&mut m, &[1]).unwrap();
        store(&mut m, &[3]).unwrap();
        m.take_events();
        m.reset();
        let s = m.stats();
        assert_eq!(
            (s.used, s.pinned, s.stores_in_flight, s.evictable),
            (0, 0, 0, 0)
        );
        assert_eq!(look(&mut m, 1), Lookup::Miss);
        assert!(events(&mut m).is_empty(), "reset emits no event");
        assert_eq!(store(&mut m, &[5]).unwrap().1, vec![0]);
        m.check_invariants().unwrap();
    }
}

#[test]
fn discard_drops_only_ready_unpinned_keys() {
    for policy in [Policy::Lru, Policy::Arc] {
        let mut m = mgr(4, policy);
        stored(&mut m, &[1, 2, 3]);
        store(&mut m, &[4]).unwrap();
        load(&mut m, &[2]).unwrap();
        m.take_events();
        assert_eq!(
            (
                m.ref_count(&k(2)),
                m.ref_count(&k(1)),
                m.ref_count(&k(4)),
                m.ref_count(&k(9))
            ),
            (Some(1), Some(0), Some(-1), None)
        );
        assert_eq!(m.discard(&keys(&[1, 2, 4, 9])).unwrap(), 1);
        assert_eq!(events(&mut m), vec![(true, vec![1])]);
        assert_eq!(
            (look(&mut m, 1), look(&mut m, 2), look(&mut m, 4)),
            (Lookup::Miss, Lookup::Hit, Lookup::Retry)
        );
        m.check_invariants().unwrap();
        assert_eq!(
            store(&mut m, &[5]).unwrap().1,
            vec![0],
            "the dropped slot is free again"
        );
    }
}

#[test]
fn huge_tier_fails_cleanly_instead_of_aborting() {
    // With heuristic overcommit (Linux default) an allocation beyond RAM + swap is refused.
    let heuristic =
        std::fs::read_to_string("/proc/sys/vm/overcommit_memory").is_ok_and(|s| s.trim() == "0");
    if !heuristic {
        eprintln!("skipped: needs vm.overcommit_memory = 0");
        return;
    }
    let cfg = ManagerConfig {
        key_len: 64,
        num_slots: u32::MAX as usize - 1,
        ..Default::default()
    };
    assert!(
        matches!(Manager::new(cfg), Err(Error::OutOfMemory(m)) if m.contains("slots") || m.contains("keys"))
    );
}

#[test]
fn no_room_writes_no_output() {
    let mut m = mgr(1, Policy::Lru);
    store(&mut m, &[1]).unwrap();
    let (mut idx, mut slots, mut ev) = ([7u32; 2], [7u32; 2], [7u8; 16]);
    assert!(matches!(
        m.prepare_store_into(&keys(&[2, 3]), &mut idx, &mut slots, &mut ev),
        Err(Error::NoRoom(_))
    ));
    assert_eq!((idx, slots, ev), ([7; 2], [7; 2], [7; 16]));
}

#[test]
fn events_not_taken_are_bounded_and_counted() {
    let mut m = Manager::new(ManagerConfig {
        key_len: 8,
        num_slots: 16,
        enable_events: true,
        ..Default::default()
    })
    .unwrap();
    // 200k keys stored and evicted through 16 slots, never taken: 400k events of one key.
    let mut plan = StorePlan::default();
    for i in 0..200_000u64 {
        let k = i.to_be_bytes();
        assert_eq!(m.prepare_store(&k, &mut plan).unwrap().stored, 1);
        m.complete_store(&k, true).unwrap();
    }
    let log = m.events();
    assert!(log.num_keys() <= MIN_EVENT_KEYS, "{} keys", log.num_keys());
    let s = m.stats();
    assert_eq!(
        s.events_dropped + log.len() as u64,
        200_000 + (200_000 - 16)
    );
    assert!(s.events_dropped > 0);
    // The newest event is the last store.
    let last = log.iter().last().unwrap();
    assert_eq!(
        (last.removed, last.keys),
        (false, &199_999u64.to_be_bytes()[..])
    );
    let dropped = s.events_dropped;
    let kept = log.len();
    let taken = m.take_events();
    assert_eq!(taken.iter().count(), kept);
    assert_eq!(m.stats().events_dropped, dropped, "kept after the take");
    assert!(m.events().is_empty());
}

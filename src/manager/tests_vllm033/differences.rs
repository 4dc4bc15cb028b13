//! The table of differences between vLLM 0.24 and 0.33 as tests: each row, the same calls
//! and both releases' answers.

use super::*;

/// M-1: a lookup of a key whose store is in flight.
#[test]
fn diff_m1_lookup_of_a_pending_key() {
    for (sem, pending) in [(V024, Lookup::Retry), (V033, Lookup::HitPending)] {
        let mut t = T::new(sem, Policy::Lru, 2);
        let a = t.lk(g(1, 0));
        t.ps("", &ks(&[1]));
        let b = t.lk(g(1, 0));
        t.cs(&ks(&[1]), true);
        assert_eq!([a, b, t.lk(g(1, 0))], [Lookup::Miss, pending, Lookup::Hit]);
    }
}

fn with_threshold(sem: Semantics, num_slots: usize, tracker: usize) -> T {
    T::with(ManagerConfig {
        key_len: 8,
        num_slots,
        store_threshold: 2,
        max_tracker_size: tracker,
        enable_events: true,
        semantics: sem,
        ..Default::default()
    })
}

/// M-2: the threshold counts lookups (0.24) or offers (0.33).
#[test]
fn diff_m2_threshold_counts_lookups_or_offers() {
    for sem in [V024, V033] {
        let mut t = with_threshold(sem, 4, 64);
        t.lk(g(5, 0));
        t.lk(g(5, 0));
        let answers = [
            t.ps("", &ks(&[5])),
            t.ps("", &ks(&[6])),
            t.ps("", &ks(&[6])),
        ];
        let none = stored(&[], &[], &[]);
        let want = if sem == V024 {
            [stored(&[5], &[0], &[]), none.clone(), none]
        } else {
            [none.clone(), none, stored(&[6], &[0], &[])]
        };
        assert_eq!(answers, want, "{sem:?}");
        assert_eq!(t.m.stats().stores_skipped, 2);
    }
}

/// M-3: 0.33 filters only absent candidates and protects the whole offer. (0.24 as vLLM runs
/// it evicts key 1 for key 3 and counts 1 skipped; this library protects every key named in a
/// store in both releases, so its 0.24 answer is "no room", which changes nothing.)
#[test]
fn diff_m3_threshold_filters_candidates_and_the_offer_is_protected() {
    for sem in [V024, V033] {
        let mut t = with_threshold(sem, 1, 1);
        t.lk(g(1, 0));
        t.lk(g(1, 0));
        let a = t.ps("", &ks(&[1]));
        let b = t.ps("", &ks(&[1]));
        t.cs(&ks(&[1]), true);
        t.lk(g(3, 0));
        t.lk(g(3, 0));
        let c = t.ps("", &ks(&[1, 3]));
        let l = (t.lk(g(1, 0)), t.lk(g(3, 0)));
        let skipped = t.m.stats().stores_skipped;
        if sem == V024 {
            assert_eq!((a, b), (stored(&[1], &[0], &[]), stored(&[], &[], &[])));
            assert_eq!(c, None);
            assert_eq!((l, skipped), ((Lookup::Hit, Lookup::Miss), 0));
        } else {
            assert_eq!((a, b), (stored(&[], &[], &[]), stored(&[1], &[0], &[])));
            assert_eq!(c, stored(&[], &[], &[]));
            assert_eq!((l, skipped), ((Lookup::Hit, Lookup::Miss), 2));
        }
    }
}

/// M-4: a failed store's event (0.33 only), and re-stored keys dropped from it.
#[test]
fn diff_m4_failed_store_event() {
    for sem in [V024, V033] {
        let mut t = T::new(sem, Policy::Lru, 4);
        t.ps("a", &ks(&[1, 2, 3]));
        t.cs(&ks(&[1]), true);
        t.cs(&ks(&[1, 2]), false);
        t.ps("b", &ks(&[2]));
        t.cs(&ks(&[3]), false);
        let want = match sem {
            V024 => vec![sto(&[1])],
            V033 => vec![sto(&[1]), (true, true, ks(&[3]))],
        };
        assert_eq!(t.events(), want);
    }
}

/// L-1: recency from insertion, not from store completion.
#[test]
fn diff_l1_recency_from_insertion() {
    for (sem, want) in [
        (V024, stored(&[3], &[1], &[2])),
        (V033, stored(&[3], &[0], &[1])),
    ] {
        let mut t = T::new(sem, Policy::Lru, 2);
        t.ps("a", &ks(&[1]));
        t.ps("a", &ks(&[2]));
        t.cs(&ks(&[2]), true);
        t.cs(&ks(&[1]), true);
        assert_eq!(t.ps("a", &ks(&[3])), want, "{sem:?}");
    }
}

/// L-2: a load's completion is not a use.
#[test]
fn diff_l2_load_completion_is_not_a_use() {
    for (sem, want) in [
        (V024, stored(&[3], &[1], &[2])),
        (V033, stored(&[3], &[0], &[1])),
    ] {
        let mut t = T::new(sem, Policy::Lru, 2);
        ps_done(&mut t, &[1, 2]);
        t.pl("", &ks(&[1]));
        t.cl(&ks(&[1]));
        assert_eq!(t.ps("", &ks(&[3])), want, "{sem:?}");
    }
}

/// L-3: touch re-ranks pinned keys too.
#[test]
fn diff_l3_touch_reranks_pinned_keys() {
    for (sem, want) in [
        (V024, stored(&[5], &[1], &[2])),
        (V033, stored(&[5], &[0], &[1])),
    ] {
        let mut t = T::new(sem, Policy::Lru, 3);
        ps_done(&mut t, &[1, 2, 3]);
        t.pl("", &ks(&[1]));
        t.touch(&ks(&[1]));
        t.touch(&ks(&[2]));
        t.cl(&ks(&[1]));
        assert_eq!(ps_done(&mut t, &[4]).unwrap().2, ks(&[3]));
        assert_eq!(t.ps("", &ks(&[5])), want, "{sem:?}");
    }
}

/// L-4: a request's tail is evicted before its head.
#[test]
fn diff_l4_tails_before_heads() {
    for (sem, want) in [
        (V024, stored(&[3], &[0], &[1])),
        (V033, stored(&[3], &[1], &[2])),
    ] {
        let mut t = T::new(sem, Policy::Lru, 2);
        t.pos("a", &[(g(1, 0), 16), (g(2, 0), 32)]);
        t.ps("a", &ks(&[1, 2]));
        t.cs(&ks(&[1, 2]), true);
        assert_eq!(t.ps("b", &ks(&[3])), want, "{sem:?}");
    }
}

/// L-5: the finish commit makes a request's keys newest.
#[test]
fn diff_l5_finish_commits_recency() {
    for (sem, want) in [
        (V024, stored(&[3], &[0], &[1])),
        (V033, stored(&[3], &[1], &[2])),
    ] {
        let mut t = T::new(sem, Policy::Lru, 2);
        t.req("a");
        t.req("b");
        t.ps("a", &ks(&[1]));
        t.ps("b", &ks(&[2]));
        t.cs(&ks(&[1]), true);
        t.cs(&ks(&[2]), true);
        t.finish("a");
        assert_eq!(t.ps("c", &ks(&[3])), want, "{sem:?}");
    }
}

/// eviction falls back to T1 when T2 has no candidate.
#[test]
fn diff_a1_arc_falls_back_to_t1() {
    for sem in [V024, V033] {
        let mut t = T::new(sem, Policy::Arc, 2);
        let a = "a";
        t.ps(a, &ks(&[1, 2]));
        t.cs(&ks(&[1, 2]), true);
        t.touch(&ks(&[1]));
        assert_eq!(t.ps(a, &ks(&[3])).unwrap().2, ks(&[2]));
        t.cs(&ks(&[3]), true);
        t.touch(&ks(&[2]));
        t.touch(&ks(&[2]));
        t.pl(a, &ks(&[1]));
        assert_eq!(t.arc(), (ks(&[3]), ks(&[1]), ks(&[2]), vec![], 2.0));
        let want = match sem {
            V024 => None,
            V033 => stored(&[4], &[1], &[3]),
        };
        assert_eq!(t.ps(a, &ks(&[4])), want, "{sem:?}");
    }
}

/// ghost hits of offered keys adapt the target before that store's eviction.
#[test]
fn diff_a2_store_misses_adapt_the_target() {
    for sem in [V024, V033] {
        let mut t = T::new(sem, Policy::Arc, 2);
        ps_done(&mut t, &[1, 2]);
        t.touch(&ks(&[1]));
        ps_done(&mut t, &[3]);
        assert_eq!(ps_done(&mut t, &[2]).unwrap().2, ks(&[3]));
        let target = t.arc().4;
        let last = ps_done(&mut t, &[3]).unwrap().2;
        if sem == V024 {
            assert_eq!((target, last), (0.0, ks(&[2])));
            assert_eq!(t.arc(), (ks(&[3]), ks(&[1]), ks(&[2]), vec![], 0.0));
        } else {
            assert_eq!((target, last), (1.0, ks(&[1])));
            assert_eq!(t.arc(), (ks(&[2, 3]), vec![], vec![], ks(&[1]), 2.0));
        }
    }
}

/// a reused key is promoted when its request finishes.
#[test]
fn diff_a3_reuse_promotes_at_finish() {
    for sem in [V024, V033] {
        let mut t = T::new(sem, Policy::Arc, 2);
        t.ps("a", &ks(&[1, 2]));
        t.cs(&ks(&[1, 2]), true);
        t.req("b");
        t.pl("b", &ks(&[1]));
        t.cl(&ks(&[1]));
        t.finish("b");
        let (t1, t2, ..) = t.arc();
        let r = t.ps("c", &ks(&[3]));
        if sem == V024 {
            assert_eq!((t1, t2, r), (ks(&[1, 2]), vec![], stored(&[3], &[0], &[1])));
        } else {
            assert_eq!((t1, t2, r), (ks(&[2]), ks(&[1]), stored(&[3], &[1], &[2])));
        }
    }
}

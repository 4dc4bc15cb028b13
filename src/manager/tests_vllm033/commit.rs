//! The 0.33 commit's shortcuts against the key-by-key commit: the LRU's commit of a request's
//! anchor as it lies, and ARC's commit of the keys a request's last store inserted.

use super::*;

/// The 0.33 LRU commit that takes a request's anchor as it lies gives the ranks and order of
/// the key-by-key commit.
#[test]
fn lru_commit_in_anchor_order_matches_the_key_by_key_commit() {
    commit_shortcut_matches_the_key_by_key_commit(Policy::Lru);
}

/// The 0.33 ARC commit that reverses the run its last store inserted gives the lists of the
/// key-by-key commit.
#[test]
fn arc_commit_of_the_inserted_tail_matches_the_key_by_key_commit() {
    commit_shortcut_matches_the_key_by_key_commit(Policy::Arc);
}

/// Random interleavings of requests (loads, stores with ascending or scattered positions,
/// failed stores, touches, evictions, anonymous stores) on two managers, one committing key by
/// key, compared after every call; each shortcut and the fallback are taken often.
fn commit_shortcut_matches_the_key_by_key_commit(which: Policy) {
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let (mut shortcuts, mut fallbacks) = (0, 0);
    for _ in 0..300 {
        let mk = |general| {
            let mut t = T::new(Semantics::Vllm033, which, 6);
            t.m.commit_general_only = general;
            t
        };
        let mut m = [mk(false), mk(true)];
        // (request in each manager, last position given)
        let mut active: Vec<([RequestId; 2], u64)> = Vec::new();
        for _ in 0..60 {
            let op = next(7);
            let pick = (!active.is_empty()).then(|| next(active.len() as u64) as usize);
            let mut keys: Vec<u64> = (0..1 + next(4)).map(|_| g(next(10) as u32, 0)).collect();
            keys.sort_unstable();
            keys.dedup();
            match (op, pick) {
                (0, _) | (1..=3, None) => {
                    let r = [m[0].m.begin_request(), m[1].m.begin_request()];
                    active.push((r, 0));
                }
                (1, Some(i)) => {
                    // Ascending positions after the request's last, or (1 in 4) scattered.
                    let scattered = next(4) == 0;
                    let p: Vec<u64> = keys
                        .iter()
                        .map(|_| match scattered {
                            true => 16 * (1 + next(8)),
                            false => {
                                active[i].1 += 16;
                                active[i].1
                            }
                        })
                        .collect();
                    let ok = next(5) != 0;
                    let out: Vec<_> = m
                        .iter_mut()
                        .zip(active[i].0)
                        .map(|(t, r)| {
                            let mut plan = StorePlan::default();
                            let c = t.m.prepare_store_for(r, &flat(&keys), &p, &mut plan);
                            let done: Vec<u64> =
                                plan.indices.iter().map(|&j| keys[j as usize]).collect();
                            t.m.complete_store(&flat(&done), ok).unwrap();
                            (c.map_err(|e| e.to_string()), plan.slots, plan.evicted)
                        })
                        .collect();
                    assert_eq!(out[0], out[1]);
                    // (1 in 3) the request finishes at once, as a request of a trace does.
                    if next(3) == 0 {
                        let (r, _) = active.swap_remove(i);
                        finish(&mut m, r, &mut shortcuts, &mut fallbacks);
                    }
                }
                (2, Some(i)) => {
                    let ready: Vec<u64> = keys
                        .into_iter()
                        .filter(|&k| m[0].lk(k) == Lookup::Hit)
                        .collect();
                    let p: Vec<u64> = ready
                        .iter()
                        .map(|_| {
                            active[i].1 += 16;
                            active[i].1
                        })
                        .collect();
                    for (t, r) in m.iter_mut().zip(active[i].0) {
                        let mut slots = vec![0; ready.len()];
                        t.m.prepare_load_for(r, &flat(&ready), &p, &mut slots)
                            .unwrap();
                        t.m.complete_load(&flat(&ready)).unwrap();
                    }
                }
                (3, Some(i)) => {
                    let (r, _) = active.swap_remove(i);
                    finish(&mut m, r, &mut shortcuts, &mut fallbacks);
                }
                (4, _) => m.iter_mut().for_each(|t| t.touch(&keys)),
                _ => {
                    let out: Vec<_> = m.iter_mut().map(|t| t.ps("", &keys)).collect();
                    assert_eq!(out[0], out[1]);
                    let done = out[0].as_ref().map(|s| s.0.clone()).unwrap_or_default();
                    m.iter_mut().for_each(|t| t.cs(&done, true));
                }
            }
            for t in &m {
                t.m.check_invariants().unwrap();
            }
            match which {
                Policy::Lru => {
                    let lru = |t: &T| {
                        let l = t.m.policy.ranked_lru().unwrap();
                        let order = l.order();
                        let ranks: Vec<_> = order.iter().map(|&s| l.rank(s)).collect();
                        (order, ranks)
                    };
                    assert_eq!(lru(&m[0]), lru(&m[1]));
                }
                Policy::Arc => {
                    let arc = |t: &T| t.m.policy.arc().unwrap().snapshot(&t.m.keys);
                    assert_eq!(arc(&m[0]), arc(&m[1]));
                }
            }
        }
    }
    assert!(
        shortcuts > 100 && fallbacks > 100,
        "{shortcuts} {fallbacks}"
    );
}

/// Finishes request `r` (one handle per manager), counting whether the first manager commits
/// it by a shortcut.
fn finish(m: &mut [T; 2], r: [RequestId; 2], shortcuts: &mut usize, fallbacks: &mut usize) {
    for (t, r) in m.iter_mut().zip(r) {
        let before = t.m.commit_shortcuts;
        t.m.finish_request(r).unwrap();
        if !t.m.commit_general_only {
            *(if t.m.commit_shortcuts > before {
                &mut *shortcuts
            } else {
                &mut *fallbacks
            }) += 1;
        }
    }
}

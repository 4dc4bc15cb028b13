//! The far-sighted reference: Belady's MIN on the host tier's block keys, offline (it knows the
//! whole request sequence), for the sequential prefix-cache model of the sweep.
//!
//! The model: requests in arrival order; a request's hit is the longest run of its leading full
//! blocks in the cache; afterwards all its full blocks are candidates to be cached. The cache
//! keeps at most `capacity` blocks: after each request, while it holds more, it evicts the block
//! whose next use is farthest (a request's own blocks compete too, so a block may be dropped
//! right after its use, which a tier that stores every block cannot do).
//!
//! Eviction order (the rule, exactly): the largest next-use request index first (a block never
//! used again counts as infinitely far); among blocks next used by the same request, the one at
//! the largest position in that request's prompt (its tail: losing a tail block costs only that
//! block of the hit, losing a head block costs the rest of the hit); among blocks never used
//! again, the largest block id.
//!
//! MIN is optimal for hits of single keys, not provably for prefix hits (a block is worth
//! nothing at its next use if an earlier block of that prompt is gone): the report says where it
//! falls below LRU or ARC.

use crate::fasthash::HashMap;
use crate::trace::Workload;
use std::collections::BTreeSet;

const NEVER: (u64, u64) = (u64::MAX, 0);

/// The full blocks of each request, as indices into the workload's requests.
fn full_blocks(w: &Workload) -> Vec<&[u64]> {
    let bt = w.block_tokens as u64;
    w.requests
        .iter()
        .map(|r| &r.blocks[..(r.input_tokens / bt) as usize])
        .collect()
}

/// For each request and position: (next request using the block, its position there).
fn next_uses(reqs: &[&[u64]]) -> Vec<Vec<(u64, u64)>> {
    let mut later: HashMap<u64, (u64, u64)> = HashMap::default();
    let mut out = vec![Vec::new(); reqs.len()];
    for (t, keys) in reqs.iter().enumerate().rev() {
        out[t] = keys
            .iter()
            .map(|k| later.get(k).copied().unwrap_or(NEVER))
            .collect();
        for (j, &k) in keys.iter().enumerate().rev() {
            later.insert(k, (t as u64, j as u64));
        }
    }
    out
}

/// What a MIN run found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MinResult {
    /// Hit blocks per request.
    pub hits: Vec<u64>,
    /// Blocks evicted after each request, in eviction order.
    pub victims: Vec<Vec<u64>>,
}

/// Runs MIN with room for `capacity` blocks over the workload's full blocks.
pub fn run(w: &Workload, capacity: usize) -> MinResult {
    run_on(&full_blocks(w), capacity)
}

/// Runs MIN on request key sequences.
pub fn run_on(reqs: &[&[u64]], capacity: usize) -> MinResult {
    let next = next_uses(reqs);
    // Cached blocks: key -> its eviction rank; ranks ordered, the largest evicted first.
    let mut cached: HashMap<u64, (u64, u64, u64)> = HashMap::default();
    let mut order: BTreeSet<(u64, u64, u64)> = BTreeSet::new();
    let mut out = MinResult::default();
    for (t, keys) in reqs.iter().enumerate() {
        out.hits
            .push(keys.iter().take_while(|k| cached.contains_key(k)).count() as u64);
        for (j, &k) in keys.iter().enumerate() {
            let (nt, np) = next[t][j];
            let rank = (nt, if nt == u64::MAX { k } else { np }, k);
            if let Some(old) = cached.insert(k, rank) {
                order.remove(&old);
            }
            order.insert(rank);
        }
        let mut victims = Vec::new();
        while cached.len() > capacity {
            let Some(v) = order.pop_last() else { break };
            cached.remove(&v.2);
            victims.push(v.2);
        }
        out.victims.push(victims);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// The victims by brute force: after each request, candidates are the cached blocks and the
    /// request's; while over capacity, scan the future for each candidate's next use and evict by
    /// the documented rule.
    fn brute_force(reqs: &[&[u64]], capacity: usize) -> MinResult {
        let mut cache: HashSet<u64> = HashSet::new();
        let mut out = MinResult::default();
        for (t, keys) in reqs.iter().enumerate() {
            out.hits
                .push(keys.iter().take_while(|k| cache.contains(k)).count() as u64);
            cache.extend(keys.iter().copied());
            let mut victims = Vec::new();
            while cache.len() > capacity {
                let rank = |k: u64| {
                    for (u, later) in reqs.iter().enumerate().skip(t + 1) {
                        if let Some(p) = later.iter().position(|&x| x == k) {
                            return (u as u64, p as u64, k);
                        }
                    }
                    (u64::MAX, k, k)
                };
                let v = *cache.iter().max_by_key(|&&k| rank(k)).unwrap();
                cache.remove(&v);
                victims.push(v);
            }
            out.victims.push(victims);
        }
        out
    }

    #[test]
    fn victims_equal_the_brute_force_choice() {
        let cases: Vec<Vec<Vec<u64>>> = vec![
            vec![
                vec![1, 2, 3],
                vec![4, 5],
                vec![1, 2, 6],
                vec![4, 5, 7],
                vec![1, 2, 3],
            ],
            // Ties: blocks 1 and 2 are next used by the same request; the tail (2) goes first.
            vec![vec![1, 2], vec![3], vec![1, 2]],
            vec![
                vec![9, 8, 7, 6],
                vec![9, 8],
                vec![5, 4],
                vec![9, 8, 7],
                vec![5, 4, 3],
                vec![6],
            ],
        ];
        for reqs in &cases {
            let r: Vec<&[u64]> = reqs.iter().map(|v| v.as_slice()).collect();
            for cap in 0..8 {
                assert_eq!(
                    run_on(&r, cap),
                    brute_force(&r, cap),
                    "{reqs:?} capacity {cap}"
                );
            }
        }
        let r: Vec<&[u64]> = cases[1].iter().map(|v| v.as_slice()).collect();
        let one = run_on(&r, 1);
        assert_eq!(
            one.victims,
            vec![vec![2], vec![3], vec![2]],
            "the tail 2 first; 3 never again"
        );
        assert_eq!(one.hits, vec![0, 0, 1]);
        assert_eq!(run_on(&r, 2).victims[1], vec![3]);
    }

    #[test]
    fn random_sequences_equal_the_brute_force_choice() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for _ in 0..200 {
            let reqs: Vec<Vec<u64>> = (0..rng.random_range(1..12))
                .map(|_| {
                    let mut v: Vec<u64> = (0..rng.random_range(0..6))
                        .map(|_| rng.random_range(0..10))
                        .collect();
                    v.dedup();
                    let mut seen = HashSet::new();
                    v.retain(|k| seen.insert(*k));
                    v
                })
                .collect();
            let r: Vec<&[u64]> = reqs.iter().map(|v| v.as_slice()).collect();
            let cap = rng.random_range(0..8);
            assert_eq!(
                run_on(&r, cap),
                brute_force(&r, cap),
                "{reqs:?} capacity {cap}"
            );
        }
    }
}

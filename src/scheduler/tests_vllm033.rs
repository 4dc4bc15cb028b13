//! Scheduler scenarios in both releases' semantics: vLLM 0.33's scheduler traces (one
//! full-attention group, 4-token blocks and chunks, one worker), each with the answers of 0.24
//! and 0.33 for the same host calls.

use super::*;
use crate::manager::{Policy, Semantics};

const V024: Semantics = Semantics::Vllm024;
const V033: Semantics = Semantics::Vllm033;
const TPB: u64 = 4;

fn cfg(semantics: Semantics, num_slots: usize) -> SchedulerConfig {
    SchedulerConfig {
        key_len: 8,
        gpu_block_size: TPB as u32,
        block_size_factor: 1,
        num_slots,
        policy: Policy::Lru,
        num_workers: 1,
        offload_prompt_only: false,
        enable_events: true,
        semantics,
        ..Default::default()
    }
}

/// The hash of block `i` of prompt family `seed`.
fn h(seed: u64, i: u64) -> u64 {
    seed * 1000 + i
}

fn hashes(seed: u64, from: u64, to: u64) -> Vec<u8> {
    (from..to).flat_map(|i| h(seed, i).to_be_bytes()).collect()
}

fn dec(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| u64::from_be_bytes(c.try_into().unwrap()))
        .collect()
}

struct T {
    s: Scheduler,
    step: Step,
}

impl T {
    fn new(cfg: SchedulerConfig) -> Self {
        Self {
            s: Scheduler::new(cfg).unwrap(),
            step: Step::new(),
        }
    }

    /// Adds request `id` of `tokens` prompt tokens hashed from `seed`, matches it (a GPU hit of
    /// `gpu_hit` tokens) and records its blocks; returns the match.
    fn admit(&mut self, id: u64, seed: u64, tokens: u64, blocks: &[u32]) -> Match {
        self.s.add_request(id, tokens, None).unwrap();
        self.s
            .append_block_hashes(id, &hashes(seed, 0, tokens / TPB), tokens)
            .unwrap();
        let m = self.s.match_request(id, 0).unwrap();
        self.s.on_alloc(id, blocks, 0).unwrap();
        self.s.check_invariants().unwrap();
        m
    }

    /// Builds a step; returns its store jobs as (job id, stored block hashes, slots) and its
    /// flush set.
    fn build(
        &mut self,
        scheduled: &[ScheduledRequest<'_>],
        preempted: &[u64],
    ) -> Vec<(u64, Vec<u64>, Vec<u32>)> {
        self.s
            .build_step(scheduled, preempted, &mut self.step)
            .unwrap();
        self.s.check_invariants().unwrap();
        let st = &self.step;
        st.jobs()
            .iter()
            .filter(|j| j.kind == Direction::Store)
            .map(|j| {
                let keys = dec(&self.s.jobs[&j.id].keys);
                (j.id, keys, st.dst(j).to_vec())
            })
            .collect()
    }

    fn complete(&mut self, jobs: &[(u64, Vec<u64>, Vec<u32>)]) {
        let reports: Vec<_> = jobs
            .iter()
            .map(|j| JobReport {
                job_id: j.0,
                count: 1,
                success: true,
            })
            .collect();
        self.s.complete_jobs(&reports).unwrap();
        self.s.check_invariants().unwrap();
    }

    /// Evicted keys (the tier's removed events) since the last call.
    fn evicted(&mut self) -> Vec<u64> {
        let ev = self.s.take_events();
        ev.iter()
            .filter(|e| e.removed)
            .flat_map(|e| dec(e.keys))
            .collect()
    }

    fn stored(&self, k: u64) -> bool {
        self.s.manager.ref_count(&k.to_be_bytes()).is_some()
    }
}

fn sched<'a>(
    id: u64,
    computed: u64,
    n: u64,
    tokens: u64,
    blocks: &'a [u32],
) -> ScheduledRequest<'a> {
    ScheduledRequest {
        request_id: id,
        num_computed_tokens: computed,
        num_scheduled_tokens: n,
        num_tokens: tokens,
        new_block_ids: blocks,
        resumed: false,
    }
}

/// S-1 (differences row S-2): the chunk completed by a finished request's last computed token
/// is stored by the next step in 0.33 (the token count lagged when it was scheduled); 0.24
/// never offers it.
#[test]
fn a_finished_request_gets_its_final_store_in_0_33() {
    for sem in [V024, V033] {
        let mut t = T::new(cfg(sem, 8));
        let b = [0, 1, 2];
        assert_eq!(t.admit(1, 1, 10, &b), Match::Miss);
        let jobs = t.build(&[sched(1, 0, 10, 10, &b)], &[]);
        assert_eq!(jobs.len(), 1);
        assert_eq!(
            (jobs[0].1.clone(), jobs[0].2.clone()),
            (vec![h(1, 0), h(1, 1)], vec![0, 1])
        );
        t.complete(&jobs);
        // Decode: the token count lags one behind the computed tokens (async scheduling).
        assert!(t.build(&[sched(1, 10, 1, 10, &[])], &[]).is_empty());
        assert!(t.build(&[sched(1, 11, 1, 11, &[])], &[]).is_empty());
        // Finished at 13 tokens: block 2 (tokens 8..12) was computed by the last step.
        t.s.append_block_hashes(1, &hashes(1, 2, 3), 13).unwrap();
        t.s.finish_request(1).unwrap();
        let jobs = t.build(&[], &[]);
        if sem == V033 {
            assert_eq!(jobs.len(), 1);
            assert_eq!(
                (jobs[0].1.clone(), jobs[0].2.clone()),
                (vec![h(1, 2)], vec![2])
            );
            assert!(t.s.has_jobs_in_flight(1).unwrap());
            t.complete(&jobs);
            assert!(t.stored(h(1, 2)));
        } else {
            assert!(jobs.is_empty());
            assert!(!t.stored(h(1, 2)));
        }
        // Dropped once nothing is left in flight.
        assert!(t.s.has_jobs_in_flight(1).is_err(), "{sem:?}");
        assert_eq!(t.s.stats().requests, 0);
    }
}

/// A final store leaves out a chunk whose GPU block was given to another request since the
/// request finished (its KV may be overwritten by then), and the chunks after it.
#[test]
fn a_final_store_leaves_out_chunks_on_reallocated_blocks() {
    let mut t = T::new(cfg(V033, 8));
    let b = [0, 1, 2];
    t.admit(1, 1, 12, &b);
    // Only the first chunk is stored while running (the token count lags).
    let jobs = t.build(&[sched(1, 0, 8, 8, &b)], &[]);
    assert_eq!(jobs[0].1, vec![h(1, 0), h(1, 1)]);
    t.complete(&jobs);
    assert!(t.build(&[sched(1, 8, 4, 8, &[])], &[]).is_empty());
    t.s.finish_request(1).unwrap();
    // Block 2 goes to request 2 before the next step.
    t.admit(2, 2, 4, &[2]);
    let jobs = t.build(&[sched(2, 0, 4, 4, &[2])], &[]);
    assert_eq!(jobs.len(), 1, "request 2's own store only");
    assert_eq!(jobs[0].1, vec![h(2, 0)]);
    assert!(!t.stored(h(1, 2)));
    assert!(t.s.has_jobs_in_flight(1).is_err());
}

/// S-3 (differences rows S-3, L-4): the evicted prefix of a preempted request is restored when
/// it is re-admitted (0.33 rewinds the next chunk to store at every match), and a request's
/// tail is evicted before its head.
#[test]
fn a_readmitted_request_restores_its_evicted_prefix_in_0_33() {
    for sem in [V024, V033] {
        let mut t = T::new(cfg(sem, 2));
        let a = [0, 1, 2];
        t.admit(1, 1, 9, &a);
        let jobs = t.build(&[sched(1, 0, 9, 9, &a)], &[]);
        assert_eq!(jobs[0].1, vec![h(1, 0), h(1, 1)]);
        t.complete(&jobs);
        assert!(t.build(&[sched(1, 9, 1, 10, &[])], &[]).is_empty());
        t.build(&[], &[1]);
        let b = [10, 11];
        t.admit(2, 2, 8, &b);
        let jobs = t.build(&[sched(2, 0, 8, 8, &b)], &[]);
        assert_eq!(jobs[0].1, vec![h(2, 0), h(2, 1)]);
        t.complete(&jobs);
        let want = match sem {
            V024 => vec![h(1, 0), h(1, 1)],
            V033 => vec![h(1, 1), h(1, 0)],
        };
        assert_eq!(t.evicted(), want, "{sem:?}: A's tail first in 0.33");
        t.s.finish_request(2).unwrap();
        assert!(t.build(&[], &[]).is_empty());
        // A comes back with a GPU prefix hit of 8 tokens: less than a chunk to gain.
        assert_eq!(t.s.match_request(1, 8).unwrap(), Match::Miss);
        t.s.on_alloc(1, &a, 0).unwrap();
        let resumed = ScheduledRequest {
            resumed: true,
            ..sched(1, 8, 2, 10, &a)
        };
        let jobs = t.build(&[resumed], &[]);
        if sem == V033 {
            assert_eq!(
                (jobs[0].1.clone(), jobs[0].2.clone()),
                (vec![h(1, 0), h(1, 1)], vec![0, 1])
            );
            assert_eq!(t.evicted(), vec![h(2, 1), h(2, 0)]);
        } else {
            assert!(jobs.is_empty(), "0.24 offers nothing");
        }
        t.complete(&jobs);
        t.s.append_block_hashes(1, &hashes(1, 2, 3), 12).unwrap();
        let jobs = t.build(&[sched(1, 10, 2, 12, &[])], &[]);
        assert_eq!(jobs[0].1, vec![h(1, 2)]);
        let want = match sem {
            V024 => vec![h(2, 0)],
            V033 => vec![h(1, 1)],
        };
        assert_eq!(t.evicted(), want, "{sem:?}");
        t.complete(&jobs);
    }
}

/// Differences row S-1: a match does not touch the request's keys in 0.33, so a looked-up
/// prefix keeps its place in the eviction order.
#[test]
fn a_match_touches_nothing_in_0_33() {
    for sem in [V024, V033] {
        let mut t = T::new(cfg(sem, 2));
        for (id, seed, blocks) in [(1, 1, [0]), (2, 2, [1])] {
            t.admit(id, seed, 4, &blocks);
            let jobs = t.build(&[sched(id, 0, 4, 4, &blocks)], &[]);
            t.complete(&jobs);
            t.s.finish_request(id).unwrap();
            t.build(&[], &[]);
        }
        // Request 3 shares request 1's prefix: its match looks (and in 0.24 touches) h(1, 0).
        t.s.add_request(3, 8, None).unwrap();
        let mut hs = hashes(1, 0, 1);
        hs.extend(hashes(3, 1, 2));
        t.s.append_block_hashes(3, &hs, 8).unwrap();
        assert_eq!(t.s.match_request(3, 0).unwrap(), Match::Hit(4));
        t.s.finish_request(3).unwrap();
        t.build(&[], &[]);
        // A new store evicts the least recent key.
        t.admit(4, 4, 4, &[5]);
        t.build(&[sched(4, 0, 4, 4, &[5])], &[]);
        let want = match sem {
            V024 => vec![h(2, 0)],
            V033 => vec![h(1, 0)],
        };
        assert_eq!(t.evicted(), want, "{sem:?}");
    }
}

/// S-6 (differences row S-7): a store without room is offered again at the next step and each
/// failure is counted.
#[test]
fn a_store_without_room_is_offered_again_and_counted() {
    for sem in [V024, V033] {
        let mut t = T::new(cfg(sem, 1));
        t.admit(1, 1, 4, &[0]);
        let jobs = t.build(&[sched(1, 0, 4, 4, &[0])], &[]);
        assert_eq!(jobs.len(), 1);
        t.admit(2, 2, 8, &[1, 2]);
        assert!(t.build(&[sched(2, 0, 4, 8, &[1, 2])], &[]).is_empty());
        assert!(t.build(&[sched(2, 4, 1, 8, &[])], &[]).is_empty());
        assert_eq!(t.s.stats().store_no_room, 2, "{sem:?}");
    }
}

/// S-5 (differences row S-5): after a reset with a store in flight, the request offers its
/// chunks again from the first, and the stale report is ignored.
#[test]
fn a_reset_with_a_store_in_flight_re_offers_from_the_first_chunk() {
    for sem in [V024, V033] {
        let mut t = T::new(cfg(sem, 8));
        let b = [0, 1, 2];
        t.admit(1, 1, 8, &b);
        let first = t.build(&[sched(1, 0, 8, 9, &b)], &[]);
        assert_eq!(first[0].1, vec![h(1, 0), h(1, 1)]);
        t.s.reset().unwrap();
        let jobs = t.build(&[sched(1, 8, 1, 9, &[])], &[]);
        assert_eq!(t.step.flush(), &[first[0].0]);
        assert_eq!(
            (jobs[0].1.clone(), jobs[0].2.clone()),
            (vec![h(1, 0), h(1, 1)], vec![0, 1])
        );
        t.complete(&first);
        t.complete(&jobs);
        assert!(t.stored(h(1, 1)));
    }
}

/// A request finished with no job in flight and no chunk left for a final store is dropped
/// at once, and its record is still committed by the next step, after that step's stores: the
/// store that needs room evicts the finished request's key, which ranks oldest until then.
#[test]
fn a_request_with_nothing_left_to_store_is_dropped_at_finish_and_committed_next_step() {
    let mut t = T::new(cfg(V033, 2));
    for (id, block) in [(1, 0), (2, 1)] {
        t.admit(id, id, 4, &[block]);
        let jobs = t.build(&[sched(id, 0, 4, 4, &[block])], &[]);
        assert_eq!(jobs[0].1, vec![h(id, 0)]);
        t.complete(&jobs);
    }
    t.evicted();
    t.s.finish_request(1).unwrap();
    assert!(t.s.has_jobs_in_flight(1).is_err(), "dropped at once");
    assert_eq!(t.s.stats().requests, 1);
    assert_eq!(t.s.manager.num_active_requests(), 2, "not committed yet");
    assert!(matches!(t.s.finish_request(1), Err(Error::NotFound(_))));
    t.admit(3, 3, 4, &[2]);
    let jobs = t.build(&[sched(3, 0, 4, 4, &[2])], &[]);
    assert_eq!(jobs[0].1, vec![h(3, 0)]);
    // Committed at finish, request 1's key would have ranked newest and request 2's gone.
    assert_eq!(t.evicted(), vec![h(1, 0)]);
    assert_eq!(t.s.manager.num_active_requests(), 2, "requests 2 and 3");
    t.complete(&jobs);
    assert!(t.stored(h(2, 0)) && t.stored(h(3, 0)));
}

/// A request finished while a reset comes before the next step: its record is committed, its
/// final store never happens, and it is dropped.
#[test]
fn a_reset_commits_requests_finished_since_the_last_step() {
    let mut t = T::new(cfg(V033, 8));
    let b = [0, 1];
    t.admit(1, 1, 8, &b);
    t.build(&[sched(1, 0, 8, 8, &b)], &[]);
    t.s.finish_request(1).unwrap();
    t.s.reset().unwrap();
    assert_eq!(t.s.manager.num_active_requests(), 0);
    assert!(t.s.has_jobs_in_flight(1).is_err());
    assert!(t.build(&[], &[]).is_empty());
}

/// A request preempted (its blocks given back) and then finished has nothing on the GPU: its
/// final store reads no block. Likewise a request re-matched after a preemption has only its
/// GPU prefix hit in its new blocks.
#[test]
fn a_final_store_reads_no_block_given_back_at_preemption() {
    let mut t = T::new(cfg(V033, 8));
    let b = [0, 1, 2];
    t.admit(1, 1, 12, &b);
    // The token count lags: only two chunks are stored while running.
    let jobs = t.build(&[sched(1, 0, 12, 8, &b)], &[]);
    assert_eq!(jobs[0].1, vec![h(1, 0), h(1, 1)]);
    t.complete(&jobs);
    t.build(&[], &[1]);
    t.s.finish_request(1).unwrap();
    assert!(
        t.build(&[], &[]).is_empty(),
        "blocks 0..3 are not the request's any more"
    );
    assert!(!t.stored(h(1, 2)));
    // Preempted, matched again (no GPU hit), allocated new blocks, then finished.
    t.admit(2, 2, 12, &b);
    let jobs = t.build(&[sched(2, 0, 12, 8, &b)], &[]);
    t.complete(&jobs);
    t.build(&[], &[2]);
    assert_eq!(t.s.match_request(2, 0).unwrap(), Match::Hit(8));
    t.s.on_alloc(2, &[5, 6, 7], 0).unwrap();
    t.s.finish_request(2).unwrap();
    assert!(
        t.build(&[], &[]).is_empty(),
        "blocks 5..8 hold nothing computed"
    );
    assert!(!t.stored(h(2, 2)));
}

//! Scheduler scenarios (one full-attention group): vLLM 0.24's connector scheduler tests in our
//! own words, and the races of `docs/design.md`.

use super::*;
use crate::manager::Lookup;
use crate::manager::Policy;

const GBS: u64 = 4;
const F: u64 = 3;

fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        key_len: 8,
        gpu_block_size: GBS as u32,
        block_size_factor: F as u32,
        num_slots: 100,
        policy: Policy::Lru,
        num_workers: 1,
        offload_prompt_only: false,
        enable_events: true,
        ..Default::default()
    }
}

/// Hash of GPU block `i` of a prompt family `seed` (equal seeds share prefixes).
fn hashes(seed: u64, from: u64, to: u64) -> Vec<u8> {
    (from..to)
        .flat_map(|i| (seed * 1_000_000 + i).to_be_bytes())
        .collect()
}

fn key(seed: u64, chunk: u64) -> Vec<u8> {
    hashes(seed, (chunk + 1) * F - 1, (chunk + 1) * F)
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

    fn check(&self) {
        self.s.check_invariants().unwrap();
    }

    /// Adds request `id` with `tokens` prompt tokens hashed from `seed`.
    fn add(&mut self, id: u64, seed: u64, tokens: u64) {
        self.s.add_request(id, tokens, None).unwrap();
        self.s
            .append_block_hashes(id, &hashes(seed, 0, tokens / GBS), tokens)
            .unwrap();
        self.check();
    }

    /// Adds request `id` (a miss), schedules its whole prompt on GPU blocks from `first_block`
    /// and returns the store job of its chunks.
    fn prefill(&mut self, id: u64, seed: u64, tokens: u64, first_block: u32) -> u64 {
        self.add(id, seed, tokens);
        assert_eq!(self.matched(id, 0), Match::Miss);
        let b = blocks(first_block, first_block + (tokens / GBS) as u32);
        self.s.on_alloc(id, &b, 0).unwrap();
        self.step(&[sched(id, 0, tokens, tokens, &b)], &[]).jobs()[0].id
    }

    fn grow(&mut self, id: u64, seed: u64, from_tokens: u64, to_tokens: u64) {
        self.s
            .append_block_hashes(
                id,
                &hashes(seed, from_tokens / GBS, to_tokens / GBS),
                to_tokens,
            )
            .unwrap();
    }

    fn matched(&mut self, id: u64, gpu_hit: u64) -> Match {
        let m = self.s.match_request(id, gpu_hit).unwrap();
        self.check();
        m
    }

    fn step(&mut self, scheduled: &[ScheduledRequest<'_>], preempted: &[u64]) -> &Step {
        self.s
            .build_step(scheduled, preempted, &mut self.step)
            .unwrap();
        self.check();
        &self.step
    }

    fn complete(&mut self, ids: &[u64], success: bool) {
        let reports: Vec<_> = ids
            .iter()
            .map(|&job_id| JobReport {
                job_id,
                count: 1,
                success,
            })
            .collect();
        self.s.complete_jobs(&reports).unwrap();
        self.check();
    }

    fn jobs(&self, kind: Direction) -> Vec<(u64, u64, Vec<u32>, Vec<u32>)> {
        let st = &self.step;
        st.jobs()
            .iter()
            .filter(|j| j.kind == kind)
            .map(|j| (j.id, j.request_id, st.src(j).to_vec(), st.dst(j).to_vec()))
            .collect()
    }

    fn lookup(&mut self, k: &[u8]) -> Lookup {
        // A probe outside the scheduler; the tier's counters are not used by the tests below.
        match self.s.manager.ref_count(k) {
            None => Lookup::Miss,
            Some(-1) => Lookup::Retry,
            Some(_) => Lookup::Hit,
        }
    }
}

fn sched<'a>(
    id: u64,
    computed: u64,
    scheduled: u64,
    tokens: u64,
    blocks: &'a [u32],
) -> ScheduledRequest<'a> {
    ScheduledRequest {
        request_id: id,
        num_computed_tokens: computed,
        num_scheduled_tokens: scheduled,
        num_tokens: tokens,
        new_block_ids: blocks,
        resumed: false,
    }
}

fn blocks(from: u32, to: u32) -> Vec<u32> {
    (from..to).collect()
}

#[test]
fn store_schedule_complete_chunks_only_in_order() {
    let mut t = T::new(cfg());
    t.add(1, 1, 20); // 5 GPU blocks: one complete chunk of 12 tokens
    assert_eq!(t.matched(1, 0), Match::Miss);
    assert_eq!(t.s.on_alloc(1, &blocks(10, 15), 0).unwrap(), None);
    // A chunk missing one token is not stored.
    let b = blocks(10, 15);
    assert!(t.step(&[sched(1, 0, 11, 20, &b)], &[]).jobs().is_empty());
    let stores = t.jobs(Direction::Store);
    assert!(stores.is_empty());
    // Its last token computed: GPU blocks 10, 11, 12 go to slot 0.
    t.step(&[sched(1, 11, 9, 20, &[])], &[]);
    let stores = t.jobs(Direction::Store);
    assert_eq!(stores.len(), 1);
    assert_eq!(
        (stores[0].2.clone(), stores[0].3.clone()),
        (vec![10, 11, 12], vec![0])
    );
    assert_eq!(t.step.jobs()[0].block_index, 0);
    assert_eq!(t.lookup(&key(1, 0)), Lookup::Retry);
    t.complete(&[stores[0].0], true);
    assert_eq!(t.lookup(&key(1, 0)), Lookup::Hit);
    // Grows to 40 tokens: chunks 1 and 2 complete in one step, stored in one job, in order.
    t.grow(1, 1, 20, 40);
    let b = blocks(15, 20);
    t.step(&[sched(1, 20, 20, 40, &b)], &[]);
    let stores = t.jobs(Direction::Store);
    assert_eq!(
        (stores[0].2.clone(), stores[0].3.clone()),
        (vec![13, 14, 15, 16, 17, 18], vec![1, 2])
    );
    assert_eq!(t.step.jobs()[0].block_index, 3);
    assert_eq!(t.s.stats().stored_chunks, 3);
}

#[test]
fn deferral_rule_no_lookup_no_touch_and_block_ids_cleared() {
    let mut t = T::new(cfg());
    t.add(1, 1, 24);
    t.matched(1, 0);
    t.s.on_alloc(1, &blocks(0, 6), 0).unwrap();
    let b = blocks(0, 6);
    t.step(&[sched(1, 0, 24, 24, &b)], &[]);
    assert!(t.s.has_jobs_in_flight(1).unwrap());
    assert!(!t.s.requests[&1].block_ids.is_empty());
    let before = t.s.stats().manager;
    assert_eq!(t.matched(1, 0), Match::Defer(DeferReason::JobsInFlight));
    let after = t.s.stats();
    assert_eq!(
        (after.manager.lookups, after.manager.hits),
        (before.lookups, before.hits),
        "nothing looked up"
    );
    assert_eq!(after.deferred_jobs_in_flight, 1);
    assert!(
        t.s.requests[&1].block_ids.is_empty(),
        "stale GPU block ids cleared"
    );
}

/// The race of vLLM #46014: R's stores are flushed at preemption, and R is re-matched before
/// their completions are reported; a lookup that does not reach R's in-flight keys (GPU hit over
/// them, the next chunk stored by another request) would answer a hit and start a load.
fn race(sync: bool) {
    let mut t = T::new(cfg());
    // R stores chunks 0..3; those stores stay in flight.
    t.add(1, 7, 36);
    t.matched(1, 0);
    t.s.on_alloc(1, &blocks(0, 9), 0).unwrap();
    let b = blocks(0, 9);
    t.step(&[sched(1, 0, 36, 36, &b)], &[]);
    let p: Vec<u64> = t.jobs(Direction::Store).iter().map(|j| j.0).collect();
    assert_eq!(p.len(), 1);
    // Q shares R's prefix and stores chunk 3 (chunks 0..3 are R's, in flight, so filtered).
    t.add(2, 7, 48);
    assert_eq!(t.matched(2, 36), Match::Miss);
    t.s.on_alloc(2, &blocks(20, 32), 0).unwrap();
    let b = blocks(20, 32);
    t.step(&[sched(2, 36, 12, 48, &b)], &[]);
    let q = t.jobs(Direction::Store);
    assert_eq!(q[0].2, vec![29, 30, 31]);
    t.complete(&[q[0].0], true);
    assert_eq!(t.lookup(&key(7, 3)), Lookup::Hit);
    // R decodes to 48 tokens (chunk 3 is already stored), then is preempted.
    t.grow(1, 7, 36, 48);
    let b = blocks(9, 12);
    t.step(&[sched(1, 36, 12, 48, &b)], &[]);
    assert!(t.jobs(Direction::Store).is_empty());
    let flush = t.step(&[], &[1]).flush().to_vec();
    assert_eq!(flush, p, "preemption flushes R's stores");
    assert_eq!(t.s.requests[&1].jobs, p, "without clearing them");

    if sync {
        t.complete(&p, true);
    } else {
        // Batch-queue window: schedule again before the flushed completions are reported.
        let lookups = t.s.stats().manager.lookups;
        assert_eq!(t.matched(1, 36), Match::Defer(DeferReason::JobsInFlight));
        assert_eq!(t.s.stats().manager.lookups, lookups);
        let st = t.step(&[], &[]);
        assert!(st.jobs().is_empty(), "no load job");
        assert_eq!(t.s.requests[&1].jobs, p, "in-flight set unchanged");
        assert!(matches!(
            t.s.on_alloc(1, &blocks(40, 52), 12),
            Err(Error::InvalidState(_))
        ));
        t.complete(&p, true);
    }
    // Completions consumed: R matches and loads chunk 3 normally.
    assert_eq!(t.matched(1, 36), Match::Hit(12));
    let b = blocks(40, 52);
    let job = t.s.on_alloc(1, &b, 12).unwrap().unwrap();
    let loads = t.step(&[], &[]).jobs().to_vec();
    assert_eq!(loads.len(), 1);
    assert_eq!(
        (loads[0].id, t.step.src(&loads[0]), t.step.dst(&loads[0])),
        (job, &[3u32][..], &[49, 50, 51][..])
    );
    assert_eq!(loads[0].block_index, 9);
    t.complete(&[job], true);
    assert_eq!(t.s.stats().manager.pinned, 0);
}

#[test]
fn preempt_readmit_before_completions_is_deferred_async() {
    race(false);
}

#[test]
fn preempt_readmit_after_completions_loads_sync() {
    race(true);
}

#[test]
fn concurrent_lookups_of_one_prefix_defer_the_second() {
    let mut t = T::new(cfg());
    let s = t.prefill(1, 3, 24, 0);
    t.complete(&[s], true);
    t.s.finish_request(1).unwrap();
    // A and B share the prefix; A starts loading it, B must wait instead of loading it again.
    t.add(2, 3, 30);
    t.add(3, 3, 30);
    assert_eq!(t.matched(2, 0), Match::Hit(24));
    let load = t.s.on_alloc(2, &blocks(10, 18), 24).unwrap().unwrap();
    assert_eq!(t.matched(3, 0), Match::Defer(DeferReason::BeingLoaded));
    assert_eq!(t.s.stats().deferred_being_loaded, 1);
    t.step(&[], &[]);
    t.complete(&[load], true);
    assert_eq!(t.matched(3, 0), Match::Hit(24));
    assert!(t.s.fence.is_empty());
}

#[test]
fn abort_while_loading_releases_pins_when_the_load_completes() {
    for success in [true, false] {
        let mut t = T::new(cfg());
        let s = t.prefill(1, 3, 12, 0);
        t.complete(&[s], true);
        t.s.finish_request(1).unwrap();
        t.add(2, 3, 13);
        assert_eq!(t.matched(2, 0), Match::Hit(12));
        let load = t.s.on_alloc(2, &blocks(5, 9), 12).unwrap().unwrap();
        t.step(&[], &[]);
        t.s.finish_request(2).unwrap();
        assert_eq!(t.s.stats().requests, 1, "kept until its load completes");
        assert_eq!(t.s.stats().manager.pinned, 1);
        t.complete(&[load], success);
        let st = t.s.stats();
        assert_eq!(
            (st.requests, st.manager.pinned, st.loads_in_flight),
            (0, 0, 0)
        );
        assert!(matches!(t.s.match_request(2, 0), Err(Error::NotFound(_))));
    }
}

/// A finished request's pending store reads GPU blocks 0..3; reallocating one of them must
/// flush that store before the next forward pass.
fn finished_with_pending_store() -> (T, u64) {
    let mut t = T::new(cfg());
    let s = t.prefill(1, 3, 12, 0);
    t.s.finish_request(1).unwrap();
    assert_eq!(t.s.fence.len(), 3);
    (t, s)
}

#[test]
fn fence_at_allocation() {
    let (mut t, s) = finished_with_pending_store();
    t.add(2, 9, 8);
    assert_eq!(t.matched(2, 0), Match::Miss);
    t.s.on_alloc(2, &[7, 1], 0).unwrap();
    assert_eq!(t.step(&[], &[]).flush(), &[s]);
    t.complete(&[s], true);
    assert!(t.s.fence.is_empty());
    assert_eq!(t.s.stats().requests, 1);
}

#[test]
fn fence_at_store_building() {
    let (mut t, s) = finished_with_pending_store();
    t.add(2, 9, 8);
    let b = [2u32, 8];
    assert_eq!(t.step(&[sched(2, 0, 8, 8, &b)], &[]).flush(), &[s]);
    // Unrelated blocks flush nothing.
    let b = [20u32];
    t.grow(2, 9, 8, 12);
    assert!(t.step(&[sched(2, 8, 4, 12, &b)], &[]).flush().is_empty());
    t.complete(&[s], true);
    assert!(t.s.fence.is_empty());
}

/// vLLM issue-style abort while loading, as a host reading only the header does it: request 2's
/// load of prefix A ships, request 2 is aborted, its GPU blocks go to request 3 at once. The step
/// that schedules request 3 must flush the load, or the load overwrites request 3's KV.
#[test]
fn abort_while_loading_fences_the_loads_blocks() {
    let mut t = T::new(SchedulerConfig {
        block_size_factor: 1,
        ..cfg()
    });
    let b1 = blocks(0, 16);
    t.add(1, 3, 64);
    assert_eq!(t.matched(1, 0), Match::Miss);
    t.s.on_alloc(1, &b1, 0).unwrap();
    let store = t.step(&[sched(1, 0, 64, 64, &b1)], &[]).jobs()[0].id;
    t.complete(&[store], true);
    t.s.finish_request(1).unwrap();

    t.add(2, 3, 61); // shares prefix A: 15 full blocks hit
    assert_eq!(t.matched(2, 0), Match::Hit(60));
    let b2 = blocks(16, 32);
    let load = t.s.on_alloc(2, &b2, 60).unwrap().unwrap();
    assert_eq!(t.step(&[], &[]).jobs()[0].id, load, "the load ships");
    assert_eq!(t.step.dst(&t.step.jobs()[0]), &b2[..15]);
    t.s.finish_request(2).unwrap(); // aborted while its load is in flight
    assert_eq!(t.s.fence.len(), 15, "the blocks the load writes are fenced");

    t.add(3, 9, 64);
    assert_eq!(t.matched(3, 0), Match::Miss);
    t.s.on_alloc(3, &b2, 0).unwrap();
    let st = t.step(&[sched(3, 0, 64, 64, &b2)], &[]);
    assert_eq!(
        st.flush(),
        &[load],
        "request 3's first step waits for the load"
    );
    assert_eq!(st.jobs().len(), 1, "request 3's store");
    assert_eq!(
        t.s.stats().requests,
        2,
        "request 2 kept until its load completes"
    );
    t.complete(&[load], true);
    assert!(t.s.fence.is_empty());
    assert_eq!((t.s.stats().requests, t.s.stats().manager.pinned), (1, 0));
}

/// Request 1's chunk is stored; request 2 hits it and its load into GPU blocks 5..9 is made
/// (not yet in a step). Returns the load's id.
fn loading_request() -> (T, u64) {
    let mut t = T::new(cfg());
    let s = t.prefill(1, 3, 12, 0);
    t.complete(&[s], true);
    t.add(2, 3, 13);
    assert_eq!(t.matched(2, 0), Match::Hit(12));
    let load = t.s.on_alloc(2, &blocks(5, 9), 12).unwrap().unwrap();
    (t, load)
}

/// A load not yet in a step when its request is aborted never ships: nothing has touched its
/// blocks, so it is withdrawn (keys unpinned) and the host may reuse the blocks at once.
#[test]
fn abort_before_the_load_ships_withdraws_it() {
    let (mut t, load) = loading_request();
    t.s.finish_request(2).unwrap();
    assert!(t.s.fence.is_empty());
    let st = t.s.stats();
    assert_eq!(
        (st.requests, st.manager.pinned, st.loads_in_flight),
        (1, 0, 0)
    );
    let st = t.step(&[], &[]);
    assert!(st.jobs().is_empty() && st.flush().is_empty());
    let r = t.s.complete_jobs(&[JobReport {
        job_id: load,
        count: 1,
        success: true,
    }]);
    assert!(matches!(r, Err(Error::NotFound(_))), "{r:?}");
    assert!(matches!(t.s.finish_request(2), Err(Error::NotFound(_))));
}

/// Preempting a loading request: a shipped load is flushed by the preemption's step; one not
/// shipped yet is withdrawn, and the request can match again at once.
#[test]
fn preempting_a_loading_request_flushes_or_withdraws_its_load() {
    let (mut t, shipped) = loading_request();
    t.step(&[], &[]);
    let st = t.step(&[], &[2]);
    assert_eq!(st.flush(), &[shipped]);
    assert_eq!(
        t.matched(2, 0),
        Match::Defer(DeferReason::JobsInFlight),
        "until its completion is reported"
    );
    t.complete(&[shipped], true);

    assert_eq!(t.matched(2, 0), Match::Hit(12));
    t.s.on_alloc(2, &blocks(5, 9), 12).unwrap().unwrap();
    let st = t.step(&[], &[2]);
    assert!(st.jobs().is_empty() && st.flush().is_empty(), "withdrawn");
    assert_eq!(t.s.stats().manager.pinned, 0);
    assert_eq!(t.matched(2, 0), Match::Hit(12));
}

/// A host that matches a request again (dropping its blocks) while its load is in flight, or
/// resumes a request on other blocks while its stores are in flight, without reporting a
/// preemption: those jobs are fenced like an aborted request's.
#[test]
fn rematch_and_resume_release_blocks_to_the_fence() {
    let (mut t, load) = loading_request();
    t.step(&[], &[]);
    assert_eq!(t.matched(2, 0), Match::Defer(DeferReason::JobsInFlight));
    assert_eq!(t.s.fence.len(), 3);
    t.add(3, 9, 8);
    assert_eq!(t.matched(3, 0), Match::Miss);
    t.s.on_alloc(3, &[6, 20], 0).unwrap();
    assert_eq!(t.step(&[], &[]).flush(), &[load]);
    t.complete(&[load], true);
    assert!(t.s.fence.is_empty());

    // Resumed on new blocks while its store of blocks 0..3 is in flight.
    let s = t.prefill(4, 7, 12, 30);
    t.grow(4, 7, 12, 13);
    let b = [40u32, 41, 42, 43];
    let resumed = ScheduledRequest {
        resumed: true,
        ..sched(4, 0, 13, 13, &b)
    };
    assert!(t.step(&[resumed], &[]).flush().is_empty());
    assert_eq!(t.s.fence.len(), 3, "blocks 30..33 given back");
    t.add(5, 8, 4);
    assert_eq!(t.matched(5, 0), Match::Miss);
    t.s.on_alloc(5, &[31], 0).unwrap();
    assert_eq!(t.step(&[], &[]).flush(), &[s]);
}

/// A request scheduled and preempted in one step, or finished twice, is refused, changing nothing.
#[test]
fn contradictory_release_calls_change_nothing() {
    let mut t = T::new(cfg());
    let s = t.prefill(1, 3, 12, 0);
    let b = [3u32];
    t.grow(1, 3, 12, 13);
    let before = t.s.stats();
    let r =
        t.s.build_step(&[sched(1, 12, 1, 13, &b)], &[1], &mut t.step);
    assert!(
        matches!(r, Err(Error::InvalidArgument(ref m)) if m.contains("preempted[0]")),
        "{r:?}"
    );
    assert_eq!(t.s.stats(), before);
    t.s.finish_request(1).unwrap();
    let before = t.s.stats();
    assert!(matches!(t.s.finish_request(1), Err(Error::InvalidState(_))));
    assert_eq!(t.s.stats(), before);
    assert_eq!(t.s.fence.len(), 3);
    t.complete(&[s], true);
    assert!(t.s.fence.is_empty());
}

#[test]
fn one_complete_store_per_job() {
    let mut t = T::new(cfg());
    t.add(1, 3, 24);
    t.matched(1, 0);
    t.s.on_alloc(1, &blocks(0, 6), 0).unwrap();
    let b = blocks(0, 3);
    let s1 = t.step(&[sched(1, 0, 12, 24, &b)], &[]).jobs()[0].id;
    let b = blocks(3, 6);
    let s2 = t.step(&[sched(1, 12, 12, 24, &b)], &[]).jobs()[0].id;
    assert_ne!(s1, s2);
    t.complete(&[s2], true);
    assert_eq!(
        (t.lookup(&key(3, 0)), t.lookup(&key(3, 1))),
        (Lookup::Retry, Lookup::Hit)
    );
    let ev = t.s.take_events();
    assert_eq!(
        ev.iter().map(|e| e.keys.to_vec()).collect::<Vec<_>>(),
        vec![key(3, 1)]
    );
    t.complete(&[s1], true);
    assert_eq!(t.lookup(&key(3, 0)), Lookup::Hit);
}

#[test]
fn max_offload_tokens_and_prompt_only_limit_stores() {
    for (cap, prompt_only, expect_chunks) in [
        (None, false, 3),
        (Some(0), false, 0),
        (Some(24), false, 2),
        (None, true, 1),
    ] {
        let mut t = T::new(SchedulerConfig {
            offload_prompt_only: prompt_only,
            ..cfg()
        });
        t.s.add_request(1, 12, cap).unwrap();
        t.s.append_block_hashes(1, &hashes(3, 0, 9), 36).unwrap();
        t.matched(1, 0);
        let b = blocks(0, 9);
        t.step(&[sched(1, 0, 36, 36, &b)], &[]);
        let stored: usize = t.jobs(Direction::Store).iter().map(|j| j.3.len()).sum();
        assert_eq!(
            stored, expect_chunks,
            "cap {cap:?}, prompt only {prompt_only}"
        );
        assert!(t.step.flush().is_empty());
    }
}

#[test]
fn no_room_is_retried_next_step() {
    let mut t = T::new(SchedulerConfig {
        num_slots: 1,
        ..cfg()
    });
    let s1 = t.prefill(1, 3, 12, 0);
    t.add(2, 4, 12);
    t.matched(2, 0);
    let b = blocks(3, 6);
    assert!(
        t.step(&[sched(2, 0, 12, 12, &b)], &[]).jobs().is_empty(),
        "slot held by an in-flight store"
    );
    assert_eq!(t.s.stats().store_no_room, 1);
    t.complete(&[s1], true);
    let st = t.step(&[sched(2, 11, 1, 12, &[])], &[]);
    assert_eq!(
        st.jobs().len(),
        1,
        "retried: chunk 0 of request 2 evicts request 1's chunk"
    );
    assert_eq!(t.lookup(&key(3, 0)), Lookup::Miss);
}

#[test]
fn partial_first_chunk_after_gpu_hit() {
    let mut t = T::new(cfg());
    let s = t.prefill(1, 3, 36, 0);
    t.complete(&[s], true);
    t.add(2, 3, 40);
    // One GPU block (4 tokens) already hit: chunk 0 is partly on the GPU.
    // Fewer than one chunk beyond the GPU hit is a miss: 36 - 28 < 12.
    assert_eq!(t.matched(2, 28), Match::Miss);
    assert_eq!(t.matched(2, 4), Match::Hit(32));
    let b = blocks(50, 60);
    let job = t.s.on_alloc(2, &b, 32).unwrap().unwrap();
    let st = t.step(&[], &[]);
    let j = st.jobs()[0];
    assert_eq!((j.id, j.block_index, j.num_gpu_blocks), (job, 1, 8));
    assert_eq!((st.src(&j), st.dst(&j)), (&[0u32, 1, 2][..], &b[1..9]));
}

#[test]
fn failed_store_rolls_back_and_failed_load_reports_recompute() {
    let mut t = T::new(cfg());
    let s = t.prefill(1, 3, 24, 0);
    t.complete(&[s], false);
    assert_eq!(t.lookup(&key(3, 0)), Lookup::Miss);
    assert_eq!(t.s.stats().manager.used, 0);
    // Store again (the request is re-offered only if rewound: use another request).
    let s = t.prefill(2, 3, 24, 10);
    t.complete(&[s], true);
    t.add(3, 3, 25);
    assert_eq!(t.matched(3, 0), Match::Hit(24));
    let load = t.s.on_alloc(3, &blocks(20, 27), 24).unwrap().unwrap();
    t.step(&[], &[]);
    t.complete(&[load], false);
    assert_eq!(
        t.s.load_failure(3).unwrap(),
        Some(Recompute {
            from_token: 0,
            to_token: 24
        })
    );
    assert_eq!(
        (t.lookup(&key(3, 0)), t.lookup(&key(3, 1))),
        (Lookup::Miss, Lookup::Miss)
    );
    assert_eq!(t.s.stats().failed_jobs, 2);
    assert_eq!(t.matched(3, 0), Match::Miss);
    assert_eq!(t.s.load_failure(3).unwrap(), None);
}

#[test]
fn completion_needs_every_worker_and_bad_reports_change_nothing() {
    let mut t = T::new(SchedulerConfig {
        num_workers: 2,
        ..cfg()
    });
    let s = t.prefill(1, 3, 12, 0);
    let rep = |count, success| JobReport {
        job_id: s,
        count,
        success,
    };
    assert!(matches!(
        t.s.complete_jobs(&[rep(1, true), rep(2, true)]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        t.s.complete_jobs(&[rep(1, true), rep(0, true)]),
        Err(Error::InvalidArgument(_))
    ));
    let unknown = JobReport {
        job_id: 99,
        count: 1,
        success: true,
    };
    assert!(matches!(
        t.s.complete_jobs(&[rep(1, true), unknown]),
        Err(Error::NotFound(_))
    ));
    assert_eq!(t.s.jobs[&s].pending, 2, "failed calls applied nothing");
    t.complete(&[s], true);
    assert_eq!(
        t.lookup(&key(3, 0)),
        Lookup::Retry,
        "one of two workers reported"
    );
    t.complete(&[s], true);
    assert_eq!(t.lookup(&key(3, 0)), Lookup::Hit);
    assert!(matches!(
        t.s.complete_jobs(&[rep(1, true)]),
        Err(Error::NotFound(_))
    ));
}

#[test]
fn reset_flushes_everything_and_clears_in_flight_sets() {
    let mut t = T::new(cfg());
    let s = t.prefill(1, 3, 24, 0);
    t.complete(&[s], true);
    t.add(2, 3, 25);
    assert_eq!(t.matched(2, 0), Match::Hit(24));
    let load = t.s.on_alloc(2, &blocks(20, 27), 24).unwrap().unwrap();
    assert!(
        matches!(t.s.reset(), Err(Error::InvalidState(_))),
        "load not in a step yet"
    );
    t.step(&[], &[]);
    t.s.reset().unwrap();
    t.check();
    assert_eq!(t.step(&[], &[]).flush(), &[load]);
    // Stale report ignored; the request is no longer deferred forever.
    t.complete(&[load], true);
    assert_eq!(t.matched(2, 0), Match::Miss);
    assert_eq!(t.s.requests[&1].next_stored_chunk, 0);
    let b = blocks(30, 36);
    let st = t.step(&[sched(1, 24, 0, 24, &b)], &[]);
    assert_eq!(
        st.jobs().len(),
        1,
        "request 1 stores its chunks again from chunk 0"
    );
}

#[test]
fn reset_drops_finished_request_with_pending_store() {
    let (mut t, s) = finished_with_pending_store();
    t.s.reset().unwrap();
    assert_eq!(t.s.stats().requests, 0);
    assert!(t.s.fence.is_empty());
    t.complete(&[s], true);
    assert_eq!(t.s.stats().manager.used, 0);
}

#[test]
fn bad_inputs_change_nothing() {
    let mut t = T::new(cfg());
    t.add(1, 3, 12);
    assert!(matches!(
        t.s.add_request(1, 5, None),
        Err(Error::InvalidState(_))
    ));
    assert!(matches!(t.s.match_request(9, 0), Err(Error::NotFound(_))));
    t.s.add_request(2, 12, None).unwrap();
    assert!(
        matches!(t.s.match_request(2, 0), Err(Error::InvalidState(m)) if m.contains("block hashes"))
    );
    assert!(matches!(
        t.s.append_block_hashes(2, &[0; 7], 12),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        t.s.append_block_hashes(2, &hashes(1, 0, 4), 12),
        Err(Error::InvalidArgument(_))
    ));
    // Block ids shorter than the tokens need.
    let b = blocks(0, 2);
    let r = t.s.build_step(&[sched(1, 0, 12, 12, &b)], &[], &mut t.step);
    assert!(matches!(r, Err(Error::InvalidArgument(m)) if m.contains("new_block_ids")));
    let b = blocks(0, 3);
    let r = t.s.build_step(
        &[sched(1, 0, 12, 12, &b), sched(1, 0, 12, 12, &b)],
        &[],
        &mut t.step,
    );
    assert!(matches!(r, Err(Error::InvalidArgument(m)) if m.contains("twice")));
    let r =
        t.s.build_step(&[sched(1, 0, 12, 12, &b)], &[77], &mut t.step);
    assert!(matches!(r, Err(Error::NotFound(m)) if m.contains("preempted[0]")));
    assert!(
        t.s.requests[&1].block_ids.is_empty(),
        "failed steps recorded nothing"
    );
    // A load needs a hit of at least that many tokens in the request's last match.
    t.matched(1, 0);
    assert!(
        matches!(t.s.on_alloc(1, &b, 12), Err(Error::InvalidState(m)) if m.contains("last match"))
    );
    assert!(matches!(t.s.finish_request(5), Err(Error::NotFound(_))));
    assert_eq!(t.s.stats().load_jobs, 0);
    t.check();
    assert!(matches!(
        Scheduler::new(SchedulerConfig {
            num_workers: 0,
            ..cfg()
        }),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Scheduler::new(SchedulerConfig {
            gpu_block_size: 0,
            ..cfg()
        }),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Scheduler::new(SchedulerConfig {
            key_len: 0,
            ..cfg()
        }),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn on_alloc_checks_the_hit_it_loads() {
    let mut t = T::new(cfg());
    let s = t.prefill(1, 3, 24, 0);
    t.complete(&[s], true);
    t.add(2, 3, 24);
    assert_eq!(t.matched(2, 0), Match::Hit(24));
    assert!(
        matches!(t.s.on_alloc(2, &blocks(10, 15), 24), Err(Error::InvalidArgument(m)) if m.contains("block_ids"))
    );
    assert!(
        matches!(
            t.s.on_alloc(2, &blocks(10, 16), 36),
            Err(Error::InvalidState(_))
        ),
        "more than the hit"
    );
    // The hit's chunks were evicted between match and on_alloc: not found, nothing pinned.
    t.s.manager.reset();
    assert!(matches!(
        t.s.on_alloc(2, &blocks(10, 16), 24),
        Err(Error::NotFound(_))
    ));
    assert_eq!(t.s.stats().manager.pinned, 0);
    // A stale hit is not reused: a deferred match in between forgets it.
    t.s.reset().unwrap();
    let b = blocks(0, 6);
    let s = t.step(&[sched(1, 0, 24, 24, &b)], &[]).jobs()[0].id;
    assert_eq!(t.matched(2, 0), Match::Defer(DeferReason::StoreInFlight));
    t.complete(&[s], true);
    assert!(matches!(
        t.s.on_alloc(2, &blocks(10, 16), 24),
        Err(Error::InvalidState(_))
    ));
    assert_eq!(t.matched(2, 0), Match::Hit(24));
    assert!(t.s.on_alloc(2, &blocks(10, 16), 24).unwrap().is_some());
}

#[test]
fn hit_requires_a_full_chunk_beyond_the_gpu_hit_and_is_capped_by_tokens() {
    let mut t = T::new(cfg());
    let s = t.prefill(1, 3, 36, 0);
    t.complete(&[s], true);
    // A request of 11 tokens has no complete chunk: no lookup at all.
    t.add(2, 3, 11);
    let before = t.s.stats().manager.lookups;
    assert_eq!(t.matched(2, 0), Match::Miss);
    assert_eq!(t.s.stats().manager.lookups, before);
    // Hits stop at the first missing chunk.
    t.add(3, 3, 24);
    assert_eq!(t.matched(3, 12), Match::Hit(12));
    t.add(4, 3, 48);
    assert_eq!(t.matched(4, 0), Match::Hit(36));
}

#[test]
fn loads_must_be_shipped_before_completion_and_loading_requests_are_not_scheduled() {
    let mut t = T::new(cfg());
    let s = t.prefill(1, 3, 24, 0);
    t.complete(&[s], true);
    t.add(2, 3, 25);
    assert_eq!(t.matched(2, 0), Match::Hit(24));
    let b2 = blocks(10, 17);
    let load = t.s.on_alloc(2, &b2, 24).unwrap().unwrap();
    let early = t.s.complete_jobs(&[JobReport {
        job_id: load,
        count: 1,
        success: true,
    }]);
    assert!(matches!(early, Err(Error::InvalidState(m)) if m.contains("not in a step")));
    assert_eq!(t.s.stats().manager.pinned, 2, "pins kept");
    t.step(&[], &[]);
    let r =
        t.s.build_step(&[sched(2, 24, 1, 25, &b2)], &[], &mut t.step);
    assert!(matches!(r, Err(Error::InvalidState(m)) if m.contains("still loading")));
    t.complete(&[load], true);
    t.step(&[sched(2, 24, 1, 25, &b2)], &[]);
}

#[test]
fn failed_jobs_offer_their_chunks_again() {
    let mut t = T::new(cfg());
    t.add(1, 3, 48);
    t.matched(1, 0);
    let b = blocks(0, 12);
    let s = t.step(&[sched(1, 0, 36, 48, &b[..9])], &[]).jobs()[0].id;
    t.complete(&[s], false);
    // The next step offers chunks 0..4 again, not only the new chunk 3.
    let st = t.step(&[sched(1, 36, 12, 48, &b[9..])], &[]);
    assert_eq!(st.dst(&st.jobs()[0]).len(), 4);
}

#[test]
fn allocation_without_tokens_consumes_the_hit() {
    let mut t = T::new(cfg());
    let s = t.prefill(1, 3, 24, 0);
    t.complete(&[s], true);
    t.add(2, 3, 24);
    assert_eq!(t.matched(2, 0), Match::Hit(24));
    // The host computes instead of loading: a later load for that hit is refused.
    assert_eq!(t.s.on_alloc(2, &blocks(10, 16), 0).unwrap(), None);
    assert!(matches!(
        t.s.on_alloc(2, &blocks(10, 16), 24),
        Err(Error::InvalidState(_))
    ));
}

/// A `build_step` that fails (here: its last scheduled request is unknown, or a preempted one
/// is) changes nothing: the loads made since the last step and the owed flushes are still in
/// the next step, and no store was made.
#[test]
fn failed_build_step_keeps_pending_loads_and_flushes() {
    let (mut t, store) = finished_with_pending_store();
    let s2 = t.prefill(2, 4, 12, 20);
    t.complete(&[s2], true);
    t.add(3, 4, 13);
    assert_eq!(t.matched(3, 0), Match::Hit(12));
    let load = t.s.on_alloc(3, &[1, 30, 31, 32], 12).unwrap().unwrap();
    t.add(4, 9, 12);
    let b4 = blocks(40, 43);
    let before = t.s.stats();
    let bad = t.s.build_step(
        &[sched(4, 0, 12, 12, &b4), sched(99, 0, 4, 4, &[])],
        &[],
        &mut t.step,
    );
    assert!(matches!(bad, Err(Error::NotFound(_))), "{bad:?}");
    let bad =
        t.s.build_step(&[sched(4, 0, 12, 12, &b4)], &[77], &mut t.step);
    assert!(matches!(bad, Err(Error::NotFound(_))), "{bad:?}");
    assert_eq!(t.s.stats(), before);
    t.check();
    let st = t.step(&[sched(4, 0, 12, 12, &b4)], &[]);
    let kinds: Vec<_> = st.jobs().iter().map(|j| (j.id, j.kind)).collect();
    assert_eq!(kinds[0], (load, Direction::Load));
    assert_eq!(kinds.len(), 2, "the load and request 4's store");
    assert_eq!(st.flush(), &[store], "block 1 was reallocated to request 3");
}

//! Deterministic scheduler races, call by call: the batch-queue window of vLLM issue #46014
//! (a preempted request re-admitted while its flushed stores are still tracked), with
//! asynchronous and synchronous completions and one or two workers; a reset that must not
//! defer a request forever; two matches of one prefix before their allocations. The
//! randomized host that finds such orders is `tests/scheduler_state_machine/`.

use kvoffload::Error;
use kvoffload::manager::Policy;
use kvoffload::plan::{Direction, Step};
use kvoffload::scheduler::{
    DeferReason, JobReport, Match, ScheduledRequest, Scheduler, SchedulerConfig,
};

const KEY_LEN: usize = 8;
/// Tokens per GPU block.
const GBS: u64 = 4;

fn det_cfg(num_workers: u32) -> SchedulerConfig {
    SchedulerConfig {
        key_len: KEY_LEN,
        gpu_block_size: GBS as u32,
        block_size_factor: 3,
        num_slots: 100,
        policy: Policy::Lru,
        num_workers,
        offload_prompt_only: false,
        ..Default::default()
    }
}

/// Hashes of GPU blocks `from..to` of prompt family `seed`.
fn hashes(seed: u64, from: u64, to: u64) -> Vec<u8> {
    (from..to)
        .flat_map(|i| (seed * 1_000_000 + i).to_be_bytes())
        .collect()
}

fn sched(id: u64, computed: u64, n: u64, tokens: u64, blocks: &[u32]) -> ScheduledRequest<'_> {
    ScheduledRequest {
        request_id: id,
        num_computed_tokens: computed,
        num_scheduled_tokens: n,
        num_tokens: tokens,
        new_block_ids: blocks,
        resumed: false,
    }
}

struct Det {
    s: Scheduler,
    step: Step,
}

impl Det {
    fn check(&self) {
        self.s.check_invariants().unwrap();
    }

    fn build(&mut self, scheduled: &[ScheduledRequest<'_>], preempted: &[u64]) -> Step {
        self.s
            .build_step(scheduled, preempted, &mut self.step)
            .unwrap();
        self.check();
        self.step.clone()
    }

    fn ids(step: &Step, kind: Direction) -> Vec<u64> {
        step.jobs()
            .iter()
            .filter(|j| j.kind == kind)
            .map(|j| j.id)
            .collect()
    }

    /// One worker's report for each job.
    fn report(&mut self, ids: &[u64]) {
        let reps: Vec<JobReport> = ids
            .iter()
            .map(|&job_id| JobReport {
                job_id,
                count: 1,
                success: true,
            })
            .collect();
        self.s.complete_jobs(&reps).unwrap();
        self.check();
    }

    fn matched(&mut self, id: u64, gpu_hit: u64) -> Match {
        let m = self.s.match_request(id, gpu_hit).unwrap();
        self.check();
        m
    }
}

/// Request R stores its three chunks; Q, sharing R's prefix, stores chunk 3; R is preempted with
/// its stores in flight and flushed, then re-matched with a GPU prefix hit over its in-flight
/// chunks, so a lookup would hit Q's chunk 3 without reaching R's in-flight keys and start a
/// load while R's stores are still tracked (the crash of vLLM #46014).
fn race_46014(sync: bool, workers: u32) {
    let mut d = Det {
        s: Scheduler::new(det_cfg(workers)).unwrap(),
        step: Step::new(),
    };
    let r_blocks: Vec<u32> = (0..9).collect();
    d.s.add_request(1, 36, None).unwrap();
    d.s.append_block_hashes(1, &hashes(7, 0, 9), 36).unwrap();
    assert_eq!(d.matched(1, 0), Match::Miss);
    assert_eq!(d.s.on_alloc(1, &r_blocks, 0).unwrap(), None);
    let st = d.build(&[sched(1, 0, 36, 36, &r_blocks)], &[]);
    let p = Det::ids(&st, Direction::Store);
    assert_eq!(p.len(), 1, "R stores chunks 0..3 in one job");

    let q_blocks: Vec<u32> = (20..32).collect();
    d.s.add_request(2, 48, None).unwrap();
    d.s.append_block_hashes(2, &hashes(7, 0, 12), 48).unwrap();
    assert_eq!(d.matched(2, 36), Match::Miss);
    d.s.on_alloc(2, &q_blocks, 0).unwrap();
    let st = d.build(&[sched(2, 36, 12, 48, &q_blocks)], &[]);
    let q = Det::ids(&st, Direction::Store);
    assert_eq!(
        st.src(&st.jobs()[0]),
        &[29, 30, 31],
        "Q stores chunk 3 only"
    );
    for _ in 0..workers {
        d.report(&q);
    }
    let chunk3 = 7_000_000u64 + 11;
    assert_eq!(d.s.manager().ref_count(&chunk3.to_be_bytes()), Some(0));

    // R decodes to 48 tokens (chunk 3 is already offloaded), then is preempted: the step
    // flushes R's stores without forgetting them.
    d.s.append_block_hashes(1, &hashes(7, 9, 12), 48).unwrap();
    let st = d.build(&[sched(1, 36, 12, 48, &[9, 10, 11])], &[]);
    assert!(st.jobs().is_empty());
    let st = d.build(&[], &[1]);
    assert_eq!(st.flush(), &p[..], "preemption flushes R's stores");
    assert!(st.jobs().is_empty());
    assert!(d.s.has_jobs_in_flight(1).unwrap());
    let load_blocks: Vec<u32> = (40..52).collect();

    if sync {
        // The flushed completions are consumed before the next schedule.
        for _ in 0..workers {
            d.report(&p);
        }
    } else {
        // Batch-queue window: step N+1 is scheduled before step N's output (with the flushed
        // completions) is processed. A lookup would hit chunk 3; the scheduler must defer
        // without looking anything up, and make no load.
        for w in 0..workers {
            let lookups = d.s.stats().manager.lookups;
            assert_eq!(d.matched(1, 36), Match::Defer(DeferReason::JobsInFlight));
            assert_eq!(d.s.stats().manager.lookups, lookups, "nothing looked up");
            let st = d.build(&[], &[]);
            assert!(st.jobs().is_empty(), "no load job in the next step");
            assert!(d.s.has_jobs_in_flight(1).unwrap());
            assert_eq!(d.s.stats().stores_in_flight, 1);
            assert!(
                matches!(
                    d.s.on_alloc(1, &load_blocks, 12),
                    Err(Error::InvalidState(_))
                ),
                "a load for a request with jobs in flight is refused"
            );
            d.check();
            // Worker w's report arrives (the last one completes the job).
            d.report(&p);
            assert_eq!(d.s.has_jobs_in_flight(1).unwrap(), w + 1 < workers);
        }
        assert_eq!(d.s.stats().deferred_jobs_in_flight, workers as u64);
    }

    // Completions consumed: R matches and loads chunk 3 normally.
    assert!(!d.s.has_jobs_in_flight(1).unwrap());
    assert_eq!(d.matched(1, 36), Match::Hit(12));
    let job = d.s.on_alloc(1, &load_blocks, 12).unwrap().unwrap();
    d.check();
    let st = d.build(&[], &[]);
    assert_eq!(Det::ids(&st, Direction::Load), vec![job]);
    let l = st.jobs()[0];
    assert_eq!(l.block_index, 9);
    assert_eq!(st.dst(&l), &[49, 50, 51]);
    assert_eq!(st.src(&l).len(), 1);
    assert_eq!(d.s.stats().manager.pinned, 1);
    for _ in 0..workers {
        d.report(&[job]);
    }
    assert_eq!(d.s.load_failure(1).unwrap(), None);
    // R resumes with all its blocks; chunks 0..4 are offloaded, nothing is stored again.
    let st = d.build(
        &[ScheduledRequest {
            resumed: true,
            ..sched(1, 47, 1, 48, &load_blocks)
        }],
        &[],
    );
    assert!(st.jobs().is_empty());
    let s = d.s.stats();
    assert_eq!(
        (
            s.manager.pinned,
            s.loads_in_flight,
            s.stores_in_flight,
            s.manager.stores_in_flight,
            s.load_jobs,
            s.store_jobs
        ),
        (0, 0, 0, 0, 1, 2)
    );
    d.s.finish_request(1).unwrap();
    d.s.finish_request(2).unwrap();
    assert_eq!(d.s.stats().requests, 0);
    d.check();
}

#[test]
fn preempt_readmit_in_the_batch_queue_window_is_deferred() {
    race_46014(false, 1);
    race_46014(false, 2);
}

#[test]
fn preempt_readmit_after_synchronous_completions_loads() {
    race_46014(true, 1);
    race_46014(true, 2);
}

/// After a reset a request whose stores were in flight is not deferred, and the stale
/// completions are ignored.
#[test]
fn reset_does_not_defer_forever() {
    let mut d = Det {
        s: Scheduler::new(det_cfg(2)).unwrap(),
        step: Step::new(),
    };
    let b: Vec<u32> = (0..6).collect();
    d.s.add_request(1, 24, None).unwrap();
    d.s.append_block_hashes(1, &hashes(3, 0, 6), 24).unwrap();
    assert_eq!(d.matched(1, 0), Match::Miss);
    d.s.on_alloc(1, &b, 0).unwrap();
    let st = d.build(&[sched(1, 0, 24, 24, &b)], &[]);
    let p = Det::ids(&st, Direction::Store);
    d.report(&p); // one worker of two
    let st = d.build(&[], &[1]);
    assert_eq!(st.flush(), &p[..]);
    assert_eq!(d.matched(1, 0), Match::Defer(DeferReason::JobsInFlight));
    d.s.reset().unwrap();
    d.check();
    assert!(!d.s.has_jobs_in_flight(1).unwrap());
    assert_eq!(d.matched(1, 0), Match::Miss);
    let st = d.build(&[], &[]);
    assert_eq!(st.flush(), &p[..], "the reset flushes what was in flight");
    d.report(&p); // the stale report is ignored
    let s = d.s.stats();
    assert_eq!(
        (s.stores_in_flight, s.manager.stores_in_flight, s.requests),
        (0, 0, 1)
    );
}

/// Minimal reproducer of what `random_host_with_match_and_alloc_apart` finds: two requests
/// sharing a prefix both match (both hits: nothing is pinned yet), then both allocate. The
/// second `on_alloc` pins chunks the first load already pins: the prefix is loaded twice (what
/// `DeferReason::BeingLoaded` exists to prevent) and `check_invariants` reports an internal
/// error ("key ... shared"). `on_alloc` should refuse (`InvalidState`, as for a hit that went
/// away), or the invariant should allow it.
#[test]
fn two_matches_then_two_allocs_do_not_load_one_prefix_twice() {
    let mut d = Det {
        s: Scheduler::new(det_cfg(1)).unwrap(),
        step: Step::new(),
    };
    let b: Vec<u32> = (0..6).collect();
    d.s.add_request(1, 24, None).unwrap();
    d.s.append_block_hashes(1, &hashes(3, 0, 6), 24).unwrap();
    assert_eq!(d.matched(1, 0), Match::Miss);
    d.s.on_alloc(1, &b, 0).unwrap();
    let st = d.build(&[sched(1, 0, 24, 24, &b)], &[]);
    d.report(&Det::ids(&st, Direction::Store));
    d.s.finish_request(1).unwrap();
    for id in [2, 3] {
        d.s.add_request(id, 25, None).unwrap();
        d.s.append_block_hashes(id, &hashes(3, 0, 6), 25).unwrap();
    }
    assert_eq!(d.matched(2, 0), Match::Hit(24));
    assert_eq!(d.matched(3, 0), Match::Hit(24));
    let b2: Vec<u32> = (10..17).collect();
    let b3: Vec<u32> = (20..27).collect();
    d.s.on_alloc(2, &b2, 24).unwrap().unwrap();
    d.check();
    match d.s.on_alloc(3, &b3, 24) {
        Err(Error::InvalidState(_)) => {}
        Ok(Some(_)) => {
            if let Err(e) = d.s.check_invariants() {
                panic!("second load of the same chunks accepted, then check_invariants: {e}");
            }
        }
        other => panic!("on_alloc(3) = {other:?}"),
    }
    d.check();
}

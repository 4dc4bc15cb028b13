"""Tests of kvoffload.Scheduler and kvoffload.Step through the shared library (stdlib unittest).

The scenarios follow src/scheduler/tests.rs: 8-byte block hashes, the hash of GPU block ``i`` of
prompt family ``seed`` is ``seed * 1_000_000 + i`` big-endian, and the offload key of a chunk is
the hash of its last GPU block.
"""

import gc
import random
import unittest
import weakref
from unittest import mock


import kvoffload  # noqa: E402
from kvoffload import _scheduler  # noqa: E402
from kvoffload import (  # noqa: E402
    CorruptDataError,
    DeferReason,
    Event,
    InvalidArgumentError,
    InvalidStateError,
    Job,
    JobKind,
    JobReport,
    KvoError,
    Match,
    MatchResult,
    NotFoundError,
    Recompute,
    ScheduledRequest,
    Scheduler,
    SchedulerStats,
    Step,
    StepInfo,
)

GBS = 4  # tokens per GPU block
F = 3  # GPU blocks per chunk (host slot)


def hashes(seed, frm, to):
    """Hashes of GPU blocks ``frm..to`` of prompt family ``seed``."""
    return [(seed * 1_000_000 + i).to_bytes(8, "big") for i in range(frm, to)]


def key(seed, chunk, factor=F):
    """The offload key of ``chunk``: the hash of its last GPU block."""
    return hashes(seed, (chunk + 1) * factor - 1, (chunk + 1) * factor)[0]


def blocks(frm, to):
    return list(range(frm, to))


def sched(rid, computed, scheduled, tokens, new_blocks=(), resumed=False):
    return ScheduledRequest(rid, computed, scheduled, tokens, new_blocks, resumed)


def race_scheduler(**kw):
    """The configuration of ``cfg()`` in src/scheduler/tests.rs."""
    args = dict(
        num_slots=100,
        key_len=8,
        gpu_block_size=GBS,
        block_size_factor=F,
        policy="lru",
        num_workers=1,
        offload_prompt_only=False,
        enable_events=True,
    )
    args.update(kw)
    return Scheduler(**args)


class Harness(unittest.TestCase):
    """Helpers of the scenarios; every call is followed by an invariants check."""

    def new(self, **kw):
        s = race_scheduler(**kw)
        self.addCleanup(s.close)
        self.s = s
        return s

    def step(self, scheduled=(), preempted=()):
        st = self.s.build_step(list(scheduled), list(preempted))
        self.addCleanup(st.close)
        self.s.check_invariants()
        return st

    def add(self, rid, seed, tokens):
        self.s.add_request(rid, tokens)
        self.s.append_block_hashes(rid, hashes(seed, 0, tokens // GBS), tokens)
        self.s.check_invariants()

    def grow(self, rid, seed, from_tokens, to_tokens):
        self.s.append_block_hashes(
            rid, hashes(seed, from_tokens // GBS, to_tokens // GBS), to_tokens
        )

    def matched(self, rid, gpu_hit):
        m = self.s.match(rid, gpu_hit)
        self.s.check_invariants()
        return m

    def complete(self, job_ids, success=True):
        self.s.complete_jobs([(j, 1, success) for j in job_ids])
        self.s.check_invariants()

    def stored_keys(self):
        """Keys that became ready since the last call (events with ``removed`` False)."""
        return [k for e in self.s.take_events() if not e.removed for k in e.keys]

    @staticmethod
    def of_kind(step, kind):
        return [j for j in step.jobs if j.kind == kind]


class LifeCycleTest(Harness):
    def test_one_request_stored_then_loaded_by_a_second_one(self):
        # gpu_block_size 4, factor 2: a chunk is 8 tokens.
        s = Scheduler(
            num_slots=16, key_len=8, gpu_block_size=4, block_size_factor=2, enable_events=True
        )
        self.addCleanup(s.close)
        self.s = s
        self.assertEqual((s.key_len, s.gpu_block_size, s.block_size_factor), (8, 4, 2))
        self.assertIs(s.policy, kvoffload.Policy.LRU)

        # Request 1: 16 prompt tokens, 4 GPU blocks, 2 chunks.
        s.add_request(1, 16)
        s.append_block_hashes(1, hashes(1, 0, 4), 16)
        m = s.match(1, 0)
        self.assertEqual(m, MatchResult(Match.MISS, 0, DeferReason.NONE))
        self.assertIsInstance(m.kind, Match)
        self.assertIsInstance(m.defer_reason, DeferReason)
        self.assertFalse(m.is_hit or m.is_deferred)
        self.assertIsNone(s.on_alloc(1, [10, 11, 12, 13], 0))
        st = self.step([sched(1, 0, 16, 16, [10, 11, 12, 13])])
        self.assertIsInstance(st, Step)
        self.assertEqual(st.info, StepInfo(num_jobs=1, num_flush=0, block_size_factor=2))
        (job,) = st.jobs
        self.assertIsInstance(job, Job)
        self.assertIs(job.kind, JobKind.STORE)
        self.assertEqual(
            (job.request_id, job.group_size, job.block_index, job.src, job.dst),
            (1, 4, 0, [10, 11, 12, 13], [0, 1]),
        )
        self.assertEqual(st.flush, [])
        stats = s.stats()
        self.assertEqual((stats.store_jobs, stats.stored_chunks, stats.stores_in_flight), (1, 2, 1))
        self.assertEqual((stats.manager.stores_in_flight, stats.manager.ready), (2, 0))
        self.assertEqual(self.stored_keys(), [])

        s.complete_jobs([(job.id, 1, True)])
        s.check_invariants()
        self.assertEqual(self.stored_keys(), [key(1, 0, 2), key(1, 1, 2)])
        s.finish_request(1)
        stats = s.stats()
        self.assertEqual((stats.requests, stats.stores_in_flight, stats.manager.ready), (0, 0, 2))
        with self.assertRaises(NotFoundError):
            s.match(1, 0)

        # Request 2 shares the prefix; one GPU block (4 tokens) is a GPU prefix-cache hit.
        s.add_request(2, 18)
        s.append_block_hashes(2, hashes(1, 0, 4), 18)
        m = s.match(2, 4)
        self.assertEqual(m, MatchResult(Match.HIT, 12, DeferReason.NONE))
        self.assertTrue(m.is_hit)
        gpu = [20, 21, 22, 23, 24]
        load = s.on_alloc(2, gpu, 12)
        self.assertIsInstance(load, int)
        self.assertEqual(s.stats().manager.pinned, 2)
        st = self.step()
        (job,) = st.jobs
        self.assertEqual(
            job,
            Job(
                id=load,
                request_id=2,
                kind=JobKind.LOAD,
                group_size=3,
                block_index=1,
                src=[0, 1],
                dst=[21, 22, 23],
            ),
        )
        self.assertEqual(job.block_index % st.info.block_size_factor, 1, "one sub-block skipped")
        self.assertEqual(s.stats().loads_in_flight, 1)
        s.complete_jobs([JobReport(load, 1, True)])
        s.check_invariants()
        self.assertIsNone(s.load_failure(2))
        # The rest of the prompt is computed: no new complete chunk, no store.
        st = self.step([sched(2, 16, 2, 18, gpu)])
        self.assertEqual(st.jobs, [])
        s.finish_request(2)

        stats = s.stats()
        self.assertIsInstance(stats, SchedulerStats)
        self.assertEqual(
            (stats.requests, stats.loads_in_flight, stats.stores_in_flight, stats.failed_jobs),
            (0, 0, 0, 0),
        )
        self.assertEqual((stats.hits, stats.hit_tokens, stats.load_jobs), (1, 12, 1))
        self.assertEqual(stats.matches, 2)
        mgr = stats.manager
        self.assertEqual((mgr.pinned, mgr.stores_in_flight), (0, 0), "nothing pinned or in flight")
        self.assertEqual((mgr.capacity, mgr.used, mgr.ready, mgr.evictable), (16, 2, 2, 2))
        d = stats.as_dict()
        self.assertEqual(d["manager"]["pinned"], 0)
        self.assertEqual(d["hit_tokens"], 12)
        s.check_invariants()

    def test_take_events_grows_its_buffers(self):
        s = self.new(num_slots=200)
        # 40 requests of 2 chunks each, one store job each: 40 events, 80 keys.
        ids = []
        for rid in range(40):
            self.add(rid, 100 + rid, 24)
            self.matched(rid, 0)
            ids.append(self.step([sched(rid, 0, 24, 24, blocks(0, 6))]).jobs[0].id)
        self.complete(ids)
        events = s.take_events()
        self.assertEqual(len(events), 40)
        self.assertTrue(all(isinstance(e, Event) and not e.removed for e in events))
        self.assertEqual(events[7].keys, [key(107, 0), key(107, 1)])
        self.assertEqual(s.take_events(), [])

    def test_events_off_by_default(self):
        with Scheduler(num_slots=4, key_len=8, gpu_block_size=4) as s:
            s.add_request(1, 4)
            s.append_block_hashes(1, hashes(1, 0, 1), 4)
            s.match(1, 0)
            (job,) = s.build_step([sched(1, 0, 4, 4, [0])]).jobs
            s.complete_jobs([job.id])
            self.assertEqual(s.take_events(), [])
            self.assertEqual(s.stats().manager.ready, 1)


class RaceTest(Harness):
    """vLLM #46014, as ``race()`` in src/scheduler/tests.rs."""

    def race(self, sync):
        s = self.new()
        # R stores chunks 0..3; those stores stay in flight.
        self.add(1, 7, 36)
        self.matched(1, 0)
        self.assertIsNone(s.on_alloc(1, blocks(0, 9), 0))
        st = self.step([sched(1, 0, 36, 36, blocks(0, 9))])
        p = [j.id for j in self.of_kind(st, JobKind.STORE)]
        self.assertEqual(len(p), 1)
        # Q shares R's prefix and stores chunk 3 (chunks 0..3 are R's, in flight, so filtered).
        self.add(2, 7, 48)
        self.assertEqual(self.matched(2, 36).kind, Match.MISS)
        s.on_alloc(2, blocks(20, 32), 0)
        st = self.step([sched(2, 36, 12, 48, blocks(20, 32))])
        q = self.of_kind(st, JobKind.STORE)
        self.assertEqual(list(q[0].src), [29, 30, 31])
        self.stored_keys()
        self.complete([q[0].id])
        self.assertEqual(self.stored_keys(), [key(7, 3)], "chunk 3 is ready")
        # R decodes to 48 tokens (chunk 3 is already stored), then is preempted.
        self.grow(1, 7, 36, 48)
        st = self.step([sched(1, 36, 12, 48, blocks(9, 12))])
        self.assertEqual(self.of_kind(st, JobKind.STORE), [])
        st = self.step([], [1])
        self.assertEqual(st.flush, p, "preemption flushes R's stores")
        self.assertEqual(s.stats().stores_in_flight, 1, "without clearing them")

        if sync:
            self.complete(p)
        else:
            # Batch-queue window: schedule again before the flushed completions are reported.
            lookups = s.stats().manager.lookups
            m = self.matched(1, 36)
            self.assertEqual(m, MatchResult(Match.DEFER, 0, DeferReason.JOBS_IN_FLIGHT))
            self.assertTrue(m.is_deferred)
            stats = s.stats()
            self.assertEqual(stats.manager.lookups, lookups, "nothing looked up")
            self.assertEqual(stats.deferred_jobs_in_flight, 1)
            st = self.step()
            self.assertEqual(st.jobs, [], "no load job")
            self.assertEqual(s.stats().stores_in_flight, 1, "in-flight set unchanged")
            with self.assertRaises(InvalidStateError) as cm:
                s.on_alloc(1, blocks(40, 52), 12)
            self.assertIn("request_id", cm.exception.message)
            self.assertEqual(s.stats().load_jobs, 0)
            self.complete(p)
        # Completions consumed: R matches and loads chunk 3 normally.
        self.assertEqual(self.matched(1, 36), MatchResult(Match.HIT, 12, DeferReason.NONE))
        job = s.on_alloc(1, blocks(40, 52), 12)
        self.assertIsNotNone(job)
        loads = self.step().jobs
        self.assertEqual(len(loads), 1)
        self.assertEqual(
            (loads[0].id, loads[0].kind, loads[0].src, loads[0].dst),
            (job, JobKind.LOAD, [3], [49, 50, 51]),
        )
        self.assertEqual(loads[0].block_index, 9)
        self.complete([job])
        stats = s.stats()
        self.assertEqual(stats.manager.pinned, 0)
        self.assertEqual((stats.loads_in_flight, stats.stores_in_flight), (0, 0))
        self.assertEqual(stats.deferred_jobs_in_flight, 0 if sync else 1)

    def test_preempt_readmit_before_completions_is_deferred_async(self):
        self.race(False)

    def test_preempt_readmit_after_completions_loads_sync(self):
        self.race(True)


class StepEncodingTest(Harness):
    def plan_with_everything(self):
        """A plan with a load, a store and a flushed job."""
        s = self.new()
        self.add(1, 3, 24)
        self.matched(1, 0)
        stored = self.step([sched(1, 0, 24, 24, blocks(0, 6))]).jobs[0].id
        self.complete([stored])
        s.finish_request(1)
        # Request 3's store stays in flight; request 3 is preempted below.
        self.add(3, 5, 12)
        self.matched(3, 0)
        pending = self.step([sched(3, 0, 12, 12, blocks(30, 33))]).jobs[0].id
        self.add(2, 3, 25)
        self.assertEqual(self.matched(2, 0).kind, Match.HIT)
        load = s.on_alloc(2, blocks(10, 17), 24)
        self.add(4, 6, 12)
        self.matched(4, 0)
        st = self.step([sched(4, 0, 12, 12, blocks(40, 43))], [3])
        self.assertEqual([(j.kind, j.request_id) for j in st.jobs],
                         [(JobKind.LOAD, 2), (JobKind.STORE, 4)])
        self.assertEqual(st.jobs[0].id, load)
        self.assertEqual(list(st.flush), [pending])
        self.assertEqual(st.info, StepInfo(2, 1, F))
        return st

    def test_round_trip(self):
        st = self.plan_with_everything()
        data = st.encode()
        self.assertIsInstance(data, bytes)
        back = Step.decode(data)
        self.addCleanup(back.close)
        self.assertIsInstance(back, Step)
        self.assertEqual(back.info, st.info)
        self.assertEqual(back.jobs, st.jobs)
        self.assertEqual(back.flush, st.flush)
        self.assertEqual(back.encode(), data)
        self.assertEqual([j.kind for j in back.jobs], [JobKind.LOAD, JobKind.STORE])
        self.assertEqual(back.jobs[0].src, [0, 1])
        self.assertEqual(back.jobs[0].dst, blocks(10, 16))
        self.assertEqual(back.info.block_size_factor, F)
        # Bytes-like input, and decoding into an existing plan.
        other = Step()
        self.addCleanup(other.close)
        self.assertIs(Step.decode(bytearray(data), into=other), other)
        self.assertEqual(other.jobs, st.jobs)
        self.assertEqual(Step.decode(memoryview(data)).flush, st.flush)

    def test_round_trip_of_a_load_plan(self):
        s = self.new()
        self.add(1, 3, 36)
        self.matched(1, 0)
        self.complete([self.step([sched(1, 0, 36, 36, blocks(0, 9))]).jobs[0].id])
        self.add(2, 3, 40)
        self.assertEqual(self.matched(2, 4), MatchResult(Match.HIT, 32, DeferReason.NONE))
        load = s.on_alloc(2, blocks(50, 60), 32)
        st = self.step()
        (j,) = st.jobs
        self.assertEqual((j.id, j.block_index, j.group_size), (load, 1, 8))
        self.assertEqual((list(j.src), list(j.dst)), ([0, 1, 2], blocks(51, 59)))
        back = Step.decode(st.encode())
        self.addCleanup(back.close)
        self.assertEqual(back.jobs, st.jobs)

    def test_empty_plan(self):
        with Step() as st:
            self.assertEqual(st.info, StepInfo(0, 0, 0))
            self.assertEqual((st.jobs, list(st.flush)), ([], []))
            data = st.encode()
            self.assertGreater(len(data), 0)
            with Step.decode(data) as back:
                self.assertEqual(back.info, st.info)

    def test_corrupt_bytes_are_refused(self):
        st = self.plan_with_everything()
        data = st.encode()
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x40
        bad = [
            b"",
            data[:-1],
            data[:10],
            bytes(flipped),
            data + b"\0",
            b"\xff" * len(data),
            b"KVOS",
        ]
        version = bytearray(data)
        version[4] ^= 0x7F  # the format version follows the magic
        bad.append(bytes(version))
        for b in bad:
            with self.subTest(data=b[:16]):
                with self.assertRaises(CorruptDataError) as cm:
                    Step.decode(b)
                self.assertEqual(cm.exception.status, kvoffload.Status.CORRUPT_DATA)
                self.assertIn("step bytes", cm.exception.message)
        # A failed decode into an existing plan changes nothing.
        target = Step.decode(data)
        self.addCleanup(target.close)
        for b in bad:
            with self.assertRaises(CorruptDataError):
                Step.decode(b, into=target)
            self.assertEqual(target.jobs, st.jobs)
            self.assertEqual(target.flush, st.flush)

    def test_decode_type_errors(self):
        with self.assertRaises(TypeError):
            Step.decode("KVOS")
        with self.assertRaises(TypeError):
            Step.decode(None)
        with self.assertRaises(TypeError):
            Step.decode(b"", into="step")

    def test_build_step_into_an_existing_plan(self):
        s = self.new()
        self.add(1, 3, 12)
        self.matched(1, 0)
        with Step() as st:
            self.assertIs(s.build_step([sched(1, 0, 12, 12, blocks(0, 3))], step=st), st)
            self.assertEqual(len(st.jobs), 1)
            # The next step replaces the plan.
            self.assertIs(s.build_step([], step=st), st)
            self.assertEqual(st.jobs, [])
            # A failed build leaves it alone.
            self.add(2, 4, 12)
            self.matched(2, 0)
            s.build_step([sched(2, 0, 12, 12, blocks(3, 6))], step=st)
            before = st.encode()
            with self.assertRaises(NotFoundError):
                s.build_step([], [99], step=st)
            self.assertEqual(st.encode(), before)


class FailureTest(Harness):
    def test_failed_store_rolls_back_and_failed_load_reports_recompute(self):
        s = self.new()
        self.add(1, 3, 24)
        self.matched(1, 0)
        job = self.step([sched(1, 0, 24, 24, blocks(0, 6))]).jobs[0].id
        self.complete([job], success=False)
        stats = s.stats()
        self.assertEqual((stats.manager.used, stats.manager.stores_in_flight), (0, 0))
        self.assertEqual(stats.failed_jobs, 1)
        self.assertEqual(self.stored_keys(), [])
        self.assertIsNone(s.load_failure(1), "a failed store is not a load failure")
        # Store again through another request.
        self.add(2, 3, 24)
        self.matched(2, 0)
        job = self.step([sched(2, 0, 24, 24, blocks(10, 16))]).jobs[0].id
        self.complete([job])
        self.assertEqual(self.stored_keys(), [key(3, 0), key(3, 1)])
        self.add(3, 3, 25)
        self.assertEqual(self.matched(3, 0), MatchResult(Match.HIT, 24, DeferReason.NONE))
        load = s.on_alloc(3, blocks(20, 27), 24)
        self.step()
        self.complete([load], success=False)
        self.assertEqual(s.load_failure(3), Recompute(0, 24))
        self.assertEqual(s.load_failure(3), (0, 24))
        stats = s.stats()
        self.assertEqual(stats.failed_jobs, 2)
        self.assertEqual(
            (stats.manager.used, stats.manager.pinned), (0, 0), "dropped from the tier"
        )
        self.assertEqual(self.matched(3, 0).kind, Match.MISS)
        self.assertIsNone(s.load_failure(3))

    def test_completion_needs_every_worker(self):
        s = self.new(num_workers=2)
        self.assertEqual(s.num_workers, 2)
        self.add(1, 3, 12)
        self.matched(1, 0)
        job = self.step([sched(1, 0, 12, 12, blocks(0, 3))]).jobs[0].id
        # Bad batches apply nothing.
        with self.assertRaises(InvalidArgumentError) as cm:
            s.complete_jobs([(job, 1, True), (job, 2, True)])
        self.assertIn("reports[1].count", cm.exception.message)
        with self.assertRaises(InvalidArgumentError):
            s.complete_jobs([(job, 1, True), (job, 0, True)])
        with self.assertRaises(NotFoundError) as cm:
            s.complete_jobs([JobReport(job), JobReport(99)])
        self.assertIn("reports[1].job_id", cm.exception.message)
        self.assertEqual(s.stats().stores_in_flight, 1)
        # One of two workers reported: still in flight.
        s.complete_jobs([(job, 1, True)])
        s.check_invariants()
        stats = s.stats()
        self.assertEqual((stats.stores_in_flight, stats.manager.stores_in_flight), (1, 1))
        self.assertEqual(self.stored_keys(), [])
        s.complete_jobs([job])  # a bare id: one successful report
        stats = s.stats()
        self.assertEqual((stats.stores_in_flight, stats.manager.ready), (0, 1))
        self.assertEqual(self.stored_keys(), [key(3, 0)])
        with self.assertRaises(NotFoundError):
            s.complete_jobs([(job, 1, True)])

    def test_two_workers_in_one_report_and_one_failure(self):
        s = self.new(num_workers=2)
        self.add(1, 3, 12)
        self.add(2, 4, 12)
        self.matched(1, 0)
        self.matched(2, 0)
        a, b = (
            j.id
            for j in self.step(
                [sched(1, 0, 12, 12, blocks(0, 3)), sched(2, 0, 12, 12, blocks(3, 6))]
            ).jobs
        )
        s.complete_jobs([JobReport(a, 2, True), (b, 1, True), (b, 1, False)])
        s.check_invariants()
        stats = s.stats()
        self.assertEqual((stats.stores_in_flight, stats.failed_jobs), (0, 1))
        self.assertEqual(self.stored_keys(), [key(3, 0)], "the job one worker failed is dropped")

    def test_reset(self):
        s = self.new()
        self.add(1, 3, 24)
        self.matched(1, 0)
        self.complete([self.step([sched(1, 0, 24, 24, blocks(0, 6))]).jobs[0].id])
        self.add(2, 3, 25)
        self.assertEqual(self.matched(2, 0).kind, Match.HIT)
        load = s.on_alloc(2, blocks(20, 27), 24)
        with self.assertRaises(InvalidStateError):
            s.reset()  # the load is not in a step yet
        self.step()
        s.reset()
        s.check_invariants()
        self.assertEqual(list(self.step().flush), [load])
        self.complete([load])  # a stale report is ignored
        self.assertEqual(self.matched(2, 0).kind, Match.MISS)
        self.assertEqual(s.stats().manager.used, 0)


class BadInputTest(Harness):
    def test_library_errors(self):
        s = self.new()
        self.add(1, 3, 12)
        with self.assertRaises(InvalidStateError) as cm:
            s.add_request(1, 5)
        self.assertIn("request_id", cm.exception.message)
        self.assertIn("already tracked", cm.exception.message)
        for call in (
            lambda: s.match(9, 0),
            lambda: s.finish_request(9),
            lambda: s.append_block_hashes(9, [], 0),
            lambda: s.on_alloc(9, [], 0),
            lambda: s.load_failure(9),
            lambda: s.build_step([sched(9, 0, 4, 4, [0])]),
        ):
            with self.assertRaises(NotFoundError) as cm:
                call()
            self.assertIn("9", cm.exception.message)
            self.assertIsInstance(cm.exception, KvoError)
        with self.assertRaises(NotFoundError) as cm:
            s.build_step([], [77])
        self.assertIn("preempted[0]", cm.exception.message)
        # Match before the hashes cover the tokens.
        s.add_request(2, 12)
        with self.assertRaises(InvalidStateError) as cm:
            s.match(2, 0)
        self.assertIn("block hashes", cm.exception.message)
        with self.assertRaises(InvalidArgumentError) as cm:
            s.append_block_hashes(2, hashes(1, 0, 4), 12)
        self.assertIn("hashes", cm.exception.message)
        # Block ids shorter than the tokens need.
        with self.assertRaises(InvalidArgumentError) as cm:
            s.build_step([sched(1, 0, 12, 12, blocks(0, 2))])
        self.assertIn("scheduled[0].new_block_ids", cm.exception.message)
        with self.assertRaises(InvalidArgumentError) as cm:
            s.build_step([sched(1, 0, 12, 12, blocks(0, 3))] * 2)
        self.assertIn("twice", cm.exception.message)
        # on_alloc with tokens to load needs a HIT of that many tokens in the last match.
        self.matched(1, 0)
        with self.assertRaises(InvalidStateError) as cm:
            s.on_alloc(1, blocks(0, 3), 12)
        self.assertIn("num_external_tokens", cm.exception.message)
        s.finish_request(1)
        with self.assertRaises(NotFoundError):
            s.finish_request(1)
        self.assertEqual(s.stats().load_jobs, 0)
        s.check_invariants()

    def test_short_block_ids_at_allocation(self):
        s = self.new()
        self.add(1, 3, 12)
        self.matched(1, 0)
        self.complete([self.step([sched(1, 0, 12, 12, blocks(0, 3))]).jobs[0].id])
        self.add(2, 3, 16)
        self.assertEqual(self.matched(2, 0), MatchResult(Match.HIT, 12, DeferReason.NONE))
        with self.assertRaises(InvalidArgumentError) as cm:
            s.on_alloc(2, blocks(5, 7), 12)
        self.assertIn("block_ids", cm.exception.message)
        self.assertEqual(s.stats().manager.pinned, 0, "a failed call changes nothing")
        self.assertIsNotNone(s.on_alloc(2, blocks(5, 9), 12))

    def test_finished_request(self):
        s = self.new()
        self.add(1, 3, 12)
        self.matched(1, 0)
        job = self.step([sched(1, 0, 12, 12, blocks(0, 3))]).jobs[0].id
        s.finish_request(1)  # kept until its store completes
        self.assertEqual(s.stats().requests, 1)
        with self.assertRaises(InvalidStateError):
            s.finish_request(1)
        with self.assertRaises(InvalidStateError):
            s.match(1, 0)
        self.complete([job])
        self.assertEqual(s.stats().requests, 0)

    def test_python_side_validation(self):
        s = self.new()
        self.add(1, 3, 12)
        before = s.stats()
        cases = [
            (TypeError, "request_id", lambda: s.add_request("2", 4)),
            (TypeError, "request_id", lambda: s.add_request(2.0, 4)),
            (TypeError, "request_id", lambda: s.match(True, 0)),
            (ValueError, "request_id", lambda: s.add_request(-1, 4)),
            (ValueError, "request_id", lambda: s.match(2**64, 0)),
            (ValueError, "prompt_tokens", lambda: s.add_request(2, -4)),
            (ValueError, "max_offload_tokens", lambda: s.add_request(2, 4, -1)),
            (ValueError, "num_computed_tokens", lambda: s.match(1, -1)),
            (TypeError, "hashes", lambda: s.append_block_hashes(1, "\0" * 8, 12)),
            (TypeError, "hashes", lambda: s.append_block_hashes(1, None, 12)),
            (TypeError, "hashes[0]", lambda: s.append_block_hashes(1, ["abcdefgh"], 12)),
            (TypeError, "hashes[1]", lambda: s.append_block_hashes(1, [b"\0" * 8, 7], 12)),
            (ValueError, "hashes[0]", lambda: s.append_block_hashes(1, [b"\0" * 7], 12)),
            (ValueError, "hashes[1]", lambda: s.append_block_hashes(1, [b"\0" * 8, b""], 12)),
            (ValueError, "num_tokens", lambda: s.append_block_hashes(1, [], -1)),
            (ValueError, "block_ids[1]", lambda: s.on_alloc(1, [0, -1], 0)),
            (ValueError, "block_ids[0]", lambda: s.on_alloc(1, [2**32], 0)),
            (TypeError, "block_ids[0]", lambda: s.on_alloc(1, ["0"], 0)),
            (TypeError, "block_ids", lambda: s.on_alloc(1, 5, 0)),
            (ValueError, "num_external_tokens", lambda: s.on_alloc(1, [0], -12)),
            (TypeError, "scheduled[0]", lambda: s.build_step([{"request_id": 1}])),
            (TypeError, "scheduled", lambda: s.build_step(7)),
            (
                ValueError,
                "scheduled[0].num_tokens",
                lambda: s.build_step([sched(1, 0, 12, -12, blocks(0, 3))]),
            ),
            (
                ValueError,
                "scheduled[0].new_block_ids[2]",
                lambda: s.build_step([sched(1, 0, 12, 12, [0, 1, -2])]),
            ),
            (
                TypeError,
                "scheduled[0].resumed",
                lambda: s.build_step([sched(1, 0, 12, 12, blocks(0, 3), resumed="yes")]),
            ),
            (ValueError, "preempted[1]", lambda: s.build_step([], [1, -1])),
            (TypeError, "step", lambda: s.build_step([], step=object())),
            (TypeError, "reports[0]", lambda: s.complete_jobs(["1"])),
            (TypeError, "reports[0]", lambda: s.complete_jobs([True])),
            (ValueError, "reports[0].job_id", lambda: s.complete_jobs([(-1, 1, True)])),
            (ValueError, "reports[0].count", lambda: s.complete_jobs([(1, 2**32, True)])),
            (TypeError, "reports[0].success", lambda: s.complete_jobs([(1, 1, "no")])),
            (ValueError, "request_id", lambda: s.finish_request(-1)),
            (ValueError, "request_id", lambda: s.load_failure(-1)),
        ]
        for exc, name, call in cases:
            with self.subTest(name=name):
                with self.assertRaises(exc) as cm:
                    call()
                self.assertNotIsInstance(cm.exception, KvoError)
                self.assertIn(name, str(cm.exception))
        s.check_invariants()
        self.assertEqual(s.stats(), before, "refused calls changed nothing")
        # Tuples are taken as ScheduledRequest fields; integer types with __index__ (numpy's)
        # are taken as ints.
        class Index:
            def __init__(self, v):
                self.v = v

            def __index__(self):
                return self.v

        self.assertEqual(s.match(Index(1), Index(0)).kind, Match.MISS)
        st = s.build_step([(Index(1), 0, 12, 12, [Index(0), 1, Index(2)])])
        self.addCleanup(st.close)
        (job,) = st.jobs
        self.assertEqual(list(job.src), [0, 1, 2])
        s.build_step([], [Index(1)], step=st)
        self.assertEqual(st.flush, [job.id])
        s.complete_jobs([Index(job.id)])
        self.assertEqual(s.stats().stores_in_flight, 0)

    def test_bad_configuration(self):
        for kw, exc, name in [
            (dict(num_workers=0), InvalidArgumentError, "num_workers"),
            (dict(gpu_block_size=0), InvalidArgumentError, "gpu_block_size"),
            (dict(block_size_factor=0), InvalidArgumentError, "block_size_factor"),
            (dict(key_len=0), InvalidArgumentError, "key_len"),
            (dict(key_len=65), InvalidArgumentError, "key_len"),
            (dict(policy=7), InvalidArgumentError, "policy"),
            (dict(policy="fifo"), ValueError, "policy"),
            (dict(num_slots=-1), ValueError, "num_slots"),
            (dict(num_slots="4"), TypeError, "num_slots"),
            (dict(key_len=2**32), ValueError, "key_len"),
            (dict(enable_events="yes"), TypeError, "enable_events"),
        ]:
            with self.subTest(**{k: repr(v) for k, v in kw.items()}):
                args = dict(num_slots=4, key_len=8)
                args.update(kw)
                with self.assertRaises(exc) as cm:
                    Scheduler(**args)
                self.assertIn(name, str(cm.exception))
        with Scheduler(num_slots=4, policy="ARC") as s:
            self.assertIs(s.policy, kvoffload.Policy.ARC)
            self.assertEqual(s.key_len, 32)
        with Scheduler(num_slots=4, policy=kvoffload.Policy.ARC) as s:
            self.assertIs(s.policy, kvoffload.Policy.ARC)

    def test_default_key_len_is_32(self):
        with Scheduler(num_slots=4, gpu_block_size=4) as s:
            s.add_request(1, 4)
            with self.assertRaises(ValueError):
                s.append_block_hashes(1, [b"\0" * 8], 4)
            s.append_block_hashes(1, [b"\0" * 32], 4)


class LifetimeTest(unittest.TestCase):
    def test_close_twice_and_use_after_close(self):
        s = Scheduler(num_slots=4, key_len=8)
        self.assertFalse(s.closed)
        s.close()
        s.close()
        self.assertTrue(s.closed)
        self.assertIn("closed", repr(s))
        for call in (
            lambda: s.add_request(1, 4),
            lambda: s.stats(),
            lambda: s.build_step([]),
            lambda: s.check_invariants(),
            lambda: s.__enter__(),
        ):
            with self.assertRaises(ValueError) as cm:
                call()
            self.assertIn("closed", str(cm.exception))
        st = Step()
        st.close()
        st.close()
        self.assertTrue(st.closed)
        self.assertIn("closed", repr(st))
        for call in (lambda: st.info, lambda: st.jobs, lambda: st.flush, st.encode):
            with self.assertRaises(ValueError):
                call()
        with Scheduler(num_slots=4, key_len=8) as s2:
            with self.assertRaises(ValueError):
                s2.build_step([], step=st)
            with self.assertRaises(ValueError):
                Step.decode(b"", into=st)

    def test_context_managers(self):
        with Scheduler(num_slots=4, key_len=8) as s:
            self.assertIn("Scheduler", repr(s))
            with s.build_step([]) as st:
                self.assertIn("0 jobs", repr(st))
            self.assertTrue(st.closed)
        self.assertTrue(s.closed)
        s.close()

    def test_finalizers_free_unclosed_handles(self):
        s = Scheduler(num_slots=4, key_len=8)
        st = s.build_step([])
        fs, fst = s._finalizer, st._finalizer
        ref = weakref.ref(s)
        self.assertTrue(fs.alive and fst.alive)
        del s, st
        gc.collect()
        self.assertIsNone(ref())
        self.assertFalse(fs.alive)
        self.assertFalse(fst.alive)

    def test_failed_build_closes_its_own_step(self):
        made = []

        class Recording(Step):
            def __init__(self):
                super().__init__()
                made.append(self)

        with Scheduler(num_slots=4, key_len=8) as s:
            with mock.patch.object(_scheduler, "Step", Recording):
                with self.assertRaises(NotFoundError):
                    s.build_step([], [5])
                self.assertEqual(len(made), 1)
                self.assertTrue(made[0].closed, "the plan made for the failed call is freed")
                with s.build_step([]) as st:
                    self.assertIs(st, made[1])
                    self.assertFalse(st.closed)

    def test_failed_decode_closes_its_own_step(self):
        made = []

        class Recording(Step):
            def __init__(self):
                super().__init__()
                made.append(self)

        with self.assertRaises(CorruptDataError):
            Recording.decode(b"junk")
        self.assertEqual(len(made), 1)
        self.assertTrue(made[0].closed)

    def test_exports(self):
        for name in (
            "Scheduler",
            "Step",
            "ScheduledRequest",
            "MatchResult",
            "JobReport",
            "Job",
            "StepInfo",
            "SchedulerStats",
            "Recompute",
            "Match",
            "DeferReason",
            "JobKind",
        ):
            self.assertIn(name, kvoffload.__all__)
            self.assertTrue(hasattr(kvoffload, name), name)


class RandomSequenceTest(unittest.TestCase):
    """Random call sequences of a well-behaved host (plus preemptions, failures, finishes and
    resets): the invariants hold after every call, no call panics or finds an invariant broken,
    every plan survives encode/decode, and once every job is reported and every request finished
    nothing stays pinned or in flight."""

    SEEDS = 60
    OPS = 300

    def run_one(self, seed):
        rng = random.Random(seed)
        gbs, f = rng.choice([1, 2, 4]), rng.choice([1, 2, 3])
        workers = rng.choice([1, 2])
        s = Scheduler(
            num_slots=rng.choice([2, 5, 50]),
            key_len=8,
            gpu_block_size=gbs,
            block_size_factor=f,
            num_workers=workers,
            offload_prompt_only=rng.random() < 0.5,
            enable_events=True,
            policy=rng.choice(["lru", "arc"]),
        )
        self.addCleanup(s.close)
        reqs = {}  # id -> [family, tokens, hashed blocks, block ids, computed tokens]
        jobs = set()
        log = []
        next_id = next_block = 0

        def call(name, *args):
            log.append((name, args))
            try:
                return getattr(s, name)(*args)
            except (kvoffload.PanicError, kvoffload.InternalError) as e:
                self.fail(f"seed {seed}: {name}{args}: {e!r}; last calls: {log[-20:]}")
            except KvoError as e:
                return e

        for _ in range(self.OPS):
            op = rng.random()
            if op < 0.12 or not reqs:
                rid, next_id = next_id, next_id + 1
                fam, t = rng.randrange(3), rng.randrange(40)
                call("add_request", rid, t, rng.choice([None, None, 0, rng.randrange(60)]))
                call("append_block_hashes", rid, hashes(fam, 0, t // gbs), t)
                reqs[rid] = [fam, t, t // gbs, [], 0]
            elif op < 0.3:
                rid = rng.choice(list(reqs))
                m = call("match", rid, rng.randrange(3) * gbs)
                if isinstance(m, MatchResult):
                    r = reqs[rid]
                    nb = -(-r[1] // gbs)
                    b, next_block = blocks(next_block, next_block + nb), next_block + nb
                    j = call("on_alloc", rid, b, m.tokens if m.is_hit else 0)
                    if isinstance(j, int):
                        jobs.add(j)
                    r[3] = b
            elif op < 0.55:
                scheduled = []
                for rid in rng.sample(list(reqs), min(len(reqs), rng.randrange(3))):
                    r = reqs[rid]
                    if rng.random() < 0.3:  # decode a few tokens
                        t = r[1] + rng.randrange(1, 9)
                        call("append_block_hashes", rid, hashes(r[0], r[2], t // gbs), t)
                        r[1], r[2] = t, t // gbs
                    nb = -(-r[1] // gbs)
                    new = blocks(next_block, next_block + max(0, nb - len(r[3])))
                    next_block += len(new)
                    c = min(r[4], r[1])
                    n = rng.randrange(r[1] - c + 1)
                    scheduled.append(sched(rid, c, n, r[1], new))
                    r[3] += new
                    r[4] = c + n
                preempted = rng.sample(list(reqs), min(len(reqs), rng.choice([0, 0, 1])))
                st = call("build_step", scheduled, preempted)
                if isinstance(st, Step):
                    jobs.update(j.id for j in st.jobs)
                    with st, Step.decode(st.encode()) as back:
                        self.assertEqual((back.jobs, back.flush), (st.jobs, st.flush))
            elif op < 0.75 and jobs:
                j = rng.choice(sorted(jobs))
                if isinstance(call("complete_jobs", [(j, 1, rng.random() < 0.85)]), KvoError):
                    jobs.discard(j)
            elif op < 0.85:
                rid = rng.choice(list(reqs))
                call("finish_request", rid)
                del reqs[rid]
            elif op < 0.88:
                call("reset")
            elif op < 0.92:
                call("take_events")
            else:
                call("load_failure", rng.choice(list(reqs)))
            try:
                s.check_invariants()
            except KvoError as e:
                self.fail(f"seed {seed}: {e!r}; last calls: {log[-20:]}")
        # Drain: a last step ships the loads made since the previous one; then every job is
        # reported by every worker (reports of jobs done or from before a reset are refused or
        # ignored) and every request finished.
        st = call("build_step", [], [])
        if isinstance(st, Step):
            jobs.update(j.id for j in st.jobs)
            st.close()
        for j in sorted(jobs):
            for _ in range(workers):
                call("complete_jobs", [(j, 1, True)])
        for rid in list(reqs):
            call("finish_request", rid)
        s.check_invariants()
        end = s.stats()
        self.assertEqual(
            (end.requests, end.loads_in_flight, end.stores_in_flight),
            (0, 0, 0),
            f"seed {seed}",
        )
        self.assertEqual(
            (end.manager.pinned, end.manager.stores_in_flight), (0, 0), f"seed {seed}"
        )
        return end

    def test_random_sequences(self):
        totals = {"hits": 0, "deferred_jobs_in_flight": 0, "load_jobs": 0, "failed_jobs": 0}
        for seed in range(self.SEEDS):
            end = self.run_one(seed)
            for name in totals:
                totals[name] += getattr(end, name)
        # The sequences reach the interesting paths.
        for name, n in totals.items():
            self.assertGreater(n, 0, name)


if __name__ == "__main__":
    unittest.main()

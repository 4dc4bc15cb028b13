"""Abort while loading through kvoffload.Scheduler and kvoffload.Worker, checked on the bytes.

Request 2's load of prefix A is queued on the worker behind big loads when request 2 is aborted
and its GPU blocks go to request 3. The step that schedules request 3 must flush the load, so the
load cannot overwrite the KV that request 3 computes into those blocks.
"""

import ctypes
import unittest


from kvoffload import JobKind, KvTensor, Match, ScheduledRequest, Scheduler, Worker  # noqa: E402

PAGE = 1 << 20  # bytes per GPU block
NUM_BLOCKS = 48
NUM_SLOTS = 64
GBS = 4  # tokens per GPU block
BUSY_JOBS = 8


def hashes(family, n):
    return [(family * 1_000_000 + i).to_bytes(8, "big") for i in range(n)]


class AbortWhileLoading(unittest.TestCase):
    def setUp(self):
        self.kv = ctypes.create_string_buffer(NUM_BLOCKS * PAGE)
        self.base = ctypes.addressof(self.kv)
        self.s = Scheduler(num_slots=NUM_SLOTS, key_len=8, gpu_block_size=GBS)
        self.addCleanup(self.s.close)
        self.w = Worker([KvTensor(self.base, NUM_BLOCKS, PAGE, PAGE)], NUM_SLOTS)
        self.addCleanup(self.w.close)

    def compute(self, req, blocks):
        """The forward pass of ``req``: block ``i`` of the request gets byte ``16 * req + i``."""
        for i, b in enumerate(blocks):
            ctypes.memset(self.base + b * PAGE, 16 * req + i, PAGE)

    def overwritten(self, req, blocks):
        return [
            b
            for i, b in enumerate(blocks)
            if self.kv.raw[b * PAGE : (b + 1) * PAGE] != bytes([16 * req + i]) * PAGE
        ]

    def drain(self, ids, expected):
        """Waits for ``ids``, polls everything, reports the scheduler's jobs (ids < 1000)."""
        self.w.wait(ids, timeout_ms=10000)
        done = self.w.poll()
        self.assertEqual(len(done), expected)
        self.assertTrue(all(c.success for c in done))
        reports = [(c.job_id, 1, True) for c in done if c.job_id < 1000]
        if reports:
            self.s.complete_jobs(reports)

    def test_the_reusing_requests_kv_survives_the_aborted_load(self):
        s, w = self.s, self.w
        b1, b2 = list(range(16)), list(range(16, 32))

        # 1. Request 1 computes prefix A in blocks 0..15, stores it, finishes.
        s.add_request(1, 64)
        s.append_block_hashes(1, hashes(1, 16), 64)
        self.assertEqual(s.match(1, 0).kind, Match.MISS)
        s.on_alloc(1, b1, 0)
        self.compute(1, b1)
        step = s.build_step([ScheduledRequest(1, 0, 64, 64, b1)])
        self.addCleanup(step.close)
        (store1,) = step.jobs
        w.submit_step(step)
        self.drain([store1.id], 1)
        s.finish_request(1)

        # 2. Request 2 hits 60 tokens of A; its load into blocks 16..31 queues behind big loads.
        s.add_request(2, 61)
        s.append_block_hashes(2, hashes(1, 15), 61)
        m = s.match(2, 0)
        self.assertEqual((m.kind, m.tokens), (Match.HIT, 60))
        load = s.on_alloc(2, b2, 60)
        for j in range(BUSY_JOBS):
            w.submit_job(1000 + j, JobKind.LOAD, range(40, 56), range(32, 48))
        step = s.build_step([], step=step)
        self.assertEqual([j.id for j in step.jobs], [load])
        w.submit_step(step)

        # 3. Request 2 is aborted; its blocks go to request 3 (prefix B) at once.
        s.finish_request(2)
        s.add_request(3, 64)
        s.append_block_hashes(3, hashes(2, 16), 64)
        self.assertEqual(s.match(3, 0).kind, Match.MISS)
        s.on_alloc(3, b2, 0)
        step = s.build_step([ScheduledRequest(3, 0, 64, 64, b2)], step=step)
        self.assertEqual(step.flush, [load])
        (store3,) = step.jobs
        w.submit_step(step)  # waits for request 2's load
        self.compute(3, b2)

        # 4. Every copy drains; request 3's blocks still hold request 3's KV.
        self.drain([load, store3.id], BUSY_JOBS + 2)
        self.assertEqual(self.overwritten(3, b2), [])
        s.check_invariants()
        st = s.stats()
        self.assertEqual(
            (st.requests, st.loads_in_flight, st.stores_in_flight, st.manager.pinned),
            (1, 0, 0, 0),
        )


if __name__ == "__main__":
    unittest.main()

"""Tests of kvoffload.Worker through the shared library (stdlib unittest), host backend.

"GPU" KV tensors are Python memory (``ctypes.create_string_buffer`` or ``bytearray``) registered
by address; every check compares bytes: the host tier (slot ``s``, sub-block ``j`` of a tensor
at ``s * page_size * factor + j * page_size``) after stores, the whole tensors (other blocks and
stride padding included) after loads. Scheduler scenarios follow src/scheduler/tests.rs: 8-byte
block hashes, the hash of GPU block ``i`` of prompt family ``seed`` is ``seed * 1_000_000 + i``.
"""

import ctypes
import gc
import random
import unittest
import weakref


import kvoffload  # noqa: E402
from kvoffload import (  # noqa: E402
    Backend,
    Completion,
    CudaUnavailableError,
    InvalidArgumentError,
    InvalidStateError,
    JobKind,
    KvTensor,
    Match,
    NotFoundError,
    NullArgumentError,
    ScheduledRequest,
    Scheduler,
    Step,
    Worker,
)

GBS = 4  # tokens per GPU block (scheduler)
SLOTS = 16
NBLOCKS = 32


def hashes(seed, frm, to):
    return [(seed * 1_000_000 + i).to_bytes(8, "big") for i in range(frm, to)]


class Mem:
    """A "GPU" tensor in Python memory: ``num_blocks`` pages of ``page`` bytes ``stride`` bytes
    apart, 64-byte aligned, filled with random bytes (padding included); ``orig`` keeps them."""

    def __init__(self, num_blocks, stride, page, seed, kind="ctypes"):
        self.num_blocks, self.stride, self.page = num_blocks, stride, page
        self.size = num_blocks * stride
        if kind == "ctypes":
            self.buf = ctypes.create_string_buffer(self.size + 64)
            address = ctypes.addressof(self.buf)
        else:
            self.buf = bytearray(self.size + 64)
            address = ctypes.addressof((ctypes.c_char * len(self.buf)).from_buffer(self.buf))
        self.off = -address % 64
        self.base = address + self.off
        data = random.Random(seed).randbytes(self.size)
        self.view[:] = data
        self.orig = bytes(data)

    @property
    def view(self):
        return memoryview(self.buf).cast("B")[self.off : self.off + self.size]

    def bytes(self):
        return bytes(self.view)

    def block(self, b):
        return self.bytes()[b * self.stride : b * self.stride + self.page]

    def orig_block(self, b):
        return self.orig[b * self.stride : b * self.stride + self.page]

    def tensor(self):
        return KvTensor(self.base, self.num_blocks, self.stride, self.page)


def store_image(image, mem, blocks, slots, skip, factor):
    """Writes into ``image`` (a bytearray host tier) what a store of ``blocks`` into ``slots``
    from sub-block ``skip`` on puts there, from ``mem``'s original bytes."""
    for i, b in enumerate(blocks):
        k = skip + i
        off = slots[k // factor] * mem.page * factor + (k % factor) * mem.page
        image[off : off + mem.page] = mem.orig_block(b)


def load_image(mem, src_blocks, dst_blocks):
    """``mem``'s original bytes with block ``src_blocks[i]`` copied into ``dst_blocks[i]``."""
    want = bytearray(mem.orig)
    for s, d in zip(src_blocks, dst_blocks):
        want[d * mem.stride : d * mem.stride + mem.page] = mem.orig_block(s)
    return bytes(want)


class Base(unittest.TestCase):
    def mems(self, kind="ctypes", seed=1):
        """Two tensors: contiguous 64-byte pages, and 40-byte pages with 56 bytes of padding."""
        return Mem(NBLOCKS, 64, 64, seed, kind), Mem(NBLOCKS, 96, 40, seed + 1, kind)

    def worker(self, tensors, **kw):
        kw.setdefault("num_host_slots", SLOTS)
        w = Worker(tensors, **kw)
        self.addCleanup(w.close)
        return w

    def run_jobs(self, w, ids):
        """Waits for ``ids``, polls once; every one must be there. Returns {id: Completion}."""
        w.wait(ids)
        done = w.poll()
        got = {c.job_id: c for c in done}
        self.assertEqual(len(got), len(done), "no id twice")
        for i in ids:
            self.assertIn(i, got)
        return got


class StoreLoadTest(Base):
    def round_trip(self, factor, block_index, kind):
        m0, m1 = self.mems(kind, seed=factor * 10 + block_index)
        w = self.worker([m0.tensor(), m1.tensor()], block_size_factor=factor)
        self.assertEqual((w.num_tensors, w.block_size_factor, w.backend), (2, factor, Backend.HOST))
        rng = random.Random(factor)
        n = 7
        skip = block_index % factor
        src = rng.sample(range(NBLOCKS), n)  # random order
        slots = rng.sample(range(SLOTS), -(-(n + skip) // factor))
        dst = rng.sample([b for b in range(NBLOCKS) if b not in src], n)

        img0 = bytearray(SLOTS * 64 * factor)
        img1 = bytearray(SLOTS * 40 * factor)
        self.assertEqual(bytes(w.host_buffer(0)), bytes(img0))  # zeroed
        self.assertEqual(w.host_buffer_address(1)[1], len(img1))

        w.submit_job(1, JobKind.STORE, src, slots, block_index=block_index)
        got = self.run_jobs(w, [1])
        self.assertEqual(got[1].bytes, n * (64 + 40))
        self.assertTrue(got[1].success)
        self.assertIsNone(got[1].error)
        self.assertGreaterEqual(got[1].seconds, 0.0)
        store_image(img0, m0, src, slots, skip, factor)
        store_image(img1, m1, src, slots, skip, factor)
        self.assertEqual(bytes(w.host_buffer(0)), bytes(img0))
        self.assertEqual(bytes(w.host_buffer(1)), bytes(img1))
        self.assertEqual(m0.bytes(), m0.orig)
        self.assertEqual(m1.bytes(), m1.orig)

        w.submit_job(2, "load", slots, dst, block_index)
        got = self.run_jobs(w, [2])
        self.assertEqual(got[2], Completion(2, True, n * 104, got[2].seconds, None))
        self.assertEqual(m0.bytes(), load_image(m0, src, dst))
        self.assertEqual(m1.bytes(), load_image(m1, src, dst))  # padding untouched
        self.assertEqual(w.poll(), [])

    def test_factor_1(self):
        self.round_trip(1, 0, "ctypes")

    def test_factor_3_aligned(self):
        self.round_trip(3, 6, "bytearray")

    def test_factor_3_partial_first_chunk(self):
        self.round_trip(3, 4, "ctypes")  # 4 % 3 == 1: sub-block 0 of the first slot skipped

    def test_factor_3_partial_first_chunk_skip_2(self):
        self.round_trip(3, 5, "bytearray")

    def test_fifo_per_direction_and_poll_max(self):
        m0, m1 = self.mems()
        w = self.worker([m0.tensor(), m1.tensor()], threads=1)
        stores = list(range(100, 108))
        loads = list(range(200, 208))
        w.submit_job(100, JobKind.STORE, range(8), range(8))
        for i in range(1, 8):
            w.submit_job(100 + i, JobKind.STORE, [i], [i])
            w.submit_job(200 + i, JobKind.LOAD, [8 + i], [16 + i])
        w.submit_job(200, JobKind.LOAD, [15], [31])
        w.wait(stores + loads)
        seen = []
        while len(seen) < 16:
            batch = w.poll(max=3)
            self.assertTrue(1 <= len(batch) <= 3)
            seen += [c.job_id for c in batch]
        self.assertEqual([i for i in seen if i < 200], stores)
        self.assertEqual([i for i in seen if i >= 200], loads[1:] + [200])
        self.assertEqual(w.poll(), [])
        self.assertEqual(w.poll(max=0), [])
        with self.assertRaises(NotFoundError):
            w.wait([100])  # already polled

    def test_wait_accepts_one_id_and_keeps_the_completion(self):
        (m0,) = self.mems()[:1]
        w = self.worker([m0.tensor()])
        w.submit_job(7, JobKind.STORE, [3], [4])
        w.wait(7, timeout_ms=30000)
        w.wait([7])  # finished, not yet polled: still known
        w.wait([])
        (c,) = w.poll()
        self.assertEqual((c.job_id, c.success, c.bytes), (7, True, 64))
        self.assertEqual(bytes(w.host_buffer(0)[4 * 64 : 5 * 64]), m0.orig_block(3))

    def test_swap_blocks(self):
        m0, m1 = self.mems()
        m2 = Mem(8, 128, 64, 99)  # m0's page size, another stride
        w = self.worker([m0.tensor(), m1.tensor(), m2.tensor()], block_size_factor=3)
        w.swap_blocks(0, 2, [1, 5], [7, 0])  # synchronous: done now, nothing to poll
        self.assertEqual(m2.block(7), m0.orig_block(1))
        self.assertEqual(m2.block(0), m0.orig_block(5))
        self.assertEqual(m2.bytes()[64:128], m2.orig[64:128])  # padding of block 0
        self.assertEqual(w.poll(), [])
        w.swap_blocks(0, 0, [2, 3], [20, 21], job_id=50)
        got = self.run_jobs(w, [50])
        self.assertEqual((got[50].success, got[50].bytes), (True, 128))
        self.assertEqual(m0.bytes(), load_image(m0, [2, 3], [20, 21]))
        with self.assertRaises(InvalidArgumentError) as e:
            w.swap_blocks(0, 1, [0], [0])  # page sizes differ
        self.assertIn("page", e.exception.message)
        with self.assertRaises(InvalidArgumentError) as e:
            w.swap_blocks(0, 3, [0], [0])
        self.assertIn("dst_tensor", e.exception.message)
        with self.assertRaises(InvalidArgumentError) as e:
            w.swap_blocks(0, 2, [0], [8])
        self.assertIn("dst_blocks", e.exception.message)
        with self.assertRaises(ValueError):
            w.swap_blocks(0, 2, [0, 1], [0])
        self.assertEqual(m1.bytes(), m1.orig)
        self.assertEqual(w.poll(), [])

    def test_large_job_split_across_threads(self):
        page, nb = 128 * 1024 + 8, 40
        m = Mem(nb, page + 56, page, 5)
        w = self.worker([m.tensor()], num_host_slots=nb, threads=4)
        rng = random.Random(3)
        src, slots = rng.sample(range(nb), nb), rng.sample(range(nb), nb)
        w.submit_job(1, JobKind.STORE, src, slots)
        self.assertEqual(self.run_jobs(w, [1])[1].bytes, nb * page)
        host = w.host_buffer(0)
        for b, s in zip(src, slots):
            self.assertEqual(bytes(host[s * page : (s + 1) * page]), m.orig_block(b))


class CallerBufferTest(Base):
    def test_host_buffers_are_used_and_kept_alive(self):
        class Buf(bytearray):  # weak-referenceable
            pass

        m0, m1 = self.mems()
        b0, b1 = Buf(b"\xee" * (SLOTS * 64 * 3)), Buf(b"\xdd" * (SLOTS * 40 * 3 + 8))
        r0, r1 = weakref.ref(b0), weakref.ref(b1)
        img0, img1 = bytearray(b0), bytearray(b1)
        w = Worker([m0.tensor(), m1.tensor()], SLOTS, block_size_factor=3, host_buffers=[b0, b1])
        self.addCleanup(w.close)
        a0 = ctypes.addressof((ctypes.c_char * len(b0)).from_buffer(b0))
        self.assertEqual(w.host_buffer_address(0), (a0, len(b0)))
        del b0, b1
        gc.collect()
        self.assertIsNotNone(r0(), "the worker keeps its host buffers alive")
        self.assertIsNotNone(r1())
        src, slots = [9, 2, 30, 17], [15, 0]
        w.submit_job(1, JobKind.STORE, src, slots, block_index=2)
        self.run_jobs(w, [1])
        store_image(img0, m0, src, slots, 2, 3)
        store_image(img1, m1, src, slots, 2, 3)
        self.assertEqual(bytes(r0()), bytes(img0))
        self.assertEqual(bytes(r1()), bytes(img1))  # the 8 extra bytes untouched
        w.close()
        gc.collect()
        self.assertIsNone(r0(), "released once the worker is freed")
        self.assertIsNone(r1())

    def test_address_length_pairs_and_from_buffer_tensors(self):
        host = ctypes.create_string_buffer(SLOTS * 64)
        t_mem = bytearray(random.Random(4).randbytes(NBLOCKS * 64 + 64))
        off = -ctypes.addressof((ctypes.c_char * len(t_mem)).from_buffer(t_mem)) % 64
        t = KvTensor.from_buffer(t_mem, NBLOCKS, 64, 64, offset=off)
        self.assertIsNotNone(t.keepalive)
        w = self.worker([t], host_buffers=[(ctypes.addressof(host), len(host))])
        w.submit_job(1, JobKind.STORE, [5], [2])
        self.run_jobs(w, [1])
        self.assertEqual(host.raw[2 * 64 : 3 * 64], bytes(t_mem[off + 5 * 64 : off + 6 * 64]))
        with self.assertRaises(ValueError):
            KvTensor.from_buffer(t_mem, NBLOCKS + 2, 64, 64)
        with self.assertRaises(TypeError):
            KvTensor.from_buffer(b"read-only", 1, 8, 8)


class SchedulerStepTest(Base):
    def execute(self, s, plan, w):
        """What a worker process does with a plan: decode, submit, wait, poll, report."""
        recv = Step.decode(plan.encode())
        self.addCleanup(recv.close)
        ids = [j.id for j in recv.jobs]
        w.submit_step(recv)
        done = self.run_jobs(w, ids)
        self.assertEqual(len(done), len(ids))
        s.complete_jobs([(c.job_id, 1, c.success) for c in done.values()])
        s.check_invariants()
        return done

    def test_store_then_load_through_step_plans(self):
        m0, m1 = self.mems(seed=7)
        w = self.worker([m0.tensor(), m1.tensor()], block_size_factor=3)
        s = Scheduler(
            num_slots=SLOTS, key_len=8, gpu_block_size=GBS, block_size_factor=3,
            offload_prompt_only=False,
        )
        self.addCleanup(s.close)
        rng = random.Random(11)
        b1 = rng.sample(range(NBLOCKS), 9)
        b2 = rng.sample([b for b in range(NBLOCKS) if b not in b1], 10)

        # Request 1: 36 tokens = 9 GPU blocks = 3 chunks, stored by the worker.
        s.add_request(1, 36)
        s.append_block_hashes(1, hashes(3, 0, 9), 36)
        self.assertEqual(s.match(1, 0).kind, Match.MISS)
        s.on_alloc(1, b1, 0)
        plan = s.build_step([ScheduledRequest(1, 0, 36, 36, b1)])
        self.addCleanup(plan.close)
        (job,) = plan.jobs
        self.assertEqual((job.kind, list(job.src), len(job.dst)), (JobKind.STORE, b1, 3))
        done = self.execute(s, plan, w)
        self.assertEqual((done[job.id].success, done[job.id].bytes), (True, 9 * 104))
        img0 = bytearray(SLOTS * 64 * 3)
        store_image(img0, m0, b1, job.dst, 0, 3)
        self.assertEqual(bytes(w.host_buffer(0)), bytes(img0))
        s.finish_request(1)
        self.assertEqual(s.stats().manager.ready, 3)

        # Request 2 shares the prefix; one GPU block hit: a load from sub-block 1.
        s.add_request(2, 40)
        s.append_block_hashes(2, hashes(3, 0, 10), 40)
        m = s.match(2, GBS)
        self.assertEqual((m.kind, m.tokens), (Match.HIT, 32))
        load = s.on_alloc(2, b2, 32)
        plan = s.build_step([], step=plan)
        (job,) = plan.jobs
        self.assertEqual(
            (job.id, job.kind, job.block_index, job.dst), (load, JobKind.LOAD, 1, b2[1:9])
        )
        done = self.execute(s, plan, w)
        self.assertEqual((done[load].success, done[load].bytes), (True, 8 * 104))
        self.assertEqual(m0.bytes(), load_image(m0, b1[1:9], b2[1:9]))
        self.assertEqual(m1.bytes(), load_image(m1, b1[1:9], b2[1:9]))
        st = s.stats()
        self.assertEqual((st.loads_in_flight, st.failed_jobs, st.manager.pinned), (0, 0, 0))
        self.assertIsNone(s.load_failure(2))

        # A worker with another factor refuses the plan; submitting nothing.
        w1 = self.worker([m0.tensor(), m1.tensor()], block_size_factor=1)
        with self.assertRaises(InvalidArgumentError) as e:
            w1.submit_step(plan)
        self.assertIn("block_size_factor", e.exception.message)
        self.assertEqual(w1.poll(), [])
        with self.assertRaises(TypeError):
            w1.submit_step(plan.encode())

    def test_failed_store_is_reported_to_the_scheduler(self):
        (m0,) = self.mems()[:1]
        # The worker's registration has fewer blocks than the scheduler hands out.
        small = KvTensor(m0.base, 8, 64, 64)
        w = self.worker([small], block_size_factor=3)
        s = Scheduler(num_slots=SLOTS, key_len=8, gpu_block_size=GBS, block_size_factor=3,
                      offload_prompt_only=False)
        self.addCleanup(s.close)
        s.add_request(1, 12)
        s.append_block_hashes(1, hashes(4, 0, 3), 12)
        s.match(1, 0)
        s.on_alloc(1, [20, 21, 22], 0)
        plan = s.build_step([ScheduledRequest(1, 0, 12, 12, [20, 21, 22])])
        self.addCleanup(plan.close)
        done = self.execute(s, plan, w)
        (c,) = done.values()
        self.assertFalse(c.success)
        self.assertEqual(c.bytes, 0)
        self.assertIn("20", c.error)
        st = s.stats()
        self.assertEqual((st.failed_jobs, st.manager.used), (1, 0))  # rolled back
        self.assertEqual(m0.bytes(), m0.orig)


class FailureTest(Base):
    def test_out_of_range_block_fails_the_job_with_a_message(self):
        m0, m1 = self.mems()
        w = self.worker([m0.tensor(), m1.tensor()], block_size_factor=3)
        w.submit_job(10, JobKind.STORE, [3, 99], [4])
        w.submit_job(11, JobKind.LOAD, [4], [5, 1234567])
        w.submit_job(12, JobKind.STORE, [3], [SLOTS])
        w.submit_job(13, JobKind.STORE, [3, 4], [1, 2])  # one slot too many
        w.submit_job(14, JobKind.STORE, [6], [7])  # fine
        with self.assertRaises(InvalidStateError) as e:  # failed ids are in flight until polled
            w.submit_job(10, JobKind.STORE, [3], [4])
        self.assertIn("job_id", e.exception.message)
        got = self.run_jobs(w, [10, 11, 12, 13, 14])
        for i, word in [(10, "99"), (11, "1234567"), (12, str(SLOTS)), (13, "slot")]:
            self.assertFalse(got[i].success)
            self.assertEqual(got[i].bytes, 0)
            self.assertIsInstance(got[i].error, str)
            self.assertIn(word, got[i].error)
        self.assertTrue(got[14].success)
        self.assertIsNone(got[14].error)
        host = bytes(w.host_buffer(0))
        self.assertEqual(host[:7 * 192], bytes(7 * 192))  # slots 0..6 untouched
        self.assertEqual(m0.bytes(), m0.orig)
        self.assertEqual(m1.bytes(), m1.orig)

    def test_bad_registrations_name_the_argument(self):
        m0, m1 = self.mems()
        t0, t1 = m0.tensor(), m1.tensor()

        def bad(word, tensors, **kw):
            kw.setdefault("num_host_slots", SLOTS)
            with self.assertRaises(InvalidArgumentError) as e:
                Worker(tensors, **kw)
            self.assertIn(word, e.exception.message)
            self.assertEqual(m0.bytes(), m0.orig)
            self.assertEqual(m1.bytes(), m1.orig)

        bad("tensors", [])
        bad("overlaps", [t0, KvTensor(t0.base + 31 * 64 + 8, 1, 96, 40)])
        bad("tensors[1]", [t0, t0])
        bad("tensors[0]", [KvTensor(t0.base, NBLOCKS, 64, 0)])
        bad("block_stride", [t0, KvTensor(t1.base, NBLOCKS, 60, 40)])
        bad("block_stride", [t0, KvTensor(t1.base, NBLOCKS, 32, 40)])
        bad("base", [KvTensor(t0.base + 4, NBLOCKS, 64, 64)])
        bad("tensors[0].base", [KvTensor(0, NBLOCKS, 64, 64)])
        bad("tensors[1]", [t0, KvTensor(t1.base, NBLOCKS, 96, 40, on_device=True)])
        bad("block_size_factor", [t0], block_size_factor=0)
        bad("num_host_slots", [t0], num_host_slots=0)
        bad("backend", [t0], backend=7)
        small = bytearray(SLOTS * 64 * 3 - 1)
        bad("host_buffers[0]", [t0], block_size_factor=3, host_buffers=[small])
        bad("host_buffers[0]", [t0], host_buffers=[(0, SLOTS * 64)])

        # Checked on the Python side.
        with self.assertRaises(TypeError):
            Worker([(t0.base, NBLOCKS, 64, 64)], SLOTS)
        with self.assertRaises(ValueError):
            Worker([t0], SLOTS, host_buffers=[])
        with self.assertRaises(TypeError):
            Worker([t0], SLOTS, host_buffers=[bytes(SLOTS * 64)])  # read-only
        with self.assertRaises(ValueError):
            Worker([t0], SLOTS, backend="tpu")
        with self.assertRaises(ValueError):
            Worker([t0], -1)
        with self.assertRaises(TypeError):
            Worker([t0], SLOTS, device="0")

    def test_bad_calls(self):
        (m0,) = self.mems()[:1]
        w = self.worker([m0.tensor()])
        with self.assertRaises(NotFoundError) as e:
            w.wait([777])
        self.assertIn("777", e.exception.message)
        with self.assertRaises(InvalidArgumentError) as e:
            w.submit_job(1, 5, [0], [0])
        self.assertIn("kind", e.exception.message)
        with self.assertRaises(ValueError):
            w.submit_job(1, "copy", [0], [0])
        with self.assertRaises(ValueError):
            w.submit_job(-1, JobKind.STORE, [0], [0])
        with self.assertRaises(TypeError):
            w.submit_job(1, JobKind.STORE, 0, [0])
        with self.assertRaises(InvalidArgumentError) as e:
            w.host_buffer(1)
        self.assertIn("tensor", e.exception.message)
        w.submit_job(1, JobKind.STORE, [0], [0])
        with self.assertRaises(InvalidStateError):
            w.submit_job(1, JobKind.LOAD, [0], [1])
        self.run_jobs(w, [1])
        self.assertEqual(m0.bytes(), m0.orig)  # the refused load did not run

    def test_shutdown(self):
        (m0,) = self.mems()[:1]
        w = self.worker([m0.tensor()])
        w.submit_job(1, JobKind.STORE, [6], [9])
        w.shutdown()
        with self.assertRaises(InvalidStateError) as e:
            w.submit_job(2, JobKind.STORE, [6], [9])
        self.assertIn("shut down", e.exception.message)
        with self.assertRaises(InvalidStateError):
            w.swap_blocks(0, 0, [1], [2])
        with self.assertRaises(InvalidStateError):
            w.swap_blocks(0, 0, [1], [2], job_id=3)
        self.assertEqual(m0.bytes(), m0.orig)
        s = Scheduler(num_slots=SLOTS, key_len=8, gpu_block_size=GBS, offload_prompt_only=False)
        self.addCleanup(s.close)
        s.add_request(1, 4)
        s.append_block_hashes(1, hashes(1, 0, 1), 4)
        s.match(1, 0)
        s.on_alloc(1, [3], 0)
        plan = s.build_step([ScheduledRequest(1, 0, 4, 4, [3])])
        self.addCleanup(plan.close)
        self.assertEqual(len(plan.jobs), 1)
        with self.assertRaises(InvalidStateError):
            w.submit_step(plan)
        w.shutdown()  # again: harmless
        (c,) = w.poll()  # completions stay pollable
        self.assertEqual((c.job_id, c.success), (1, True))
        self.assertEqual(bytes(w.host_buffer(0)[9 * 64 : 10 * 64]), m0.orig_block(6))


class LifetimeTest(Base):
    def test_close_twice_and_use_after_close(self):
        (m0,) = self.mems()[:1]
        w = Worker([m0.tensor()], SLOTS)
        self.assertIn("host", repr(w))
        w.close()
        w.close()
        self.assertTrue(w.closed)
        self.assertFalse(w._finalizer.alive, "freed by close() when no host-tier view is held")
        self.assertIn("closed", repr(w))
        with self.assertRaises(ValueError):
            w.poll()
        with self.assertRaises(ValueError):
            w.submit_job(1, JobKind.STORE, [0], [0])
        with self.assertRaises(ValueError):
            with w:
                pass

    def test_host_buffer_views_keep_the_tier_until_they_go(self):
        (m0,) = self.mems()[:1]
        w = Worker([m0.tensor()], SLOTS)
        view = w.host_buffer(0)
        view[64:128] = bytes(range(64))
        part = view[64:128]  # a slice: its own view of the same memory
        del view
        w.close()
        self.assertTrue(w.closed)
        with self.assertRaises(ValueError):
            w.host_buffer(0)
        self.assertTrue(w._finalizer.alive, "the slice still shows the tier: not freed yet")
        self.assertEqual(bytes(part), bytes(range(64)))  # still the tier's bytes, not freed memory
        part[0] = 7
        self.assertEqual(part[0], 7)
        del part
        gc.collect()
        self.assertFalse(w._finalizer.alive, "freed with the last view")

    def test_context_manager_and_finalizer(self):
        (m0,) = self.mems()[:1]
        with Worker([m0.tensor()], SLOTS) as w:
            w.submit_job(1, JobKind.STORE, [0], [0])
        self.assertTrue(w.closed)  # closed with a job in flight: it was finished first
        w = Worker([m0.tensor()], SLOTS)
        fin = w._finalizer
        w.submit_job(1, JobKind.STORE, [0], [0])
        del w
        gc.collect()
        self.assertFalse(fin.alive)

    def test_cuda(self):
        self.assertIsInstance(kvoffload.cuda_available(), bool)
        (m0,) = self.mems()[:1]
        if kvoffload.cuda_available():
            self.skipTest("a CUDA device is usable here")
        with self.assertRaises(CudaUnavailableError):
            Worker([m0.tensor()], SLOTS, backend="cuda")
        with self.assertRaises(CudaUnavailableError):
            Worker([m0.tensor()], SLOTS, backend=Backend.CUDA, device=0)

    def test_exports(self):
        for name in ("Worker", "KvTensor", "Completion", "cuda_available"):
            self.assertIn(name, kvoffload.__all__)
            self.assertTrue(hasattr(kvoffload, name))
        self.assertIsNotNone(NullArgumentError)


if __name__ == "__main__":
    unittest.main()

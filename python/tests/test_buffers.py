"""Buffer arguments and results: every accepted kind gives the answers a list gives; wrong
sizes, types, alignment and read-only outputs raise naming the argument and change nothing; the
library never keeps a caller's buffer."""

import ctypes
import os
import tracemalloc
import unittest
from array import array

HERE = os.path.dirname(os.path.abspath(__file__))

import kvoffload  # noqa: E402
from kvoffload import (  # noqa: E402
    InvalidArgumentError,
    JobKind,
    KvTensor,
    Keys,
    Manager,
    Scheduler,
    ScheduledRequest,
    StoreBuffers,
    Worker,
)

try:
    import numpy
except ImportError:  # optional: the package has no run-time dependency
    numpy = None

KL = 8


def k(i):
    return i.to_bytes(KL, "big")


def flat(*ids):
    return b"".join(k(i) for i in ids)


def key_kinds(data):
    """The same keys as every accepted kind of keys argument."""
    kinds = {
        "list": [data[i : i + KL] for i in range(0, len(data), KL)],
        "tuple": tuple(data[i : i + KL] for i in range(0, len(data), KL)),
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(data),
        "memoryview slice": memoryview(b"xx" + data + b"yy")[2:-2],
        "array B": array("B", data),
        "ctypes": (ctypes.c_uint8 * len(data)).from_buffer_copy(data) if data else bytearray(),
    }
    if numpy is not None:
        kinds["numpy"] = numpy.frombuffer(data, dtype=numpy.uint8)
        kinds["numpy writable"] = numpy.frombuffer(bytearray(data), dtype=numpy.uint8)
    return kinds


def id_kinds(values, code="I"):
    kinds = {"list": list(values), "tuple": tuple(values), "array": array(code, values),
             "memoryview": memoryview(array(code, values)), "range": range(0)}
    if list(values) != []:
        del kinds["range"]
    if numpy is not None:
        kinds["numpy"] = numpy.array(values, dtype=numpy.uint32 if code == "I" else numpy.uint64)
        kinds["numpy int64"] = numpy.array(values, dtype=numpy.int64)
    return kinds


def fresh():
    m = Manager(num_slots=4, key_len=KL)
    return m


class ManagerBufferTest(unittest.TestCase):
    def run_all(self, data):
        """The answers of every manager call for keys given as one kind."""
        with Manager(num_slots=4, key_len=KL) as m:
            plan = m.prepare_store(data)
            out = [list(plan.indices), list(plan.slots), list(plan.evicted)]
            m.complete_store(data, slots=plan.slots)
            out.append(m.lookup_prefix(data))
            out.append(list(m.prepare_load(data)))
            m.touch(data)
            m.complete_load(data)
            out.append(m.stats().as_dict())
            m.check_invariants()
            return out

    def test_every_kind_gives_the_list_answers(self):
        data = flat(5, 6, 7)
        kinds = key_kinds(data)
        want = self.run_all(kinds["list"])
        self.assertEqual(want[0:2], [[0, 1, 2], [0, 1, 2]])
        for name, keys in kinds.items():
            with self.subTest(kind=name):
                self.assertEqual(self.run_all(keys), want)

    def test_empty_buffers(self):
        for name, keys in key_kinds(b"").items():
            with self.subTest(kind=name), fresh() as m:
                self.assertEqual(m.lookup_prefix(keys), (0, False))
                self.assertEqual(len(m.prepare_store(keys).indices), 0)
                self.assertEqual(len(m.prepare_load(keys)), 0)

    def test_lookup_takes_one_key_of_any_kind(self):
        with fresh() as m:
            m.prepare_store([k(1)])
            m.complete_store([k(1)])
            for name, key in key_kinds(k(1)).items():
                if name in ("list", "tuple"):
                    continue
                with self.subTest(kind=name):
                    self.assertEqual(m.lookup(key), kvoffload.Lookup.HIT)

    def test_results(self):
        with Manager(num_slots=2, key_len=KL) as m:
            plan = m.prepare_store(flat(1, 2))
            self.assertIsInstance(plan.indices, array)
            self.assertEqual(plan.indices.typecode, "I")
            m.complete_store(flat(1, 2))
            plan = m.prepare_store(flat(3))
            self.assertIsInstance(plan.evicted, Keys)
            self.assertEqual(plan.evicted, [k(1)])
            self.assertEqual(plan.evicted.data, k(1))
            self.assertEqual(plan.evicted[0], k(1))
            self.assertEqual(plan.evicted[-1:], Keys(k(1), KL))
            with self.assertRaises(IndexError):
                plan.evicted[1]

    def test_wrong_sizes_raise_and_change_nothing(self):
        with fresh() as m:
            for name, keys in key_kinds(flat(1, 2) + b"abc").items():
                if name in ("list", "tuple"):
                    continue
                for call in (m.prepare_store, m.prepare_load, m.touch, m.complete_load,
                             m.complete_store, m.lookup_prefix):
                    with self.subTest(kind=name, call=call.__name__):
                        with self.assertRaises(ValueError) as cm:
                            call(keys)
                        self.assertIn("keys: 19 bytes is not a multiple of key_len 8",
                                      str(cm.exception))
            self.assertEqual(m.stats().lookups, 0)
            self.assertEqual(m.stats().used, 0)

    def test_wrong_types_name_the_argument(self):
        with fresh() as m:
            for bad in ("a string", 5, None, array("I", [1, 2]), [k(1), 7]):
                with self.subTest(bad=bad), self.assertRaises(TypeError) as cm:
                    m.prepare_store(bad)
                self.assertIn("keys", str(cm.exception))
            with self.assertRaises(TypeError) as cm:  # not contiguous
                m.touch(memoryview(flat(1, 2, 3, 4))[::2])
            self.assertIn("keys", str(cm.exception))
            self.assertEqual(m.stats().used, 0)

    def test_mutating_a_buffer_after_the_call_does_not_reach_the_library(self):
        with fresh() as m:
            buf = bytearray(flat(1, 2))
            plan = m.prepare_store(buf)
            buf[:] = flat(8, 9)
            m.complete_store(flat(1, 2), slots=plan.slots)
            self.assertEqual(m.lookup_prefix(flat(1, 2)), (2, False))
            self.assertEqual(m.lookup_prefix(flat(8, 9)), (0, False))
            slots = array("I", plan.slots)
            loaded = m.prepare_load(flat(1, 2))
            loaded[0] = 99  # our copy, not the library's
            self.assertEqual(list(m.prepare_load(flat(1, 2))), list(slots))

    def test_a_buffer_exported_during_the_call_cannot_be_resized(self):
        with fresh() as m:
            buf = bytearray(flat(1))
            m.prepare_store(buf)
            buf.extend(k(2))  # the export ended with the call
            self.assertEqual(len(buf), 2 * KL)

    def test_slots_of_every_kind_and_their_range(self):
        for name, slots in id_kinds([0, 1]).items():
            with self.subTest(kind=name), fresh() as m:
                m.prepare_store(flat(1, 2))
                m.complete_store(flat(1, 2), slots=slots)
                self.assertEqual(m.lookup_prefix(flat(1, 2)), (2, False))
        with fresh() as m:
            plan = m.prepare_store(flat(1))
            s = plan.slots[0]
            # Issue 16: ints beyond uint32 were truncated by ctypes (2**40 + s became s).
            for bad, err in ((2**40 + s, ValueError), (-1, ValueError), (2**32, ValueError),
                             ("0", TypeError), (1.0, TypeError)):
                with self.subTest(bad=bad), self.assertRaises(err) as cm:
                    m.complete_store(flat(1), slots=[bad])
                self.assertIn("slots[0]", str(cm.exception))
            self.assertEqual(m.lookup(k(1)), kvoffload.Lookup.RETRY)  # nothing changed
            with self.assertRaises(TypeError) as cm:  # floats are no ids
                m.complete_store(flat(1), slots=array("d", [s]))
            self.assertIn("slots", str(cm.exception))
            with self.assertRaises(ValueError) as cm:  # other int buffers: each value checked
                m.complete_store(flat(1), slots=array("q", [-1]))
            self.assertIn("slots[0]: -1", str(cm.exception))
            with self.assertRaises(ValueError) as cm:
                m.complete_store(flat(1), slots=array("I", [s, s]))
            self.assertIn("slots: 2 slots for 1 keys", str(cm.exception))
            m.complete_store(flat(1), slots=array("I", [s]))
            self.assertEqual(m.lookup(k(1)), kvoffload.Lookup.HIT)

    def test_misaligned_uint32_buffers_are_refused(self):
        raw = bytearray(4 * 3 + 1)
        misaligned = memoryview(raw)[1:].cast("I")
        with fresh() as m:
            m.prepare_store(flat(1, 2, 3))
            with self.assertRaises(ValueError) as cm:
                m.complete_store(flat(1, 2, 3), slots=misaligned)
            self.assertIn("slots", str(cm.exception))
            self.assertIn("aligned", str(cm.exception))
            with self.assertRaises(ValueError) as cm:
                m.prepare_load(flat(1), out=misaligned)
            self.assertIn("out", str(cm.exception))
            self.assertEqual(m.stats().stores_in_flight, 3)

    def test_output_buffers(self):
        with fresh() as m:
            m.prepare_store(flat(1, 2))
            m.complete_store(flat(1, 2))
            out = array("I", [7] * 4)
            self.assertIs(m.prepare_load(flat(2, 1), out=out), out)
            self.assertEqual(list(out), [1, 0, 7, 7])
            m.complete_load(flat(2, 1))
            if numpy is not None:
                nout = numpy.zeros(2, dtype=numpy.uint32)
                m.prepare_load(flat(1, 2), out=nout)
                self.assertEqual(nout.tolist(), [0, 1])
                m.complete_load(flat(1, 2))
            for bad, err, what in (
                (bytes(8), TypeError, "writable"),  # read-only
                (memoryview(array("I", [0, 0])).toreadonly(), TypeError, "writable"),
                (array("I", [0]), ValueError, "room for 1 ids, 2 needed"),
                (array("Q", [0, 0]), TypeError, "uint32"),
            ):
                with self.subTest(out=bad), self.assertRaises(err) as cm:
                    m.prepare_load(flat(1, 2), out=bad)
                self.assertIn("out", str(cm.exception))
                self.assertIn(what, str(cm.exception))
            self.assertEqual(m.stats().pinned, 0)  # the failed calls pinned nothing

    def test_store_buffers_are_reused(self):
        with Manager(num_slots=2, key_len=KL) as m:
            b = StoreBuffers(4, KL)
            self.assertIs(m.prepare_store(flat(1, 2), out=b), b)
            self.assertEqual((b.n_store, b.n_evicted), (2, 0))
            self.assertEqual(list(b.indices[: b.n_store]), [0, 1])
            m.complete_store(flat(1, 2), slots=b.slots[: b.n_store])
            m.prepare_store(flat(3), out=b)
            self.assertEqual((b.n_store, b.n_evicted), (1, 1))
            self.assertEqual(bytes(b.evicted[:KL]), k(1))
            self.assertEqual(b.plan(), m_plan(b))
            with self.assertRaises(ValueError) as cm:
                m.prepare_store(flat(4, 5, 6, 7, 8), out=b)
            self.assertIn("out", str(cm.exception))
            with self.assertRaises(ValueError):
                m.prepare_store(flat(4), out=StoreBuffers(4, KL + 1))
            with self.assertRaises(TypeError):
                m.prepare_store(flat(4), out=bytearray(64))
            m.check_invariants()


def m_plan(b):
    return kvoffload.StorePlan(b.indices[: b.n_store], b.slots[: b.n_store],
                               Keys(bytes(b.evicted[: b.n_evicted * KL]), KL))


class SchedulerBufferTest(unittest.TestCase):
    def setUp(self):
        self.s = Scheduler(num_slots=64, key_len=KL, gpu_block_size=4)
        self.addCleanup(self.s.close)

    def add(self, rid, hashes, tokens):
        self.s.add_request(rid, tokens)
        self.s.append_block_hashes(rid, hashes, tokens)

    def test_hashes_of_every_kind(self):
        for i, (name, hashes) in enumerate(key_kinds(flat(1, 2)).items()):
            with self.subTest(kind=name):
                self.add(100 + i, hashes, 8)
                self.assertFalse(self.s.match(100 + i, 0).is_hit)
        with self.assertRaises(ValueError) as cm:
            self.s.append_block_hashes(100, flat(1)[:5], 12)
        self.assertIn("hashes", str(cm.exception))

    def test_build_step_arrays_equals_build_step(self):
        def plan(use_arrays, kind):
            with Scheduler(num_slots=64, key_len=KL, gpu_block_size=4) as s:
                for r in range(3):
                    s.add_request(r, 8)
                    s.append_block_hashes(r, flat(10 * r, 10 * r + 1), 8)
                    s.match(r, 0)
                blocks = [[0, 1], [2, 3], [4, 5]]
                if use_arrays:
                    ids = id_kinds([0, 1, 2], "Q")[kind]
                    step = s.build_step_arrays(
                        ids, id_kinds([0, 0, 0], "Q")[kind], id_kinds([8, 8, 8], "Q")[kind],
                        id_kinds([8, 8, 8], "Q")[kind], id_kinds([2, 2, 2], "Q")[kind],
                        id_kinds([0, 1, 2, 3, 4, 5])[kind],
                    )
                else:
                    step = s.build_step([ScheduledRequest(r, 0, 8, 8, blocks[r]) for r in range(3)])
                with step:
                    return step.jobs, step.flush, step.encode()[:0]

        want = plan(False, None)
        self.assertEqual(len(want[0]), 3)
        kinds = ["list", "tuple", "array", "memoryview"] + (
            ["numpy", "numpy int64"] if numpy is not None else [])
        for kind in kinds:
            with self.subTest(kind=kind):
                got = plan(True, kind)
                self.assertEqual([j[1:] for j in got[0]], [j[1:] for j in want[0]])

    def test_build_step_arrays_bad_input_changes_nothing(self):
        s = self.s
        self.add(1, flat(1, 2), 8)
        s.match(1, 0)
        before = s.stats()
        cases = [
            (ValueError, "num_tokens: 2 entries for 1 request_ids",
             lambda: s.build_step_arrays([1], [0], [8], [8, 8], [2], [0, 1])),
            (InvalidArgumentError, "n_new_block_ids",
             lambda: s.build_step_arrays([1], [0], [8], [8], [3], [0, 1])),
            (ValueError, "request_ids[0]", lambda: s.build_step_arrays([-1], [0], [8], [8], [2],
                                                                       [0, 1])),
            (ValueError, "new_block_ids[1]",
             lambda: s.build_step_arrays([1], [0], [8], [8], [2], [0, 2**32])),
            (ValueError, "resumed: 2 entries",
             lambda: s.build_step_arrays([1], [0], [8], [8], [2], [0, 1], resumed=b"\0\0")),
            (kvoffload.NotFoundError, "request_id",
             lambda: s.build_step_arrays([9], [0], [8], [8], [2], [0, 1])),
            (InvalidArgumentError, "scheduled[0].new_block_ids",
             lambda: s.build_step_arrays([1], [0], [8], [8], [1], [0])),
            (TypeError, "step", lambda: s.build_step_arrays([1], [0], [8], [8], [2], [0, 1],
                                                            step=5)),
        ]
        for err, what, call in cases:
            with self.subTest(what=what), self.assertRaises(err) as cm:
                call()
            self.assertIn(what, str(cm.exception))
        self.assertEqual(s.stats(), before)
        with s.build_step_arrays([1], [0], [8], [8], [2], array("I", [0, 1])) as st:
            self.assertEqual(len(st.jobs), 1)
        s.check_invariants()

    def test_step_decode_takes_any_bytes_like(self):
        self.add(1, flat(1, 2), 8)
        self.s.match(1, 0)
        with self.s.build_step([ScheduledRequest(1, 0, 8, 8, [0, 1])]) as st:
            data = st.encode()
            want = st.jobs
        self.assertEqual(len(want), 1)
        for name, buf in key_kinds(data).items():
            if name in ("list", "tuple"):
                continue
            with self.subTest(kind=name), kvoffload.Step.decode(buf) as got:
                self.assertEqual(got.jobs, want)
        with self.assertRaises(TypeError) as cm:
            kvoffload.Step.decode("text")
        self.assertIn("data", str(cm.exception))
        with self.assertRaises(TypeError):
            kvoffload.Step.decode([data])
        with kvoffload.Step.decode(data) as into:
            with self.assertRaises(kvoffload.CorruptDataError):
                kvoffload.Step.decode(bytearray(data[:-1]), into=into)
            self.assertEqual(into.jobs, want)  # unchanged

    def test_stats_is_one_struct(self):
        st = self.s.stats()
        self.assertIsInstance(st.requests, int)
        self.assertIsInstance(st.manager, kvoffload.ManagerStats)
        self.assertEqual(st.as_dict()["manager"]["capacity"], 64)
        self.assertNotIn("struct_size", st.as_dict())


class WorkerBufferTest(unittest.TestCase):
    PAGE = 16

    def setUp(self):
        self.mem = bytearray(self.PAGE * 8)
        self.w = Worker([KvTensor.from_buffer(self.mem, 8, self.PAGE, self.PAGE)], 8)
        self.addCleanup(self.w.close)

    def test_submit_job_takes_every_kind(self):
        w = self.w
        for i in range(8):
            self.mem[i * self.PAGE : (i + 1) * self.PAGE] = bytes([i]) * self.PAGE
        for n, (name, src) in enumerate(id_kinds([1, 2]).items()):
            with self.subTest(kind=name):
                w.submit_job(n, JobKind.STORE, src, array("I", [2 * (n % 4), 2 * (n % 4) + 1]))
                w.wait([n])
                done = w.poll()
                self.assertEqual(done.job_ids.tolist(), [n])
                self.assertEqual(done[0].success, True)
                host = w.host_buffer(0)
                slot = 2 * (n % 4)
                self.assertEqual(bytes(host[slot * self.PAGE : (slot + 1) * self.PAGE]),
                                 bytes([1]) * self.PAGE)
        for bad, err, what in ((["x"], TypeError, "src[0]"), ([-1], ValueError, "src[0]"),
                               ([2**32], ValueError, "src[0]"), ("ab", TypeError, "src"),
                               (array("d", [1.0]), TypeError, "src")):
            with self.subTest(bad=bad), self.assertRaises(err) as cm:
                w.submit_job(99, "store", bad, [0])
            self.assertIn(what, str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            w.submit_job(2**64, "store", [0], [0])
        self.assertIn("job_id", str(cm.exception))
        self.assertEqual(len(w.poll()), 0)

    def test_poll_of_many_failures_keeps_every_message(self):
        w = self.w
        n = 2500  # more than the library's 1024 kept messages
        for j in range(n):
            w.submit_job(j, JobKind.STORE, [0], [100 + j])  # slot out of range: fails
        done = w.poll(max=2**31 - 1)
        self.assertEqual(len(done), n)
        self.assertEqual(done.job_ids.tolist(), list(range(n)))
        self.assertEqual(done.success.tolist(), [0] * n)
        self.assertEqual(len(done.errors), n)
        for c in (done[0], done[1500], done[-1]):
            self.assertFalse(c.success)
            self.assertIn(str(100 + c.job_id), c.error)

    def test_poll_max_allocates_only_what_is_found(self):
        w = self.w
        w.submit_job(1, JobKind.STORE, [0], [0])
        w.wait([1])
        tracemalloc.start()
        try:
            done = w.poll(max=2**31 - 1)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        self.assertEqual(len(done), 1)
        self.assertLess(peak, 1 << 20, "poll(max=2**31-1) allocated for max up front")
        with self.assertRaises(ValueError):
            w.poll(max=-1)
        self.assertEqual(w.poll(max=0), [])

    def test_completions_feed_the_scheduler(self):
        with Scheduler(num_slots=8, key_len=KL, gpu_block_size=4) as s:
            s.add_request(1, 8)
            s.append_block_hashes(1, flat(1, 2), 8)
            s.match(1, 0)
            with s.build_step([ScheduledRequest(1, 0, 8, 8, [0, 1])]) as step:
                ids = [j.id for j in step.jobs]
                self.w.submit_step(step)
            self.w.wait(ids)
            done = self.w.poll()
            self.assertEqual(done.job_ids.tolist(), ids)
            s.complete_jobs(done)  # as it is: one report per completion
            self.assertEqual(s.stats().manager.ready, 2)
            s.check_invariants()


if __name__ == "__main__":
    unittest.main()

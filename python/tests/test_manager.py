"""Tests of kvoffload.Manager through the shared library (stdlib unittest)."""

import gc
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from array import array
import unittest


HERE = os.path.dirname(os.path.abspath(__file__))

import kvoffload  # noqa: E402
from kvoffload import (  # noqa: E402
    InvalidArgumentError,
    InvalidStateError,
    KvoError,
    Lookup,
    Manager,
    NoRoomError,
    NotFoundError,
    Status,
)


def k(i):
    """An 8-byte big-endian integer key."""
    return i.to_bytes(8, "big")


def ks(*ids):
    return [k(i) for i in ids]


def ids(keys):
    return [int.from_bytes(x, "big") for x in keys]


class ModuleTest(unittest.TestCase):
    def test_version_and_abi(self):
        self.assertEqual(kvoffload.ABI_VERSION, 1)
        self.assertEqual(kvoffload.lib.kvo_abi_version(), kvoffload.ABI_VERSION)
        v = kvoffload.version()
        self.assertIsInstance(v, str)
        self.assertRegex(v, r"^\d+\.\d+\.\d+")
        self.assertEqual(kvoffload.__version__, v)

    def test_constants_mirror_the_header(self):
        self.assertEqual(kvoffload.KVO_STATUS_OK, 0)
        self.assertEqual(kvoffload.KVO_STATUS_NO_ROOM, 5)
        self.assertEqual(kvoffload.KVO_STATUS_INTERNAL, 12)
        self.assertEqual(kvoffload.KVO_POLICY_LRU, 0)
        self.assertEqual(kvoffload.KVO_POLICY_ARC, 1)
        self.assertEqual(kvoffload.KVO_LOOKUP_MISS, 0)
        self.assertEqual(kvoffload.KVO_LOOKUP_HIT, 1)
        self.assertEqual(kvoffload.KVO_LOOKUP_RETRY, 2)
        self.assertEqual(kvoffload.KVO_MAX_KEY_LEN, 64)

    def test_error_classes_carry_their_status(self):
        pairs = {
            kvoffload.NullArgumentError: Status.NULL_ARGUMENT,
            kvoffload.InvalidArgumentError: Status.INVALID_ARGUMENT,
            kvoffload.NotFoundError: Status.NOT_FOUND,
            kvoffload.InvalidStateError: Status.INVALID_STATE,
            kvoffload.NoRoomError: Status.NO_ROOM,
            kvoffload.BufferTooSmallError: Status.BUFFER_TOO_SMALL,
            kvoffload.InternalError: Status.INTERNAL,
            kvoffload.PanicError: Status.PANIC,
        }
        for cls, status in pairs.items():
            e = kvoffload._ffi.error_for(int(status), "msg")
            self.assertIs(type(e), cls)
            self.assertIsInstance(e, KvoError)
            self.assertEqual(e.status, status)
            self.assertEqual(e.message, "msg")
            self.assertIn("msg", str(e))

    def test_raw_null_argument_goes_through_errcheck(self):
        # Calling the raw binding with a NULL handle: the errcheck raises with the message.
        with self.assertRaises(kvoffload.NullArgumentError) as cm:
            kvoffload.lib.kvo_manager_reset(None)
        self.assertEqual(cm.exception.status, Status.NULL_ARGUMENT)
        self.assertIn("manager", cm.exception.message)
        # After a success the thread's message is empty again.
        with Manager(1, key_len=8) as m:
            m.reset()
        self.assertEqual(kvoffload.last_error_message(), "")


class LoaderTest(unittest.TestCase):
    """Import-time checks, each in a fresh interpreter."""

    # The directory holding the package under test (this checkout's python/ or site-packages).
    PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(kvoffload.__file__)))

    def import_with(self, lib_path, code="import kvoffload", cwd=None, **env_changes):
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", **env_changes)
        env.pop("KVOFFLOAD_LIB", None)
        if lib_path is not None:
            env["KVOFFLOAD_LIB"] = lib_path
        return subprocess.run(
            [sys.executable, "-c", code],
            cwd=cwd or self.PYTHON_DIR, env=env, capture_output=True, text=True, timeout=60,
        )

    def test_system_search_is_used_when_nothing_is_bundled(self):
        # A copy of the package outside any checkout, with no library inside: the loader falls
        # back to the system search (LD_LIBRARY_PATH here) and reports the file it loaded.
        lib = os.path.realpath(kvoffload.library_path)
        with tempfile.TemporaryDirectory() as d:
            pkg = os.path.join(d, "kvoffload")
            shutil.copytree(os.path.dirname(kvoffload.__file__), pkg,
                            ignore=shutil.ignore_patterns("*.so", "*.dylib", "*.dll",
                                                          "__pycache__"))
            libdir = os.path.join(d, "lib")
            os.mkdir(libdir)
            shutil.copy(lib, os.path.join(libdir, os.path.basename(lib)))
            code = "import kvoffload, os; print(os.path.realpath(kvoffload.library_path))"
            r = self.import_with(None, code, cwd=d, LD_LIBRARY_PATH=libdir)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.strip(), os.path.realpath(os.path.join(libdir,
                                                                              os.path.basename(lib))))
            r = self.import_with(None, code, cwd=d, LD_LIBRARY_PATH=os.path.join(d, "none"))
            if r.returncode == 0:  # installed system-wide: found there, never in the checkout
                self.assertNotIn(os.path.realpath(os.path.join(HERE, os.pardir, os.pardir)),
                                 r.stdout)
            else:
                self.assertIn("not found", r.stderr)
                self.assertIn("pip install", r.stderr)

    def test_a_bundled_library_comes_first(self):
        lib = os.path.realpath(kvoffload.library_path)
        with tempfile.TemporaryDirectory() as d:
            pkg = os.path.join(d, "kvoffload")
            shutil.copytree(os.path.dirname(kvoffload.__file__), pkg,
                            ignore=shutil.ignore_patterns("__pycache__"))
            bundled = os.path.join(pkg, os.path.basename(lib))
            if not os.path.exists(bundled):
                shutil.copy(lib, bundled)
            code = "import kvoffload, os; print(os.path.realpath(kvoffload.library_path))"
            r = self.import_with(None, code, cwd=d, LD_LIBRARY_PATH=os.path.join(d, "none"))
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.strip(), os.path.realpath(bundled))

    def test_installed_package_loads_its_bundled_library(self):
        if not os.environ.get("KVOFFLOAD_TEST_INSTALLED"):
            self.skipTest("run.py --installed tests an installed package")
        pkg = os.path.dirname(os.path.realpath(kvoffload.__file__))
        checkout = os.path.realpath(os.path.join(HERE, os.pardir))
        self.assertFalse(pkg.startswith(checkout + os.sep), f"{pkg} is this checkout's")
        if not os.environ.get("KVOFFLOAD_LIB"):
            self.assertEqual(os.path.dirname(os.path.realpath(kvoffload.library_path)), pkg)

    def test_missing_library_is_an_import_error(self):
        r = self.import_with("/nonexistent/libkvoffload.so")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("ImportError", r.stderr)
        self.assertIn("KVOFFLOAD_LIB", r.stderr)

    def test_abi_mismatch_is_an_import_error(self):
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            self.skipTest("no C compiler to build a fake library")
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "fake.c")
            lib = os.path.join(d, "libkvoffload.so")
            with open(src, "w") as f:
                f.write("unsigned int kvo_abi_version(void) { return 2; }\n")
            subprocess.run([cc, "-shared", "-fPIC", "-o", lib, src], check=True)
            r = self.import_with(lib)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("ImportError", r.stderr)
        self.assertIn("ABI version 2", r.stderr)

    def test_library_path_is_the_one_asked_for(self):
        self.assertEqual(
            os.path.realpath(kvoffload.lib_path),
            os.path.realpath(os.environ.get("KVOFFLOAD_LIB", kvoffload.lib_path)),
        )


class LruWorkedExampleTest(unittest.TestCase):
    """The worked LRU example: capacity 4, 8-byte big-endian integer keys."""

    def test_worked_example(self):
        m = Manager(num_slots=4, key_len=8, policy="lru", enable_events=True)
        self.addCleanup(m.close)

        plan = m.prepare_store(ks(1, 2))
        self.assertEqual(list(plan.indices), [0, 1])
        self.assertEqual(list(plan.slots), [0, 1])
        self.assertEqual(plan.evicted, [])
        self.assertEqual(m.lookup(k(1)), Lookup.RETRY)
        self.assertEqual(m.lookup(k(1)), Lookup.RETRY)
        self.assertEqual(m.lookup_prefix(ks(1, 2, 3)), (2, True))
        m.complete_store(ks(1, 2))
        self.assertEqual(m.lookup(k(1)), Lookup.HIT)
        self.assertEqual(m.lookup_prefix(ks(1, 2, 3)), (2, False))
        m.check_invariants()

        plan = m.prepare_store(ks(2, 3, 4, 5))
        self.assertEqual(list(plan.indices), [1, 2, 3])
        self.assertEqual(list(plan.slots), [2, 3, 0])
        self.assertEqual(ids(plan.evicted), [1])
        self.assertEqual(m.lookup(k(1)), Lookup.MISS)
        m.check_invariants()

        with self.assertRaises(NoRoomError) as cm:
            m.prepare_store(ks(1, 6))
        self.assertEqual(cm.exception.status, Status.NO_ROOM)
        m.complete_store(ks(2, 3, 4, 5))

        self.assertEqual(list(m.prepare_load(ks(2, 3))), [1, 2])
        with self.assertRaises(NoRoomError):
            m.prepare_store(ks(6, 7, 8))
        m.complete_load(ks(2, 3))
        m.check_invariants()

        plan = m.prepare_store(ks(6, 7, 8))
        self.assertEqual(list(plan.indices), [0, 1, 2])
        self.assertEqual(ids(plan.evicted), [4, 5, 2])
        self.assertEqual(list(plan.slots), [1, 0, 3])
        m.complete_store(ks(6, 7, 8), slots=plan.slots)
        m.touch(ks(3, 6, 7))

        plan = m.prepare_store(ks(9))
        self.assertEqual(ids(plan.evicted), [8])
        self.assertEqual(list(plan.slots), [3])
        self.assertEqual(list(plan.indices), [0])

        m.complete_store(ks(7, 9), success=False)
        self.assertEqual(m.lookup(k(7)), Lookup.HIT)
        self.assertEqual(m.lookup(k(9)), Lookup.MISS)
        m.check_invariants()

        events = m.take_events()
        got = [(e.removed, set(ids(e.keys))) for e in events]
        self.assertEqual(
            got,
            [
                (False, {1, 2}),
                (True, {1}),
                (False, {3, 4, 5}),
                (True, {4, 5, 2}),
                (False, {6, 7, 8}),
                (True, {8}),
            ],
        )
        self.assertEqual(m.take_events(), [], "events are taken once")

        s = m.stats()
        self.assertEqual(s.capacity, 4)
        self.assertEqual(s.used, 3)  # 3, 6, 7
        self.assertEqual(s.ready, 3)
        self.assertEqual(s.pinned, 0)
        self.assertEqual(s.stores_in_flight, 0)
        self.assertEqual(s.evictable, 3)
        self.assertEqual(s.evictions, 5)  # 1, 4, 5, 2, 8


class ArcTest(unittest.TestCase):
    def test_basic_use(self):
        with Manager(num_slots=3, key_len=8, policy="arc") as m:
            self.assertEqual(m.policy, kvoffload.Policy.ARC)
            plan = m.prepare_store(ks(1, 2, 3))
            self.assertEqual(list(plan.slots), [0, 1, 2])
            m.complete_store(ks(1, 2, 3))
            self.assertEqual(m.lookup_prefix(ks(1, 2, 3, 4)), (3, False))
            m.touch(ks(1))  # 1 moves to T2; 2 is the LRU end of T1
            plan = m.prepare_store(ks(4))
            self.assertEqual((list(plan.indices), list(plan.slots), ids(plan.evicted)), ([0], [1], [2]))
            m.complete_store(ks(4))
            self.assertEqual(m.lookup(k(2)), Lookup.MISS)
            self.assertEqual(m.lookup(k(4)), Lookup.HIT)
            self.assertEqual(list(m.prepare_load(ks(4, 1))), [1, 0])
            m.complete_load(ks(4, 1))
            m.check_invariants()

    def test_policy_accepts_enum_and_case(self):
        for p in ("ARC", kvoffload.Policy.ARC, kvoffload.KVO_POLICY_ARC):
            with Manager(2, key_len=8, policy=p) as m:
                self.assertEqual(m.policy, kvoffload.Policy.ARC)
        with Manager(2, key_len=8, policy=kvoffload.Policy.LRU) as m:
            self.assertEqual(m.policy, kvoffload.Policy.LRU)

    def test_first_in_is_evicted_first(self):
        with Manager(num_slots=2, key_len=8, policy="arc", enable_events=True) as m:
            m.prepare_store(ks(1, 2))
            m.complete_store(ks(1, 2))
            self.assertEqual(ids(m.prepare_store(ks(3)).evicted), [1])
            m.complete_store(ks(3))
            evs = [(e.removed, ids(e.keys)) for e in m.take_events()]
            self.assertEqual(evs, [(False, [1, 2]), (True, [1]), (False, [3])])


class Vllm033Test(unittest.TestCase):
    """vLLM 0.33 semantics through the friendly API: request contexts with positions."""

    def test_three_requests_positions_and_commit(self):
        # vLLM 0.33 LRUCachePolicy, three requests: ranks by request then position, recency
        # committed at finish_request, load and store completion leave recency alone.
        m = Manager(num_slots=5, key_len=8, enable_events=True, semantics="0.33")
        self.assertEqual(m.semantics, kvoffload.Semantics.VLLM_0_33)
        a, b, c = m.begin_request(), m.begin_request(), m.begin_request()
        self.assertEqual(m.lookup(k(1)), Lookup.MISS)
        plan = m.prepare_store(ks(1, 2), request=a, positions=[16, 32])
        self.assertEqual(list(plan.slots), [0, 1])
        self.assertEqual(m.lookup(k(1)), Lookup.HIT_PENDING)
        m.complete_store(ks(1, 2))
        self.assertEqual(list(m.prepare_store(ks(3), request=a, positions=[48]).slots), [2])
        m.complete_store(ks(3))
        self.assertEqual(list(m.prepare_store(ks(4, 5), request=b, positions=[16, 32]).slots),
                         [3, 4])
        m.complete_store(ks(4, 5))
        m.finish_request(a)
        self.assertEqual(list(m.prepare_load(ks(1, 2), request=c, positions=[16, 32])), [0, 1])
        plan = m.prepare_store(ks(6), request=c, positions=[48])
        self.assertEqual((list(plan.slots), ids(plan.evicted)), ([4], [5]))
        m.complete_load(ks(1, 2))
        m.complete_store(ks(6))
        m.finish_request(c)
        m.finish_request(b)
        events = [(e.removed, ids(e.keys)) for e in m.take_events()]
        self.assertEqual(
            events,
            [(False, [1, 2]), (False, [3]), (False, [4, 5]), (True, [5]), (False, [6])],
        )
        # Eviction order now 3, 6, 2, 1, 4 (oldest first).
        plan = m.prepare_store(ks(10, 11, 12, 13, 14))
        self.assertEqual(ids(plan.evicted), [3, 6, 2, 1, 4])
        m.check_invariants()

    def test_failed_store_is_a_metadata_only_removal(self):
        m = Manager(num_slots=4, key_len=8, enable_events=True, semantics="0.33")
        a, b = m.begin_request(), m.begin_request()
        self.assertEqual(list(m.prepare_store(ks(1, 2, 3), request=a).slots), [0, 1, 2])
        m.complete_store(ks(1))
        m.complete_store(ks(1, 2), success=False)
        self.assertEqual(list(m.prepare_store(ks(2), request=b).slots), [3])
        m.complete_store(ks(3), success=False)
        events = [(e.removed, ids(e.keys), e.metadata_only) for e in m.take_events()]
        self.assertEqual(events, [(False, [1], False), (True, [3], True)])
        self.assertEqual(m.lookup(k(2)), Lookup.HIT_PENDING)
        self.assertEqual(m.lookup(k(3)), Lookup.MISS)

    def test_store_buffers_with_a_request(self):
        m = Manager(num_slots=2, key_len=8, semantics="0.33")
        r = m.begin_request()
        out = kvoffload.StoreBuffers(4, 8)
        self.assertIs(m.prepare_store(ks(1, 2), out=out, request=r, positions=[4, 8]), out)
        self.assertEqual((out.n_store, list(out.slots[:2])), (2, [0, 1]))
        m.complete_store(ks(1, 2))
        slots = array("I", [9, 9])
        self.assertIs(m.prepare_load(ks(1, 2), out=slots, request=r), slots)
        self.assertEqual(list(slots), [0, 1])
        m.complete_load(ks(1, 2))
        m.finish_request(r)
        m.check_invariants()

    def test_bad_request_arguments_change_nothing(self):
        m = Manager(num_slots=4, key_len=8, semantics="0.33")
        r = m.begin_request()
        with self.assertRaisesRegex(ValueError, "positions: given without a request"):
            m.prepare_store(ks(1), positions=[16])
        with self.assertRaisesRegex(ValueError, "positions: 1 positions for 2 keys"):
            m.prepare_store(ks(1, 2), request=r, positions=[16])
        with self.assertRaisesRegex(ValueError, "request"):
            m.prepare_load(ks(1), request=-1)
        with self.assertRaises(InvalidArgumentError) as cm:
            m.prepare_store(ks(1), request=r + 100)
        self.assertIn("request", str(cm.exception))
        with self.assertRaises(InvalidArgumentError):
            m.prepare_store(ks(1), request=r, positions=[2**64 - 1])
        s = m.stats()
        self.assertEqual((s.used, s.stores_in_flight), (0, 0))
        m.finish_request(r)
        with self.assertRaises(InvalidArgumentError):
            m.finish_request(r)
        m.close()
        with self.assertRaises(ValueError):
            m.begin_request()

    def test_begin_and_finish_in_0_24_semantics(self):
        # The request calls exist in both semantics; in 0.24 they only add positions' ranks.
        m = Manager(num_slots=2, key_len=8)
        r = m.begin_request()
        m.prepare_store(ks(1), request=r, positions=[16])
        m.complete_store(ks(1))
        m.finish_request(r)
        self.assertEqual(m.lookup(k(1)), Lookup.HIT)


class ErrorTest(unittest.TestCase):
    def setUp(self):
        self.m = Manager(num_slots=4, key_len=8)
        self.addCleanup(self.m.close)

    def test_complete_load_of_unpinned_key(self):
        self.m.prepare_store(ks(1))
        self.m.complete_store(ks(1))
        with self.assertRaises(InvalidStateError) as cm:
            self.m.complete_load(ks(1))
        e = cm.exception
        self.assertEqual(e.status, Status.INVALID_STATE)
        self.assertIn("keys[0]", e.message)
        self.assertIn("keys[0]", str(e))

    def test_complete_load_of_missing_key(self):
        with self.assertRaises(NotFoundError) as cm:
            self.m.complete_load(ks(42))
        self.assertIn("keys[0]", cm.exception.message)

    def test_prepare_load_of_missing_key(self):
        self.m.prepare_store(ks(1))
        self.m.complete_store(ks(1))
        with self.assertRaises(NotFoundError) as cm:
            self.m.prepare_load(ks(1, 2))
        self.assertEqual(cm.exception.status, Status.NOT_FOUND)
        self.assertIn("keys[1]", cm.exception.message)
        # A call that fails changes nothing: key 1 was not pinned.
        self.assertEqual(self.m.stats().pinned, 0)
        self.m.check_invariants()

    def test_prepare_load_of_in_flight_key(self):
        self.m.prepare_store(ks(1))
        with self.assertRaises(InvalidStateError) as cm:
            self.m.prepare_load(ks(1))
        self.assertIn("keys[0]", cm.exception.message)

    def test_complete_store_with_bad_slots_changes_nothing(self):
        plan = self.m.prepare_store(ks(1))
        with self.assertRaises(InvalidArgumentError) as cm:
            self.m.complete_store(ks(1), slots=[4])
        self.assertIn("slots[0]", cm.exception.message)
        with self.assertRaises(ValueError):
            self.m.complete_store(ks(1), slots=[0, 1])
        self.assertEqual(self.m.lookup(k(1)), Lookup.RETRY)
        self.m.complete_store(ks(1), slots=plan.slots)
        self.assertEqual(self.m.lookup(k(1)), Lookup.HIT)

    def test_bad_key_len(self):
        for bad in (0, 65):
            with self.assertRaises(InvalidArgumentError) as cm:
                Manager(num_slots=4, key_len=bad)
            self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
            self.assertIn("key_len", cm.exception.message)
            self.assertIn(str(bad), cm.exception.message)
        for good in (1, 64):
            with Manager(num_slots=1, key_len=good) as m:
                m.prepare_store([b"\x07" * good])

    def test_bad_policy(self):
        with self.assertRaises(ValueError):
            Manager(num_slots=4, policy="fifo")
        with self.assertRaises(InvalidArgumentError) as cm:
            Manager(num_slots=4, policy=7)
        self.assertIn("policy", cm.exception.message)

    def test_bad_integers_are_refused_in_python(self):
        with self.assertRaises(ValueError):
            Manager(num_slots=-1)
        with self.assertRaises(ValueError):
            Manager(num_slots=4, key_len=2**32)
        with self.assertRaises(TypeError):
            Manager(num_slots="4")

    def test_arc_tier_size_is_bounded(self):
        with self.assertRaises(InvalidArgumentError) as cm:
            Manager(num_slots=(2**32 - 1) // 5 + 1, policy="arc")
        self.assertIn("num_slots", cm.exception.message)

    def test_store_threshold_needs_tracker(self):
        with self.assertRaises(InvalidArgumentError) as cm:
            Manager(num_slots=4, store_threshold=2, max_tracker_size=0)
        self.assertIn("max_tracker_size", cm.exception.message)

    def test_keys_are_validated_in_python(self):
        m = self.m
        for call in (m.prepare_store, m.prepare_load, m.touch, m.complete_load,
                     m.complete_store, m.lookup_prefix):
            with self.assertRaises(ValueError) as cm:
                call([k(1), b"short"])
            self.assertIn("keys[1]", str(cm.exception))
            with self.assertRaises(TypeError) as cm:
                call([k(1), "strkey12"])
            self.assertIn("keys[1]", str(cm.exception))
            with self.assertRaises(ValueError) as cm:
                call(k(1) + b"short")  # one buffer, not a multiple of key_len
            self.assertIn("keys", str(cm.exception))
            self.assertIn("multiple of key_len", str(cm.exception))
            with self.assertRaises(TypeError):
                call("strkey12")
        with self.assertRaises(ValueError):
            m.lookup(b"\x00" * 9)
        with self.assertRaises(ValueError):
            m.lookup(bytearray(16))  # two keys
        m.check_invariants()
        self.assertEqual(m.stats().lookups, 0)

    def test_error_message_is_per_call(self):
        with self.assertRaises(NotFoundError):
            self.m.prepare_load(ks(5))
        self.m.touch(ks(5))
        self.assertEqual(kvoffload.last_error_message(), "")

    def test_errors_on_other_threads_keep_their_own_message(self):
        results = {}

        def worker(i):
            try:
                if i % 2:
                    Manager(num_slots=1, key_len=0)
                else:
                    with Manager(num_slots=1, key_len=8) as m:
                        m.complete_load(ks(i))
            except KvoError as e:
                results[i] = (e.status, e.message)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(8):
            status, msg = results[i]
            if i % 2:
                self.assertEqual(status, Status.INVALID_ARGUMENT)
                self.assertIn("key_len", msg)
            else:
                self.assertEqual(status, Status.NOT_FOUND)
                self.assertIn("keys[0]", msg)


class BehaviourTest(unittest.TestCase):
    def test_empty_calls(self):
        with Manager(num_slots=2, key_len=8, enable_events=True) as m:
            self.assertEqual(tuple(map(list, m.prepare_store([]))), ([], [], []))
            self.assertEqual(list(m.prepare_load([])), [])
            self.assertEqual(m.lookup_prefix([]), (0, False))
            m.touch([])
            m.complete_load([])
            m.complete_store([])
            self.assertEqual(m.take_events(), [])

    def test_duplicates_and_already_stored_keys_are_skipped(self):
        with Manager(num_slots=4, key_len=8) as m:
            plan = m.prepare_store(ks(1, 1, 2))
            self.assertEqual(list(plan.indices), [0, 2])
            m.complete_store(ks(1, 2))
            self.assertEqual(list(m.prepare_store(ks(1, 2, 3)).indices), [2])
            # complete_store may be repeated safely
            m.complete_store(ks(3))
            m.complete_store(ks(3))
            self.assertEqual(m.lookup_prefix(ks(1, 2, 3)), (3, False))

    def test_stats_after_operations(self):
        with Manager(num_slots=3, key_len=8) as m:
            s = m.stats()
            self.assertEqual(s, kvoffload.ManagerStats(3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
            m.prepare_store(ks(1, 2, 3))
            s = m.stats()
            self.assertEqual((s.used, s.ready, s.stores_in_flight, s.evictable), (3, 0, 3, 0))
            m.complete_store(ks(1, 2))
            m.complete_store(ks(3), success=False)
            self.assertEqual(m.lookup(k(1)), Lookup.HIT)
            self.assertEqual(m.lookup(k(3)), Lookup.MISS)
            m.prepare_load(ks(1))
            s = m.stats()
            self.assertEqual(
                (s.used, s.ready, s.evictable, s.pinned, s.stores_in_flight), (2, 2, 1, 1, 0)
            )
            self.assertEqual((s.lookups, s.hits), (2, 1))
            m.complete_load(ks(1))
            m.prepare_store(ks(4, 5))
            m.complete_store(ks(4, 5))
            s = m.stats()
            self.assertEqual((s.used, s.evictions), (3, 1))
            d = s.as_dict()
            self.assertEqual(d["capacity"], 3)
            self.assertEqual(set(d), {
                "capacity", "used", "ready", "evictable", "pinned", "stores_in_flight",
                "lookups", "hits", "stores_skipped", "evictions", "events_dropped",
                "allocation_size_buckets", "allocation_keys",
            })
            # Two allocations (3 keys, then 2): both in the bucket of at most 4 keys.
            self.assertEqual(d["allocation_size_buckets"], [0, 2] + [0] * 9)
            self.assertEqual(d["allocation_keys"], 5)

    def test_store_threshold(self):
        with Manager(num_slots=4, key_len=8, store_threshold=2) as m:
            self.assertEqual(list(m.prepare_store(ks(1)).indices), [])
            self.assertEqual(m.stats().stores_skipped, 1)
            m.lookup(k(1))
            m.lookup(k(1))
            self.assertEqual(list(m.prepare_store(ks(1)).indices), [0])

    def test_reset_keeps_counters(self):
        with Manager(num_slots=2, key_len=8, enable_events=True) as m:
            m.prepare_store(ks(1, 2))
            m.complete_store(ks(1))
            m.lookup(k(1))
            m.take_events()
            m.reset()
            self.assertEqual(m.lookup(k(1)), Lookup.MISS)
            s = m.stats()
            self.assertEqual((s.used, s.ready, s.stores_in_flight), (0, 0, 0))
            self.assertEqual((s.lookups, s.hits), (2, 1))
            self.assertEqual(m.take_events(), [], "reset makes no events")
            m.check_invariants()
            self.assertEqual(list(m.prepare_store(ks(3, 4)).indices), [0, 1])

    def test_many_events_grow_the_buffers(self):
        # More events and keys than take_events' first guess (16 events, 64 keys).
        with Manager(num_slots=1000, key_len=16, enable_events=True) as m:
            want = []
            for i in range(40):
                batch = [i.to_bytes(8, "big") + j.to_bytes(8, "big") for j in range(5)]
                m.prepare_store(batch)
                m.complete_store(batch)
                want.append((False, batch))
            got = [(e.removed, e.keys) for e in m.take_events()]
            self.assertEqual(got, want)

    def test_events_disabled(self):
        with Manager(num_slots=2, key_len=8) as m:
            m.prepare_store(ks(1, 2))
            m.complete_store(ks(1, 2))
            self.assertEqual(m.take_events(), [])


class LifetimeTest(unittest.TestCase):
    def test_close_twice_is_harmless(self):
        m = Manager(num_slots=2, key_len=8)
        self.assertFalse(m.closed)
        m.close()
        self.assertTrue(m.closed)
        m.close()
        self.assertTrue(m.closed)

    def test_context_manager_closes(self):
        with Manager(num_slots=2, key_len=8) as m:
            m.prepare_store(ks(1))
        self.assertTrue(m.closed)
        m.close()

    def test_closed_manager_raises_python_error(self):
        m = Manager(num_slots=2, key_len=8)
        m.close()
        calls = [
            lambda: m.lookup(k(1)),
            lambda: m.lookup_prefix(ks(1)),
            lambda: m.prepare_load(ks(1)),
            lambda: m.touch(ks(1)),
            lambda: m.complete_load(ks(1)),
            lambda: m.prepare_store(ks(1)),
            lambda: m.complete_store(ks(1)),
            m.take_events,
            m.stats,
            m.reset,
            m.check_invariants,
        ]
        for call in calls:
            with self.assertRaises(ValueError) as cm:
                call()
            self.assertIn("closed", str(cm.exception))
        with self.assertRaises(ValueError):
            with m:
                pass

    def test_garbage_collected_manager_is_freed(self):
        m = Manager(num_slots=2, key_len=8)
        fin = m._finalizer
        self.assertTrue(fin.alive)
        del m
        gc.collect()
        self.assertFalse(fin.alive)

    def test_many_managers(self):
        for i in range(200):
            m = Manager(num_slots=16, key_len=32, policy="arc" if i % 2 else "lru")
            m.prepare_store([bytes([i % 256]) * 32])
            if i % 3:
                m.close()

    def test_threads_share_one_manager(self):
        with Manager(num_slots=10000, key_len=8) as m:
            errors = []

            def worker(t):
                try:
                    for i in range(200):
                        key = k(t * 1000 + i)
                        m.prepare_store([key])
                        m.complete_store([key])
                        if m.lookup(key) != Lookup.HIT:
                            errors.append(key)
                except Exception as e:  # pragma: no cover - reported below
                    errors.append(e)

            threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.assertEqual(errors, [])
            self.assertEqual(m.stats().ready, 800)
            m.check_invariants()


if __name__ == "__main__":
    unittest.main()

"""The raw ctypes bindings (kvoffload._ffi) against the header's documented behaviour:
size checks, NULL checks, BUFFER_TOO_SMALL sizes, last-error truncation, versioned structs."""

import ctypes as C
import unittest


import kvoffload  # noqa: E402
from kvoffload import Status, _ffi  # noqa: E402

lib = kvoffload.lib


def keys(*ids):
    return b"".join(i.to_bytes(8, "big") for i in ids)


class RawApiTest(unittest.TestCase):
    def setUp(self):
        cfg = _ffi.kvo_manager_config()
        lib.kvo_manager_config_default(C.byref(cfg))
        cfg.num_slots = 4
        cfg.key_len = 8
        cfg.enable_events = 1
        self.cfg = cfg
        self.h = C.POINTER(_ffi._Manager)()
        lib.kvo_manager_new(C.byref(cfg), C.byref(self.h))
        self.assertTrue(self.h)
        self.addCleanup(lib.kvo_manager_free, self.h)

    def store(self, *ids):
        n = len(ids)
        idx, slots = (C.c_uint32 * n)(), (C.c_uint32 * n)()
        ev = (C.c_uint8 * (8 * n))()
        ns, ne = C.c_size_t(), C.c_size_t()
        lib.kvo_manager_prepare_store(
            self.h, keys(*ids), n, idx, slots, ev, n, C.byref(ns), C.byref(ne)
        )
        lib.kvo_manager_complete_store(self.h, keys(*ids), n, 1)
        return list(slots[: ns.value])

    def test_config_default(self):
        cfg = _ffi.kvo_manager_config()
        self.assertEqual(lib.kvo_manager_config_default(C.byref(cfg)), 0)
        self.assertEqual(cfg.struct_size, C.sizeof(_ffi.kvo_manager_config))
        self.assertEqual(
            (cfg.key_len, cfg.policy, cfg.num_slots, cfg.store_threshold, cfg.enable_events,
             cfg.max_tracker_size),
            (32, kvoffload.KVO_POLICY_LRU, 0, 0, 0, 64000),
        )
        with self.assertRaises(kvoffload.NullArgumentError):
            lib.kvo_manager_config_default(None)

    def test_new_checks_struct_size_and_leaves_out_alone(self):
        bad = _ffi.kvo_manager_config.from_buffer_copy(self.cfg)
        bad.struct_size = 8
        out = C.POINTER(_ffi._Manager)()
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            lib.kvo_manager_new(C.byref(bad), C.byref(out))
        self.assertIn("struct_size", cm.exception.message)
        self.assertFalse(out, "*out is not written on failure")
        with self.assertRaises(kvoffload.NullArgumentError):
            lib.kvo_manager_new(None, C.byref(out))
        with self.assertRaises(kvoffload.NullArgumentError):
            lib.kvo_manager_new(C.byref(self.cfg), None)

    def test_free_accepts_null(self):
        lib.kvo_manager_free(None)

    def test_prepare_store_buffer_too_small_writes_needed_count(self):
        ns, ne = C.c_size_t(99), C.c_size_t(99)
        idx, slots, ev = (C.c_uint32 * 3)(), (C.c_uint32 * 3)(), (C.c_uint8 * 24)()
        with self.assertRaises(kvoffload.BufferTooSmallError) as cm:
            lib.kvo_manager_prepare_store(
                self.h, keys(1, 2, 3), 3, idx, slots, ev, 2, C.byref(ns), C.byref(ne)
            )
        self.assertIn("out_cap", cm.exception.message)
        self.assertEqual(ns.value, 3)
        with self.assertRaises(kvoffload.NullArgumentError) as cm:
            lib.kvo_manager_prepare_store(
                self.h, keys(1, 2, 3), 3, None, slots, ev, 3, C.byref(ns), C.byref(ne)
            )
        self.assertIn("out_indices", cm.exception.message)
        with self.assertRaises(kvoffload.NullArgumentError) as cm:
            lib.kvo_manager_prepare_store(
                self.h, None, 3, idx, slots, ev, 3, C.byref(ns), C.byref(ne)
            )
        self.assertIn("keys", cm.exception.message)
        # Nothing changed.
        st = _ffi.kvo_manager_stats()
        st.struct_size = C.sizeof(st)
        lib.kvo_manager_get_stats(self.h, C.byref(st))
        self.assertEqual(st.used, 0)

    def test_prepare_load_buffer_too_small(self):
        self.store(1, 2)
        slots = (C.c_uint32 * 1)()
        with self.assertRaises(kvoffload.BufferTooSmallError):
            lib.kvo_manager_prepare_load(self.h, keys(1, 2), 2, slots, 1)
        lib.kvo_manager_check_invariants(self.h)

    def test_length_overflow_is_invalid_argument(self):
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            lib.kvo_manager_touch(self.h, keys(1), 2**62)
        self.assertIn("n_keys", cm.exception.message)

    def test_lookup_prefix_null_keys(self):
        hits, retry = C.c_size_t(5), C.c_uint32(5)
        lib.kvo_manager_lookup_prefix(self.h, None, 0, C.byref(hits), C.byref(retry))
        self.assertEqual((hits.value, retry.value), (0, 0))
        with self.assertRaises(kvoffload.NullArgumentError):
            lib.kvo_manager_lookup_prefix(self.h, None, 1, C.byref(hits), C.byref(retry))
        with self.assertRaises(kvoffload.NullArgumentError):
            lib.kvo_manager_lookup_prefix(self.h, keys(1), 1, None, C.byref(retry))

    def test_lookup_writes_a_kvo_lookup(self):
        out = C.c_uint32(99)
        lib.kvo_manager_lookup(self.h, keys(1), C.byref(out))
        self.assertEqual(out.value, kvoffload.KVO_LOOKUP_MISS)
        self.store(1)
        lib.kvo_manager_lookup(self.h, keys(1), C.byref(out))
        self.assertEqual(out.value, kvoffload.KVO_LOOKUP_HIT)
        with self.assertRaises(kvoffload.NullArgumentError):
            lib.kvo_manager_lookup(self.h, keys(1), None)

    def test_take_events_sizes_then_takes(self):
        self.store(1, 2)
        n_ev, n_keys = C.c_size_t(), C.c_size_t()
        with self.assertRaises(kvoffload.BufferTooSmallError) as cm:
            lib.kvo_manager_take_events(self.h, None, 0, None, 0, C.byref(n_ev), C.byref(n_keys))
        self.assertIn("events_cap", cm.exception.message)
        self.assertEqual((n_ev.value, n_keys.value), (1, 2))
        evs = (_ffi.kvo_event * 1)()
        with self.assertRaises(kvoffload.BufferTooSmallError) as cm:
            lib.kvo_manager_take_events(
                self.h, evs, 1, (C.c_uint8 * 8)(), 1, C.byref(n_ev), C.byref(n_keys)
            )
        self.assertIn("keys_cap", cm.exception.message)
        buf = (C.c_uint8 * 16)()
        lib.kvo_manager_take_events(self.h, evs, 1, buf, 2, C.byref(n_ev), C.byref(n_keys))
        self.assertEqual((n_ev.value, n_keys.value), (1, 2))
        e = evs[0]
        self.assertEqual((e.first_key, e.n_keys, e.removed, e.metadata_only), (0, 2, 0, 0))
        self.assertEqual(bytes(buf), keys(1, 2))
        lib.kvo_manager_take_events(self.h, None, 0, None, 0, C.byref(n_ev), C.byref(n_keys))
        self.assertEqual((n_ev.value, n_keys.value), (0, 0))

    def test_stats_struct_size(self):
        self.store(1)
        st = _ffi.kvo_manager_stats()
        for name, t in st._fields_[1:]:
            if not issubclass(t, C.Array):
                setattr(st, name, 777)
        st.struct_size = 0
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            lib.kvo_manager_get_stats(self.h, C.byref(st))
        self.assertIn("struct_size", cm.exception.message)
        self.assertEqual(st.capacity, 777)
        # An older caller knowing only struct_size and capacity: nothing past them is written.
        st.struct_size = 16
        lib.kvo_manager_get_stats(self.h, C.byref(st))
        self.assertEqual((st.struct_size, st.capacity, st.used), (16, 4, 777))
        st.struct_size = C.sizeof(st)
        lib.kvo_manager_get_stats(self.h, C.byref(st))
        self.assertEqual((st.capacity, st.used, st.ready, st.evictions), (4, 1, 1, 0))
        with self.assertRaises(kvoffload.NullArgumentError):
            lib.kvo_manager_get_stats(self.h, None)

    def test_null_handles(self):
        out = C.c_uint32()
        for call in (
            lambda: lib.kvo_manager_lookup(None, keys(1), C.byref(out)),
            lambda: lib.kvo_manager_touch(None, keys(1), 1),
            lambda: lib.kvo_manager_complete_load(None, keys(1), 1),
            lambda: lib.kvo_manager_complete_store(None, keys(1), 1, 1),
            lambda: lib.kvo_manager_reset(None),
            lambda: lib.kvo_manager_check_invariants(None),
        ):
            with self.assertRaises(kvoffload.NullArgumentError) as cm:
                call()
            self.assertEqual(cm.exception.status, Status.NULL_ARGUMENT)

    def test_last_error_message_truncates_and_reports_length(self):
        with self.assertRaises(kvoffload.NullArgumentError):
            lib.kvo_manager_reset(None)
        full = kvoffload.last_error_message()
        self.assertTrue(full)
        buf = C.create_string_buffer(4)
        n = lib.kvo_last_error_message(buf, 4)
        self.assertEqual(n, len(full.encode()))
        self.assertEqual(buf.raw, full.encode()[:3] + b"\0")
        self.assertEqual(lib.kvo_last_error_message(None, 0), n)

    def test_abi_and_version(self):
        self.assertEqual(lib.kvo_abi_version(), 1)
        self.assertIsInstance(lib.kvo_version(), bytes)


class SchedulerStepRawTest(unittest.TestCase):
    """Smoke test of the kvo_scheduler_* / kvo_step_* declarations: one store job end to end,
    a step plan encoded and decoded, corrupt bytes refused."""

    def setUp(self):
        cfg = _ffi.kvo_scheduler_config()
        lib.kvo_scheduler_config_default(C.byref(cfg))
        self.assertEqual(cfg.struct_size, C.sizeof(_ffi.kvo_scheduler_config))
        self.assertEqual((cfg.key_len, cfg.num_workers), (32, 1))
        cfg.num_slots = 16
        cfg.key_len = 8
        cfg.gpu_block_size = 4
        cfg.block_size_factor = 1
        self.s = C.POINTER(_ffi._Scheduler)()
        lib.kvo_scheduler_new(C.byref(cfg), C.byref(self.s))
        self.addCleanup(lib.kvo_scheduler_free, self.s)

    def new_step(self):
        st = C.POINTER(_ffi._Step)()
        lib.kvo_step_new(C.byref(st))
        self.addCleanup(lib.kvo_step_free, st)
        return st

    def info(self, st):
        info = _ffi.kvo_step_info()
        lib.kvo_step_get_info(st, C.byref(info))
        return info

    def test_store_job_end_to_end(self):
        s = self.s
        lib.kvo_scheduler_add_request(s, 7, 8, kvoffload.KVO_NO_LIMIT)
        with self.assertRaises(kvoffload.InvalidStateError) as cm:
            lib.kvo_scheduler_add_request(s, 7, 8, kvoffload.KVO_NO_LIMIT)
        self.assertIn("request_id", cm.exception.message)
        lib.kvo_scheduler_append_block_hashes(s, 7, keys(1, 2), 2, 8)
        mr = _ffi.kvo_match_result()
        lib.kvo_scheduler_match(s, 7, 0, C.byref(mr))
        self.assertEqual(mr.kind, kvoffload.KVO_MATCH_MISS)
        blocks = (C.c_uint32 * 2)(10, 11)
        has_job, job_id = C.c_uint32(9), C.c_uint64()
        lib.kvo_scheduler_on_alloc(s, 7, blocks, 2, 0, C.byref(has_job), C.byref(job_id))
        self.assertEqual(has_job.value, 0)

        st = self.new_step()
        req = _ffi.kvo_scheduled_request(
            request_id=7, num_computed_tokens=0, num_scheduled_tokens=8, num_tokens=8,
            new_block_ids=blocks, n_new_block_ids=2,
        )
        lib.kvo_scheduler_build_step(s, C.byref(req), 1, None, 0, st)
        self.assertEqual(self.info(st).num_jobs, 1)
        job = _ffi.kvo_job_info()
        lib.kvo_step_get_job(st, 0, C.byref(job))
        self.assertEqual((job.request_id, job.kind), (7, kvoffload.KVO_JOB_KIND_STORE))
        src, dst = (C.c_uint32 * job.n_src)(), (C.c_uint32 * job.n_dst)()
        lib.kvo_step_get_job_blocks(st, 0, src, job.n_src, dst, job.n_dst)
        self.assertEqual(list(src), [10, 11])
        with self.assertRaises(kvoffload.InvalidArgumentError):
            lib.kvo_step_get_job(st, 1, C.byref(job))
        n = C.c_size_t()
        lib.kvo_step_get_flush(st, None, 0, C.byref(n))
        self.assertEqual(n.value, 0)

        report = _ffi.kvo_job_report(job_id=job.id, count=1, success=1)
        lib.kvo_scheduler_complete_jobs(s, C.byref(report), 1)
        with self.assertRaises(kvoffload.NotFoundError):
            lib.kvo_scheduler_complete_jobs(s, C.byref(report), 1)
        stats = _ffi.kvo_scheduler_stats()
        stats.struct_size = C.sizeof(stats)
        lib.kvo_scheduler_get_stats(s, C.byref(stats))
        self.assertEqual((stats.store_jobs, stats.stores_in_flight), (1, 0))
        self.assertEqual((stats.manager.capacity, stats.manager.ready), (16, 2))
        failed = C.c_uint32(9)
        a, b = C.c_uint64(), C.c_uint64()
        lib.kvo_scheduler_load_failure(s, 7, C.byref(failed), C.byref(a), C.byref(b))
        self.assertEqual(failed.value, 0)
        lib.kvo_scheduler_check_invariants(s)
        lib.kvo_scheduler_finish_request(s, 7)
        ne, nk = C.c_size_t(), C.c_size_t()
        lib.kvo_scheduler_take_events(s, None, 0, None, 0, C.byref(ne), C.byref(nk))
        self.assertEqual((ne.value, nk.value), (0, 0))
        lib.kvo_scheduler_reset(s)

    def test_step_encode_decode(self):
        s = self.s
        lib.kvo_scheduler_add_request(s, 1, 4, kvoffload.KVO_NO_LIMIT)
        lib.kvo_scheduler_append_block_hashes(s, 1, keys(5), 1, 4)
        mr = _ffi.kvo_match_result()
        lib.kvo_scheduler_match(s, 1, 0, C.byref(mr))
        blocks = (C.c_uint32 * 1)(3)
        st = self.new_step()
        req = _ffi.kvo_scheduled_request(
            request_id=1, num_scheduled_tokens=4, num_tokens=4,
            new_block_ids=blocks, n_new_block_ids=1,
        )
        lib.kvo_scheduler_build_step(s, C.byref(req), 1, None, 0, st)
        n = C.c_size_t()
        with self.assertRaises(kvoffload.BufferTooSmallError):
            lib.kvo_step_encode(st, None, 0, C.byref(n))
        self.assertGreater(n.value, 0)
        buf = (C.c_uint8 * n.value)()
        lib.kvo_step_encode(st, buf, n.value, C.byref(n))
        data = bytes(buf[: n.value])
        other = self.new_step()
        lib.kvo_step_decode(other, data, len(data))
        self.assertEqual(self.info(other).num_jobs, 1)
        for bad in (data[:-1], data[:-1] + bytes([data[-1] ^ 1]), b""):
            with self.assertRaises(kvoffload.CorruptDataError):
                lib.kvo_step_decode(other, bad, len(bad))
            self.assertEqual(self.info(other).num_jobs, 1, "a failed decode changes nothing")

    def test_null_handles(self):
        lib.kvo_scheduler_free(None)
        lib.kvo_step_free(None)
        with self.assertRaises(kvoffload.NullArgumentError):
            lib.kvo_scheduler_reset(None)
        with self.assertRaises(kvoffload.NullArgumentError):
            lib.kvo_step_get_info(None, C.byref(_ffi.kvo_step_info()))
        with self.assertRaises(kvoffload.NullArgumentError):
            lib.kvo_step_new(None)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
"""Per-call costs of the Python binding, and the conversation-trace replay per block.

Usage: python3 python/bench/bench.py [--package DIR] [--trace PATH] [--quick] [--json]

``--package DIR``: the directory holding the ``kvoffload`` package to measure (default: this
checkout's ``python/``); the library is found as that package finds it (``KVOFFLOAD_LIB``...).
Cases the package lacks (the buffer API in an older one) are skipped. Each figure is the median
of several timed repeats, in microseconds per call (per block for the replay, per completion
for poll), by the wall clock and by the calling thread's CPU clock. ``python/bench/compare.py`` runs two packages alternately and reports medians.
"""

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TRACE = os.path.join(HERE, os.pardir, os.pardir, os.pardir, "shared", "traces",
                             "conversation_trace.jsonl")


class Timer:
    """Wall time and the calling thread's CPU time together: on a loaded machine the wall clock
    also counts the time the thread waited for a CPU, the thread clock only what the calls
    cost (worker threads' copies excluded)."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.thread_time() - self.cpu
        return False


def medians(runs, per):
    """``(wall, cpu)`` medians of ``runs`` (Timers), divided by ``per``, in microseconds."""
    return (statistics.median(r.wall for r in runs) / per * 1e6,
            statistics.median(r.cpu for r in runs) / per * 1e6)


def per_call(fn, number, repeat=7):
    """Medians over ``repeat`` runs of ``number`` calls: ``(wall, cpu)`` microseconds per
    call."""
    runs = []
    for _ in range(repeat):
        with Timer() as t:
            for _ in range(number):
                fn()
        runs.append(t)
    return medians(runs, number)


def key(i, kl):
    return i.to_bytes(kl, "big")


def manager_cases(kvo, quick):
    out = {}
    kl = 32
    n = 2000 if quick else 20000
    m = kvo.Manager(num_slots=100_000, key_len=kl)
    keys = [key(i, kl) for i in range(32)]
    flat = b"".join(keys)
    m.prepare_store(keys)
    m.complete_store(keys)
    buffers = hasattr(kvo, "StoreBuffers")
    out["lookup_prefix 32 keys (list)"] = per_call(lambda: m.lookup_prefix(keys), n)
    out["touch 32 keys (list)"] = per_call(lambda: m.touch(keys), n)
    out["prepare_store 32 keys, all stored (list)"] = per_call(lambda: m.prepare_store(keys), n)
    if buffers:
        out["lookup_prefix 32 keys (bytes)"] = per_call(lambda: m.lookup_prefix(flat), n)
        out["touch 32 keys (bytes)"] = per_call(lambda: m.touch(flat), n)
        out["prepare_store 32 keys, all stored (bytes)"] = per_call(
            lambda: m.prepare_store(flat), n)
        sb = kvo.StoreBuffers(32, kl)
        out["prepare_store 32 keys, all stored (bytes, out=)"] = per_call(
            lambda: m.prepare_store(flat, out=sb), n)
    # New keys each call: 32 stores in flight, then completed, on a tier that evicts.
    m2 = kvo.Manager(num_slots=4096, key_len=kl)
    counter = [0]

    def timed(as_bytes):
        runs = []
        for _ in range(7):
            args = []
            for _ in range(n // 4):
                base = counter[0]
                counter[0] += 32
                ks = [key(base + i, kl) for i in range(32)]
                args.append(b"".join(ks) if as_bytes else ks)
            with Timer() as t:
                for arg in args:
                    plan = m2.prepare_store(arg)
                    m2.complete_store(arg, slots=plan.slots)
            runs.append(t)
        return medians(runs, n // 4)

    out["prepare_store+complete_store 32 new keys (list)"] = timed(False)
    if buffers:
        out["prepare_store+complete_store 32 new keys (bytes)"] = timed(True)
    out["stats"] = per_call(m.stats, n)
    m.close()
    m2.close()
    return out


def scheduler_cases(kvo, quick):
    out = {}
    n = 2000 if quick else 20000
    kl, gbs, nreq = 8, 16, 256
    s = kvo.Scheduler(num_slots=100_000, key_len=kl, gpu_block_size=gbs)
    for r in range(nreq):
        s.add_request(r, 64)
        s.append_block_hashes(r, [key(r * 100 + i, kl) for i in range(4)], 64)
        s.match(r, 0)
    out["match (miss)"] = per_call(lambda: s.match(0, 0), n)
    first = [kvo.ScheduledRequest(r, 0, 64, 65, list(range(5 * r, 5 * r + 5)))
             for r in range(nreq)]
    step = s.build_step(first)
    reports = [(j.id, 1, True) for j in step.jobs]
    step.close()
    s.complete_jobs(reports)
    decode = [kvo.ScheduledRequest(r, 64, 1, 65, []) for r in range(nreq)]
    nb = 200 if quick else 2000
    reuse = kvo.Step()
    out["build_step 256 requests (list of ScheduledRequest)"] = per_call(
        lambda: s.build_step(decode, step=reuse), nb)
    if hasattr(s, "build_step_arrays"):
        from array import array
        ids = array("Q", range(nreq))
        comp = array("Q", [64]) * nreq
        one = array("Q", [1]) * nreq
        tok = array("Q", [65]) * nreq
        zero = array("Q", [0]) * nreq
        out["build_step 256 requests (arrays)"] = per_call(
            lambda: s.build_step_arrays(ids, comp, one, tok, zero, step=reuse), nb)
    # The C ABI call itself, its struct array prepared beforehand (one ctypes call around it).
    lib, ffi = kvo.lib, kvo._ffi
    arr = (ffi.kvo_scheduled_request * nreq)()
    for i, r in enumerate(decode):
        arr[i].request_id = r.request_id
        arr[i].num_computed_tokens = 64
        arr[i].num_scheduled_tokens = 1
        arr[i].num_tokens = 65
    sh, st = s._ptr, reuse._ptr
    out["build_step 256 requests (C ABI call, prepared structs)"] = per_call(
        lambda: lib.kvo_scheduler_build_step(sh, arr, nreq, None, 0, st), nb)
    out["scheduler stats"] = per_call(s.stats, n)
    reuse.close()
    s.close()
    return out


def worker_cases(kvo, quick):
    out = {}
    page, blocks, slots = 64, 1024, 4096
    mem = ctypes.create_string_buffer(page * blocks)
    w = kvo.Worker([kvo.KvTensor.from_buffer(mem, blocks, page, page)], slots, threads=1)
    n = 5000 if quick else 50000
    job = [0]
    src, dst = [1, 2], [3, 4]
    if hasattr(kvo, "Completions"):
        from array import array
        src_a, dst_a = array("I", src), array("I", dst)
    else:
        src_a = dst_a = None

    def run(s, d):
        runs = []
        for _ in range(7):
            with Timer() as t:
                for _ in range(n // 7):
                    w.submit_job(job[0], kvo.JobKind.STORE, s, d)
                    job[0] += 1
            runs.append(t)
            w.wait(list(range(job[0] - n // 7, job[0])))
            while len(w.poll(max=100_000)):
                pass
        return medians(runs, n // 7)

    out["Worker.submit_job 2 blocks (lists)"] = run(src, dst)
    if src_a is not None:
        out["Worker.submit_job 2 blocks (array('I'))"] = run(src_a, dst_a)
    # poll: per completion, of batches of 1000 finished jobs.
    runs = []
    for _ in range(7):
        first = job[0]
        for _ in range(1000):
            w.submit_job(job[0], kvo.JobKind.STORE, src, dst)
            job[0] += 1
        w.wait(list(range(first, job[0])))
        with Timer() as t:
            got = w.poll(max=1000)
        runs.append(t)
        assert len(got) == 1000, len(got)
    out["Worker.poll per completion (1000 finished)"] = medians(runs, 1000)
    w.close()
    return out


def replay_cases(kvo, trace_path, quick):
    if not os.path.isfile(trace_path):
        raise SystemExit(f"trace {trace_path} not found (pass --trace PATH)")
    kl, slots = 8, 5859
    with open(trace_path) as f:
        reqs = [json.loads(line)["hash_ids"] for line in f if line.strip()]
    if quick:
        reqs = reqs[:2000]
    flat = [b"".join(h.to_bytes(kl, "big") for h in ids) for ids in reqs]
    lists = [[h.to_bytes(kl, "big") for h in ids] for ids in reqs]
    n_blocks = sum(len(r) for r in reqs)
    out = {}

    def replay_lists():
        m = kvo.Manager(num_slots=slots, key_len=kl)
        t = Timer().__enter__()
        hit = 0
        for keys in lists:
            hits, _ = m.lookup_prefix(keys)
            m.touch(keys)
            if hits:
                m.prepare_load(keys[:hits])
                m.complete_load(keys[:hits])
            hit += hits
            try:
                plan = m.prepare_store(keys)
            except kvo.NoRoomError:
                continue
            if len(plan.indices):
                m.complete_store([keys[i] for i in plan.indices], slots=plan.slots)
        t.__exit__()
        m.close()
        return t, hit

    def replay_buffers():
        m = kvo.Manager(num_slots=slots, key_len=kl)
        cap = max(len(r) for r in reqs)
        sb = kvo.StoreBuffers(cap, kl)
        from array import array
        load_out = array("I", bytes(4 * cap))
        t = Timer().__enter__()
        hit = 0
        for keys in flat:
            hits, _ = m.lookup_prefix(keys)
            m.touch(keys)
            if hits:
                head = keys[: hits * kl]
                m.prepare_load(head, out=load_out)
                m.complete_load(head)
            hit += hits
            try:
                m.prepare_store(keys, out=sb)
            except kvo.NoRoomError:
                continue
            k = sb.n_store
            if k:
                a, b = sb.indices[0], sb.indices[k - 1]
                if b - a + 1 == k:  # contiguous (all but a prefix of hits): one slice
                    done = keys[a * kl : (b + 1) * kl]
                else:
                    done = b"".join(keys[i * kl : (i + 1) * kl] for i in sb.indices[:k])
                m.complete_store(done, slots=sb.slots[:k])
        t.__exit__()
        m.close()
        return t, hit

    def replay_floor():
        """The buffer replay through the bound functions themselves (``_ffi.fast``), no
        wrapper: what ctypes alone costs for the same calls."""
        from array import array
        f = kvo._ffi.fast
        lookup, touch = f["kvo_manager_lookup_prefix"], f["kvo_manager_touch"]
        pload, cload = f["kvo_manager_prepare_load"], f["kvo_manager_complete_load"]
        pstore, cstore = f["kvo_manager_prepare_store"], f["kvo_manager_complete_store_at"]
        m = kvo.Manager(num_slots=slots, key_len=kl)
        h = m._h
        cap = max(len(r) for r in reqs)
        out = (ctypes.c_uint64 * 4)()
        oa = ctypes.addressof(out)
        ids = array("I", bytes(8 * cap))
        ia = ids.buffer_info()[0]
        ev = (ctypes.c_char * (cap * kl))()
        ea = ctypes.addressof(ev)
        t = Timer().__enter__()
        hit = 0
        for keys in flat:
            n = len(keys) // kl
            lookup(h, keys, n, oa, oa + 8)
            hits = out[0]
            touch(h, keys, n)
            if hits:
                pload(h, keys, hits, ia, hits)
                cload(h, keys, hits)
            hit += hits
            if pstore(h, keys, n, ia, ia + 4 * cap, ea, n, oa + 16, oa + 24):
                continue
            k = out[2]
            if k:
                a = ids[0]
                if ids[k - 1] - a + 1 == k:
                    cstore(h, keys[a * kl :], ia + 4 * cap, k, 1)
                else:
                    done = b"".join(keys[i * kl : (i + 1) * kl] for i in ids[:k])
                    cstore(h, done, ia + 4 * cap, k, 1)
        t.__exit__()
        m.close()
        return t, hit

    rounds = 3 if quick else 7
    times, hits = zip(*(replay_lists() for _ in range(rounds)))
    out["replay per block (lists of bytes)"] = medians(times, n_blocks)
    if hasattr(kvo, "StoreBuffers"):
        times_b, hits_b = zip(*(replay_buffers() for _ in range(rounds)))
        assert hits_b[0] == hits[0], (hits_b[0], hits[0])  # the same replay
        out["replay per block (bytes buffers)"] = medians(times_b, n_blocks)
        times_f, hits_f = zip(*(replay_floor() for _ in range(rounds)))
        assert hits_f[0] == hits[0], (hits_f[0], hits[0])
        out["replay per block (bound ctypes calls alone, no wrapper)"] = medians(times_f,
                                                                                n_blocks)
    out["replay hit blocks / blocks"] = (hits[0] / n_blocks, hits[0] / n_blocks)
    return out


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--package", default=os.path.join(HERE, os.pardir))
    p.add_argument("--trace", default=DEFAULT_TRACE)
    p.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.abspath(a.package))
    import kvoffload as kvo

    results = {}
    for cases in (manager_cases, scheduler_cases, worker_cases):
        results.update(cases(kvo, a.quick))
    results.update(replay_cases(kvo, a.trace, a.quick))
    if a.json:
        print(json.dumps({"library": kvo.lib_path, "results": results}))
    else:
        print(f"kvoffload from {os.path.dirname(kvo.__file__)}, library {kvo.lib_path}")
        print(f"{'case (us per call unless said)':58s} {'wall':>9s} {'thread CPU':>10s}")
        for name, (wall, cpu) in results.items():
            print(f"{name:58s} {wall:9.3f} {cpu:10.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])

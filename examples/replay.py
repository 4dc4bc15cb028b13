#!/usr/bin/env python3
"""A small replay through the C ABI with the ``kvoffload`` package: examples/replay.c in Python.

The same seeded workload (REQUESTS prompts, most of them starting with one of a few shared
system prompts, each ending with a unique suffix) runs on the same simulated engine, one step
at a time:

1. admit: requests whose load finished run now; arrived requests are matched against the host
   tier (``Scheduler.match``; DEFER: try again next step), get GPU blocks from a free list, and
   are recorded (``Scheduler.on_alloc``); a HIT waits for its load, a MISS runs;
2. ``Scheduler.build_step`` with the running requests, ``Worker.submit_step`` on a KV tensor in
   host memory (it holds the plan's stores until the next submit or a wait naming them);
3. the forward pass: each computed block is filled with its hash (so loads can be checked),
   each request ends after its prefill (``Scheduler.finish_request``, blocks freed);
4. completions: the jobs shipped one step earlier are waited for, polled and reported
   (``Scheduler.complete_jobs``); each loaded block's content is checked.

Reporting completions one step after shipping keeps the run deterministic (a server reports
whatever ``Worker.poll`` returns). It prints the same lines as the C program.
Run: ``PYTHONPATH=python python3 examples/replay.py`` (the library as ``kvoffload`` finds it,
or ``KVOFFLOAD_LIB``).
"""

import sys

import kvoffload
from kvoffload import JobKind, KvTensor, Match, ScheduledRequest

REQUESTS = 200
ARRIVALS_PER_STEP = 2
BLOCK_TOKENS = 16
GPU_BLOCKS = 64
HOST_SLOTS = 64
PAGE_BYTES = 128  # KV bytes per GPU block in this toy tensor
KEY_LEN = 8
PREFIX_BLOCKS = (4, 6, 8, 10)  # the shared system prompts
MASK = (1 << 64) - 1


class Random:
    """splitmix64: the workload's generator (examples/replay.c has the same)."""

    def __init__(self, seed=1):
        self.state = seed

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)


class Request:
    def __init__(self, tokens, hashes):
        self.tokens = tokens
        self.hashes = hashes  # one per full block
        self.blocks = []  # GPU blocks while admitted
        self.host_tokens = 0  # the load's tokens
        self.state = "arriving"  # waiting, loading, loaded, done


def make_workload():
    """Request i: a shared prefix (or none, one in five), 1-3 unique blocks, 0-15 more tokens."""
    rng = Random()
    reqs = []
    for i in range(REQUESTS):
        p = rng.next() % 5
        prefix = PREFIX_BLOCKS[p] if p < 4 else 0
        suffix = 1 + rng.next() % 3
        n = prefix + suffix
        tokens = n * BLOCK_TOKENS + rng.next() % BLOCK_TOKENS
        hashes = [((p + 1) << 56) | j if j < prefix else ((i + 1) << 16) | j for j in range(n)]
        reqs.append(Request(tokens, hashes))
    return reqs


def key(h):
    return h.to_bytes(KEY_LEN, "big")


def page(h):
    return key(h) * (PAGE_BYTES // KEY_LEN)


def main():
    reqs = make_workload()
    free = list(range(GPU_BLOCKS - 1, -1, -1))  # a stack: block 0 is taken first
    kv = bytearray(GPU_BLOCKS * PAGE_BYTES)  # the KV tensor
    tensor = KvTensor.from_buffer(kv, GPU_BLOCKS, block_stride=PAGE_BYTES, page_size=PAGE_BYTES)
    prompt_tokens = flushed = checked_blocks = steps = finished = 0
    jobs = []  # [job id, request, shipped step, kind, polled]
    with kvoffload.Scheduler(
        num_slots=HOST_SLOTS, key_len=KEY_LEN, gpu_block_size=BLOCK_TOKENS
    ) as s, kvoffload.Worker([tensor], num_host_slots=HOST_SLOTS) as w, kvoffload.Step() as step:
        now = 0
        while finished < REQUESTS or jobs:
            # 1. Admission. Loaded requests run first; then the arrived ones, in order.
            sched = []
            for i, r in enumerate(reqs):
                if r.state == "loaded":
                    sched.append(ScheduledRequest(i, r.host_tokens, r.tokens - r.host_tokens,
                                                  r.tokens, r.blocks))
            for i in range(min(REQUESTS, (now + 1) * ARRIVALS_PER_STEP)):
                r = reqs[i]
                if r.state == "arriving":
                    prompt_tokens += r.tokens
                    s.add_request(i, r.tokens)
                    s.append_block_hashes(i, b"".join(map(key, r.hashes)), r.tokens)
                    r.state = "waiting"
                if r.state != "waiting":
                    continue
                need = -(-r.tokens // BLOCK_TOKENS)
                if need > len(free):
                    break  # the first request that does not fit ends admission
                m = s.match(i, 0)  # no GPU prefix cache: 0 computed tokens
                if m.kind == Match.DEFER:
                    continue  # stays waiting; asked again next step
                r.blocks = [free.pop() for _ in range(need)]
                r.host_tokens = m.tokens if m.kind == Match.HIT else 0
                if s.on_alloc(i, r.blocks, r.host_tokens) is not None:
                    r.state = "loading"  # runs once its load is reported
                else:
                    sched.append(ScheduledRequest(i, 0, r.tokens, r.tokens, r.blocks))

            # 2. The step's plan: this step's loads and stores, and the jobs to flush first.
            s.build_step(sched, step=step)
            w.submit_step(step)
            flushed += step.info.num_flush
            jobs += [[j.id, j.request_id, now, j.kind, False] for j in step.jobs]

            # 3. The forward pass computes the running requests' blocks; each ends after its
            # prefill.
            for sr in sched:
                r = reqs[sr.request_id]
                for b in range(r.host_tokens // BLOCK_TOKENS, len(r.hashes)):
                    at = r.blocks[b] * PAGE_BYTES
                    kv[at : at + PAGE_BYTES] = page(r.hashes[b])
                s.finish_request(sr.request_id)
                free += r.blocks
                r.state = "done"
                finished += 1

            # 4. Completions of the jobs shipped last step (waiting submits their held stores).
            due = [j[0] for j in jobs if j[2] < now and not j[4]]
            if due:
                w.wait(due, timeout_ms=10000)
            done = w.poll()
            for c in done:
                if not c.success:
                    sys.exit(f"job {c.job_id} failed: {c.error}")
            polled = set(done.job_ids)
            reports = []
            kept = []
            for j in jobs:
                j[4] = j[4] or j[0] in polled
                if j[2] == now:  # reported next step
                    kept.append(j)
                    continue
                if not j[4]:
                    sys.exit(f"job {j[0]} was waited for but not polled")
                reports.append((j[0], 1, True))
                r = reqs[j[1]]
                if j[3] == JobKind.LOAD:
                    for b in range(r.host_tokens // BLOCK_TOKENS):
                        at = r.blocks[b] * PAGE_BYTES
                        if kv[at : at + PAGE_BYTES] != page(r.hashes[b]):
                            sys.exit(f"request {j[1]}: block {b} was not loaded")
                        checked_blocks += 1
                    r.state = "loaded"
            jobs = kept
            if reports:
                s.complete_jobs(reports)
            now += 1
            steps += 1

        st = s.stats()
        s.check_invariants()
        if st.loads_in_flight or st.stores_in_flight or st.manager.pinned or st.requests:
            sys.exit(f"left over: {st.loads_in_flight} loads, {st.stores_in_flight} stores in "
                     f"flight, {st.manager.pinned} slots pinned, {st.requests} requests")
    tenths = (st.hit_tokens * 1000 + prompt_tokens // 2) // prompt_tokens
    deferrals = st.deferred_jobs_in_flight + st.deferred_store_in_flight + st.deferred_being_loaded
    print(f"requests: {REQUESTS}")
    print(f"steps: {steps}")
    print(f"prompt tokens: {prompt_tokens}")
    print(f"host hit tokens: {st.hit_tokens} ({tenths // 10}.{tenths % 10} %)")
    print(f"load jobs: {st.load_jobs}")
    print(f"store jobs: {st.store_jobs} ({st.stored_chunks} blocks)")
    print(f"deferrals: {deferrals} (jobs in flight {st.deferred_jobs_in_flight}, store in flight "
          f"{st.deferred_store_in_flight}, being loaded {st.deferred_being_loaded})")
    print(f"flushed jobs: {flushed}")
    print(f"host evictions: {st.manager.evictions}")
    print(f"loaded blocks checked: {checked_blocks}")
    print("invariants: ok")


if __name__ == "__main__":
    main()

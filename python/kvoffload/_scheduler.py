"""The scheduler side of KV offloading (``kvo_scheduler_*``) and step plans (``kvo_step_*``).

    import kvoffload
    from kvoffload import ScheduledRequest

    with kvoffload.Scheduler(num_slots=64, key_len=8, gpu_block_size=16) as s:
        s.add_request(1, prompt_tokens=32)
        s.append_block_hashes(1, [h0, h1], num_tokens=32)  # one hash per full GPU block
        if s.match(1, num_computed_tokens=0).kind == kvoffload.Match.MISS:
            s.on_alloc(1, [10, 11], num_external_tokens=0)
        with s.build_step([ScheduledRequest(1, 0, 32, 32, new_block_ids=[10, 11])]) as step:
            data = step.encode()          # ship to the workers
        ...                               # workers copy, report back:
        s.complete_jobs([(job_id, 1, True)])

Every request id, token count, job id and block id is a non-negative ``int`` (TypeError for
another type, ValueError out of range, naming the argument); block hashes are ``bytes`` of
exactly ``key_len`` bytes. Library failures raise the :class:`KvoError` subclass of their
status with the library's message.
"""

import ctypes
import dataclasses
from typing import List, NamedTuple, Optional, Sequence

from . import _ffi, _metrics
from ._common import _take_events, _MAX_U32, _MAX_U64, Event, ManagerStats, _Handle, _policy, _uint
from ._ffi import (
    KVO_NO_LIMIT,
    BufferTooSmallError,
    DeferReason,
    JobKind,
    Match,
    Policy,
    lib,
)

__all__ = [
    "Scheduler",
    "SchedulerStats",
    "ScheduledRequest",
    "MatchResult",
    "JobReport",
    "Recompute",
    "Step",
    "StepInfo",
    "Job",
]


# ---------------------------------------------------------------------------------------------
# Value types
# ---------------------------------------------------------------------------------------------


class MatchResult(NamedTuple):
    """The answer of :meth:`Scheduler.match`.

    ``kind``: :class:`Match` ``MISS`` (compute normally), ``HIT`` (``tokens`` beyond the GPU hit
    can be loaded) or ``DEFER`` (ask again on a later step, allocate nothing now);
    ``defer_reason``: why it was deferred (:class:`DeferReason` ``NONE`` otherwise).
    """

    kind: Match
    tokens: int
    defer_reason: DeferReason

    @property
    def is_hit(self):
        return self.kind == Match.HIT

    @property
    def is_deferred(self):
        return self.kind == Match.DEFER


class JobReport(NamedTuple):
    """One completion report for :meth:`Scheduler.complete_jobs`: ``count`` workers report job
    ``job_id``; ``success`` False if any of them failed it."""

    job_id: int
    count: int = 1
    success: bool = True


class Recompute(NamedTuple):
    """Tokens ``[from_token, to_token)`` a request must recompute after a failed load."""

    from_token: int
    to_token: int


@dataclasses.dataclass
class ScheduledRequest:
    """One request scheduled in a step (``kvo_scheduled_request``).

    ``new_block_ids``: GPU block ids allocated since the last step (all of them when first
    scheduled, or when ``resumed`` after preemption: then they replace its block list).
    """

    request_id: int
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_tokens: int
    new_block_ids: Sequence[int] = ()
    resumed: bool = False


class StepInfo(NamedTuple):
    """Summary of a step plan (``kvo_step_info``)."""

    num_jobs: int
    num_flush: int
    block_size_factor: int


class Job(NamedTuple):
    """One job of a step plan.

    ``src``: host slots for a load, GPU blocks for a store; ``dst``: GPU blocks for a load, host
    slots for a store. ``block_index``: logical index within the request of the first GPU block
    copied (for a load, ``block_index % block_size_factor`` leading GPU blocks of the first host
    slot are skipped). ``group_size``: GPU blocks copied.
    """

    id: int
    request_id: int
    kind: JobKind
    group_size: int
    block_index: int
    src: List[int]
    dst: List[int]


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """Counters and gauges of a scheduler (``kvo_scheduler_stats``); ``manager`` is its tier's."""

    requests: int
    matches: int
    deferred_jobs_in_flight: int
    deferred_store_in_flight: int
    deferred_being_loaded: int
    hits: int
    hit_tokens: int
    load_jobs: int
    store_jobs: int
    stored_chunks: int
    store_no_room: int
    failed_jobs: int
    loads_in_flight: int
    stores_in_flight: int
    manager: ManagerStats

    def as_dict(self):
        """The stats as a dict (``manager`` as a nested dict)."""
        return dataclasses.asdict(self)


_SCHED_STATS_FIELDS = [f.name for f in dataclasses.fields(SchedulerStats) if f.name != "manager"]


# ---------------------------------------------------------------------------------------------
# Argument helpers
# ---------------------------------------------------------------------------------------------


def _seq(name, value):
    """``value`` as a list; a str/bytes or a non-iterable is a TypeError."""
    if isinstance(value, (str, bytes, bytearray, memoryview)) or value is None:
        raise TypeError(f"{name}: expected a sequence, got {type(value).__name__}")
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{name}: expected a sequence, got {type(value).__name__}") from None


def _u32_array(name, values):
    """A ctypes ``uint32_t[]`` of the checked ``values`` (None when empty) and its length."""
    values = [_uint(f"{name}[{i}]", v, _MAX_U32) for i, v in enumerate(_seq(name, values))]
    n = len(values)
    return ((ctypes.c_uint32 * n)(*values) if n else None), n


def _flag(name, value):
    if not isinstance(value, (bool, int)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return 1 if value else 0


# ---------------------------------------------------------------------------------------------
# Step plans
# ---------------------------------------------------------------------------------------------


class Step(_Handle):
    """A step plan (``kvo_step``): the jobs of one engine step and the flush set. Filled by
    :meth:`Scheduler.build_step` or decoded from bytes with :meth:`Step.decode`.

    Calls on one plan are serialized by the library; :meth:`close` must not race with them.
    """

    def __init__(self):
        ptr = ctypes.POINTER(_ffi._Step)()
        lib.kvo_step_new(ctypes.byref(ptr))
        self._own(ptr, lib.kvo_step_free)

    def __repr__(self):
        if self.closed:
            return "<kvoffload.Step closed>"
        i = self.info
        return f"<kvoffload.Step {i.num_jobs} jobs, {i.num_flush} to flush>"

    # -- reading --------------------------------------------------------------------------------

    @property
    def info(self) -> StepInfo:
        """Numbers of jobs and flushed job ids, and the plan's block size factor."""
        out = _ffi.kvo_step_info()
        lib.kvo_step_get_info(self._handle(), ctypes.byref(out))
        return StepInfo(out.num_jobs, out.num_flush, out.block_size_factor)

    @property
    def jobs(self) -> List[Job]:
        """The plan's jobs (loads first, then stores) with their block ids."""
        h = self._handle()
        info = _ffi.kvo_step_info()
        lib.kvo_step_get_info(h, ctypes.byref(info))
        out = []
        j = _ffi.kvo_job_info()
        for i in range(info.num_jobs):
            lib.kvo_step_get_job(h, i, ctypes.byref(j))
            src = (ctypes.c_uint32 * j.n_src)()
            dst = (ctypes.c_uint32 * j.n_dst)()
            lib.kvo_step_get_job_blocks(h, i, src, j.n_src, dst, j.n_dst)
            try:
                kind = JobKind(j.kind)
            except ValueError:
                kind = j.kind
            out.append(
                Job(j.id, j.request_id, kind, j.group_size, j.block_index, list(src), list(dst))
            )
        return out

    @property
    def flush(self) -> List[int]:
        """Job ids to wait for before the forward pass (ascending)."""
        h = self._handle()
        n = ctypes.c_size_t()
        cap = 0
        while True:
            ids = (ctypes.c_uint64 * cap)() if cap else None
            try:
                lib.kvo_step_get_flush(h, ids, cap, ctypes.byref(n))
            except BufferTooSmallError:
                cap = n.value  # the needed size was written
                continue
            return list(ids[: n.value]) if ids is not None else []

    # -- encoding -------------------------------------------------------------------------------

    def encode(self) -> bytes:
        """The plan as bytes for another process (versioned, checksummed)."""
        h = self._handle()
        n = ctypes.c_size_t()
        cap = 0
        while True:
            buf = (ctypes.c_uint8 * cap)() if cap else None
            try:
                lib.kvo_step_encode(h, buf, cap, ctypes.byref(n))
            except BufferTooSmallError:
                cap = n.value  # the needed length was written
                continue
            return bytes(buf[: n.value]) if buf is not None else b""

    @classmethod
    def decode(cls, data, into: Optional["Step"] = None) -> "Step":
        """A plan decoded from bytes made by :meth:`encode`. With ``into``, that plan is replaced
        (and returned) instead of a new one being made; on failure it is left unchanged.

        Raises :class:`CorruptDataError` for truncated or corrupt bytes or another format
        version; TypeError unless ``data`` is bytes-like.
        """
        if isinstance(data, (bytearray, memoryview)):
            data = bytes(data)
        if not isinstance(data, bytes):
            raise TypeError(f"data: expected bytes, got {type(data).__name__}")
        if into is not None and not isinstance(into, Step):
            raise TypeError(f"into: expected a Step, got {type(into).__name__}")
        step = cls() if into is None else into
        try:
            lib.kvo_step_decode(step._handle(), data, len(data))
        except BaseException:
            if into is None:
                step.close()
            raise
        return step


# ---------------------------------------------------------------------------------------------
# Scheduler
# ---------------------------------------------------------------------------------------------


class Scheduler(_Handle):
    """The scheduler side of KV offloading (``kvo_scheduler``): per-request state, matching with
    the deferral rule, load and store jobs, step plans, completions; it owns its tier.

    Calls on one scheduler are serialized by the library, so it may be shared between threads;
    :meth:`close` must not race with other calls on it.
    """

    def __init__(
        self,
        num_slots,
        key_len=32,
        gpu_block_size=16,
        block_size_factor=1,
        policy="lru",
        num_workers=1,
        offload_prompt_only=True,
        store_threshold=0,
        max_tracker_size=64000,
        enable_events=False,
    ):
        cfg = _ffi.kvo_scheduler_config()
        lib.kvo_scheduler_config_default(ctypes.byref(cfg))
        cfg.num_slots = _uint("num_slots", num_slots, _MAX_U64)
        cfg.key_len = _uint("key_len", key_len, _MAX_U32)
        cfg.gpu_block_size = _uint("gpu_block_size", gpu_block_size, _MAX_U32)
        cfg.block_size_factor = _uint("block_size_factor", block_size_factor, _MAX_U32)
        # Unknown policy numbers go through: the library refuses them.
        cfg.policy = _policy(policy)
        cfg.num_workers = _uint("num_workers", num_workers, _MAX_U32)
        cfg.offload_prompt_only = _flag("offload_prompt_only", offload_prompt_only)
        cfg.store_threshold = _uint("store_threshold", store_threshold, _MAX_U32)
        cfg.max_tracker_size = _uint("max_tracker_size", max_tracker_size, _MAX_U64)
        cfg.enable_events = _flag("enable_events", enable_events)
        ptr = ctypes.POINTER(_ffi._Scheduler)()
        lib.kvo_scheduler_new(ctypes.byref(cfg), ctypes.byref(ptr))
        self._own(ptr, lib.kvo_scheduler_free)
        self.num_slots = cfg.num_slots
        self.key_len = cfg.key_len
        self.gpu_block_size = cfg.gpu_block_size
        self.block_size_factor = cfg.block_size_factor
        self.policy = Policy(cfg.policy)
        self.num_workers = cfg.num_workers
        self.offload_prompt_only = bool(cfg.offload_prompt_only)

    def __repr__(self):
        state = "closed" if self.closed else f"{self.num_slots} slots"
        return (
            f"<kvoffload.Scheduler {self.policy.name} key_len={self.key_len} "
            f"gpu_block_size={self.gpu_block_size} block_size_factor={self.block_size_factor} "
            f"{state}>"
        )


    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request_id, prompt_tokens, max_offload_tokens=None):
        """Starts tracking a request of ``prompt_tokens`` tokens; ``max_offload_tokens`` caps
        the tokens offloaded for it (None: no cap; 0: nothing is offloaded).

        Raises :class:`InvalidStateError` if the request is already tracked.
        """
        h = self._handle()
        rid = _uint("request_id", request_id, _MAX_U64)
        n = _uint("prompt_tokens", prompt_tokens, _MAX_U64)
        cap = (
            KVO_NO_LIMIT
            if max_offload_tokens is None
            else _uint("max_offload_tokens", max_offload_tokens, _MAX_U64)
        )
        lib.kvo_scheduler_add_request(h, rid, n, cap)

    def append_block_hashes(self, request_id, hashes, num_tokens):
        """Appends block hashes (one ``key_len``-byte hash per newly full GPU block) and sets the
        request's token count to ``num_tokens``.

        Raises :class:`NotFoundError` for an unknown request, :class:`InvalidStateError` for a
        finished one, :class:`InvalidArgumentError` if the hashes exceed the full blocks of
        ``num_tokens``.
        """
        h = self._handle()
        rid = _uint("request_id", request_id, _MAX_U64)
        hashes = _seq("hashes", hashes)
        kl = self.key_len
        for i, x in enumerate(hashes):
            if not isinstance(x, (bytes, bytearray)):
                raise TypeError(f"hashes[{i}]: expected bytes, got {type(x).__name__}")
            if len(x) != kl:
                raise ValueError(f"hashes[{i}]: {len(x)} bytes, key_len is {kl}")
        n = _uint("num_tokens", num_tokens, _MAX_U64)
        lib.kvo_scheduler_append_block_hashes(h, rid, b"".join(hashes), len(hashes), n)

    def match(self, request_id, num_computed_tokens) -> MatchResult:
        """Matches a waiting request against the tier; ``num_computed_tokens`` are its GPU
        prefix-cache hit tokens. While the request has jobs in flight the answer is DEFER
        (``DeferReason.JOBS_IN_FLIGHT``) and nothing is looked up.

        Raises :class:`NotFoundError` for an unknown request, :class:`InvalidStateError` for a
        finished one or one whose hashes do not cover its tokens.
        """
        h = self._handle()
        rid = _uint("request_id", request_id, _MAX_U64)
        n = _uint("num_computed_tokens", num_computed_tokens, _MAX_U64)
        out = _ffi.kvo_match_result()
        lib.kvo_scheduler_match(h, rid, n, ctypes.byref(out))
        return MatchResult(Match(out.kind), out.tokens, DeferReason(out.defer_reason))

    def on_alloc(self, request_id, block_ids, num_external_tokens) -> Optional[int]:
        """Records the GPU blocks allocated to a matched request (all of its blocks) and, with
        ``num_external_tokens > 0`` (the hit), makes its load job for the next step. Returns the
        load job's id, or None without a load.

        Raises :class:`InvalidStateError` if the request has jobs in flight (a deferred match),
        :class:`InvalidArgumentError` if ``block_ids`` is shorter than the tokens need or the
        tokens exceed its offloaded chunks, :class:`NotFoundError` for an unknown request or a
        key no longer stored. On failure nothing changes.
        """
        h = self._handle()
        rid = _uint("request_id", request_id, _MAX_U64)
        ids, n = _u32_array("block_ids", block_ids)
        ext = _uint("num_external_tokens", num_external_tokens, _MAX_U64)
        has_job = ctypes.c_uint32()
        job_id = ctypes.c_uint64()
        lib.kvo_scheduler_on_alloc(
            h, rid, ids, n, ext, ctypes.byref(has_job), ctypes.byref(job_id)
        )
        return job_id.value if has_job.value else None

    def build_step(self, scheduled=(), preempted=(), step: Optional[Step] = None) -> Step:
        """Builds this step's plan: the load jobs made since the last step, the store jobs of the
        ``scheduled`` requests' newly complete chunks (a list of :class:`ScheduledRequest`), and
        the flush set (jobs of the ``preempted`` request ids, fenced stores, jobs of a reset).
        Writes into ``step`` when given (reusing it), else into a new :class:`Step`; returns it.

        Raises :class:`NotFoundError`, :class:`InvalidStateError` or
        :class:`InvalidArgumentError` (a request scheduled twice, block ids that do not cover
        its tokens); then nothing changes and ``step`` is not written.
        """
        h = self._handle()
        if step is not None and not isinstance(step, Step):
            raise TypeError(f"step: expected a Step, got {type(step).__name__}")
        reqs = _seq("scheduled", scheduled)
        n = len(reqs)
        arr = (_ffi.kvo_scheduled_request * n)() if n else None
        keep = []  # the block id arrays, alive until the call returns
        for i, r in enumerate(reqs):
            if not isinstance(r, ScheduledRequest):
                if isinstance(r, tuple):
                    r = ScheduledRequest(*r)
                else:
                    raise TypeError(
                        f"scheduled[{i}]: expected a ScheduledRequest, got {type(r).__name__}"
                    )
            c = arr[i]
            c.request_id = _uint(f"scheduled[{i}].request_id", r.request_id, _MAX_U64)
            c.num_computed_tokens = _uint(
                f"scheduled[{i}].num_computed_tokens", r.num_computed_tokens, _MAX_U64
            )
            c.num_scheduled_tokens = _uint(
                f"scheduled[{i}].num_scheduled_tokens", r.num_scheduled_tokens, _MAX_U64
            )
            c.num_tokens = _uint(f"scheduled[{i}].num_tokens", r.num_tokens, _MAX_U64)
            ids, nids = _u32_array(f"scheduled[{i}].new_block_ids", r.new_block_ids)
            keep.append(ids)
            if ids is not None:
                c.new_block_ids = ctypes.cast(ids, ctypes.POINTER(ctypes.c_uint32))
            c.n_new_block_ids = nids
            c.resumed = _flag(f"scheduled[{i}].resumed", r.resumed)
        pre = [
            _uint(f"preempted[{i}]", p, _MAX_U64)
            for i, p in enumerate(_seq("preempted", preempted))
        ]
        pre_arr = (ctypes.c_uint64 * len(pre))(*pre) if pre else None
        out = Step() if step is None else step
        try:
            lib.kvo_scheduler_build_step(h, arr, n, pre_arr, len(pre), out._handle())
        except BaseException:
            if step is None:
                out.close()
            raise
        del keep
        return out

    def complete_jobs(self, reports):
        """Counts worker reports: each a :class:`JobReport`, a ``(job_id, count, success)``
        tuple, or a bare job id (one successful report). A job completes once ``num_workers``
        reports arrived (failed if any failed).

        Raises :class:`NotFoundError` for a job not in flight, :class:`InvalidArgumentError` for
        a zero count or more reports than workers; then no report is applied.
        """
        h = self._handle()
        reps = _seq("reports", reports)
        n = len(reps)
        arr = (_ffi.kvo_job_report * n)() if n else None
        for i, r in enumerate(reps):
            if hasattr(r, "__index__") and not isinstance(r, bool):
                r = JobReport(r)
            elif isinstance(r, tuple) and len(r) in (1, 2, 3):
                r = JobReport(*r)
            else:
                raise TypeError(
                    f"reports[{i}]: expected a JobReport, a (job_id, count, success) tuple or a "
                    f"job id, got {type(r).__name__}"
                )
            c = arr[i]
            c.job_id = _uint(f"reports[{i}].job_id", r.job_id, _MAX_U64)
            c.count = _uint(f"reports[{i}].count", r.count, _MAX_U32)
            c.success = _flag(f"reports[{i}].success", r.success)
        lib.kvo_scheduler_complete_jobs(h, arr, n)

    def finish_request(self, request_id):
        """Finishes or aborts a request (its state is kept until its jobs complete).

        Raises :class:`NotFoundError` for an unknown request, :class:`InvalidStateError` if it
        was already finished.
        """
        h = self._handle()
        lib.kvo_scheduler_finish_request(h, _uint("request_id", request_id, _MAX_U64))

    def load_failure(self, request_id) -> Optional[Recompute]:
        """The tokens ``(from_token, to_token)`` the request must recompute because its last
        load failed, or None. Reported until the request's next match."""
        h = self._handle()
        rid = _uint("request_id", request_id, _MAX_U64)
        failed = ctypes.c_uint32()
        a, b = ctypes.c_uint64(), ctypes.c_uint64()
        lib.kvo_scheduler_load_failure(
            h, rid, ctypes.byref(failed), ctypes.byref(a), ctypes.byref(b)
        )
        return Recompute(a.value, b.value) if failed.value else None

    # -- whole scheduler ------------------------------------------------------------------------

    def reset(self):
        """Drops the whole tier: in-flight jobs go into the next step's flush set and their
        later reports are ignored. Raises :class:`InvalidStateError` while load jobs made since
        the last step are not in a step yet."""
        lib.kvo_scheduler_reset(self._handle())

    def take_events(self) -> List[Event]:
        """Takes the tier's buffered events, oldest first (empty unless ``enable_events``)."""
        return _take_events(lib.kvo_scheduler_take_events, self._handle(), self.key_len)

    def stats(self) -> SchedulerStats:
        """Counters and gauges, with the tier's stats as ``manager``."""
        h = self._handle()
        s = _ffi.kvo_scheduler_stats()
        s.struct_size = ctypes.sizeof(s)
        lib.kvo_scheduler_get_stats(h, ctypes.byref(s))
        fields = {f: getattr(s, f) for f in _SCHED_STATS_FIELDS}
        return SchedulerStats(manager=ManagerStats._from_c(s.manager), **fields)

    def metrics_text(self, prefix, labels=None) -> str:
        """The scheduler's stats, its tier's included, as Prometheus text
        (``kvo_scheduler_metrics_text``): every name ``<prefix>_<name>`` (vLLM's prefix:
        ``"vllm:kv_offload"``), every sample with the constant ``labels`` (a dict of str, in
        order). README.md lists the metrics."""
        return _metrics.metrics_text(
            lib.kvo_scheduler_metrics_text, self._handle(), prefix, labels
        )

    def metrics(self, prefix, labels=None) -> dict:
        """The same metrics as plain dicts, ``{family: {"type", "help", "samples"}}`` with
        ``samples`` a list of ``(name, labels, value)``: what a ``prometheus_client`` custom
        collector yields as ``Metric(family, help, type)`` with ``add_sample`` per sample."""
        return _metrics.parse(self.metrics_text(prefix, labels))

    def check_invariants(self):
        """Recounts the scheduler's and tier's state; raises :class:`InternalError` naming a
        broken invariant."""
        lib.kvo_scheduler_check_invariants(self._handle())

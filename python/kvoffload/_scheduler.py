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
another type, ValueError out of range, naming the argument); lists of block ids may also be
``uint32`` buffers (``array('I')``, numpy), and a batch of hundreds of scheduled requests goes
in as arrays (:meth:`Scheduler.build_step_arrays`). Block hashes are one bytes-like object of
``n * key_len`` bytes or a list of ``key_len``-byte hashes. Library failures raise the
:class:`KvoError` subclass of their status with the library's message.
"""

import ctypes
import dataclasses
import operator
from array import array
from itertools import chain
from typing import Any, List, NamedTuple, Optional, Sequence, Union

from . import _ffi, _metrics
from ._buffers import IdsLike, KeysLike, keys_arg, u32_arg, u64_arg
from ._common import (
    _take_events,
    _MAX_U32,
    _MAX_U64,
    Event,
    ManagerStats,
    _Handle,
    _Stats,
    _policy,
    _semantics,
    _uint,
)
from ._ffi import (
    KVO_NO_LIMIT,
    BufferTooSmallError,
    DeferReason,
    JobKind,
    Match,
    Policy,
    Semantics,
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


class SchedulerStats(_Stats, ctypes.Structure):
    """Counters and gauges of a scheduler (``kvo_scheduler_stats``), as the struct the library
    filled: requests, matches, deferred_jobs_in_flight, deferred_store_in_flight,
    deferred_being_loaded, hits, hit_tokens, load_jobs, store_jobs, stored_chunks,
    store_no_room, failed_jobs, loads_in_flight, stores_in_flight, and ``manager``: its tier's
    :class:`ManagerStats`. ``as_dict()`` on demand."""

    _fields_ = [
        (name, ManagerStats if name == "manager" else t)
        for name, t in _ffi.kvo_scheduler_stats._fields_
    ]


_tmpl = SchedulerStats()
_tmpl.struct_size = ctypes.sizeof(SchedulerStats)
_tmpl.manager.struct_size = ctypes.sizeof(ManagerStats)
SchedulerStats._template = bytes(_tmpl)
del _tmpl
assert ctypes.sizeof(SchedulerStats) == ctypes.sizeof(_ffi.kvo_scheduler_stats)


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


def _flag(name, value):
    if not isinstance(value, (bool, int)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return 1 if value else 0


_fast = _ffi.fast
_failure = _ffi.failure
_addressof = ctypes.addressof
_step_get_jobs = _fast["kvo_step_get_jobs"]
_step_get_flush = _fast["kvo_step_get_flush"]
_step_decode = _fast["kvo_step_decode"]
_append_block_hashes = _fast["kvo_scheduler_append_block_hashes"]
_match = _fast["kvo_scheduler_match"]
_on_alloc = _fast["kvo_scheduler_on_alloc"]
_build_step_arrays = _fast["kvo_scheduler_build_step_arrays"]
_complete_jobs = _fast["kvo_scheduler_complete_jobs"]
_finish_request = _fast["kvo_scheduler_finish_request"]
_get_stats = _fast["kvo_scheduler_get_stats"]
_Out = ctypes.c_uint64 * 2
_MATCHES = tuple(Match)
_DEFER_REASONS = tuple(DeferReason)
_JOB_KINDS = tuple(JobKind)
_new_match_result = tuple.__new__
_BUFFER_TOO_SMALL = int(_ffi.Status.BUFFER_TOO_SMALL)


def _u64(name, value):
    """``value`` if it is an int in range (the fast path), else :func:`_uint`'s answer."""
    if type(value) is int and 0 <= value <= _MAX_U64:
        return value
    return _uint(name, value, _MAX_U64)


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
        """The plan's jobs (loads first, then stores) with their block ids, read in one library
        call."""
        h = self._h
        if h is None:
            raise self._closed_error()
        counts = _Out()
        ca = _addressof(counts)
        n_jobs = n_blocks = 0
        while True:
            infos = (_ffi.kvo_job_info * n_jobs)()
            blocks = array("I", bytes(4 * n_blocks))
            st = _step_get_jobs(
                h, _addressof(infos), n_jobs, blocks.buffer_info()[0], n_blocks, ca, ca + 8
            )
            if st == _BUFFER_TOO_SMALL:  # the needed numbers were written
                n_jobs, n_blocks = counts[0], counts[1]
                continue
            if st:
                raise _failure(st)
            break
        out = []
        at = 0
        kinds = _JOB_KINDS
        for j in infos[: counts[0]]:
            ns, nd = j.n_src, j.n_dst
            kind = kinds[j.kind] if j.kind < len(kinds) else j.kind
            out.append(
                Job(j.id, j.request_id, kind, j.group_size, j.block_index,
                    blocks[at : at + ns].tolist(), blocks[at + ns : at + ns + nd].tolist())
            )
            at += ns + nd
        return out

    @property
    def flush(self) -> List[int]:
        """Job ids to wait for before the forward pass (ascending)."""
        h = self._h
        if h is None:
            raise self._closed_error()
        n = _Out()
        cap = 16
        while True:
            ids = array("Q", bytes(8 * cap))
            st = _step_get_flush(h, ids.buffer_info()[0], cap, _addressof(n))
            if st == _BUFFER_TOO_SMALL:  # the needed size was written
                cap = n[0]
                continue
            if st:
                raise _failure(st)
            return ids[: n[0]].tolist()

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
    def decode(cls, data: KeysLike, into: Optional["Step"] = None) -> "Step":
        """A plan decoded from bytes made by :meth:`encode`. With ``into``, that plan is replaced
        (and returned) instead of a new one being made; on failure it is left unchanged.

        ``data``: any bytes-like object (passed without copying). Raises
        :class:`CorruptDataError` for truncated or corrupt bytes or another format version;
        TypeError unless ``data`` is bytes-like.
        """
        if isinstance(data, (list, tuple)):
            raise TypeError(f"data: expected bytes, got {type(data).__name__}")
        arg, n, keep = keys_arg(data, 1, "data")
        if into is not None and not isinstance(into, Step):
            raise TypeError(f"into: expected a Step, got {type(into).__name__}")
        step = cls() if into is None else into
        st = _step_decode(step._handle_address(), arg, n)
        if st:
            err = _failure(st)
            if into is None:
                step.close()
            raise err
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
        key_len=None,
        gpu_block_size=None,
        block_size_factor=None,
        policy="lru",
        num_workers=None,
        offload_prompt_only=None,
        store_threshold=None,
        max_tracker_size=None,
        enable_events=False,
        semantics=None,
    ):
        # None keeps the library's default (``kvo_scheduler_config_default``). ``semantics``:
        # "0.24" or "0.33" (or a ``Semantics``), the vLLM release the scheduler follows.
        cfg = _ffi.kvo_scheduler_config()
        lib.kvo_scheduler_config_default(ctypes.byref(cfg))
        cfg.num_slots = _uint("num_slots", num_slots, _MAX_U64)
        if key_len is not None:
            cfg.key_len = _uint("key_len", key_len, _MAX_U32)
        if gpu_block_size is not None:
            cfg.gpu_block_size = _uint("gpu_block_size", gpu_block_size, _MAX_U32)
        if block_size_factor is not None:
            cfg.block_size_factor = _uint("block_size_factor", block_size_factor, _MAX_U32)
        # Unknown policy numbers go through: the library refuses them.
        cfg.policy = _policy(policy)
        if num_workers is not None:
            cfg.num_workers = _uint("num_workers", num_workers, _MAX_U32)
        if offload_prompt_only is not None:
            cfg.offload_prompt_only = _flag("offload_prompt_only", offload_prompt_only)
        if store_threshold is not None:
            cfg.store_threshold = _uint("store_threshold", store_threshold, _MAX_U32)
        if max_tracker_size is not None:
            cfg.max_tracker_size = _uint("max_tracker_size", max_tracker_size, _MAX_U64)
        cfg.enable_events = _flag("enable_events", enable_events)
        if semantics is not None:
            cfg.semantics = _semantics(semantics)
        ptr = ctypes.POINTER(_ffi._Scheduler)()
        lib.kvo_scheduler_new(ctypes.byref(cfg), ctypes.byref(ptr))
        self._own(ptr, lib.kvo_scheduler_free)
        self.num_slots = cfg.num_slots
        self.key_len = cfg.key_len
        self.gpu_block_size = cfg.gpu_block_size
        self.block_size_factor = cfg.block_size_factor
        self.policy = Policy(cfg.policy)
        self.semantics = Semantics(cfg.semantics)
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

    def add_request(
        self, request_id: int, prompt_tokens: int, max_offload_tokens: Optional[int] = None
    ) -> None:
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

    def append_block_hashes(self, request_id: int, hashes: KeysLike, num_tokens: int) -> None:
        """Appends block hashes (one ``key_len``-byte hash per newly full GPU block) and sets the
        request's token count to ``num_tokens``.

        Raises :class:`NotFoundError` for an unknown request, :class:`InvalidStateError` for a
        finished one, :class:`InvalidArgumentError` if the hashes exceed the full blocks of
        ``num_tokens``.
        """
        h = self._h
        if h is None:
            raise self._closed_error()
        rid = _u64("request_id", request_id)
        arg, n, keep = keys_arg(hashes, self.key_len, "hashes")
        st = _append_block_hashes(h, rid, arg, n, _u64("num_tokens", num_tokens))
        if st:
            raise _failure(st)

    def match(self, request_id: int, num_computed_tokens: int) -> MatchResult:
        """Matches a waiting request against the tier; ``num_computed_tokens`` are its GPU
        prefix-cache hit tokens. While the request has jobs in flight the answer is DEFER
        (``DeferReason.JOBS_IN_FLIGHT``) and nothing is looked up.

        Raises :class:`NotFoundError` for an unknown request, :class:`InvalidStateError` for a
        finished one or one whose hashes do not cover its tokens.
        """
        h = self._h
        if h is None:
            raise self._closed_error()
        out = _ffi.kvo_match_result()
        st = _match(
            h,
            _u64("request_id", request_id),
            _u64("num_computed_tokens", num_computed_tokens),
            _addressof(out),
        )
        if st:
            raise _failure(st)
        return _new_match_result(
            MatchResult, (_MATCHES[out.kind], out.tokens, _DEFER_REASONS[out.defer_reason])
        )

    def on_alloc(
        self, request_id: int, block_ids: IdsLike, num_external_tokens: int
    ) -> Optional[int]:
        """Records the GPU blocks allocated to a matched request (all of its blocks) and, with
        ``num_external_tokens > 0`` (the hit), makes its load job for the next step. Returns the
        load job's id, or None without a load.

        Raises :class:`InvalidStateError` if the request has jobs in flight (a deferred match),
        :class:`InvalidArgumentError` if ``block_ids`` is shorter than the tokens need or the
        tokens exceed its offloaded chunks, :class:`NotFoundError` for an unknown request or a
        key no longer stored. On failure nothing changes.
        """
        h = self._h
        if h is None:
            raise self._closed_error()
        rid = _u64("request_id", request_id)
        ids, n, keep = u32_arg(block_ids, "block_ids")
        ext = _u64("num_external_tokens", num_external_tokens)
        out = _Out()
        a = _addressof(out)
        st = _on_alloc(h, rid, ids, n, ext, a, a + 8)
        if st:
            raise _failure(st)
        return out[1] if out[0] else None

    def build_step(
        self,
        scheduled: Sequence[Union[ScheduledRequest, tuple]] = (),
        preempted: IdsLike = (),
        step: Optional[Step] = None,
    ) -> Step:
        """Builds this step's plan: the load jobs made since the last step, the store jobs of the
        ``scheduled`` requests' newly complete chunks (a list of :class:`ScheduledRequest` or of
        tuples of its fields), and the flush set (jobs of the ``preempted`` request ids, fenced
        stores, jobs of a reset). Writes into ``step`` when given (reusing it), else into a new
        :class:`Step`; returns it. With hundreds of requests, :meth:`build_step_arrays` takes
        the batch as arrays.

        Raises :class:`NotFoundError`, :class:`InvalidStateError` or
        :class:`InvalidArgumentError` (a request scheduled twice, block ids that do not cover
        its tokens); then nothing changes and ``step`` is not written.
        """
        reqs = _seq("scheduled", scheduled)
        for i, r in enumerate(reqs):
            if type(r) is not ScheduledRequest:
                if isinstance(r, ScheduledRequest):
                    continue
                if not isinstance(r, tuple):
                    raise TypeError(
                        f"scheduled[{i}]: expected a ScheduledRequest, got {type(r).__name__}"
                    )
                reqs[i] = ScheduledRequest(*r)
        cols = {}
        for field in ("request_id", "num_computed_tokens", "num_scheduled_tokens", "num_tokens"):
            get = operator.attrgetter(field)
            try:
                cols[field] = array("Q", map(get, reqs))
            except (TypeError, OverflowError):
                for i, r in enumerate(reqs):
                    _uint(f"scheduled[{i}].{field}", get(r), _MAX_U64)
                raise
        ids = [r.new_block_ids for r in reqs]
        try:
            counts = array("Q", map(len, ids))
            blocks = array("I", chain.from_iterable(ids))
        except (TypeError, OverflowError):
            for i, b in enumerate(ids):
                u32_arg(b, f"scheduled[{i}].new_block_ids")
            raise
        resumed = [r.resumed for r in reqs]
        for i, x in enumerate(resumed):
            if type(x) is not bool:
                _flag(f"scheduled[{i}].resumed", x)
        return self.build_step_arrays(
            cols["request_id"], cols["num_computed_tokens"], cols["num_scheduled_tokens"],
            cols["num_tokens"], counts, blocks, bytes(map(bool, resumed)) if any(resumed) else None,
            preempted, step,
        )

    def build_step_arrays(
        self,
        request_ids: IdsLike,
        num_computed_tokens: IdsLike,
        num_scheduled_tokens: IdsLike,
        num_tokens: IdsLike,
        n_new_block_ids: IdsLike,
        new_block_ids: IdsLike = (),
        resumed: Optional[KeysLike] = None,
        preempted: IdsLike = (),
        step: Optional[Step] = None,
    ) -> Step:
        """:meth:`build_step` with the scheduled batch as arrays (one library call, no Python
        work per request): request ``i`` is ``request_ids[i]`` with its token counts, the next
        ``n_new_block_ids[i]`` ids of ``new_block_ids`` (all requests' new block ids back to
        back) and ``resumed[i]``. The id and count arguments are ``uint64`` buffers
        (``array('Q')``, numpy ``uint64``) or lists, ``new_block_ids`` a ``uint32`` buffer or
        list, ``resumed`` None (none resumed) or a bytes-like of 0/1 per request, ``preempted``
        request ids. Raises as :meth:`build_step` (ValueError when the arrays' lengths differ).
        """
        h = self._h
        if h is None:
            raise self._closed_error()
        if step is not None and not isinstance(step, Step):
            raise TypeError(f"step: expected a Step, got {type(step).__name__}")
        rid, n, k0 = u64_arg(request_ids, "request_ids")
        computed, n1, k1 = u64_arg(num_computed_tokens, "num_computed_tokens")
        sched, n2, k2 = u64_arg(num_scheduled_tokens, "num_scheduled_tokens")
        tokens, n3, k3 = u64_arg(num_tokens, "num_tokens")
        counts, n4, k4 = u64_arg(n_new_block_ids, "n_new_block_ids")
        blocks, nb, k5 = u32_arg(new_block_ids, "new_block_ids")
        for name, m in (("num_computed_tokens", n1), ("num_scheduled_tokens", n2),
                        ("num_tokens", n3), ("n_new_block_ids", n4)):
            if m != n:
                raise ValueError(f"{name}: {m} entries for {n} request_ids")
        if resumed is None:
            res, k6 = None, None
        else:
            res, nr, k6 = keys_arg(resumed, 1, "resumed")
            if nr != n:
                raise ValueError(f"resumed: {nr} entries for {n} request_ids")
        pre, npre, k7 = u64_arg(preempted, "preempted")
        out = Step() if step is None else step
        oh = out._h
        if oh is None:
            raise out._closed_error()
        st = _build_step_arrays(
            h, n, rid, computed, sched, tokens, counts, blocks, nb, res, pre, npre, oh
        )
        if st:
            err = _failure(st)
            if step is None:
                out.close()
            raise err
        return out

    def complete_jobs(self, reports: Any) -> None:
        """Counts worker reports: each a :class:`JobReport`, a ``(job_id, count, success)``
        tuple, or a bare job id (one successful report). A job completes once ``num_workers``
        reports arrived (failed if any failed).

        Raises :class:`NotFoundError` for a job not in flight, :class:`InvalidArgumentError` for
        a zero count or more reports than workers; then no report is applied.
        """
        h = self._h
        if h is None:
            raise self._closed_error()
        words = getattr(reports, "_report_words", None)
        if words is not None:  # a Worker.poll() answer: one successful-or-failed report each
            arr, n = words()
            st = _complete_jobs(h, arr.buffer_info()[0] if n else None, n)
            if st:
                raise _failure(st)
            return
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
        st = _complete_jobs(h, _addressof(arr) if n else None, n)
        if st:
            raise _failure(st)

    def finish_request(self, request_id: int) -> None:
        """Finishes or aborts a request (its state is kept until its jobs complete).

        Raises :class:`NotFoundError` for an unknown request, :class:`InvalidStateError` if it
        was already finished.
        """
        h = self._h
        if h is None:
            raise self._closed_error()
        st = _finish_request(h, _u64("request_id", request_id))
        if st:
            raise _failure(st)

    def load_failure(self, request_id: int) -> Optional[Recompute]:
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

    def reset(self) -> None:
        """Drops the whole tier: in-flight jobs go into the next step's flush set and their
        later reports are ignored. Raises :class:`InvalidStateError` while load jobs made since
        the last step are not in a step yet."""
        lib.kvo_scheduler_reset(self._handle())

    def take_events(self) -> List[Event]:
        """Takes the tier's buffered events, oldest first (empty unless ``enable_events``)."""
        return _take_events(lib.kvo_scheduler_take_events, self._handle(), self.key_len)

    def stats(self) -> SchedulerStats:
        """Counters and gauges, with the tier's stats as ``manager``: the struct the library
        filled (one read; ``as_dict()`` on demand)."""
        h = self._h
        if h is None:
            raise self._closed_error()
        s = SchedulerStats._empty()
        st = _get_stats(h, _addressof(s))
        if st:
            raise _failure(st)
        return s

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

    def check_invariants(self) -> None:
        """Recounts the scheduler's and tier's state; raises :class:`InternalError` naming a
        broken invariant."""
        lib.kvo_scheduler_check_invariants(self._handle())

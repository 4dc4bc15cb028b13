"""The worker side of KV offloading (``kvo_worker_*``): block copies between registered KV
tensors and the host tier.

    import kvoffload
    from kvoffload import KvTensor, JobKind

    kv = [KvTensor(base=k_ptr, num_blocks=1024, block_stride=stride, page_size=page,
                   on_device=True)]
    with kvoffload.Worker(kv, num_host_slots=4096, block_size_factor=2, backend="cuda") as w:
        w.submit_step(kvoffload.Step.decode(data))      # the plan the scheduler sent
        w.wait(step_flush_ids)                          # before the forward pass
        for c in w.poll():                              # report back to the scheduler
            reports.append((c.job_id, 1, c.success))

Tensor memory stays the caller's and must outlive the worker (a :class:`KvTensor` may carry a
``keepalive`` object, kept referenced until the worker is freed). Host tier buffers are
allocated by the library, or given as ``host_buffers`` (writable Python buffers, kept alive for
the worker's lifetime, or ``(address, length)`` pairs the caller keeps valid).

Every job id and block id is a non-negative ``int`` (TypeError for another type, ValueError out
of range, naming the argument); block id lists may also be ``uint32`` buffers (``array('I')``,
numpy). :meth:`Worker.poll` answers :class:`Completions` (one buffer the library filled).
Library failures raise the :class:`KvoError` subclass of their status with the library's
message.
"""

import ctypes
import dataclasses
import weakref
from array import array
from collections.abc import Sequence
from typing import Any, Dict, NamedTuple, Optional, Tuple, Union

from . import _ffi, _metrics
from ._common import _MAX_U32, _MAX_U64, _Handle, _uint
from ._ffi import Backend, JobKind, lib
from ._buffers import IdsLike, u32_arg, u64_arg
from ._scheduler import Step, _seq, _u64

_fast = _ffi.fast
_failure = _ffi.failure
_addressof = ctypes.addressof
_submit_job = _fast["kvo_worker_submit_job"]
_submit_step = _fast["kvo_worker_submit_step"]
_submit_stores = _fast["kvo_worker_submit_stores"]
_poll = _fast["kvo_worker_poll"]
_job_error_fn = _fast["kvo_worker_job_error"]
_wait = _fast["kvo_worker_wait"]
_swap_blocks = _fast["kvo_worker_swap_blocks"]
_shutdown = _fast["kvo_worker_shutdown"]
_NOT_FOUND = int(_ffi.Status.NOT_FOUND)
_Out = ctypes.c_uint64 * 2
#: Completions asked of the library per call: no larger array is allocated up front, and the
#: messages of a call's failed jobs are read right after it (the library keeps the last 1024).
_POLL_CHUNK = 1024
_POLL_FIRST = 64
#: uint32 words per ``kvo_completion`` (job_id 0-1, bytes 2-3, seconds 4-5, success 6).
_WORDS = ctypes.sizeof(_ffi.kvo_completion) // 4
assert _WORDS == 8
_ZERO_WORDS = array("I", bytes(4 * _WORDS * _POLL_CHUNK))
_new = object.__new__

__all__ = ["KvTensor", "Completion", "Completions", "Worker", "cuda_available"]

_BACKENDS = {"host": Backend.HOST, "cuda": Backend.CUDA}
_KINDS = {"load": JobKind.LOAD, "store": JobKind.STORE}
_KIND_CODES = {JobKind.LOAD: 0, JobKind.STORE: 1, "load": 0, "store": 1}
_MIN_I32, _MAX_I32 = -(2**31), 2**31 - 1


def cuda_available() -> bool:
    """True when a CUDA driver and device are usable (``kvo_cuda_available``). Never raises."""
    return bool(lib.kvo_cuda_available())


@dataclasses.dataclass(frozen=True)
class KvTensor:
    """One registered KV tensor (``kvo_kv_tensor``): ``num_blocks`` pages of ``page_size`` bytes,
    ``block_stride`` bytes apart from address ``base`` (device memory when ``on_device``).

    ``keepalive``: any object the worker keeps referenced until it is freed (for instance the
    Python buffer behind ``base``); not part of equality.
    """

    base: int
    num_blocks: int
    block_stride: int
    page_size: int
    on_device: bool = False
    keepalive: Any = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_buffer(
        cls, buf: Any, num_blocks: int, block_stride: int, page_size: int, offset: int = 0
    ) -> "KvTensor":
        """A host tensor over a writable Python buffer (``bytearray``, ``ctypes`` array,
        ``mmap``, ...) starting ``offset`` bytes in; the buffer is kept alive by the worker.

        Raises TypeError for a read-only or non-buffer object, ValueError when the blocks do not
        fit in it.
        """
        view, address, length = _writable(buf, "buf")
        num_blocks = _uint("num_blocks", num_blocks, _MAX_U32)
        block_stride = _uint("block_stride", block_stride, _MAX_U64)
        page_size = _uint("page_size", page_size, _MAX_U64)
        offset = _uint("offset", offset, _MAX_U64)
        end = offset + (max(num_blocks, 1) - 1) * block_stride + page_size
        if end > length:
            raise ValueError(
                f"buf: {length} bytes, {end} needed for {num_blocks} blocks of stride "
                f"{block_stride} and page {page_size} from offset {offset}"
            )
        return cls(address + offset, num_blocks, block_stride, page_size, False, view)


class Completion(NamedTuple):
    """A finished job (``kvo_completion``); ``error`` is the library's message for a failed
    job, else None."""

    job_id: int
    success: bool
    bytes: int
    seconds: float
    error: Optional[str] = None


class Completions(Sequence):
    """The answer of :meth:`Worker.poll`: the ``kvo_completion`` records the library wrote, held
    in one buffer (no Python object per completion until one is asked for). Indexing gives a
    :class:`Completion`; ``job_ids`` / ``success`` give all ids / success flags as arrays;
    ``errors`` maps each failed job's id to its message. Pass it to
    :meth:`Scheduler.complete_jobs` as it is (one report per completion). Equal to a list of
    the same :class:`Completion` values."""

    __slots__ = ("_words", "errors")

    def __init__(self, words=None, errors=None):
        self._words = array("I") if words is None else words
        #: ``{job_id: message}`` of the failed jobs.
        self.errors: Dict[int, str] = {} if errors is None else errors

    def __len__(self):
        return len(self._words) // _WORDS

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("Completions index out of range")
        c = _ffi.kvo_completion.from_buffer_copy(self._words, 4 * _WORDS * i)
        ok = c.success != 0
        return Completion(c.job_id, ok, c.bytes, c.seconds, None if ok else self.errors.get(
            c.job_id, ""))

    def __eq__(self, other):
        if isinstance(other, Completions):
            return self._words == other._words and self.errors == other.errors
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self):
        return f"<kvoffload.Completions {len(self)} jobs, {len(self.errors)} failed>"

    @property
    def job_ids(self) -> array:
        """The job ids, in poll order (``array('Q')``)."""
        w = self._words
        pairs = array("I", bytes(8 * len(self)))
        pairs[0::2] = w[0::_WORDS]
        pairs[1::2] = w[1::_WORDS]
        return array("Q", pairs.tobytes())

    @property
    def success(self) -> array:
        """1 for each job that succeeded, 0 for each that failed (``array('I')``)."""
        return self._words[6::_WORDS]

    def _report_words(self):
        """The completions as ``kvo_job_report`` records (``count`` 1) in an ``array('I')``,
        and their number."""
        w, n = self._words, len(self)
        r = array("I", bytes(16 * n))
        r[0::4] = w[0::_WORDS]
        r[1::4] = w[1::_WORDS]
        r[2::4] = array("I", [1]) * n
        r[3::4] = w[6::_WORDS]
        return r, n


class _Lifetime:
    """Owns a worker's native handle: the worker is freed when the last reference goes, the
    :class:`Worker`'s own (dropped by ``close()``) or one held by a view of its host tier."""

    __slots__ = ("__weakref__",)


def _writable(buf, name) -> Tuple[Any, int, int]:
    """A ctypes view of a writable buffer (holding it exported), its address and length."""
    try:
        n = memoryview(buf).nbytes
    except TypeError:
        raise TypeError(f"{name}: expected a writable buffer, got {type(buf).__name__}") from None
    try:
        view = (ctypes.c_char * n).from_buffer(buf)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: expected a writable contiguous buffer ({e})") from None
    return view, ctypes.addressof(view), n


def _backend(value):
    if isinstance(value, str):
        try:
            return int(_BACKENDS[value.lower()])
        except KeyError:
            raise ValueError(f"backend: {value!r} is not one of {sorted(_BACKENDS)}") from None
    # Unknown numbers go through: the library refuses them, naming the argument.
    return _uint("backend", int(value) if isinstance(value, Backend) else value, _MAX_U32)


def _kind(value):
    if isinstance(value, str):
        try:
            return int(_KINDS[value.lower()])
        except KeyError:
            raise ValueError(f"kind: {value!r} is not one of {sorted(_KINDS)}") from None
    return _uint("kind", int(value) if isinstance(value, JobKind) else value, _MAX_U32)


def _free(ptr, keep):
    """The finalizer: frees the worker, then drops the memory it was using (``keep``)."""
    lib.kvo_worker_free(ptr)
    keep.clear()


#: Upper bounds in bytes of :attr:`TransferStats.size_buckets` (vLLM's; the last bucket has none).
SIZE_BUCKET_BOUNDS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)


@dataclasses.dataclass(frozen=True)
class TransferStats:
    """A worker's counters for one direction (``kvo_transfer_stats``): jobs finished (failed
    ones included), failed jobs, bytes and copy seconds of the jobs that succeeded, and their
    sizes per bucket (not cumulative; bounds :data:`SIZE_BUCKET_BOUNDS`, then one bucket above)."""

    jobs: int
    failed_jobs: int
    bytes: int
    seconds: float
    size_buckets: Tuple[int, ...]

    @classmethod
    def _from_c(cls, t) -> "TransferStats":
        return cls(t.jobs, t.failed_jobs, t.bytes, t.seconds, tuple(t.size_buckets))


@dataclasses.dataclass(frozen=True)
class WorkerStats:
    """A worker's stats (``kvo_worker_stats``): loads (host tier to KV tensors), stores (the
    other way; ``swap_blocks`` copies count by their destination) and jobs not yet polled."""

    load: TransferStats
    store: TransferStats
    jobs_in_flight: int


class Worker(_Handle):
    """Block copies between registered KV tensors and the host tier (``kvo_worker``): executes
    the load and store jobs of step plans, reports completions by polling (per direction in
    submission order), waits for listed jobs.

    ``tensors``: a sequence of :class:`KvTensor`; ``num_host_slots`` and ``block_size_factor``
    as the scheduler's; ``threads``: threads the host backend may use for one large job;
    ``backend``: ``"host"`` (memcpy; every tensor in host memory) or ``"cuda"`` (device
    ``device``; raises :class:`CudaUnavailableError` without a driver or device);
    ``host_buffers``: None (the library allocates them) or one per tensor, each a writable
    Python buffer or an ``(address, length)`` pair, at least ``num_host_slots * page_size *
    block_size_factor`` bytes.

    Calls on one worker are serialized by the library, so it may be shared between threads;
    :meth:`close` must not race with other calls on it.
    """

    def __init__(
        self,
        tensors,
        num_host_slots,
        block_size_factor=1,
        threads=4,
        backend="host",
        device=0,
        host_buffers=None,
    ):
        tensors = _seq("tensors", tensors)
        cfg = _ffi.kvo_worker_config()
        lib.kvo_worker_config_default(ctypes.byref(cfg))
        cfg.num_host_slots = _uint("num_host_slots", num_host_slots, _MAX_U32)
        cfg.block_size_factor = _uint("block_size_factor", block_size_factor, _MAX_U32)
        cfg.threads = _uint("threads", threads, _MAX_U32)
        cfg.backend = _backend(backend)
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"device: expected an int, got {type(device).__name__}")
        if not _MIN_I32 <= device <= _MAX_I32:
            raise ValueError(f"device: {device} is not an int32")
        cfg.device = device

        keep = []  # memory the worker uses, alive until it is freed
        n = len(tensors)
        arr = (_ffi.kvo_kv_tensor * n)() if n else None
        for i, t in enumerate(tensors):
            if not isinstance(t, KvTensor):
                raise TypeError(f"tensors[{i}]: expected a KvTensor, got {type(t).__name__}")
            c = arr[i]
            c.base = _uint(f"tensors[{i}].base", t.base, _MAX_U64)
            c.num_blocks = _uint(f"tensors[{i}].num_blocks", t.num_blocks, _MAX_U32)
            c.block_stride = _uint(f"tensors[{i}].block_stride", t.block_stride, _MAX_U64)
            c.page_size = _uint(f"tensors[{i}].page_size", t.page_size, _MAX_U64)
            c.on_device = 1 if t.on_device else 0
            if t.keepalive is not None:
                keep.append(t.keepalive)

        hb = None
        if host_buffers is not None:
            bufs = _seq("host_buffers", host_buffers)
            if len(bufs) != n:
                raise ValueError(f"host_buffers: {len(bufs)} buffers for {n} tensors")
            hb = (_ffi.kvo_host_buffer * n)() if n else None
            for i, b in enumerate(bufs):
                if isinstance(b, tuple):
                    if len(b) != 2:
                        raise ValueError(f"host_buffers[{i}]: expected (address, length)")
                    address = _uint(f"host_buffers[{i}].address", b[0], _MAX_U64)
                    length = _uint(f"host_buffers[{i}].length", b[1], _MAX_U64)
                else:
                    view, address, length = _writable(b, f"host_buffers[{i}]")
                    keep.append(view)
                hb[i].ptr = address
                hb[i].len = length

        ptr = ctypes.POINTER(_ffi._Worker)()
        lib.kvo_worker_new(ctypes.byref(cfg), arr, n, hb, ctypes.byref(ptr))
        self._ptr = ptr
        self._h = ctypes.cast(ptr, ctypes.c_void_p).value
        self._life = _Lifetime()
        self._finalizer = weakref.finalize(self._life, _free, ptr, keep)
        self.num_tensors = n
        self.num_host_slots = cfg.num_host_slots
        self.block_size_factor = cfg.block_size_factor
        self.backend = Backend(cfg.backend)
        self.device = cfg.device

    def close(self) -> None:
        """Finishes the jobs in flight and frees the worker and its host tier, at once or, while
        views from :meth:`host_buffer` (or slices of them) are still referenced, when the last
        of them goes: no view can outlive the memory it shows. Safe to call more than once."""
        h = self._h
        self._ptr = None
        self._h = None
        self._life = None  # the last reference unless a host-tier view holds one
        if h is not None and self._finalizer.alive:
            _shutdown(h)  # finish the jobs now, take no new ones; its status is not an error here

    def __repr__(self):
        state = "closed" if self.closed else f"{self.num_host_slots} host slots"
        return (
            f"<kvoffload.Worker {self.backend.name.lower()} {self.num_tensors} tensors "
            f"block_size_factor={self.block_size_factor} {state}>"
        )

    # -- jobs -----------------------------------------------------------------------------------

    def submit_job(
        self,
        job_id: int,
        kind: Union[JobKind, int, str],
        src: IdsLike,
        dst: IdsLike,
        block_index: int = 0,
        compute_stream: int = 0,
    ) -> None:
        """Submits one job. ``kind``: :class:`JobKind` (or ``"load"`` / ``"store"``); ``src`` /
        ``dst``: host slots → GPU blocks for a load, GPU blocks → host slots for a store (each a
        ``uint32`` buffer such as ``array('I')`` or a list of ints); ``block_index``: logical
        index of the first GPU block (``% block_size_factor`` sub-blocks of the first slot are
        skipped); ``compute_stream``: a CUDA stream handle stores wait for (0: none).

        Block ids that do not fit the registration make the job fail at :meth:`poll` (with the
        reason in :attr:`Completion.error`). Raises :class:`InvalidStateError` for a job id in
        flight or after :meth:`shutdown`, :class:`InvalidArgumentError` for an unknown kind.
        """
        h = self._h
        if h is None:
            raise self._closed_error()
        try:
            k = _KIND_CODES[kind] if type(kind) is not bool else None
        except (KeyError, TypeError):
            k = None
        if k is None:
            k = _kind(kind)
        s, ns, keep_s = u32_arg(src, "src")
        d, nd, keep_d = u32_arg(dst, "dst")
        if type(job_id) is not int or not 0 <= job_id <= _MAX_U64:
            job_id = _uint("job_id", job_id, _MAX_U64)
        if type(block_index) is not int or not 0 <= block_index <= _MAX_U32:
            block_index = _uint("block_index", block_index, _MAX_U32)
        if type(compute_stream) is not int or not 0 <= compute_stream <= _MAX_U64:
            compute_stream = _uint("compute_stream", compute_stream, _MAX_U64)
        st = _submit_job(h, job_id, k, s, ns, d, nd, block_index, compute_stream)
        if st:
            raise _failure(st)

    def submit_step(self, step: Step, compute_stream: int = 0) -> None:
        """Executes a :class:`Step` (from :meth:`Scheduler.build_step` or :meth:`Step.decode`)
        before its forward pass: submits the previous plan's deferred stores, waits for the
        flush set, submits the loads, and defers the plan's stores (they read what this step's
        forward pass writes) to the next :meth:`submit_step`, :meth:`submit_stores`, or a
        :meth:`wait` naming one. Raises :class:`InvalidArgumentError` if the plan's
        block_size_factor differs from the worker's, :class:`InvalidStateError` if one of its
        job ids is in flight or after :meth:`shutdown` (then nothing is submitted)."""
        h = self._h
        if h is None:
            raise self._closed_error()
        if not isinstance(step, Step):
            raise TypeError(f"step: expected a Step, got {type(step).__name__}")
        sh = step._h
        if sh is None:
            raise step._closed_error()
        st = _submit_step(h, sh, _u64("compute_stream", compute_stream))
        if st:
            raise _failure(st)

    def submit_stores(self) -> None:
        """Submits the stores deferred from the last plan now (once its forward pass has been
        issued, when no further plan follows soon). Raises :class:`InvalidStateError` after
        :meth:`shutdown`."""
        h = self._h
        if h is None:
            raise self._closed_error()
        st = _submit_stores(h)
        if st:
            raise _failure(st)

    def poll(self, max: int = 256) -> Completions:  # noqa: A002  (the documented name)
        """Up to ``max`` finished jobs (per direction in submission order) as
        :class:`Completions`; the rest stay for the next call. Failed ones carry the library's
        message (``errors``, and :attr:`Completion.error`)."""
        h = self._h
        if h is None:
            raise self._closed_error()
        cap = max if type(max) is int and 0 <= max <= _MAX_U64 else _uint("max", max, _MAX_U64)
        got_out = _Out()
        ga = _addressof(got_out)
        # Small first: an idle poll allocates little; the chunks grow while calls come back full.
        room = cap if cap < _POLL_FIRST else _POLL_FIRST
        words = _ZERO_WORDS[: _WORDS * room]
        errors = {}
        n = 0
        while True:
            st = _poll(h, words.buffer_info()[0] + 4 * _WORDS * n, room, ga)
            if st:
                raise _failure(st)
            got = got_out[0]
            if got:
                flags = words[_WORDS * n + 6 : _WORDS * (n + got) : _WORDS]
                if flags.count(1) != got:  # read the failed jobs' messages now
                    for i, ok in enumerate(flags):
                        if not ok:
                            c = _ffi.kvo_completion.from_buffer_copy(words, 4 * _WORDS * (n + i))
                            errors[c.job_id] = self._job_error(h, c.job_id)
            n += got
            if got < room or n == cap:
                break
            room = min(cap - n, 4 * room, _POLL_CHUNK)
            words.extend(_ZERO_WORDS[: _WORDS * room])
        del words[_WORDS * n :]
        out = _new(Completions)
        out._words = words
        out.errors = errors
        return out

    def _job_error(self, h, job_id):
        need = _Out()
        st = _job_error_fn(h, job_id, None, 0, _addressof(need))
        if st == _NOT_FOUND:
            return ""
        if st:
            raise _failure(st)
        buf = ctypes.create_string_buffer(need[0] + 1)
        st = _job_error_fn(h, job_id, _addressof(buf), len(buf), _addressof(need))
        if st:
            raise _failure(st)
        return buf.value.decode("utf-8", "replace")

    def wait(self, job_ids: Union[int, IdsLike], timeout_ms: Optional[int] = None) -> None:
        """Blocks until every listed job has finished (the flush before a forward pass); their
        completions stay for :meth:`poll`. ``job_ids``: a sequence of ids (or one id);
        ``timeout_ms``: None waits without limit.

        Raises :class:`NotFoundError` for an id never submitted or already polled,
        :class:`KvoTimeoutError` when the time runs out first.
        """
        h = self._h
        if h is None:
            raise self._closed_error()
        if hasattr(job_ids, "__index__") and not isinstance(job_ids, bool):
            job_ids = [job_ids]
        ids, n, keep = u64_arg(job_ids, "job_ids")
        t = _MAX_U64 if timeout_ms is None else _uint("timeout_ms", timeout_ms, _MAX_U64)
        st = _wait(h, ids, n, t)
        if st:
            raise _failure(st)

    def swap_blocks(
        self,
        src_tensor: int,
        dst_tensor: int,
        src_blocks: IdsLike,
        dst_blocks: IdsLike,
        job_id: Optional[int] = None,
    ) -> None:
        """Copies block ``src_blocks[i]`` of tensor ``src_tensor`` to block ``dst_blocks[i]`` of
        tensor ``dst_tensor`` (indices into the registration, equal page sizes). Without
        ``job_id`` it runs now; with one it is queued and reported by :meth:`poll`.

        Raises :class:`InvalidArgumentError` for tensor indices, block ids or page sizes that do
        not fit, :class:`InvalidStateError` for a job id in flight or after :meth:`shutdown`.
        """
        h = self._h
        if h is None:
            raise self._closed_error()
        st = _uint("src_tensor", src_tensor, _MAX_U32)
        dt = _uint("dst_tensor", dst_tensor, _MAX_U32)
        s, ns, keep_s = u32_arg(src_blocks, "src_blocks")
        d, nd, keep_d = u32_arg(dst_blocks, "dst_blocks")
        if ns != nd:
            raise ValueError(f"dst_blocks: {nd} ids for {ns} src_blocks")
        jid = 0 if job_id is None else _uint("job_id", job_id, _MAX_U64)
        status = _swap_blocks(h, st, dt, s, d, ns, 0 if job_id is None else 1, jid)
        if status:
            raise _failure(status)

    # -- host tier ------------------------------------------------------------------------------

    def host_buffer_address(self, tensor: int) -> Tuple[int, int]:
        """``(address, length)`` of tensor ``tensor``'s host tier buffer (valid until
        :meth:`close`). Slot ``s``, sub-block ``j`` starts at ``address + s * page_size *
        block_size_factor + j * page_size``."""
        h = self._handle()
        t = _uint("tensor", tensor, _MAX_U32)
        p = ctypes.c_void_p()
        n = ctypes.c_size_t()
        lib.kvo_worker_get_host_buffer(h, t, ctypes.byref(p), ctypes.byref(n))
        return p.value or 0, n.value

    def host_buffer(self, tensor: int) -> memoryview:
        """Tensor ``tensor``'s host tier buffer as a writable byte memoryview. The view (and
        every slice of it) keeps the tier alive: after :meth:`close` the memory is freed only
        once the last of them is gone."""
        address, n = self.host_buffer_address(tensor)
        mem = (ctypes.c_char * n).from_address(address)
        mem.lifetime = self._life  # views hold `mem`, `mem` holds the worker
        return memoryview(mem).cast("B")

    def stats(self) -> WorkerStats:
        """Counters per direction and jobs in flight (``kvo_worker_get_stats``)."""
        h = self._handle()
        s = _ffi.kvo_worker_stats()
        s.struct_size = ctypes.sizeof(s)
        lib.kvo_worker_get_stats(h, ctypes.byref(s))
        return WorkerStats(
            load=TransferStats._from_c(s.load),
            store=TransferStats._from_c(s.store),
            jobs_in_flight=s.jobs_in_flight,
        )

    def metrics_text(self, prefix, labels=None) -> str:
        """The worker's stats as Prometheus text (``kvo_worker_metrics_text``): every
        name ``<prefix>_<name>`` (vLLM's prefix: ``"vllm:kv_offload"``), every sample with the
        constant ``labels`` (a dict of str, in order). README.md lists the metrics."""
        return _metrics.metrics_text(
            lib.kvo_worker_metrics_text, self._handle(), prefix, labels
        )

    def metrics(self, prefix, labels=None) -> dict:
        """The same metrics as plain dicts, ``{family: {"type", "help", "samples"}}`` with
        ``samples`` a list of ``(name, labels, value)``: what a ``prometheus_client`` custom
        collector yields as ``Metric(family, help, type)`` with ``add_sample`` per sample."""
        return _metrics.parse(self.metrics_text(prefix, labels))

    def shutdown(self) -> None:
        """Finishes every job in flight, then refuses new submissions
        (:class:`InvalidStateError`). Completions stay pollable."""
        lib.kvo_worker_shutdown(self._handle())

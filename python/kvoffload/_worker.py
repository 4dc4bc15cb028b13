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
of range, naming the argument). Library failures raise the :class:`KvoError` subclass of their
status with the library's message.
"""

import ctypes
import dataclasses
import weakref
from typing import Any, List, NamedTuple, Optional, Tuple

from . import _ffi, _metrics
from ._common import _MAX_U32, _MAX_U64, _Handle, _uint
from ._ffi import Backend, JobKind, NotFoundError, lib
from ._scheduler import Step, _seq, _u32_array

__all__ = ["KvTensor", "Completion", "Worker", "cuda_available"]

_BACKENDS = {"host": Backend.HOST, "cuda": Backend.CUDA}
_KINDS = {"load": JobKind.LOAD, "store": JobKind.STORE}
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
    def from_buffer(cls, buf, num_blocks, block_stride, page_size, offset=0) -> "KvTensor":
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
        self._views = []
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
        self._own(ptr, _free, keep)
        self.num_tensors = n
        self.num_host_slots = cfg.num_host_slots
        self.block_size_factor = cfg.block_size_factor
        self.backend = Backend(cfg.backend)
        self.device = cfg.device

    def close(self):
        """Finishes the jobs in flight, frees the worker and its host tier. Memoryviews from
        :meth:`host_buffer` are released. Safe to call more than once."""
        for ref in self._views:
            view = ref()
            if view is not None:
                try:
                    view.release()
                except BufferError:  # exported further by the caller: its problem now
                    pass
        self._views = []
        super().close()

    def __repr__(self):
        state = "closed" if self.closed else f"{self.num_host_slots} host slots"
        return (
            f"<kvoffload.Worker {self.backend.name.lower()} {self.num_tensors} tensors "
            f"block_size_factor={self.block_size_factor} {state}>"
        )

    # -- jobs -----------------------------------------------------------------------------------

    def submit_job(self, job_id, kind, src, dst, block_index=0, compute_stream=0):
        """Submits one job. ``kind``: :class:`JobKind` (or ``"load"`` / ``"store"``); ``src`` /
        ``dst``: host slots → GPU blocks for a load, GPU blocks → host slots for a store;
        ``block_index``: logical index of the first GPU block (``% block_size_factor``
        sub-blocks of the first slot are skipped); ``compute_stream``: a CUDA stream handle
        stores wait for (0: none).

        Block ids that do not fit the registration make the job fail at :meth:`poll` (with the
        reason in :attr:`Completion.error`). Raises :class:`InvalidStateError` for a job id in
        flight or after :meth:`shutdown`, :class:`InvalidArgumentError` for an unknown kind.
        """
        h = self._handle()
        jid = _uint("job_id", job_id, _MAX_U64)
        k = _kind(kind)
        s, ns = _u32_array("src", src)
        d, nd = _u32_array("dst", dst)
        bi = _uint("block_index", block_index, _MAX_U32)
        cs = _uint("compute_stream", compute_stream, _MAX_U64)
        lib.kvo_worker_submit_job(h, jid, k, s, ns, d, nd, bi, cs)

    def submit_step(self, step, compute_stream=0):
        """Executes a :class:`Step` (from :meth:`Scheduler.build_step` or :meth:`Step.decode`)
        before its forward pass: submits the previous plan's deferred stores, waits for the
        flush set, submits the loads, and defers the plan's stores (they read what this step's
        forward pass writes) to the next :meth:`submit_step`, :meth:`submit_stores`, or a
        :meth:`wait` naming one. Raises :class:`InvalidArgumentError` if the plan's
        block_size_factor differs from the worker's, :class:`InvalidStateError` if one of its
        job ids is in flight or after :meth:`shutdown` (then nothing is submitted)."""
        h = self._handle()
        if not isinstance(step, Step):
            raise TypeError(f"step: expected a Step, got {type(step).__name__}")
        cs = _uint("compute_stream", compute_stream, _MAX_U64)
        lib.kvo_worker_submit_step(h, step._handle(), cs)

    def submit_stores(self):
        """Submits the stores deferred from the last plan now (once its forward pass has been
        issued, when no further plan follows soon). Raises :class:`InvalidStateError` after
        :meth:`shutdown`."""
        lib.kvo_worker_submit_stores(self._handle())

    def poll(self, max=256) -> List[Completion]:  # noqa: A002  (the documented name)
        """Up to ``max`` finished jobs (per direction in submission order); the rest stay for
        the next call. Failed ones carry the library's message in ``error``."""
        h = self._handle()
        cap = _uint("max", max, 2**31 - 1)
        if cap == 0:
            return []
        out = (_ffi.kvo_completion * cap)()
        n = ctypes.c_size_t()
        lib.kvo_worker_poll(h, out, cap, ctypes.byref(n))
        done = []
        for c in out[: n.value]:
            error = None if c.success else self._job_error(h, c.job_id)
            done.append(Completion(c.job_id, bool(c.success), c.bytes, c.seconds, error))
        return done

    def _job_error(self, h, job_id):
        need = ctypes.c_size_t()
        try:
            lib.kvo_worker_job_error(h, job_id, None, 0, ctypes.byref(need))
            buf = ctypes.create_string_buffer(need.value + 1)
            lib.kvo_worker_job_error(h, job_id, buf, len(buf), ctypes.byref(need))
        except NotFoundError:
            return ""
        return buf.value.decode("utf-8", "replace")

    def wait(self, job_ids, timeout_ms=None):
        """Blocks until every listed job has finished (the flush before a forward pass); their
        completions stay for :meth:`poll`. ``job_ids``: a sequence of ids (or one id);
        ``timeout_ms``: None waits without limit.

        Raises :class:`NotFoundError` for an id never submitted or already polled,
        :class:`KvoTimeoutError` when the time runs out first.
        """
        h = self._handle()
        if hasattr(job_ids, "__index__") and not isinstance(job_ids, bool):
            job_ids = [job_ids]
        ids = [_uint(f"job_ids[{i}]", j, _MAX_U64) for i, j in enumerate(_seq("job_ids", job_ids))]
        t = _MAX_U64 if timeout_ms is None else _uint("timeout_ms", timeout_ms, _MAX_U64)
        arr = (ctypes.c_uint64 * len(ids))(*ids) if ids else None
        lib.kvo_worker_wait(h, arr, len(ids), t)

    def swap_blocks(self, src_tensor, dst_tensor, src_blocks, dst_blocks, job_id=None):
        """Copies block ``src_blocks[i]`` of tensor ``src_tensor`` to block ``dst_blocks[i]`` of
        tensor ``dst_tensor`` (indices into the registration, equal page sizes). Without
        ``job_id`` it runs now; with one it is queued and reported by :meth:`poll`.

        Raises :class:`InvalidArgumentError` for tensor indices, block ids or page sizes that do
        not fit, :class:`InvalidStateError` for a job id in flight or after :meth:`shutdown`.
        """
        h = self._handle()
        st = _uint("src_tensor", src_tensor, _MAX_U32)
        dt = _uint("dst_tensor", dst_tensor, _MAX_U32)
        s, ns = _u32_array("src_blocks", src_blocks)
        d, nd = _u32_array("dst_blocks", dst_blocks)
        if ns != nd:
            raise ValueError(f"dst_blocks: {nd} ids for {ns} src_blocks")
        jid = 0 if job_id is None else _uint("job_id", job_id, _MAX_U64)
        lib.kvo_worker_swap_blocks(h, st, dt, s, d, ns, 0 if job_id is None else 1, jid)

    # -- host tier ------------------------------------------------------------------------------

    def host_buffer_address(self, tensor) -> Tuple[int, int]:
        """``(address, length)`` of tensor ``tensor``'s host tier buffer (valid until
        :meth:`close`). Slot ``s``, sub-block ``j`` starts at ``address + s * page_size *
        block_size_factor + j * page_size``."""
        h = self._handle()
        t = _uint("tensor", tensor, _MAX_U32)
        p = ctypes.c_void_p()
        n = ctypes.c_size_t()
        lib.kvo_worker_get_host_buffer(h, t, ctypes.byref(p), ctypes.byref(n))
        return p.value or 0, n.value

    def host_buffer(self, tensor) -> memoryview:
        """Tensor ``tensor``'s host tier buffer as a writable byte memoryview. It is released
        by :meth:`close`; do not keep other views of its memory past that."""
        address, n = self.host_buffer_address(tensor)
        view = memoryview((ctypes.c_char * n).from_address(address)).cast("B")
        self._views = [r for r in self._views if r() is not None]
        self._views.append(weakref.ref(view))
        return view

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

    def shutdown(self):
        """Finishes every job in flight, then refuses new submissions
        (:class:`InvalidStateError`). Completions stay pollable."""
        lib.kvo_worker_shutdown(self._handle())

"""Python bindings of kvoffload (ctypes, no third-party dependency).

    import kvoffload

    k1, k2 = (1).to_bytes(8, "big"), (2).to_bytes(8, "big")
    with kvoffload.Manager(num_slots=4, key_len=8) as m:
        plan = m.prepare_store([k1, k2])  # reserve host slots; the stores are in flight
        m.complete_store([k1, k2])        # the copies finished: k1 and k2 are ready
        assert m.lookup(k1) == kvoffload.Lookup.HIT

The scheduler side (:class:`Scheduler`: requests, matching with the deferral rule, load and
store jobs) builds a :class:`Step` plan per engine step; ``Step.encode()`` / ``Step.decode()``
carry it to the workers (:class:`Worker`: block copies between registered KV tensors and the
host tier), whose reports go back through :meth:`Scheduler.complete_jobs`.

The shared library is found through ``KVOFFLOAD_LIB``, then ``<repo>/target/{release,debug}``
(and their ``deps/``), then next to this package. Importing fails with ``ImportError`` when the
library's ABI version is not :data:`ABI_VERSION`.

Every failed library call raises a :class:`KvoError` subclass carrying ``status`` and the
library's message. Keys are ``bytes`` of exactly ``key_len`` bytes.
"""

import ctypes
from typing import List, NamedTuple, Tuple

from . import _ffi, _metrics
from ._ffi import *  # noqa: F401,F403  (constants, enums, errors)
from ._ffi import (
    ABI_VERSION,
    BufferTooSmallError,
    KvoError,
    Lookup,
    NoRoomError,
    Policy,
    lib,
    lib_path,
    version,
)
from ._common import _take_events, _MAX_U32, _Handle, _MAX_U64, _POLICIES, _STATS_FIELDS, Event, ManagerStats, _uint
from ._scheduler import (
    Job,
    JobReport,
    MatchResult,
    Recompute,
    ScheduledRequest,
    Scheduler,
    SchedulerStats,
    Step,
    StepInfo,
)
from ._worker import (
    SIZE_BUCKET_BOUNDS,
    Completion,
    KvTensor,
    TransferStats,
    Worker,
    WorkerStats,
    cuda_available,
)

__all__ = list(_ffi.__all__) + [
    "version",
    "Manager",
    "StorePlan",
    "Event",
    "ManagerStats",
    "Scheduler",
    "SchedulerStats",
    "ScheduledRequest",
    "MatchResult",
    "JobReport",
    "Recompute",
    "Step",
    "StepInfo",
    "Job",
    "Worker",
    "WorkerStats",
    "TransferStats",
    "SIZE_BUCKET_BOUNDS",
    "KvTensor",
    "Completion",
    "cuda_available",
]
__version__ = version()


class StorePlan(NamedTuple):
    """The answer of :meth:`Manager.prepare_store`.

    ``indices``: positions in the keys passed whose stores are now in flight (input order);
    ``slots``: the host slot of each of them; ``evicted``: the keys evicted to make room, in
    eviction order.
    """

    indices: List[int]
    slots: List[int]
    evicted: List[bytes]


class Manager(_Handle):
    """An offload tier index: keys, host slots, eviction (``kvo_manager``).

    Calls on one manager are serialized by the library, so a manager may be shared between
    threads; :meth:`close` must not race with other calls on it.
    """

    def __init__(
        self,
        num_slots,
        key_len=32,
        policy="lru",
        store_threshold=0,
        max_tracker_size=64000,
        enable_events=False,
    ):
        if isinstance(policy, str):
            try:
                policy = _POLICIES[policy.lower()]
            except KeyError:
                raise ValueError(
                    f"policy: {policy!r} is not one of {sorted(_POLICIES)}"
                ) from None
        cfg = _ffi.kvo_manager_config()
        lib.kvo_manager_config_default(ctypes.byref(cfg))
        cfg.num_slots = _uint("num_slots", num_slots, _MAX_U64)
        cfg.key_len = _uint("key_len", key_len, _MAX_U32)
        # Other ints (unknown policy numbers) go through: the library validates them.
        cfg.policy = _uint("policy", int(policy), _MAX_U32)
        cfg.store_threshold = _uint("store_threshold", store_threshold, _MAX_U32)
        cfg.max_tracker_size = _uint("max_tracker_size", max_tracker_size, _MAX_U64)
        cfg.enable_events = 1 if enable_events else 0
        ptr = ctypes.POINTER(_ffi._Manager)()
        lib.kvo_manager_new(ctypes.byref(cfg), ctypes.byref(ptr))
        self._own(ptr, lib.kvo_manager_free)
        self.key_len = cfg.key_len
        self.num_slots = cfg.num_slots
        self.policy = Policy(policy)

    def __repr__(self):
        state = "closed" if self.closed else f"{self.num_slots} slots"
        return f"<kvoffload.Manager {self.policy.name} key_len={self.key_len} {state}>"


    # -- keys -----------------------------------------------------------------------------------

    def _check_key(self, i, key):
        if not isinstance(key, bytes):
            raise ValueError(f"keys[{i}]: expected bytes, got {type(key).__name__}")
        if len(key) != self.key_len:
            raise ValueError(f"keys[{i}]: {len(key)} bytes, key_len is {self.key_len}")

    def _join(self, keys):
        if isinstance(keys, (bytes, bytearray, memoryview, str)):
            raise ValueError("keys: expected a sequence of bytes keys, not one bytes object")
        keys = list(keys)
        for i, k in enumerate(keys):
            self._check_key(i, k)
        return b"".join(keys), len(keys)

    def _split(self, buf, n):
        kl = self.key_len
        return [bytes(buf[i * kl : (i + 1) * kl]) for i in range(n)]

    # -- operations -----------------------------------------------------------------------------

    def lookup(self, key):
        """Looks one key up: :class:`Lookup` ``HIT``, ``MISS`` or ``RETRY`` (store in flight).
        Counts the lookup for the store threshold; does not change recency."""
        h = self._handle()
        self._check_key(0, key)
        out = ctypes.c_uint32()
        lib.kvo_manager_lookup(h, key, ctypes.byref(out))
        return Lookup(out.value)

    def lookup_prefix(self, keys) -> Tuple[int, bool]:
        """Number of leading stored keys, and whether the answer must be retried later
        (a key of that prefix has its store in flight)."""
        h = self._handle()
        buf, n = self._join(keys)
        hits = ctypes.c_size_t()
        retry = ctypes.c_uint32()
        lib.kvo_manager_lookup_prefix(h, buf, n, ctypes.byref(hits), ctypes.byref(retry))
        return hits.value, bool(retry.value)

    def prepare_load(self, keys) -> List[int]:
        """Pins ``keys`` for a load; returns their slots in input order."""
        h = self._handle()
        buf, n = self._join(keys)
        slots = (ctypes.c_uint32 * n)()
        lib.kvo_manager_prepare_load(h, buf, n, slots, n)
        return list(slots)

    def touch(self, keys):
        """Marks ``keys`` as used (LRU: the first key ends most recent). Unknown keys are
        ignored."""
        h = self._handle()
        buf, n = self._join(keys)
        lib.kvo_manager_touch(h, buf, n)

    def complete_load(self, keys):
        """Releases one load pin of each key."""
        h = self._handle()
        buf, n = self._join(keys)
        lib.kvo_manager_complete_load(h, buf, n)

    def prepare_store(self, keys) -> StorePlan:
        """Reserves host slots for the keys not stored yet, evicting if needed.

        Raises :class:`NoRoomError` when not enough can be evicted now (retry later).
        """
        h = self._handle()
        buf, n = self._join(keys)
        indices = (ctypes.c_uint32 * n)()
        slots = (ctypes.c_uint32 * n)()
        evicted = (ctypes.c_uint8 * (n * self.key_len))()
        n_store = ctypes.c_size_t()
        n_evicted = ctypes.c_size_t()
        lib.kvo_manager_prepare_store(
            h, buf, n, indices, slots, evicted, n, ctypes.byref(n_store), ctypes.byref(n_evicted)
        )
        k = n_store.value
        return StorePlan(
            list(indices[:k]), list(slots[:k]), self._split(bytes(evicted), n_evicted.value)
        )

    def complete_store(self, keys, success=True, slots=None):
        """Ends the stores of ``keys``: success makes them ready, failure drops them.

        ``slots``: the slots ``prepare_store`` gave the keys (``plan.slots``), to skip the hash
        lookups; wrong slots are only hints.
        """
        h = self._handle()
        buf, n = self._join(keys)
        if slots is None:
            lib.kvo_manager_complete_store(h, buf, n, 1 if success else 0)
        else:
            if len(slots) != n:
                raise ValueError(f"slots: {len(slots)} slots for {n} keys")
            at = (ctypes.c_uint32 * n)(*slots)
            lib.kvo_manager_complete_store_at(h, buf, at, n, 1 if success else 0)

    def take_events(self) -> List[Event]:
        """Takes the buffered events, oldest first (empty unless ``enable_events``)."""
        return _take_events(lib.kvo_manager_take_events, self._handle(), self.key_len)

    def stats(self) -> ManagerStats:
        """Counters and gauges (``kvo_manager_get_stats``)."""
        h = self._handle()
        s = _ffi.kvo_manager_stats()
        s.struct_size = ctypes.sizeof(s)
        lib.kvo_manager_get_stats(h, ctypes.byref(s))
        return ManagerStats(**{f: getattr(s, f) for f in _STATS_FIELDS})

    def metrics_text(self, prefix, labels=None) -> str:
        """The manager's stats as Prometheus text (``kvo_manager_metrics_text``): every
        name ``<prefix>_<name>`` (vLLM's prefix: ``"vllm:kv_offload"``), every sample with the
        constant ``labels`` (a dict of str, in order). README.md lists the metrics."""
        return _metrics.metrics_text(
            lib.kvo_manager_metrics_text, self._handle(), prefix, labels
        )

    def metrics(self, prefix, labels=None) -> dict:
        """The same metrics as plain dicts, ``{family: {"type", "help", "samples"}}`` with
        ``samples`` a list of ``(name, labels, value)``: what a ``prometheus_client`` custom
        collector yields as ``Metric(family, help, type)`` with ``add_sample`` per sample."""
        return _metrics.parse(self.metrics_text(prefix, labels))

    def reset(self):
        """Drops every key and frees every slot, without events. Cumulative counters are kept."""
        lib.kvo_manager_reset(self._handle())

    def check_invariants(self):
        """Recounts the tier's state; raises :class:`InternalError` naming a broken invariant."""
        lib.kvo_manager_check_invariants(self._handle())

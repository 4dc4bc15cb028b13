"""Python bindings of kvoffload (ctypes, no third-party dependency).

    import kvoffload

    keys = b"".join(i.to_bytes(8, "big") for i in (1, 2))  # two 8-byte keys, one buffer
    with kvoffload.Manager(num_slots=4, key_len=8) as m:
        plan = m.prepare_store(keys)      # reserve host slots; the stores are in flight
        m.complete_store(keys)            # the copies finished: both keys are ready
        assert m.lookup(keys[:8]) == kvoffload.Lookup.HIT

The scheduler side (:class:`Scheduler`: requests, matching with the deferral rule, load and
store jobs) builds a :class:`Step` plan per engine step; ``Step.encode()`` / ``Step.decode()``
carry it to the workers (:class:`Worker`: block copies between registered KV tensors and the
host tier), whose reports go back through :meth:`Scheduler.complete_jobs`.

The shared library is loaded from ``KVOFFLOAD_LIB``, else the copy bundled in this package
(``pip install``), else the system's search (``LD_LIBRARY_PATH``, the loader cache), else a
development build of the checkout this package sits in (``target/{release,debug}``);
:data:`library_path` names the file loaded. Importing fails with ``ImportError`` when none is
found or the library's ABI version is not :data:`ABI_VERSION`.

Keys are one bytes-like object of ``n * key_len`` bytes or a list of ``key_len``-byte keys;
ids are ``uint32`` / ``uint64`` buffers or lists of ints (see :mod:`kvoffload._buffers`). Calls
do O(1) Python work whatever the number of keys. A bad argument raises ``TypeError`` or
``ValueError`` naming it; every failed library call raises a :class:`KvoError` subclass carrying
``status`` and the library's message.
"""

import ctypes
import sys
from array import array
from typing import List, NamedTuple, Optional, Tuple, Union

from . import _ffi, _metrics
from ._ffi import *  # noqa: F401,F403  (constants, enums, errors)
from ._ffi import (
    ABI_VERSION,
    BufferTooSmallError,
    KvoError,
    Lookup,
    NoRoomError,
    Policy,
    Semantics,
    lib,
    lib_path,
    library_path,
    version,
)
from ._buffers import (
    IdsLike,
    IdsOut,
    Keys,
    KeysLike,
    keys_arg,
    u32_arg,
    u32_out,
    u32_zeros,
    u64_arg,
)
from ._common import (
    _take_events,
    _MAX_U32,
    _Handle,
    _MAX_U64,
    _POLICIES,
    Event,
    ManagerStats,
    _semantics,
    _uint,
)
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
    Completions,
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
    "StoreBuffers",
    "Keys",
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
    "Completions",
    "cuda_available",
]
__version__ = version()


class StorePlan(NamedTuple):
    """The answer of :meth:`Manager.prepare_store`.

    ``indices``: positions in the keys passed whose stores are now in flight (input order,
    ``array('I')``); ``slots``: the host slot of each of them (``array('I')``); ``evicted``: the
    keys evicted to make room, in eviction order (:class:`Keys`).
    """

    indices: array
    slots: array
    evicted: Keys


class StoreBuffers:
    """Reusable outputs of :meth:`Manager.prepare_store` for up to ``capacity`` keys per call
    (no allocation per call): after ``m.prepare_store(keys, out=b)``, the first ``b.n_store``
    entries of ``b.indices`` / ``b.slots`` (``array('I')``) and the first ``b.n_evicted *
    key_len`` bytes of ``b.evicted`` (``bytearray``) hold the answer."""

    __slots__ = ("capacity", "key_len", "indices", "slots", "evicted", "n_store", "n_evicted",
                 "_counts", "_addr")

    def __init__(self, capacity: int, key_len: int):
        self.capacity = _uint("capacity", capacity, _MAX_U32)
        self.key_len = _uint("key_len", key_len, _MAX_U32)
        self.indices = array("I", bytes(4 * self.capacity))
        self.slots = array("I", bytes(4 * self.capacity))
        self.evicted = (ctypes.c_char * (self.capacity * self.key_len))()
        self._counts = (ctypes.c_uint64 * 2)()
        self.n_store = self.n_evicted = 0
        c = ctypes.addressof(self._counts)
        self._addr = (
            self.indices.buffer_info()[0],
            self.slots.buffer_info()[0],
            ctypes.addressof(self.evicted),
            c,
            c + 8,
        )

    def plan(self) -> StorePlan:
        """The last answer as a :class:`StorePlan` (copies)."""
        k, e = self.n_store, self.n_evicted
        return StorePlan(
            self.indices[:k], self.slots[:k], Keys(self.evicted[: e * self.key_len], self.key_len)
        )


_lookup = _ffi.fast["kvo_manager_lookup"]
_lookup_prefix = _ffi.fast["kvo_manager_lookup_prefix"]
_prepare_load = _ffi.fast["kvo_manager_prepare_load"]
_touch = _ffi.fast["kvo_manager_touch"]
_complete_load = _ffi.fast["kvo_manager_complete_load"]
_prepare_store = _ffi.fast["kvo_manager_prepare_store"]
_prepare_load_for = _ffi.fast["kvo_manager_prepare_load_for"]
_prepare_store_for = _ffi.fast["kvo_manager_prepare_store_for"]
_begin_request = _ffi.fast["kvo_manager_begin_request"]
_finish_request = _ffi.fast["kvo_manager_finish_request"]
_complete_store = _ffi.fast["kvo_manager_complete_store"]
_complete_store_at = _ffi.fast["kvo_manager_complete_store_at"]
_get_stats = _ffi.fast["kvo_manager_get_stats"]
_failure = _ffi.failure
_addressof = ctypes.addressof
_Out = ctypes.c_uint64 * 2
_LOOKUPS = tuple(Lookup)
_LOW = 0 if sys.byteorder == "little" else 1  # the uint32 word of a small size_t's value
_new_plan = tuple.__new__


class Manager(_Handle):
    """An offload tier index: keys, host slots, eviction (``kvo_manager``).

    ``keys`` arguments are one bytes-like object of ``n * key_len`` bytes (``bytes``,
    ``bytearray``, ``memoryview``, ``array``, numpy ``uint8``: passed without copying) or a list
    of ``key_len``-byte keys; slots are a ``uint32`` buffer or a list of ints.

    Calls on one manager are serialized by the library, so a manager may be shared between
    threads; :meth:`close` must not race with other calls on it.
    """

    def __init__(
        self,
        num_slots,
        key_len=None,
        policy="lru",
        store_threshold=None,
        max_tracker_size=None,
        enable_events=False,
        semantics=None,
    ):
        # None keeps the library's default (``kvo_manager_config_default``). ``semantics``:
        # "0.24" or "0.33" (or a ``Semantics``), the vLLM release the manager follows.
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
        if key_len is not None:
            cfg.key_len = _uint("key_len", key_len, _MAX_U32)
        # Other ints (unknown policy numbers) go through: the library validates them.
        cfg.policy = _uint("policy", int(policy), _MAX_U32)
        if store_threshold is not None:
            cfg.store_threshold = _uint("store_threshold", store_threshold, _MAX_U32)
        if max_tracker_size is not None:
            cfg.max_tracker_size = _uint("max_tracker_size", max_tracker_size, _MAX_U64)
        cfg.enable_events = 1 if enable_events else 0
        if semantics is not None:
            cfg.semantics = _semantics(semantics)
        ptr = ctypes.POINTER(_ffi._Manager)()
        lib.kvo_manager_new(ctypes.byref(cfg), ctypes.byref(ptr))
        self._own(ptr, lib.kvo_manager_free)
        self.key_len = cfg.key_len
        self.num_slots = cfg.num_slots
        self.policy = Policy(policy)
        self.semantics = Semantics(cfg.semantics)
        self._no_keys = Keys(b"", self.key_len)

    def __repr__(self):
        state = "closed" if self.closed else f"{self.num_slots} slots"
        return f"<kvoffload.Manager {self.policy.name} key_len={self.key_len} {state}>"

    # -- operations -----------------------------------------------------------------------------

    def lookup(self, key: KeysLike) -> Lookup:
        """Looks one key up (bytes-like, ``key_len`` bytes): :class:`Lookup` ``HIT``, ``MISS`` or
        ``RETRY`` (store in flight). Counts the lookup for the store threshold; does not change
        recency."""
        h = self._h
        if h is None:
            raise self._closed_error()
        arg, n, keep = keys_arg(key, self.key_len, "key")
        if n != 1:
            raise ValueError(f"key: {n * self.key_len} bytes, key_len is {self.key_len}")
        out = _Out()
        st = _lookup(h, arg, _addressof(out))
        if st:
            raise _failure(st)
        return _LOOKUPS[out[0]]

    def lookup_prefix(self, keys: KeysLike) -> Tuple[int, bool]:
        """Number of leading stored keys, and whether the answer must be retried later
        (a key of that prefix has its store in flight)."""
        h = self._h
        if h is None:
            raise self._closed_error()
        kl = self.key_len
        if type(keys) is bytes and not len(keys) % kl:  # the fast path: whole keys in bytes
            arg, n, keep = keys, len(keys) // kl, None
        else:
            arg, n, keep = keys_arg(keys, kl)
        out = _Out()
        a = _addressof(out)
        st = _lookup_prefix(h, arg, n, a, a + 8)
        if st:
            raise _failure(st)
        return out[0], out[1] != 0

    def prepare_load(
        self,
        keys: KeysLike,
        out: Optional[IdsOut] = None,
        request: Optional[int] = None,
        positions: Optional[IdsLike] = None,
    ) -> array:
        """Pins ``keys`` for a load; returns their slots in input order (``array('I')``). With
        ``out`` (a writable ``uint32`` buffer of at least ``n`` entries) the slots are written
        there and ``out`` is returned.

        ``request`` (from :meth:`begin_request`) records the loaded keys as reused by that
        request, at ``positions`` (one ``uint64`` per key: the tokens up to the end of its
        block; None: no positions) — ``kvo_manager_prepare_load_for``."""
        h = self._h
        if h is None:
            raise self._closed_error()
        kl = self.key_len
        if type(keys) is bytes and not len(keys) % kl:  # the fast path: whole keys in bytes
            arg, n, keep = keys, len(keys) // kl, None
        else:
            arg, n, keep = keys_arg(keys, kl)
        if out is None:
            res, addr = u32_zeros(n)
        else:
            addr, keep_out = u32_out(out, n)
            res = out
        if request is None and positions is None:
            st = _prepare_load(h, arg, n, addr, n)
        else:
            req, pos, keep_pos = self._request_args(request, positions, n)
            st = _prepare_load_for(h, req, arg, pos, n, addr, n)
        if st:
            raise _failure(st)
        return res

    def touch(self, keys: KeysLike) -> None:
        """Marks ``keys`` as used (LRU: the first key ends most recent). Unknown keys are
        ignored."""
        h = self._h
        if h is None:
            raise self._closed_error()
        kl = self.key_len
        if type(keys) is bytes and not len(keys) % kl:  # the fast path: whole keys in bytes
            arg, n, keep = keys, len(keys) // kl, None
        else:
            arg, n, keep = keys_arg(keys, kl)
        st = _touch(h, arg, n)
        if st:
            raise _failure(st)

    def complete_load(self, keys: KeysLike) -> None:
        """Releases one load pin of each key."""
        h = self._h
        if h is None:
            raise self._closed_error()
        kl = self.key_len
        if type(keys) is bytes and not len(keys) % kl:  # the fast path: whole keys in bytes
            arg, n, keep = keys, len(keys) // kl, None
        else:
            arg, n, keep = keys_arg(keys, kl)
        st = _complete_load(h, arg, n)
        if st:
            raise _failure(st)

    def prepare_store(
        self,
        keys: KeysLike,
        out: Optional[StoreBuffers] = None,
        request: Optional[int] = None,
        positions: Optional[IdsLike] = None,
    ) -> Union[StorePlan, StoreBuffers]:
        """Reserves host slots for the keys not stored yet, evicting if needed; returns a
        :class:`StorePlan`. With ``out`` (a :class:`StoreBuffers` of this key length and enough
        capacity) the answer is written there instead and ``out`` is returned.

        ``request`` and ``positions`` as for :meth:`prepare_load`
        (``kvo_manager_prepare_store_for``): in 0.33 semantics the offer counts once per request
        for the store threshold, and ARC adapts on the request's first offer of a ghost key.

        Raises :class:`NoRoomError` when not enough can be evicted now (retry later).
        """
        h = self._h
        if h is None:
            raise self._closed_error()
        kl = self.key_len
        if type(keys) is bytes and not len(keys) % kl:  # the fast path: whole keys in bytes
            arg, n, keep = keys, len(keys) // kl, None
        else:
            arg, n, keep = keys_arg(keys, kl)
        if out is not None:
            if type(out) is not StoreBuffers:
                raise TypeError(f"out: expected StoreBuffers, got {type(out).__name__}")
            if out.key_len != kl or out.capacity < n:
                raise ValueError(
                    f"out: StoreBuffers for {out.capacity} keys of {out.key_len} bytes, "
                    f"{n} keys of {kl} bytes passed"
                )
            a = out._addr
            if request is None and positions is None:
                st = _prepare_store(h, arg, n, a[0], a[1], a[2], n, a[3], a[4])
            else:
                req, pos, keep_pos = self._request_args(request, positions, n)
                st = _prepare_store_for(h, req, arg, pos, n, a[0], a[1], a[2], n, a[3], a[4])
            if st:
                raise _failure(st)
            c = out._counts
            out.n_store = c[0]
            out.n_evicted = c[1]
            return out
        # One zeroed buffer for all outputs: the two counts (size_t, 8-byte aligned), indices,
        # slots, then the evicted keys.
        buf, ba = u32_zeros(4 + 2 * n + (n * kl + 3) // 4)
        if request is None and positions is None:
            st = _prepare_store(
                h, arg, n, ba + 16, ba + 16 + 4 * n, ba + 16 + 8 * n, n, ba, ba + 8
            )
        else:
            req, pos, keep_pos = self._request_args(request, positions, n)
            st = _prepare_store_for(
                h, req, arg, pos, n, ba + 16, ba + 16 + 4 * n, ba + 16 + 8 * n, n, ba, ba + 8
            )
        if st:
            raise _failure(st)
        # Counts are below 2**32: the low word of each size_t holds it.
        k, e = buf[_LOW], buf[2 + _LOW]
        if e:
            start = 16 + 8 * n
            evicted = Keys(memoryview(buf).cast("B")[start : start + e * kl].tobytes(), kl)
        else:
            evicted = self._no_keys
        return _new_plan(StorePlan, (buf[4 : 4 + k], buf[4 + n : 4 + n + k], evicted))

    def complete_store(
        self, keys: KeysLike, success: bool = True, slots: Optional[IdsLike] = None
    ) -> None:
        """Ends the stores of ``keys``: success makes them ready, failure drops them.

        ``slots``: the slots ``prepare_store`` gave the keys (``plan.slots``: a ``uint32``
        buffer or a list), to skip the hash lookups; wrong slots are only hints.
        """
        h = self._h
        if h is None:
            raise self._closed_error()
        kl = self.key_len
        if type(keys) is bytes and not len(keys) % kl:  # the fast path: whole keys in bytes
            arg, n, keep = keys, len(keys) // kl, None
        else:
            arg, n, keep = keys_arg(keys, kl)
        if slots is None:
            st = _complete_store(h, arg, n, 1 if success else 0)
        else:
            at, ns, keep_slots = u32_arg(slots, "slots")
            if ns != n:
                raise ValueError(f"slots: {ns} slots for {n} keys")
            st = _complete_store_at(h, arg, at, n, 1 if success else 0)
        if st:
            raise _failure(st)

    def begin_request(self) -> int:
        """Starts a request context (vLLM 0.33 request-scoped recency); returns its handle, for
        the ``request=`` argument of :meth:`prepare_load` / :meth:`prepare_store` and for
        :meth:`finish_request`."""
        h = self._h
        if h is None:
            raise self._closed_error()
        out = _Out()
        st = _begin_request(h, _addressof(out))
        if st:
            raise _failure(st)
        return out[0]

    def finish_request(self, request: int) -> None:
        """Ends ``request``: commits its recency to the policy (LRU: its keys become the newest,
        its head newest of all; ARC: the keys it reused are promoted) unless :meth:`reset` came
        after its last use. Raises :class:`InvalidArgumentError` if it is not active."""
        h = self._h
        if h is None:
            raise self._closed_error()
        st = _finish_request(h, _uint("request", request, _MAX_U64))
        if st:
            raise _failure(st)

    def _request_args(self, request, positions, n):
        if request is None:
            raise ValueError("positions: given without a request")
        req = _uint("request", request, _MAX_U64)
        if positions is None:
            return req, None, None
        pos, npos, keep = u64_arg(positions, "positions")
        if npos != n:
            raise ValueError(f"positions: {npos} positions for {n} keys")
        return req, pos, keep

    def take_events(self) -> List[Event]:
        """Takes the buffered events, oldest first (empty unless ``enable_events``)."""
        return _take_events(lib.kvo_manager_take_events, self._handle(), self.key_len)

    def stats(self) -> ManagerStats:
        """Counters and gauges (``kvo_manager_get_stats``), as the struct the library filled;
        ``as_dict()`` on demand."""
        h = self._h
        if h is None:
            raise self._closed_error()
        s = ManagerStats._empty()
        st = _get_stats(h, _addressof(s))
        if st:
            raise _failure(st)
        return s

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

    def reset(self) -> None:
        """Drops every key and frees every slot, without events. Cumulative counters are kept."""
        lib.kvo_manager_reset(self._handle())

    def check_invariants(self) -> None:
        """Recounts the tier's state; raises :class:`InternalError` naming a broken invariant."""
        lib.kvo_manager_check_invariants(self._handle())

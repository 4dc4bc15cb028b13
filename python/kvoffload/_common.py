"""Helpers and result types shared by the Python classes of kvoffload (stdlib only)."""

import ctypes
import operator
import weakref
from typing import List, NamedTuple

from . import _ffi
from ._buffers import Keys
from ._ffi import BufferTooSmallError, Policy, Semantics

_MAX_U32 = 2**32 - 1
_MAX_U64 = 2**64 - 1

_POLICIES = {"lru": Policy.LRU, "arc": Policy.ARC}


def _uint(name, value, maximum):
    """``value`` as an int in ``0..=maximum``: TypeError for a non-integer (bool included; any
    type with ``__index__``, such as numpy integers, is taken), ValueError out of range; both
    name the argument."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None
    if not 0 <= value <= maximum:
        raise ValueError(f"{name}: {value} is not in 0..={maximum}")
    return value


_SEMANTICS = {"0.24": Semantics.VLLM_0_24, "0.33": Semantics.VLLM_0_33}


def _semantics(semantics):
    """A semantics name ("0.24", "0.33") or number as an int; unknown numbers are left to the
    library to refuse."""
    if isinstance(semantics, str):
        try:
            name = semantics.lower().removeprefix("vllm").strip("_ -").replace("_", ".")
            return _SEMANTICS[name]
        except KeyError:
            raise ValueError(
                f"semantics: {semantics!r} is not one of {sorted(_SEMANTICS)}"
            ) from None
    return _uint(
        "semantics", int(semantics) if isinstance(semantics, Semantics) else semantics, _MAX_U32
    )


def _policy(policy):
    """A policy name ("lru", "arc") or number as an int; unknown numbers are left to the
    library to refuse."""
    if isinstance(policy, str):
        try:
            return _POLICIES[policy.lower()]
        except KeyError:
            raise ValueError(f"policy: {policy!r} is not one of {sorted(_POLICIES)}") from None
    return _uint("policy", int(policy) if isinstance(policy, Policy) else policy, _MAX_U32)


class Event(NamedTuple):
    """One event of :meth:`Manager.take_events` / :meth:`Scheduler.take_events`: ``removed``
    True for evicted keys (or keys whose store failed), False for keys that became ready
    (stored); ``keys`` as :class:`Keys` (equal to the list of them); ``metadata_only`` True
    for a removal of keys whose store failed (vLLM 0.33 semantics only)."""

    removed: bool
    keys: Keys
    metadata_only: bool = False


class _Stats:
    """Methods shared by the stats structs: a stats object is the C struct the library filled
    (one read per call), its fields plain ints."""

    __slots__ = ()

    def _names(self):
        return [f[0] for f in self._fields_ if f[0] != "struct_size"]

    def as_dict(self):
        """The stats as a dict (nested stats as nested dicts)."""
        out = {}
        for name in self._names():
            v = getattr(self, name)
            if isinstance(v, _Stats):
                v = v.as_dict()
            elif isinstance(v, ctypes.Array):
                v = list(v)
            out[name] = v
        return out

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self.as_dict() == other.as_dict()

    __hash__ = None

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"{type(self).__name__}({fields})"

    @classmethod
    def _empty(cls):
        """A zeroed struct with ``struct_size`` set, ready for the library to fill."""
        return cls.from_buffer_copy(cls._template)


class ManagerStats(_Stats, _ffi.kvo_manager_stats):
    """Counters and gauges of a manager (``kvo_manager_stats``): capacity, used, ready,
    evictable, pinned, stores_in_flight, lookups, hits, stores_skipped, evictions,
    events_dropped, allocation_size_buckets (a ctypes array: allocations per size bucket),
    allocation_keys."""

    def __init__(self, *values, **kw):
        super().__init__(ctypes.sizeof(_ffi.kvo_manager_stats), *values, **kw)


ManagerStats._template = bytes(ManagerStats())
_STATS_FIELDS = ManagerStats()._names()


class _Handle:
    """Owns one library handle: ``close()`` frees it exactly once (also at garbage collection or
    interpreter exit, through ``weakref.finalize``); context-manager support; use after close
    raises ``ValueError``."""

    _ptr = None
    _finalizer = None

    #: The handle's address (an int) for the hot paths, None once closed.
    _h = None

    def _own(self, ptr, free, *keep):
        """Takes ownership of ``ptr``, freed with ``free(ptr, *keep)``."""
        self._ptr = ptr
        self._h = ctypes.cast(ptr, ctypes.c_void_p).value
        self._finalizer = weakref.finalize(self, free, ptr, *keep)

    def close(self):
        """Frees the handle. Safe to call more than once."""
        self._ptr = None
        self._h = None
        if self._finalizer is not None:
            self._finalizer()

    @property
    def closed(self):
        return self._ptr is None

    def __enter__(self):
        self._handle()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _closed_error(self):
        return ValueError(f"kvoffload: operation on a closed {type(self).__name__}")

    def _handle_address(self):
        """The handle's address (an int); ValueError once closed."""
        h = self._h
        if h is None:
            raise self._closed_error()
        return h

    def _handle(self):
        ptr = self._ptr
        if ptr is None:
            raise ValueError(f"kvoffload: operation on a closed {type(self).__name__}")
        return ptr


def _take_events(take, handle, key_len) -> List[Event]:
    """Drains buffered events with ``take`` (``kvo_manager_take_events`` or
    ``kvo_scheduler_take_events``), growing the buffers on ``BUFFER_TOO_SMALL``."""
    n_events = ctypes.c_size_t()
    n_keys = ctypes.c_size_t()
    events_cap, keys_cap = 16, 64
    while True:
        events = (_ffi.kvo_event * events_cap)()
        keys = (ctypes.c_uint8 * (keys_cap * key_len))()
        try:
            take(handle, events, events_cap, keys, keys_cap, ctypes.byref(n_events), ctypes.byref(n_keys))
        except BufferTooSmallError:
            # The needed counts were written; more may arrive from other threads meanwhile.
            events_cap = max(events_cap, n_events.value)
            keys_cap = max(keys_cap, n_keys.value)
            continue
        break
    raw = bytes(keys)
    return [
        Event(e.removed != 0, Keys(raw[e.first_key * key_len : (e.first_key + e.n_keys) * key_len],
                                   key_len), e.metadata_only != 0)
        for e in events[: n_events.value]
    ]

"""Helpers and result types shared by the Python classes of kvoffload (stdlib only)."""

import dataclasses
import ctypes
import operator
import weakref
from typing import List, NamedTuple

from . import _ffi
from ._ffi import BufferTooSmallError, Policy

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
    True for evicted keys, False for keys that became ready (stored)."""

    removed: bool
    keys: List[bytes]


@dataclasses.dataclass(frozen=True)
class ManagerStats:
    """Counters and gauges of a manager (``kvo_manager_stats``)."""

    capacity: int
    used: int
    ready: int
    evictable: int
    pinned: int
    stores_in_flight: int
    lookups: int
    hits: int
    stores_skipped: int
    evictions: int
    events_dropped: int

    def as_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def _from_c(cls, s):
        return cls(**{f: getattr(s, f) for f in _STATS_FIELDS})


_STATS_FIELDS = [f.name for f in dataclasses.fields(ManagerStats)]


class _Handle:
    """Owns one library handle: ``close()`` frees it exactly once (also at garbage collection or
    interpreter exit, through ``weakref.finalize``); context-manager support; use after close
    raises ``ValueError``."""

    _ptr = None
    _finalizer = None

    def _own(self, ptr, free, *keep):
        """Takes ownership of ``ptr``, freed with ``free(ptr, *keep)``."""
        self._ptr = ptr
        self._finalizer = weakref.finalize(self, free, ptr, *keep)

    def close(self):
        """Frees the handle. Safe to call more than once."""
        self._ptr = None
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
    out = []
    for e in events[: n_events.value]:
        first = e.first_key
        ks = [raw[(first + i) * key_len : (first + i + 1) * key_len] for i in range(e.n_keys)]
        out.append(Event(bool(e.removed), ks))
    return out

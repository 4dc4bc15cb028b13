"""Low-level ctypes bindings of ``include/kvoffload.h`` (stdlib only).

Loads ``libkvoffload.so``, checks the ABI version, and declares ``argtypes`` and
``restype`` of every exported function. Every ``kvo_status``-returning function gets an
``errcheck`` that raises :class:`KvoError` (or the subclass for its status) with the
library's thread-local last-error message, read right away on the calling thread.

Everything here mirrors the header one to one; ``python/tests/test_header_drift.py``
checks that it stays so. The friendly API is in the package: ``Manager`` in ``__init__.py``,
``Scheduler`` and ``Step`` in ``_scheduler.py``, ``Worker`` in ``_worker.py``.
"""

import ctypes
import ctypes.util
import enum
import os
import sys
from ctypes import POINTER, c_char, c_char_p, c_int32, c_size_t, c_uint8, c_uint32, c_uint64

__all__ = [
    "ABI_VERSION",
    "KVO_ABI_VERSION",
    "KVO_MAX_KEY_LEN",
    "Status",
    "Policy",
    "Semantics",
    "Lookup",
    "Match",
    "DeferReason",
    "JobKind",
    "Backend",
    "KVO_NO_LIMIT",
    "KVO_STEP_FORMAT_VERSION",
    "KVO_SIZE_BUCKETS",
    "KVO_ALLOCATION_SIZE_BUCKETS",
    "KvoError",
    "NullArgumentError",
    "InvalidArgumentError",
    "NotFoundError",
    "InvalidStateError",
    "NoRoomError",
    "BufferTooSmallError",
    "CorruptDataError",
    "CudaUnavailableError",
    "CudaError",
    "IoError",
    "PanicError",
    "InternalError",
    "KvoTimeoutError",
    "KvoMemoryError",
    "lib",
    "lib_path",
    "library_path",
    "last_error_message",
]

# ---------------------------------------------------------------------------------------------
# Constants (mirroring the header)
# ---------------------------------------------------------------------------------------------

#: The C ABI version these bindings were written for (``KVO_ABI_VERSION``).
ABI_VERSION = 1
KVO_ABI_VERSION = ABI_VERSION
#: Longest key a manager accepts, in bytes.
KVO_MAX_KEY_LEN = 64


class Status(enum.IntEnum):
    """``enum kvo_status``."""

    OK = 0
    NULL_ARGUMENT = 1
    INVALID_ARGUMENT = 2
    NOT_FOUND = 3
    INVALID_STATE = 4
    NO_ROOM = 5
    BUFFER_TOO_SMALL = 6
    CORRUPT_DATA = 7
    CUDA_UNAVAILABLE = 8
    CUDA_ERROR = 9
    IO_ERROR = 10
    PANIC = 11
    INTERNAL = 12
    TIMEOUT = 13
    OUT_OF_MEMORY = 14


class Policy(enum.IntEnum):
    """``enum kvo_policy``."""

    LRU = 0
    ARC = 1


class Semantics(enum.IntEnum):
    """``enum kvo_semantics``: the vLLM release whose semantics a manager or scheduler follows."""

    VLLM_0_24 = 0
    VLLM_0_33 = 1


class Lookup(enum.IntEnum):
    """``enum kvo_lookup``: the answer of ``Manager.lookup``."""

    MISS = 0
    HIT = 1
    RETRY = 2
    HIT_PENDING = 3

    def __str__(self):
        return self.name.lower()


class Match(enum.IntEnum):
    """``enum kvo_match``: the kind of a scheduler match."""

    MISS = 0
    HIT = 1
    DEFER = 2


class DeferReason(enum.IntEnum):
    """``enum kvo_defer_reason``."""

    NONE = 0
    JOBS_IN_FLIGHT = 1
    STORE_IN_FLIGHT = 2
    BEING_LOADED = 3


class JobKind(enum.IntEnum):
    """``enum kvo_job_kind``."""

    LOAD = 0
    STORE = 1


class Backend(enum.IntEnum):
    """``enum kvo_backend``."""

    HOST = 0
    CUDA = 1


#: ``KVO_NO_LIMIT``: no cap on a request's offloaded tokens.
KVO_NO_LIMIT = 2**64 - 1
#: ``KVO_STEP_FORMAT_VERSION``: version of the encoded step-plan format (as the header spells it).
KVO_STEP_FORMAT_VERSION = 1
#: ``KVO_SIZE_BUCKETS``: buckets of ``kvo_transfer_stats.size_buckets``.
KVO_SIZE_BUCKETS = 11
#: ``KVO_ALLOCATION_SIZE_BUCKETS``: buckets of ``kvo_manager_stats.allocation_size_buckets``.
KVO_ALLOCATION_SIZE_BUCKETS = 11

#: (IntEnum, header prefix) pairs; the drift test compares them member for member.
ENUMS = (
    (Status, "KVO_STATUS_"),
    (Policy, "KVO_POLICY_"),
    (Semantics, "KVO_SEMANTICS_"),
    (Lookup, "KVO_LOOKUP_"),
    (Match, "KVO_MATCH_"),
    (DeferReason, "KVO_DEFER_REASON_"),
    (JobKind, "KVO_JOB_KIND_"),
    (Backend, "KVO_BACKEND_"),
)

# Module-level names exactly as in the header (KVO_STATUS_OK, KVO_POLICY_LRU, KVO_LOOKUP_HIT...).
_HEADER_CONSTANTS = {}
for _enum, _prefix in ENUMS:
    for _member in _enum:
        _HEADER_CONSTANTS[_prefix + _member.name] = int(_member)
globals().update(_HEADER_CONSTANTS)
__all__ += sorted(_HEADER_CONSTANTS)
del _enum, _prefix, _member

# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class KvoError(Exception):
    """A ``kvo_*`` call returned a status other than ``KVO_STATUS_OK``.

    ``status`` is the :class:`Status`; ``message`` is the library's last-error message, which
    names the argument and the value.
    """

    def __init__(self, status, message=""):
        try:
            status = Status(status)
        except ValueError:
            status = int(status)
        self.status = status
        self.message = message
        super().__init__(status, message)

    def __str__(self):
        name = self.status.name if isinstance(self.status, Status) else str(self.status)
        return f"KVO_STATUS_{name}: {self.message}" if self.message else f"KVO_STATUS_{name}"


class NullArgumentError(KvoError):
    """``KVO_STATUS_NULL_ARGUMENT``: a required pointer was NULL."""


class InvalidArgumentError(KvoError):
    """``KVO_STATUS_INVALID_ARGUMENT``: a value out of range or inconsistent with another."""


class NotFoundError(KvoError):
    """``KVO_STATUS_NOT_FOUND``: an unknown request, job or key."""


class InvalidStateError(KvoError):
    """``KVO_STATUS_INVALID_STATE``: the call is not valid now."""


class NoRoomError(KvoError):
    """``KVO_STATUS_NO_ROOM``: the tier cannot take these blocks now (retry on a later step)."""


class BufferTooSmallError(KvoError):
    """``KVO_STATUS_BUFFER_TOO_SMALL``: an output buffer is too small."""


class CorruptDataError(KvoError):
    """``KVO_STATUS_CORRUPT_DATA``: serialized bytes truncated, corrupt or of another version."""


class CudaUnavailableError(KvoError):
    """``KVO_STATUS_CUDA_UNAVAILABLE``: no CUDA driver or device."""


class CudaError(KvoError):
    """``KVO_STATUS_CUDA_ERROR``: a CUDA call failed."""


class IoError(KvoError):
    """``KVO_STATUS_IO_ERROR``: an operating-system call failed."""


class PanicError(KvoError):
    """``KVO_STATUS_PANIC``: a bug was caught inside the library; the handle may only be freed."""


class InternalError(KvoError):
    """``KVO_STATUS_INTERNAL``: an invariant was found broken."""


class KvoTimeoutError(KvoError):
    """``KVO_STATUS_TIMEOUT``: a wait ran out of time before the jobs finished.

    (Named so as not to shadow the builtin ``TimeoutError`` on ``from kvoffload import *``.)
    """


class KvoMemoryError(KvoError, MemoryError):
    """``KVO_STATUS_OUT_OF_MEMORY``: memory for the requested sizes could not be had; nothing
    was changed. (Also a builtin ``MemoryError``.)"""


_ERROR_CLASSES = {
    Status.NULL_ARGUMENT: NullArgumentError,
    Status.INVALID_ARGUMENT: InvalidArgumentError,
    Status.NOT_FOUND: NotFoundError,
    Status.INVALID_STATE: InvalidStateError,
    Status.NO_ROOM: NoRoomError,
    Status.BUFFER_TOO_SMALL: BufferTooSmallError,
    Status.CORRUPT_DATA: CorruptDataError,
    Status.CUDA_UNAVAILABLE: CudaUnavailableError,
    Status.CUDA_ERROR: CudaError,
    Status.IO_ERROR: IoError,
    Status.PANIC: PanicError,
    Status.INTERNAL: InternalError,
    Status.TIMEOUT: KvoTimeoutError,
    Status.OUT_OF_MEMORY: KvoMemoryError,
}


def error_for(status, message=""):
    """The :class:`KvoError` subclass instance for ``status``."""
    return _ERROR_CLASSES.get(status, KvoError)(status, message)


# ---------------------------------------------------------------------------------------------
# Structs and handle types
# ---------------------------------------------------------------------------------------------


class _Manager(ctypes.Structure):
    """``kvo_manager``: opaque; only ever used through ``POINTER(_Manager)``."""


class kvo_manager_config(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("key_len", c_uint32),
        ("policy", c_uint32),
        ("num_slots", c_uint64),
        ("store_threshold", c_uint32),
        ("enable_events", c_uint32),
        ("max_tracker_size", c_uint64),
        ("semantics", c_uint32),
    ]


class kvo_event(ctypes.Structure):
    _fields_ = [
        ("first_key", c_uint64),
        ("n_keys", c_uint64),
        ("removed", c_uint32),
        ("metadata_only", c_uint32),
    ]


class kvo_manager_stats(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("capacity", c_uint64),
        ("used", c_uint64),
        ("ready", c_uint64),
        ("evictable", c_uint64),
        ("pinned", c_uint64),
        ("stores_in_flight", c_uint64),
        ("lookups", c_uint64),
        ("hits", c_uint64),
        ("stores_skipped", c_uint64),
        ("evictions", c_uint64),
        ("events_dropped", c_uint64),
        ("allocation_size_buckets", c_uint64 * KVO_ALLOCATION_SIZE_BUCKETS),
        ("allocation_keys", c_uint64),
    ]


class _Scheduler(ctypes.Structure):
    """``kvo_scheduler``: opaque; only ever used through ``POINTER(_Scheduler)``."""


class _Step(ctypes.Structure):
    """``kvo_step``: opaque; only ever used through ``POINTER(_Step)``."""


class kvo_scheduler_config(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("key_len", c_uint32),
        ("gpu_block_size", c_uint32),
        ("block_size_factor", c_uint32),
        ("policy", c_uint32),
        ("num_slots", c_uint64),
        ("num_workers", c_uint32),
        ("offload_prompt_only", c_uint32),
        ("store_threshold", c_uint32),
        ("enable_events", c_uint32),
        ("max_tracker_size", c_uint64),
        ("semantics", c_uint32),
    ]


class kvo_match_result(ctypes.Structure):
    _fields_ = [
        ("kind", c_uint32),
        ("defer_reason", c_uint32),
        ("tokens", c_uint64),
    ]


class kvo_scheduled_request(ctypes.Structure):
    _fields_ = [
        ("request_id", c_uint64),
        ("num_computed_tokens", c_uint64),
        ("num_scheduled_tokens", c_uint64),
        ("num_tokens", c_uint64),
        ("new_block_ids", POINTER(c_uint32)),
        ("n_new_block_ids", c_size_t),
        ("resumed", c_uint32),
        ("reserved", c_uint32),
    ]


class kvo_job_report(ctypes.Structure):
    _fields_ = [
        ("job_id", c_uint64),
        ("count", c_uint32),
        ("success", c_uint32),
    ]


class kvo_scheduler_stats(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("requests", c_uint64),
        ("matches", c_uint64),
        ("deferred_jobs_in_flight", c_uint64),
        ("deferred_store_in_flight", c_uint64),
        ("deferred_being_loaded", c_uint64),
        ("hits", c_uint64),
        ("hit_tokens", c_uint64),
        ("load_jobs", c_uint64),
        ("store_jobs", c_uint64),
        ("stored_chunks", c_uint64),
        ("store_no_room", c_uint64),
        ("failed_jobs", c_uint64),
        ("loads_in_flight", c_uint64),
        ("stores_in_flight", c_uint64),
        ("manager", kvo_manager_stats),
    ]


class kvo_step_info(ctypes.Structure):
    _fields_ = [
        ("num_jobs", c_size_t),
        ("num_flush", c_size_t),
        ("block_size_factor", c_uint32),
        ("reserved", c_uint32),
    ]


class kvo_job_info(ctypes.Structure):
    _fields_ = [
        ("id", c_uint64),
        ("request_id", c_uint64),
        ("kind", c_uint32),
        ("group_size", c_uint32),
        ("block_index", c_uint32),
        ("reserved", c_uint32),
        ("n_src", c_size_t),
        ("n_dst", c_size_t),
    ]


class _Worker(ctypes.Structure):
    """``kvo_worker``: opaque; only ever used through ``POINTER(_Worker)``."""


class kvo_worker_config(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("block_size_factor", c_uint32),
        ("num_host_slots", c_uint32),
        ("threads", c_uint32),
        ("backend", c_uint32),
        ("device", ctypes.c_int32),
        ("reserved", c_uint32),
    ]


class kvo_kv_tensor(ctypes.Structure):
    _fields_ = [
        ("base", c_uint64),
        ("block_stride", c_uint64),
        ("page_size", c_uint64),
        ("num_blocks", c_uint32),
        ("on_device", c_uint32),
    ]


class kvo_host_buffer(ctypes.Structure):
    _fields_ = [
        ("ptr", ctypes.c_void_p),
        ("len", c_size_t),
    ]


class kvo_completion(ctypes.Structure):
    _fields_ = [
        ("job_id", c_uint64),
        ("bytes", c_uint64),
        ("seconds", ctypes.c_double),
        ("success", c_uint32),
        ("reserved", c_uint32),
    ]


class kvo_transfer_stats(ctypes.Structure):
    _fields_ = [
        ("jobs", c_uint64),
        ("failed_jobs", c_uint64),
        ("bytes", c_uint64),
        ("seconds", ctypes.c_double),
        ("size_buckets", c_uint64 * KVO_SIZE_BUCKETS),
    ]


class kvo_worker_stats(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("load", kvo_transfer_stats),
        ("store", kvo_transfer_stats),
        ("jobs_in_flight", c_uint64),
    ]


class kvo_label(ctypes.Structure):
    _fields_ = [
        ("name", c_char_p),
        ("value", c_char_p),
    ]


#: C struct name -> ctypes class (used by the drift test).
STRUCTS = {
    "kvo_manager": _Manager,
    "kvo_scheduler": _Scheduler,
    "kvo_step": _Step,
    "kvo_manager_config": kvo_manager_config,
    "kvo_event": kvo_event,
    "kvo_manager_stats": kvo_manager_stats,
    "kvo_scheduler_config": kvo_scheduler_config,
    "kvo_match_result": kvo_match_result,
    "kvo_scheduled_request": kvo_scheduled_request,
    "kvo_job_report": kvo_job_report,
    "kvo_scheduler_stats": kvo_scheduler_stats,
    "kvo_step_info": kvo_step_info,
    "kvo_job_info": kvo_job_info,
    "kvo_worker": _Worker,
    "kvo_worker_config": kvo_worker_config,
    "kvo_kv_tensor": kvo_kv_tensor,
    "kvo_host_buffer": kvo_host_buffer,
    "kvo_completion": kvo_completion,
    "kvo_transfer_stats": kvo_transfer_stats,
    "kvo_worker_stats": kvo_worker_stats,
    "kvo_label": kvo_label,
}

# The C type aliases: kvo_status is int32_t; kvo_policy and kvo_lookup are uint32_t.
kvo_status = c_int32

_ManagerP = POINTER(_Manager)
_SchedP = POINTER(_Scheduler)
_StepP = POINTER(_Step)
_WorkerP = POINTER(_Worker)
_u8p = POINTER(c_uint8)
_u32p = POINTER(c_uint32)
_u64p = POINTER(c_uint64)
_sizep = POINTER(c_size_t)

#: Every function of the header: name -> (restype, argtypes, returns kvo_status).
FUNCTIONS = {
    "kvo_last_error_message": (c_size_t, [POINTER(c_char), c_size_t], False),
    "kvo_abi_version": (c_uint32, [], False),
    "kvo_version": (c_char_p, [], False),
    "kvo_manager_config_default": (kvo_status, [POINTER(kvo_manager_config)], True),
    "kvo_manager_new": (kvo_status, [POINTER(kvo_manager_config), POINTER(_ManagerP)], True),
    "kvo_manager_free": (None, [_ManagerP], False),
    "kvo_manager_lookup": (kvo_status, [_ManagerP, c_char_p, _u32p], True),
    "kvo_manager_lookup_prefix": (kvo_status, [_ManagerP, c_char_p, c_size_t, _sizep, _u32p], True),
    "kvo_manager_prepare_load": (
        kvo_status,
        [_ManagerP, c_char_p, c_size_t, _u32p, c_size_t],
        True,
    ),
    "kvo_manager_touch": (kvo_status, [_ManagerP, c_char_p, c_size_t], True),
    "kvo_manager_complete_load": (kvo_status, [_ManagerP, c_char_p, c_size_t], True),
    "kvo_manager_prepare_store": (
        kvo_status,
        [_ManagerP, c_char_p, c_size_t, _u32p, _u32p, _u8p, c_size_t, _sizep, _sizep],
        True,
    ),
    "kvo_manager_complete_store": (kvo_status, [_ManagerP, c_char_p, c_size_t, c_uint32], True),
    "kvo_manager_begin_request": (kvo_status, [_ManagerP, _u64p], True),
    "kvo_manager_finish_request": (kvo_status, [_ManagerP, c_uint64], True),
    "kvo_manager_prepare_load_for": (
        kvo_status,
        [_ManagerP, c_uint64, c_char_p, _u64p, c_size_t, _u32p, c_size_t],
        True,
    ),
    "kvo_manager_prepare_store_for": (
        kvo_status,
        [_ManagerP, c_uint64, c_char_p, _u64p, c_size_t, _u32p, _u32p, _u8p, c_size_t, _sizep, _sizep],
        True,
    ),
    "kvo_manager_complete_store_at": (
        kvo_status,
        [_ManagerP, c_char_p, POINTER(c_uint32), c_size_t, c_uint32],
        True,
    ),
    "kvo_manager_take_events": (
        kvo_status,
        [_ManagerP, POINTER(kvo_event), c_size_t, _u8p, c_size_t, _sizep, _sizep],
        True,
    ),
    "kvo_manager_get_stats": (kvo_status, [_ManagerP, POINTER(kvo_manager_stats)], True),
    "kvo_manager_metrics_text": (
        kvo_status,
        [_ManagerP, c_char_p, POINTER(kvo_label), c_size_t, POINTER(c_char), c_size_t, _sizep],
        True,
    ),
    "kvo_manager_reset": (kvo_status, [_ManagerP], True),
    "kvo_manager_check_invariants": (kvo_status, [_ManagerP], True),
    # -- scheduler ---------------------------------------------------------------------------
    "kvo_scheduler_config_default": (kvo_status, [POINTER(kvo_scheduler_config)], True),
    "kvo_scheduler_new": (kvo_status, [POINTER(kvo_scheduler_config), POINTER(_SchedP)], True),
    "kvo_scheduler_free": (None, [_SchedP], False),
    "kvo_scheduler_add_request": (kvo_status, [_SchedP, c_uint64, c_uint64, c_uint64], True),
    "kvo_scheduler_append_block_hashes": (
        kvo_status,
        [_SchedP, c_uint64, c_char_p, c_size_t, c_uint64],
        True,
    ),
    "kvo_scheduler_match": (
        kvo_status,
        [_SchedP, c_uint64, c_uint64, POINTER(kvo_match_result)],
        True,
    ),
    "kvo_scheduler_on_alloc": (
        kvo_status,
        [_SchedP, c_uint64, _u32p, c_size_t, c_uint64, _u32p, _u64p],
        True,
    ),
    "kvo_scheduler_build_step": (
        kvo_status,
        [_SchedP, POINTER(kvo_scheduled_request), c_size_t, _u64p, c_size_t, _StepP],
        True,
    ),
    "kvo_scheduler_build_step_arrays": (
        kvo_status,
        [_SchedP, c_size_t, _u64p, _u64p, _u64p, _u64p, _u64p, _u32p, c_size_t, c_char_p, _u64p,
         c_size_t, _StepP],
        True,
    ),
    "kvo_scheduler_complete_jobs": (
        kvo_status,
        [_SchedP, POINTER(kvo_job_report), c_size_t],
        True,
    ),
    "kvo_scheduler_finish_request": (kvo_status, [_SchedP, c_uint64], True),
    "kvo_scheduler_load_failure": (kvo_status, [_SchedP, c_uint64, _u32p, _u64p, _u64p], True),
    "kvo_scheduler_reset": (kvo_status, [_SchedP], True),
    "kvo_scheduler_take_events": (
        kvo_status,
        [_SchedP, POINTER(kvo_event), c_size_t, _u8p, c_size_t, _sizep, _sizep],
        True,
    ),
    "kvo_scheduler_get_stats": (kvo_status, [_SchedP, POINTER(kvo_scheduler_stats)], True),
    "kvo_scheduler_metrics_text": (
        kvo_status,
        [_SchedP, c_char_p, POINTER(kvo_label), c_size_t, POINTER(c_char), c_size_t, _sizep],
        True,
    ),
    "kvo_scheduler_check_invariants": (kvo_status, [_SchedP], True),
    # -- step plans --------------------------------------------------------------------------
    "kvo_step_new": (kvo_status, [POINTER(_StepP)], True),
    "kvo_step_free": (None, [_StepP], False),
    "kvo_step_get_info": (kvo_status, [_StepP, POINTER(kvo_step_info)], True),
    "kvo_step_get_job": (kvo_status, [_StepP, c_size_t, POINTER(kvo_job_info)], True),
    "kvo_step_get_job_blocks": (
        kvo_status,
        [_StepP, c_size_t, _u32p, c_size_t, _u32p, c_size_t],
        True,
    ),
    "kvo_step_get_jobs": (
        kvo_status,
        [_StepP, POINTER(kvo_job_info), c_size_t, _u32p, c_size_t, _sizep, _sizep],
        True,
    ),
    "kvo_step_get_flush": (kvo_status, [_StepP, _u64p, c_size_t, _sizep], True),
    "kvo_step_encode": (kvo_status, [_StepP, _u8p, c_size_t, _sizep], True),
    "kvo_step_decode": (kvo_status, [_StepP, c_char_p, c_size_t], True),
    # -- workers (block copies) ----------------------------------------------------------------
    "kvo_cuda_available": (ctypes.c_int32, [], False),
    "kvo_worker_config_default": (kvo_status, [POINTER(kvo_worker_config)], True),
    "kvo_worker_new": (
        kvo_status,
        [
            POINTER(kvo_worker_config),
            POINTER(kvo_kv_tensor),
            c_size_t,
            POINTER(kvo_host_buffer),
            POINTER(_WorkerP),
        ],
        True,
    ),
    "kvo_worker_free": (None, [_WorkerP], False),
    "kvo_worker_submit_job": (
        kvo_status,
        [_WorkerP, c_uint64, c_uint32, _u32p, c_size_t, _u32p, c_size_t, c_uint32, c_uint64],
        True,
    ),
    "kvo_worker_submit_step": (kvo_status, [_WorkerP, _StepP, c_uint64], True),
    "kvo_worker_submit_stores": (kvo_status, [_WorkerP], True),
    "kvo_worker_poll": (kvo_status, [_WorkerP, POINTER(kvo_completion), c_size_t, _sizep], True),
    "kvo_worker_job_error": (
        kvo_status,
        [_WorkerP, c_uint64, POINTER(c_char), c_size_t, _sizep],
        True,
    ),
    "kvo_worker_wait": (kvo_status, [_WorkerP, _u64p, c_size_t, c_uint64], True),
    "kvo_worker_swap_blocks": (
        kvo_status,
        [_WorkerP, c_uint32, c_uint32, _u32p, _u32p, c_size_t, c_uint32, c_uint64],
        True,
    ),
    "kvo_worker_get_host_buffer": (
        kvo_status,
        [_WorkerP, c_uint32, POINTER(ctypes.c_void_p), _sizep],
        True,
    ),
    "kvo_worker_shutdown": (kvo_status, [_WorkerP], True),
    "kvo_worker_get_stats": (kvo_status, [_WorkerP, POINTER(kvo_worker_stats)], True),
    "kvo_worker_metrics_text": (
        kvo_status,
        [_WorkerP, c_char_p, POINTER(kvo_label), c_size_t, POINTER(c_char), c_size_t, _sizep],
        True,
    ),
}

# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

if sys.platform == "darwin":
    _LIB_NAME = "libkvoffload.dylib"
elif sys.platform == "win32":
    _LIB_NAME = "kvoffload.dll"
else:
    _LIB_NAME = "libkvoffload.so"

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_DIR = os.path.dirname(os.path.dirname(_PKG_DIR))


def _dev_builds():
    """The libraries of a development build of this checkout (``python/kvoffload`` inside the
    repository): ``$CARGO_TARGET_DIR`` or ``<repo>/target``, release before debug."""
    if not os.path.isfile(os.path.join(_REPO_DIR, "Cargo.toml")):
        return []
    target_dirs = []
    if os.environ.get("CARGO_TARGET_DIR"):
        target_dirs.append(os.environ["CARGO_TARGET_DIR"])
    target_dirs.append(os.path.join(_REPO_DIR, "target"))
    return [
        os.path.join(t, profile, *sub, _LIB_NAME)
        for t in target_dirs
        for sub in ((), ("deps",))
        for profile in ("release", "debug")
    ]


def _path_of(handle, fallback):
    """The file a loaded library came from (``dladdr`` of one of its symbols), else
    ``fallback``."""

    class _DlInfo(ctypes.Structure):
        _fields_ = [("fname", c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", c_char_p), ("saddr", ctypes.c_void_p)]

    try:
        dladdr = ctypes.CDLL(None).dladdr
    except (OSError, AttributeError):
        return fallback
    dladdr.argtypes = [ctypes.c_void_p, POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    info = _DlInfo()
    symbol = ctypes.cast(handle.kvo_abi_version, ctypes.c_void_p)
    if dladdr(symbol, ctypes.byref(info)) and info.fname:
        return os.path.abspath(os.fsdecode(info.fname))
    return fallback


def _load():
    """Loads the library, looking in order: ``KVOFFLOAD_LIB``; the library bundled in this
    package (a wheel); the system's search (``LD_LIBRARY_PATH``, the loader cache, then
    ``ctypes.util.find_library``); a development build of this checkout."""
    env = os.environ.get("KVOFFLOAD_LIB")
    if env:
        if not os.path.isfile(env):
            raise ImportError(f"kvoffload: KVOFFLOAD_LIB={env!r} is not a file")
        candidates = [(env, True)]
    else:
        bundled = os.path.join(_PKG_DIR, _LIB_NAME)
        candidates = [(bundled, True)] if os.path.isfile(bundled) else []
        candidates.append((_LIB_NAME, False))
        found = ctypes.util.find_library("kvoffload")
        if found and found != _LIB_NAME:
            candidates.append((found, False))
        candidates += [(p, True) for p in _dev_builds() if os.path.isfile(p)]
    errors = []
    for name, is_path in candidates:
        try:
            handle = ctypes.CDLL(name)
        except OSError as e:
            if is_path:  # a file that exists but does not load: say so, do not fall back
                raise ImportError(f"kvoffload: cannot load {name}: {e}") from e
            errors.append(f"{name}: {e}")
            continue
        return (_path_of(handle, name) if not is_path else os.path.abspath(name)), handle
    raise ImportError(
        f"kvoffload: {_LIB_NAME} not found: not bundled in {_PKG_DIR}, not on the system's "
        "library search path, no development build; `pip install` the package, build it with "
        "`cargo build --release`, or set KVOFFLOAD_LIB. Tried:\n  " + "\n  ".join(errors)
    )


lib_path, lib = _load()
#: The library file loaded (also ``kvoffload.library_path``).
library_path = lib_path


def last_error_message():
    """The calling thread's last error message ("" after a successful call)."""
    n = lib.kvo_last_error_message(None, 0)
    if n == 0:
        return ""
    buf = ctypes.create_string_buffer(n + 1)
    lib.kvo_last_error_message(buf, n + 1)
    return buf.value.decode("utf-8", errors="replace")


def _errcheck(result, func, args):
    if result != Status.OK:
        # Read right away, on the same thread, before any other kvo_* call.
        raise error_for(result, last_error_message())
    return result


def _declare():
    for name, (restype, argtypes, checked) in FUNCTIONS.items():
        try:
            f = getattr(lib, name)
        except AttributeError as e:
            raise ImportError(f"kvoffload: {lib_path} does not export {name}") from e
        f.restype = restype
        f.argtypes = argtypes
        if checked:
            f.errcheck = _errcheck


# kvo_abi_version first, on its own, so that a mismatching library is refused before any other
# declaration is trusted.
lib.kvo_abi_version.restype = c_uint32
lib.kvo_abi_version.argtypes = []
_found_abi = lib.kvo_abi_version()
if _found_abi != ABI_VERSION:
    raise ImportError(
        f"kvoffload: {lib_path} has C ABI version {_found_abi}, these bindings need {ABI_VERSION}"
    )
_declare()


def failure(status):
    """The exception for a failed call's ``status``, with the calling thread's last-error
    message (call right after the failed call, on the same thread)."""
    return error_for(status, last_error_message())


def _fast_argtype(t):
    is_pointer = t is c_char_p or (isinstance(t, type) and issubclass(t, ctypes._Pointer))
    return ctypes.c_void_p if is_pointer else t


#: Every status-returning function bound a second time for the hot paths: the same symbol with
#: every pointer argument as ``c_void_p`` (so addresses, ``bytes`` and ``None`` pass without
#: conversion objects) and no ``errcheck``: the caller tests the returned status itself
#: (``if st: raise failure(st)``).
fast = {}
for _name, (_restype, _argtypes, _checked) in FUNCTIONS.items():
    if _checked:
        _f = lib[_name]
        _f.restype = _restype
        _f.argtypes = [_fast_argtype(t) for t in _argtypes]
        fast[_name] = _f
del _name, _restype, _argtypes, _checked, _f


def version():
    """The library version (``kvo_version()``)."""
    return lib.kvo_version().decode("ascii")

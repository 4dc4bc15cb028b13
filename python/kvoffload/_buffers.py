"""Arguments and results as buffers, with O(1) Python work per call (stdlib only).

Keys go to the library as one bytes-like object of ``n * key_len`` bytes, ids as one buffer of
``uint32`` / ``uint64`` items: ``bytes``, ``bytearray``, ``memoryview``, ``array.array``, numpy
arrays, anything with the buffer protocol; lists stay accepted. Buffers are passed by address,
not copied, and held exported (so that no other thread can resize or free them) until the call
returns: the ``keep`` value each helper returns must stay referenced until then.

Results come back as ``array.array`` objects and :class:`Keys`, filled by the library.
"""

import ctypes
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Sequence as _Seq, Union

from ctypes import c_char_p, c_int, c_ssize_t, c_void_p, py_object

__all__ = ["Keys", "KeysLike", "IdsLike", "IdsOut"]

#: A keys argument: one bytes-like object of ``n * key_len`` bytes (anything with the buffer
#: protocol), or a sequence of ``key_len``-byte keys.
KeysLike = Union[bytes, bytearray, memoryview, _Seq[bytes], Any]
#: Ids: a buffer of ``uint32`` / ``uint64`` items (``array``, numpy) or a sequence of ints.
IdsLike = Union[_Seq[int], Any]
#: A writable buffer of ``uint32`` items for results (``array('I')``, numpy ``uint32``).
IdsOut = Any

assert array("I").itemsize == 4 and array("Q").itemsize == 8

_PyBUF_WRITABLE = 0x0001
_PyBUF_FORMAT = 0x0004
_PyBUF_ND = 0x0008
_MAX_U32 = 2**32 - 1
_MAX_U64 = 2**64 - 1


class _Py_buffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable since 3.3; ``obj`` as a plain pointer: the release
    function drops its reference)."""

    _fields_ = [
        ("buf", c_void_p),
        ("obj", c_void_p),
        ("len", c_ssize_t),
        ("itemsize", c_ssize_t),
        ("readonly", c_int),
        ("ndim", c_int),
        ("format", c_char_p),
        ("shape", c_void_p),
        ("strides", c_void_p),
        ("suboffsets", c_void_p),
        ("internal", c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [py_object, c_void_p, c_int]
_get_buffer.restype = c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [c_void_p]
_release_buffer.restype = None

# Formats of native unsigned 32- and 64-bit items ("<"/">" only where they are native).
_NATIVE = "<" if sys.byteorder == "little" else ">"
_U32_FORMATS = frozenset(p + c for p in ("", "@", "=", _NATIVE) for c in "IL" if ctypes.sizeof(
    ctypes.c_uint if c == "I" else ctypes.c_ulong) == 4)
_U64_FORMATS = frozenset(
    p + c
    for p in ("", "@", "=", _NATIVE)
    for c in "LQ"
    if ctypes.sizeof(ctypes.c_ulong if c == "L" else ctypes.c_ulonglong) == 8
)
_INT_CODES = frozenset("bBhHiIlLqQnN")
_BYTE_FORMATS = frozenset(p + c for p in ("", "@", "=", "<", ">", "!") for c in "Bbc")


class _Export:
    """One buffer export of a Python object, released when this object goes away."""

    __slots__ = ("view", "__weakref__")

    def __init__(self, obj, writable, name):
        self.view = None
        view = _Py_buffer()
        try:
            flags = _PyBUF_FORMAT | _PyBUF_ND | (_PyBUF_WRITABLE if writable else 0)
            _get_buffer(obj, ctypes.addressof(view), flags)
        except BufferError as e:
            what = "a writable contiguous buffer" if writable else "a contiguous buffer"
            raise TypeError(f"{name}: expected {what} ({e})") from None
        except TypeError:
            kind = "writable buffer" if writable else "bytes-like object or a list"
            raise TypeError(f"{name}: expected a {kind}, got {type(obj).__name__}") from None
        self.view = view

    def __del__(self):
        view = self.view
        if view is not None:
            self.view = None
            _release_buffer(ctypes.addressof(view))

    @property
    def format(self):
        f = self.view.format
        return "B" if f is None else f.decode("ascii", "replace")


def _check_items(exp, formats, size, name, what):
    v = exp.view
    if v.itemsize != size or exp.format not in formats:
        raise TypeError(
            f"{name}: expected a buffer of {what} items, got format {exp.format!r} "
            f"of {v.itemsize} bytes"
        )
    if v.buf is not None and v.buf % size:
        raise ValueError(f"{name}: buffer address {v.buf:#x} is not aligned to {size} bytes")


def keys_arg(keys, key_len, name="keys"):
    """``(arg, n, keep)`` for a keys argument: one bytes-like object of ``n * key_len`` bytes, or
    a list / tuple of ``key_len``-byte keys."""
    t = type(keys)
    if t is bytes:
        n, rest = divmod(len(keys), key_len)
        if rest:
            raise ValueError(f"{name}: {len(keys)} bytes is not a multiple of key_len {key_len}")
        return keys, n, None
    if t is list or t is tuple:
        return _joined(keys, key_len, name), len(keys), None
    if t is str:
        raise TypeError(f"{name}: expected bytes or a list of bytes keys, got str")
    exp = _Export(keys, False, name)
    v = exp.view
    if exp.format not in _BYTE_FORMATS:
        raise TypeError(f"{name}: expected a buffer of bytes, got format {exp.format!r}")
    n, rest = divmod(v.len, key_len)
    if rest:
        raise ValueError(f"{name}: {v.len} bytes is not a multiple of key_len {key_len}")
    return v.buf, n, exp


def _joined(keys, key_len, name):
    if keys:
        try:
            data = b"".join(keys)
            # Every key at least key_len long and all of them n * key_len: each exactly key_len.
            if len(data) == len(keys) * key_len and min(map(len, keys)) == key_len:
                return data
        except TypeError:
            pass
    else:
        return b""
    for i, k in enumerate(keys):
        if not isinstance(k, (bytes, bytearray, memoryview)):
            raise TypeError(f"{name}[{i}]: expected bytes, got {type(k).__name__}")
        if len(k) != key_len:
            raise ValueError(f"{name}[{i}]: {len(k)} bytes, key_len is {key_len}")
    raise ValueError(f"{name}: keys of mixed formats")  # pragma: no cover (memoryview items)


def _int_list(values, name, maximum):
    for i, v in enumerate(values):
        if type(v) is not int:
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise TypeError(f"{name}[{i}]: expected an int, got {type(v).__name__}")
            v = v.__index__()
        if not 0 <= v <= maximum:
            raise ValueError(f"{name}[{i}]: {v} is not in 0..={maximum}")


def u32_arg(values, name):
    """``(arg, n, keep)`` for ``uint32`` ids: a buffer of native ``uint32`` items (an
    ``array('I')``, a numpy ``uint32`` array, ...) or a list / tuple / other iterable of ints
    (other integer buffers are converted, each value checked)."""
    if type(values) is array and values.typecode == "I":
        # By address; the memoryview holds an export, so no thread can resize it meanwhile.
        return values.buffer_info()[0], len(values), memoryview(values)
    return _ids_arg(values, name, "I", _U32_FORMATS, 4, _MAX_U32, "uint32")


def u64_arg(values, name):
    """As :func:`u32_arg` for ``uint64`` ids (``array('Q')``, numpy ``uint64``)."""
    if type(values) is array and values.typecode == "Q":
        return values.buffer_info()[0], len(values), memoryview(values)
    return _ids_arg(values, name, "Q", _U64_FORMATS, 8, _MAX_U64, "uint64")


def _ids_arg(values, name, code, formats, size, maximum, what):
    t = type(values)
    if t is list or t is tuple:
        if not values:
            return None, 0, None
        try:
            a = array(code, values)
        except (TypeError, OverflowError):
            _int_list(values, name, maximum)
            raise
        return a.buffer_info()[0], len(a), a
    if isinstance(values, (str, bytes)) or values is None:
        raise TypeError(f"{name}: expected a sequence of ints or a {what} buffer, got "
                        f"{type(values).__name__}")
    try:
        exp = _Export(values, False, name)
    except TypeError:
        try:
            values = list(values)
        except TypeError:
            raise TypeError(f"{name}: expected a sequence of ints or a {what} buffer, got "
                            f"{type(values).__name__}") from None
        return _ids_arg(values, name, code, formats, size, maximum, what)
    fmt = exp.format
    native = fmt[1:] if fmt[:1] in ("@", "=", _NATIVE) else fmt
    if fmt not in formats and native in _INT_CODES:
        # Another integer type (numpy's default int64, say): converted, each value checked.
        values = memoryview(values).cast("B").cast(native)
        del exp
        return _ids_arg(values.tolist(), name, code, formats, size, maximum, what)
    _check_items(exp, formats, size, name, what)
    v = exp.view
    return v.buf, v.len // size, exp


def u32_out(out, n, name="out"):
    """``(address, keep)`` of a writable buffer of at least ``n`` native ``uint32`` items."""
    if type(out) is array and out.typecode == "I":
        if len(out) < n:
            raise ValueError(f"{name}: room for {len(out)} ids, {n} needed")
        return out.buffer_info()[0], memoryview(out)  # the view holds an export
    exp = _Export(out, True, name)
    _check_items(exp, _U32_FORMATS, 4, name, "uint32")
    if exp.view.len < 4 * n:
        raise ValueError(f"{name}: room for {exp.view.len // 4} ids, {n} needed")
    return exp.view.buf, exp


_ZEROS = 1 << 14
_ZERO_U32 = array("I", bytes(4 * _ZEROS))


def u32_zeros(n):
    """A new ``array('I')`` of ``n`` zeros (a slice of a zeroed template: one copy, no
    conversion) and its address."""
    a = _ZERO_U32[:n] if n <= _ZEROS else array("I", bytes(4 * n))
    return a, a.buffer_info()[0]


_set = object.__setattr__


class Keys(Sequence):
    """``n`` keys of ``key_len`` bytes each, held as one bytes object (``data``). Indexing gives
    one key as ``bytes`` (a slice gives :class:`Keys`); equal to a list of the same keys."""

    __slots__ = ("data", "key_len")

    def __init__(self, data, key_len):
        _set(self, "data", data)
        _set(self, "key_len", key_len)

    def __setattr__(self, name, value):
        raise AttributeError("Keys are read-only")

    def __len__(self):
        return len(self.data) // self.key_len

    def __getitem__(self, i):
        kl = self.key_len
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step == 1:
                return Keys(self.data[start * kl : max(start, stop) * kl], kl)
            return Keys(b"".join(self[j] for j in range(start, stop, step)), kl)
        n = len(self.data) // kl
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("Keys index out of range")
        return self.data[i * kl : (i + 1) * kl]

    def __iter__(self):
        data, kl = self.data, self.key_len
        return (data[i : i + kl] for i in range(0, len(data), kl))

    def __eq__(self, other):
        if isinstance(other, Keys):
            return self.key_len == other.key_len and self.data == other.data
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self):
        return f"Keys({len(self)} keys of {self.key_len} bytes)"

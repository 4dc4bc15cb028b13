"""A handle's stats as Prometheus text (``kvo_*_metrics_text``), and the same metrics as plain
dicts for a ``prometheus_client`` collector (stdlib only)."""

import ctypes
import re
from typing import Dict, Mapping, Optional

from . import _ffi
from ._ffi import BufferTooSmallError


def metrics_text(fn, handle, prefix: str, labels: Optional[Mapping[str, str]]) -> str:
    """Calls ``fn`` (a ``kvo_*_metrics_text`` function) on ``handle``, growing the buffer until
    the text fits (counters may grow between calls)."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
    items = list((labels or {}).items())
    for name, value in items:
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"labels: {name!r}: names and values must be str")
    keep = [(n.encode(), v.encode()) for n, v in items]
    arr = (_ffi.kvo_label * max(len(keep), 1))(*[_ffi.kvo_label(n, v) for n, v in keep])
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        n = ctypes.c_size_t(0)
        try:
            fn(handle, prefix.encode(), arr, len(keep), buf, size, ctypes.byref(n))
        except BufferTooSmallError:
            size = n.value + n.value // 4 + 64
            continue
        return buf.raw[: n.value].decode()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)",?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(s: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], s)


def parse(text: str) -> Dict[str, dict]:
    """The library's metrics text as ``{family: {"type", "help", "samples"}}``, ``samples`` a list
    of ``(sample name, labels dict, value)``. Family names follow ``prometheus_client``: a
    counter's family has no ``_total`` (its samples do), so that a collector can build
    ``prometheus_client.core.Metric(name, help, type)`` and ``add_sample`` each sample."""
    families: Dict[str, dict] = {}
    current: Optional[dict] = None
    helps: Dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            helps[name] = doc.replace("\\n", "\n").replace("\\\\", "\\")
        elif line.startswith("# TYPE "):
            name, _, typ = line[7:].partition(" ")
            family = name
            if typ == "counter" and name.endswith("_total"):
                family = name[: -len("_total")]
            current = {"type": typ, "help": helps.get(name, ""), "samples": []}
            families[family] = current
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            if m is None or current is None:
                raise ValueError(f"unexpected metrics line {line!r}")
            labels = {k: _unescape(v) for k, v in _LABEL.findall(m.group(2) or "")}
            current["samples"].append((m.group(1), labels, float(m.group(3))))
    return families


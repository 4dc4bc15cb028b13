"""The ctypes declarations of kvoffload._ffi must match include/kvoffload.h.

Parses the header's prototypes (cbindgen output is regular enough for regular expressions)
and checks, for every exported function: it is declared in the wrapper with ``argtypes`` and
``restype`` set, the same number of arguments, and compatible ctypes types (pointer vs integer,
integer width and signedness, pointee types, struct pointees, pointer depth); status-returning
functions have the errcheck. The wrapper must declare nothing the header lacks. Struct layouts
and the constants are compared as well.
"""

import ctypes
import os
import re
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))

import kvoffload  # noqa: E402
from kvoffload import _ffi  # noqa: E402

HEADER = os.path.join(HERE, os.pardir, os.pardir, "include", "kvoffload.h")

_INT_TYPES = {
    "int8_t": (8, True),
    "uint8_t": (8, False),
    "int16_t": (16, True),
    "uint16_t": (16, False),
    "int32_t": (32, True),
    "uint32_t": (32, False),
    "int64_t": (64, True),
    "uint64_t": (64, False),
    "size_t": (ctypes.sizeof(ctypes.c_size_t) * 8, False),
    "uintptr_t": (ctypes.sizeof(ctypes.c_void_p) * 8, False),
    "int": (ctypes.sizeof(ctypes.c_int) * 8, True),
    "char": (8, None),  # signedness is the platform's: not compared
}


def _strip(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    # Preprocessor lines (with continuations).
    text = re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.M)
    return text


def read_header(path=HEADER):
    with open(path, encoding="utf-8") as f:
        return f.read()


def parse_header(text):
    """Returns (functions, typedefs, structs, constants).

    functions: name -> (return type string, [parameter type strings])
    typedefs:  alias -> integer type (``typedef int32_t kvo_status;``)
    structs:   name -> [(field type string, field name)] (opaque structs map to None)
    constants: name -> int (``#define KVO_X 1`` and enumerators)
    """
    constants = {}
    limits = {"UINT64_MAX": 2**64 - 1, "UINT32_MAX": 2**32 - 1, "SIZE_MAX": 2**64 - 1}
    for name, value in re.findall(
        r"^\s*#define\s+(\w+)\s+(\d+|UINT64_MAX|UINT32_MAX|SIZE_MAX)\s*$", text, flags=re.M
    ):
        constants[name] = int(value) if value.isdigit() else limits[value]
    body = _strip(text)
    typedefs = dict(
        (alias, base)
        for base, alias in re.findall(r"\btypedef\s+(u?int\d+_t|size_t)\s+(\w+)\s*;", body)
    )
    for enum_body in re.findall(r"\benum\s+\w+[^{;]*\{([^}]*)\}", body):
        for name, value in re.findall(r"\b(KVO_\w+)\s*=\s*(-?\d+)", enum_body):
            constants[name] = int(value)
    structs = {}
    for name, fields in re.findall(r"\btypedef\s+struct\s+(\w+)\s*\{([^}]*)\}\s*\w+\s*;", body):
        structs[name] = [
            (" ".join(t.split()) + (f"[{dim}]" if dim else ""), n)
            for t, n, dim in re.findall(r"([\w\s\*]+?)\s*\b(\w+)\s*(?:\[(\w+)\])?\s*;", fields)
        ]
    for name, alias in re.findall(r"\btypedef\s+struct\s+(\w+)\s+(\w+)\s*;", body):
        structs.setdefault(name, None)
    functions = {}
    proto = re.compile(
        r"^\s*((?:const\s+)?(?:struct\s+)?\w+(?:\s*\*)*)\s*\b(kvo_\w+)\s*\(([^()]*)\)\s*$"
    )
    body = body.replace("KVO_NODISCARD", " ")
    # Each declaration ends at ';'; braces end struct and enum bodies.
    for chunk in re.split(r"[;{}]", body):
        m = proto.match(chunk)
        if m is None:
            continue
        ret, name, params = m.groups()
        params = params.strip()
        if params in ("", "void"):
            args = []
        else:
            args = []
            for p in params.split(","):
                p = " ".join(p.split())
                m = re.match(r"^(.*?[\s\*])(\w+)$", p)
                if m is None:
                    raise AssertionError(f"{name}: cannot parse parameter {p!r}")
                args.append(m.group(1).strip())
        functions[name] = (" ".join(ret.split()), args)
    return functions, typedefs, structs, constants


# -- type descriptors ----------------------------------------------------------------------------
# ("void",) | ("int", bits, signed) | ("struct", name) | ("ptr", descriptor)


def c_type(t, typedefs, constants=None):
    m = re.match(r"^(.*)\[(\w+)\]$", t)
    if m is not None:  # an array field: `uint64_t x[KVO_N]`
        dim = m.group(2)
        n = int(dim) if dim.isdigit() else (constants or {})[dim]
        return ("array", c_type(m.group(1), typedefs), n)
    t = " ".join(t.replace("*", " * ").split())
    stars = t.count("*")
    base = t.replace("*", " ")
    words = [w for w in base.split() if w not in ("const", "volatile")]
    if words and words[0] == "struct":
        d = ("struct", words[1])
    else:
        (w,) = words
        w = typedefs.get(w, w)
        if w == "void":
            d = ("void",)
        elif w in _INT_TYPES:
            d = ("int",) + _INT_TYPES[w]
        elif w in ("double", "float"):
            d = ("float", 64 if w == "double" else 32)
        elif w.startswith("kvo_"):
            d = ("struct", w)
        else:
            raise AssertionError(f"unknown C type {w!r} in {t!r}")
    for _ in range(stars):
        d = ("ptr", d)
    return d


_STRUCT_NAMES = {cls: name for name, cls in _ffi.STRUCTS.items()}


def py_type(t):
    if t is None:
        return ("void",)
    if t is ctypes.c_char_p:
        return ("ptr", ("int", 8, None))
    if t is ctypes.c_void_p:
        return ("ptr", ("void",))
    if t is ctypes.c_char:
        return ("int", 8, None)
    if t is ctypes.c_double:
        return ("float", 64)
    if t is ctypes.c_float:
        return ("float", 32)
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return ("ptr", py_type(t._type_))
    if isinstance(t, type) and issubclass(t, ctypes.Array):
        return ("array", py_type(t._type_), t._length_)
    if isinstance(t, type) and issubclass(t, ctypes.Structure):
        if t not in _STRUCT_NAMES:
            raise AssertionError(f"{t.__name__} is not in _ffi.STRUCTS")
        return ("struct", _STRUCT_NAMES[t])
    if isinstance(t, type) and issubclass(t, ctypes._SimpleCData) and t._type_ in "bBhHiIlLqQ":
        return ("int", ctypes.sizeof(t) * 8, t(-1).value < 0)
    raise AssertionError(f"unexpected ctypes type {t!r}")


def compatible(c, p):
    """Whether ctypes descriptor ``p`` fits C descriptor ``c``; returns a reason or None."""
    if c[0] != p[0]:
        return f"{c[0]} in the header, {p[0]} in the wrapper"
    if c[0] == "ptr":
        r = compatible(c[1], p[1])
        return None if r is None else f"pointee: {r}"
    if c[0] == "array":
        if c[2] != p[2]:
            return f"{c[2]} elements in the header, {p[2]} in the wrapper"
        r = compatible(c[1], p[1])
        return None if r is None else f"element: {r}"
    if c[0] == "int":
        if c[1] != p[1]:
            return f"{c[1]}-bit in the header, {p[1]}-bit in the wrapper"
        if c[2] is not None and p[2] is not None and c[2] != p[2]:
            return "signedness differs"
        return None
    if c[0] == "float" and c[1] != p[1]:
        return f"{c[1]}-bit float in the header, {p[1]}-bit in the wrapper"
    if c[0] == "struct" and c[1] != p[1]:
        return f"struct {c[1]} in the header, {p[1]} in the wrapper"
    return None


class ParserTest(unittest.TestCase):
    """The parser itself, on a small sample, so that a silent parse failure cannot pass."""

    SAMPLE = """
    #define KVO_ABI_VERSION 3
    typedef int32_t kvo_status;
    enum kvo_x { KVO_X_A = 0, KVO_X_B = 7, };
    typedef struct kvo_y kvo_y;
    typedef struct kvo_cfg { size_t struct_size; uint32_t a; } kvo_cfg;
    /** doc (with parens) */
    size_t kvo_a(char *buf, size_t len);
    uint32_t kvo_b(void);
    const char *kvo_c(void);
    KVO_NODISCARD
    kvo_status kvo_d(struct kvo_y *m,
                     const uint8_t *keys,
                     struct kvo_y **out);
    void kvo_e(struct kvo_y *m);
    """

    def test_sample(self):
        f, td, st, consts = parse_header(self.SAMPLE)
        self.assertEqual(
            f,
            {
                "kvo_a": ("size_t", ["char *", "size_t"]),
                "kvo_b": ("uint32_t", []),
                "kvo_c": ("const char *", []),
                "kvo_d": ("kvo_status", ["struct kvo_y *", "const uint8_t *", "struct kvo_y **"]),
                "kvo_e": ("void", ["struct kvo_y *"]),
            },
        )
        self.assertEqual(td, {"kvo_status": "int32_t"})
        self.assertEqual(st, {"kvo_cfg": [("size_t", "struct_size"), ("uint32_t", "a")],
                              "kvo_y": None})
        self.assertEqual(consts, {"KVO_ABI_VERSION": 3, "KVO_X_A": 0, "KVO_X_B": 7})
        self.assertEqual(c_type("struct kvo_y **", td), ("ptr", ("ptr", ("struct", "kvo_y"))))
        self.assertEqual(c_type("kvo_status", td), ("int", 32, True))
        # Array fields, their length a number or a constant.
        _, _, st2, _ = parse_header("typedef struct kvo_h { uint64_t b[KVO_N]; double x; } kvo_h;")
        self.assertEqual(st2, {"kvo_h": [("uint64_t[KVO_N]", "b"), ("double", "x")]})
        arr = c_type("uint64_t[KVO_N]", td, {"KVO_N": 4})
        self.assertEqual(arr, ("array", ("int", 64, False), 4))
        self.assertIsNone(compatible(arr, py_type(ctypes.c_uint64 * 4)))
        self.assertIsNotNone(compatible(arr, py_type(ctypes.c_uint64 * 3)))
        self.assertIsNotNone(compatible(arr, py_type(ctypes.c_uint32 * 4)))

    def test_mismatches_are_detected(self):
        td = {"kvo_status": "int32_t"}
        self.assertIsNotNone(compatible(c_type("size_t", td), py_type(ctypes.c_uint32)))
        self.assertIsNotNone(compatible(c_type("uint32_t", td), py_type(ctypes.c_uint64)))
        self.assertIsNotNone(compatible(c_type("uint32_t", td), py_type(ctypes.c_int32)))
        self.assertIsNotNone(compatible(c_type("size_t *", td), py_type(ctypes.c_size_t)))
        self.assertIsNotNone(
            compatible(c_type("size_t *", td), py_type(ctypes.POINTER(ctypes.c_uint32)))
        )
        self.assertIsNotNone(
            compatible(c_type("struct kvo_manager *", td),
                       py_type(ctypes.POINTER(ctypes.POINTER(_ffi._Manager))))
        )
        self.assertIsNotNone(
            compatible(c_type("struct kvo_event *", td),
                       py_type(ctypes.POINTER(_ffi.kvo_manager_stats)))
        )
        self.assertIsNone(compatible(c_type("const uint8_t *", td), py_type(ctypes.c_char_p)))
        self.assertIsNone(compatible(c_type("size_t", td), py_type(ctypes.c_size_t)))


class HeaderDriftTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.functions, cls.typedefs, cls.structs, cls.constants = parse_header(read_header())

    def test_header_was_parsed(self):
        # Every `kvo_...(` prototype start in the header must have been parsed.
        body = _strip(read_header())
        starts = set(re.findall(r"\b(kvo_\w+)\s*\(", body))
        self.assertEqual(starts, set(self.functions))
        self.assertGreaterEqual(len(self.functions), 17)
        self.assertIn("kvo_status", self.typedefs)

    def test_every_header_function_is_declared(self):
        missing = sorted(set(self.functions) - set(_ffi.FUNCTIONS))
        self.assertEqual(missing, [], "functions of the header without a ctypes declaration")

    def test_wrapper_declares_nothing_the_header_lacks(self):
        extra = sorted(set(_ffi.FUNCTIONS) - set(self.functions))
        self.assertEqual(extra, [], "ctypes declarations of functions not in the header")
        # Every function the wrapper touched on the CDLL object (CDLL caches them as attributes).
        touched = {n for n in vars(_ffi.lib) if n.startswith("kvo_")}
        self.assertEqual(sorted(touched - set(self.functions)), [])

    def test_signatures_match(self):
        for name, (ret, params) in sorted(self.functions.items()):
            with self.subTest(function=name):
                f = getattr(_ffi.lib, name)
                self.assertIsNotNone(f.argtypes, f"{name}: argtypes not set")
                self.assertEqual(
                    len(f.argtypes), len(params), f"{name}: argument count differs"
                )
                for i, (ct, pt) in enumerate(zip(params, f.argtypes)):
                    why = compatible(c_type(ct, self.typedefs), py_type(pt))
                    self.assertIsNone(why, f"{name} argument {i} ({ct}): {why}")
                # ctypes' default restype is c_int, which is right only for a 32-bit signed
                # return (kvo_status, where c_int32 is c_int); any other return type must have
                # been set, or the comparison below fails.
                why = compatible(c_type(ret, self.typedefs), py_type(f.restype))
                self.assertIsNone(why, f"{name} return ({ret}): {why}")
                if ret == "kvo_status":
                    self.assertIs(f.errcheck, _ffi._errcheck, f"{name}: no errcheck")
                else:
                    self.assertFalse(hasattr(f, "errcheck") and f.errcheck is _ffi._errcheck,
                                     f"{name}: errcheck on a function without kvo_status")

    def test_fast_bindings_match(self):
        """The hot-path bindings (``_ffi.fast``): every status-returning function, the same
        argument count, integers exactly as the header's, every pointer as ``c_void_p``, no
        errcheck (their callers test the status)."""
        status_fns = {n for n, (ret, _p) in self.functions.items() if ret == "kvo_status"}
        self.assertEqual(sorted(_ffi.fast), sorted(status_fns))
        for name in sorted(status_fns):
            with self.subTest(function=name):
                f = _ffi.fast[name]
                params = self.functions[name][1]
                self.assertEqual(len(f.argtypes), len(params), f"{name}: argument count differs")
                for i, (ct, pt) in enumerate(zip(params, f.argtypes)):
                    if "*" in ct:
                        self.assertIs(pt, ctypes.c_void_p, f"{name} argument {i} ({ct})")
                    else:
                        why = compatible(c_type(ct, self.typedefs), py_type(pt))
                        self.assertIsNone(why, f"{name} argument {i} ({ct}): {why}")
                self.assertIs(f.restype, ctypes.c_int32)
                self.assertIsNone(f.errcheck)

    def test_void_functions_have_restype_none(self):
        for name, (ret, _params) in self.functions.items():
            if ret == "void":
                self.assertIsNone(getattr(_ffi.lib, name).restype, name)

    def test_structs_match(self):
        declared = {n for n, fields in self.structs.items() if fields is not None}
        opaque = {n for n, fields in self.structs.items() if fields is None}
        self.assertEqual(set(_ffi.STRUCTS), declared | opaque)
        for name in opaque:
            self.assertEqual(getattr(_ffi.STRUCTS[name], "_fields_", []), [], name)
        for name in declared:
            with self.subTest(struct=name):
                cls = _ffi.STRUCTS[name]
                c_fields = self.structs[name]
                py_fields = cls._fields_
                self.assertEqual([n for _, n in c_fields], [n for n, _ in py_fields])
                for (ct, fname), (_, pt) in zip(c_fields, py_fields):
                    why = compatible(c_type(ct, self.typedefs, self.constants), py_type(pt))
                    self.assertIsNone(why, f"{name}.{fname}: {why}")

    def test_constants_match(self):
        self.assertIn("KVO_ABI_VERSION", self.constants)
        for name, value in self.constants.items():
            with self.subTest(constant=name):
                self.assertTrue(hasattr(kvoffload, name), f"kvoffload.{name} missing")
                self.assertEqual(getattr(kvoffload, name), value)
        self.assertEqual(kvoffload.ABI_VERSION, self.constants["KVO_ABI_VERSION"])
        # The IntEnums mirror the C enums, member for member.
        prefixes = []
        for enum_cls, prefix in _ffi.ENUMS:
            prefixes.append(prefix)
            c = {n[len(prefix):]: v for n, v in self.constants.items() if n.startswith(prefix)}
            self.assertEqual({m.name: int(m) for m in enum_cls}, c, enum_cls.__name__)
        # Every C enum of the header has its IntEnum.
        body = _strip(read_header())
        for enum_name, enum_body in re.findall(r"\benum\s+(\w+)[^{;]*\{([^}]*)\}", body):
            first = re.search(r"\b(KVO_\w+)\s*=", enum_body).group(1)
            self.assertTrue(
                any(first.startswith(p) for p in prefixes),
                f"enum {enum_name} has no IntEnum in _ffi.ENUMS",
            )


if __name__ == "__main__":
    unittest.main()

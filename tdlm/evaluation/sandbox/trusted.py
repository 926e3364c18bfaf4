"""The trusted side of the verdict (issue 28): decode what the sample sent back and evaluate the asserts, under
explicit budgets, in a short-lived child process of the evaluator that never runs candidate code.

The evaluator runs this file as ``python -I -S -B trusted.py`` (a small pool of them, reused:
:func:`tdlm.evaluation.sandbox.verdict.judge`); each job comes on stdin as ``marshal`` of plain data written by the
evaluator (never by the sample), the answer goes to stdout the same way. The sample's bytes are only ever parsed
here, as JSON lines, by :func:`decode_values`: tagged builtins, and dict views, ``range``, ``bytearray``,
``Fraction``, ``Decimal``, ``deque``, ``Counter``, ``OrderedDict``, ``defaultdict``, namedtuples, ``datetime``
values, ``Enum`` members, dataclass instances and a lazy iterator (the whole value only: its drained items,
replayed by a fresh generator / ``map`` / ``filter`` that ends as the sample's did - exhausted, the exception it
raised, cut at a list's budgets, or at an item that changed after it was yielded) rebuilt as those types; nan
objects a value holds twice are one object again. The sample's decimal context and int-digit limit, where it sent
them, are put in place for its check (:func:`_apply_state`). Each check is evaluated
with the values bound as globals, so a lambda or a comprehension body reads them as any name (as eval locals a
nested scope could not on 3.11, and a comprehension could on 3.12). Budgets (:data:`BUDGETS`): nesting depth,
elements per value (every decoded node counts), hex digits of an int / float, characters of a Decimal, CPU seconds
per job (``ITIMER_PROF``, whose default action ends this process mid-call; the evaluator then starts a fresh one),
address space (``RLIMIT_AS``) and the values file's cap (``value_bytes``: the sample's drain of a lazy value stops
there, as ``elements`` bounds its items, so a drained value has a list's budgets). A value past a budget fails its
sample; so does any exception (OverflowError of ``float.fromhex("0x1p+99999")``, MemoryError, a TypeError of the
assert), with one line; a process killed by its CPU limit is reported by the evaluator. Nothing raises out of
here, and the evaluator never spends more than the budget on one sample: a set of hash-colliding ints costs
quadratic time to build, but only up to the CPU limit.

Stdlib only, and importable as a module (the unit tests call :func:`decode_values` / :func:`judge_job` directly).
"""

from __future__ import annotations

import builtins
import sys

# the C scanner of the json package; importing json (re, enum) or typing would double this process's start-up
from _json import make_scanner

TRUSTED_FILE = __file__  # the trusted child runs this file as a script (verdict.py starts it)

BUDGETS = {
    "depth": 64,  # nesting of one value (lists of lists ...)
    "elements": 200_000,  # decoded nodes of one value (each value its own budget; the values file is capped)
    "int_hex_digits": 4096,  # one int: 16,384 bits (about 4,900 decimal digits)
    "float_chars": 40,  # one float.hex() string ("-0x1.fffffffffffffp+1023" is 24)
    "decimal_chars": 8192,  # one decimal.Decimal string
    "value_bytes": 4 << 20,  # the values file's cap (SandboxLimits.value_bytes); a drained lazy value stops there
    "cpu_s": 1,  # CPU seconds of one job (ITIMER_PROF)
    "memory_bytes": 1 << 30,  # RLIMIT_AS of this process
}
PLACEHOLDER = "_tdlm_v"
SEQUENCES = {"l": list, "t": tuple, "s": set, "z": frozenset}
VIEWS = {"vk": lambda xs: dict.fromkeys(xs).keys(), "vv": lambda xs: dict(enumerate(xs)).values(),
         "vi": lambda xs: dict(xs).items(), "Ovk": lambda xs: _odict().fromkeys(xs).keys(),
         "Ovv": lambda xs: _odict()(enumerate(xs)).values(), "Ovi": lambda xs: _odict()(xs).items()}  # fmt: skip
LAZY_KINDS = ("generator", "map", "filter", "iterator")
LAZY_ENDS = ("end", "err", "cut", "changed")


def _odict() -> type:
    from collections import OrderedDict  # on demand: the start-up imports nothing it does not need

    return OrderedDict


def _replay(items: list, end: str, why: str):  # noqa: ANN202 - a generator
    """The sample's lazy value as the assert consumes it: its items, then its end (exhausted, the exception it
    raised there, the cut at a list's budgets, or an item that changed after it was yielded), at the same place."""
    yield from items
    if end == "err":
        raise RuntimeError(f"the candidate's iterator raised {why} after {len(items)} items")
    if end == "cut":
        raise RuntimeError(f"the candidate's iterator was cut after {len(items)} items (a list's budgets)")
    if end == "changed":  # Python's consumer would read it in another state than it had when it was yielded
        raise RuntimeError(f"a lazy value's item changed after it was yielded: {why}")


def lazy(kind: str, items: list, end: str, why: str) -> object:
    """A fresh iterator of ``kind`` (a generator, a ``map`` / ``filter`` object) that replays ``items``."""
    g = _replay(items, end, why)
    if kind == "map":
        return map(_same, g)
    if kind == "filter":
        return filter(_keep, g)
    return g


def _same(x: object) -> object:
    return x


def _keep(x: object) -> bool:
    return True


class _JSONContext:
    """What the C scanner reads from a ``json.JSONDecoder``: strict JSON, no NaN / Infinity literals."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    memo: dict = {}

    @staticmethod
    def parse_constant(name: str) -> object:
        raise ValueError(f"{name} is not a JSON value here")


_scan = make_scanner(_JSONContext())


def _json_line(line: bytes) -> object:
    text = line.decode("utf-8").strip(" \t\r")
    obj, end = _scan(text, 0)  # StopIteration for an empty or non-JSON line
    if end != len(text):
        raise ValueError("extra data after the JSON value")
    return obj


class BadValue(ValueError):
    """What the sample sent back is not a value of the allowed builtin types, or it is past a budget."""


class _Decoder:
    def __init__(self, budgets: dict[str, int]) -> None:
        self.b = budgets
        self.left = budgets["elements"]
        self.nans: list = []  # this value's nan objects, by the sample's numbering (identity kept)
        self.classes: dict = {}  # the namedtuple / Enum / dataclass classes this job rebuilt

    def start(self) -> None:
        """A new value: budgets are per value (three asserts on one long list each get the whole budget)."""
        self.left, self.nans = self.b["elements"], []

    def number(self, tag: str, text: object, limit: int) -> object:
        if not isinstance(text, str) or len(text) > limit:
            raise BadValue(f"a {tag!r} literal longer than {limit} characters")
        if tag == "i":
            return int(text, 16)  # hex: no int/str digit limit, linear time
        return float.fromhex(text)

    def value(self, x: object, depth: int) -> object:
        self.left -= 1
        if self.left < 0:
            raise BadValue(f"more than {self.b['elements']} elements")
        if depth > self.b["depth"]:
            raise BadValue(f"nested deeper than {self.b['depth']}")
        if x is None or isinstance(x, (bool, str)):  # JSON null / true / false / string map to themselves
            return x
        if type(x) is not list or not x or not isinstance(x[0], str):
            raise BadValue(f"not a tagged value: {type(x).__name__}")
        tag, rest = x[0], x[1:]
        if tag == "i" and len(rest) == 1:
            return self.number("i", rest[0], self.b["int_hex_digits"] + 1)  # + 1: a minus sign
        if tag == "f" and len(rest) == 1:
            return self.number("f", rest[0], self.b["float_chars"])
        if tag == "c" and len(rest) == 2:
            return complex(*(self.number("f", r, self.b["float_chars"]) for r in rest))
        if tag == "b" and len(rest) == 1 and isinstance(rest[0], str):
            return bytes.fromhex(rest[0])
        if tag in SEQUENCES and len(rest) == 1 and type(rest[0]) is list:
            items = [self.value(v, depth + 1) for v in rest[0]]
            return SEQUENCES[tag](items)  # TypeError for an unhashable element
        if tag == "d" and len(rest) == 1 and type(rest[0]) is list:
            return dict(self.pairs(rest[0], depth))
        return self.other(tag, rest, depth)

    def pairs(self, raw: list, depth: int) -> list:
        items = [self.value(v, depth + 1) for v in raw]
        if not all(type(kv) is tuple and len(kv) == 2 for kv in items):
            raise BadValue("a dict item is not a (key, value) pair")
        return items

    def other(self, tag: str, rest: list, depth: int) -> object:
        """The values a plain builtin cannot hold: dict views, ``range``, ``bytearray``, ``Fraction``, ``Decimal``,
        ``deque``, and a lazy iterator (only as the whole value: its items were drained where it was returned)."""
        ints = self.b["int_hex_digits"] + 1
        if tag in VIEWS and len(rest) == 1 and type(rest[0]) is list:
            items = self.pairs(rest[0], depth) if tag.endswith("vi") else [self.value(v, depth + 1) for v in rest[0]]
            return VIEWS[tag](items)
        if tag == "r" and len(rest) == 3:
            return range(*(self.number("i", x, ints) for x in rest))
        if tag == "ba" and len(rest) == 1 and isinstance(rest[0], str):
            return bytearray.fromhex(rest[0])
        if tag == "q" and len(rest) == 2:
            from fractions import Fraction

            return Fraction(*(self.number("i", x, ints) for x in rest))
        if tag == "D" and len(rest) == 1 and isinstance(rest[0], str) and len(rest[0]) <= self.b["decimal_chars"]:
            from decimal import Decimal

            return Decimal(rest[0])
        if tag == "dq" and len(rest) == 2 and type(rest[0]) is list:
            from collections import deque

            maxlen = None if rest[1] is None else self.number("i", rest[1], ints)
            return deque([self.value(v, depth + 1) for v in rest[0]], maxlen)
        if tag in ("Ct", "Od", "dd") and len(rest) == 1 + (tag == "dd") and type(rest[-1]) is list:
            return self.mapping(tag, rest, depth)
        if tag == "nt" and len(rest) == 4 and all(isinstance(x, str) for x in rest[:2]) \
                and type(rest[2]) is list and type(rest[3]) is list and len(rest[2]) == len(rest[3]):  # fmt: skip
            return self.named(rest[0], rest[1], rest[2], [self.value(v, depth + 1) for v in rest[3]])
        if tag == "n" and len(rest) == 1 and rest[0] in ("math", "cmath"):
            return __import__(rest[0]).nan  # the very object the check's math.nan names
        if tag == "n" and len(rest) == 2 and type(rest[0]) is int and 0 <= rest[0] < len(self.nans) + 1:
            if rest[0] < len(self.nans):  # the same nan object again
                return self.nans[rest[0]]
            x = self.value(rest[1], depth)
            if not (x.is_nan() if type(x).__name__ == "Decimal" else type(x) in (float, complex) and x != x):
                raise BadValue("a nan tag around a value that is not nan")
            self.nans.append(x)
            return x
        if tag in WHEN:
            return self.when(tag, rest)
        if tag == "en" and len(rest) == 7 and all(isinstance(x, str) for x in (*rest[:3], rest[4])) \
                and rest[3] in (0, 1, 2) and type(rest[3]) is int and type(rest[5]) is list:  # fmt: skip
            return self.enum(rest, depth)
        if tag == "dc" and len(rest) == 4 and isinstance(rest[0], str) and isinstance(rest[1], str) \
                and type(rest[2]) is list and type(rest[3]) is list:  # fmt: skip
            return self.dataclass(rest, depth)
        if tag == "it" and depth == 0 and len(rest) == 4 and type(rest[1]) is list and rest[0] in LAZY_KINDS \
                and rest[2] in LAZY_ENDS and isinstance(rest[3], str):  # fmt: skip
            return lazy(rest[0], [self.value(v, depth + 1) for v in rest[1]], rest[2], rest[3][:200])
        raise BadValue(f"unknown tag {tag!r}")

    def mapping(self, tag: str, rest: list, depth: int) -> object:
        """``Counter``, ``OrderedDict`` (in its own order) and ``defaultdict`` (of a builtin type, or None)."""
        import collections

        items = self.pairs(rest[-1], depth)
        if tag == "Od":
            return collections.OrderedDict(items)
        if tag == "dd":
            if rest[0] is not None and rest[0] not in FACTORIES:
                raise BadValue(f"a defaultdict factory {str(rest[0])[:40]!r}")
            out = collections.defaultdict(None if rest[0] is None else getattr(builtins, rest[0]))
        else:
            out = collections.Counter()
        dict.update(out, items)  # as stored, not counted again (Counter.update adds)
        return out

    def named(self, name: str, module: str, fields: list, values: list) -> object:
        """A namedtuple instance: a class of the same name, module and fields (one per job), holding ``values``."""
        import collections

        key = (name, module, tuple(fields))
        if key not in self.classes:
            if not all(isinstance(f, str) for f in fields) or len(self.classes) > 64:
                raise BadValue("a namedtuple's fields are not names, or too many namedtuple classes")
            self.classes[key] = collections.namedtuple(name, fields, module=module)  # ValueError: not identifiers
        return self.classes[key](*values)

    def enum(self, rest: list, depth: int) -> object:
        """An Enum member: of the standard library's own class where the check imported it (the sample saw that
        class under that name), else of a class rebuilt by the functional API (same name, base, mixin, members)."""
        import enum

        base, name, module, std, mix, raw, value = rest
        if base not in ENUM_BASES or mix not in ("object", "int", "str", "float") or len(raw) > 4096:
            raise BadValue(f"an Enum of base {base[:20]!r}, mixin {mix[:20]!r}")
        key = ("en", base, name, module, mix, _json_key(raw))
        if key not in self.classes:
            real = sys.modules.get(module) if std else None  # only what the check's own imports loaded
            cls = real
            for part in name.split(".") if real is not None else ():
                cls = getattr(cls, part, None)
            if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
                if std == 2:  # its own methods travel only as that very class
                    raise BadValue(f"the standard library's Enum {module}.{name[:40]} is not among test_imports")
                members = self.pairs(raw, depth + 1)
                kw = {"type": getattr(builtins, mix)} if base == "Enum" and mix != "object" else {}
                cls = getattr(enum, base)(name, members, module=module, qualname=name, **kw)
            self.classes[key] = cls
        return self.classes[key](self.value(value, depth + 1))

    def dataclass(self, rest: list, depth: int) -> object:
        """A dataclass instance: a class made by ``make_dataclass`` with the same name, module, parameters and
        fields (their ``repr`` / ``compare`` flags), holding the values."""
        import dataclasses

        name, module, flags, raw = rest
        if len(flags) != 4 or not all(type(x) is bool for x in flags) or not all(
                type(f) is list and len(f) == 4 and isinstance(f[0], str) and type(f[1]) is bool
                and type(f[2]) is bool for f in raw):  # fmt: skip
            raise BadValue("a malformed dataclass")
        key = ("dc", name, module, tuple(flags), tuple(tuple(f[:3]) for f in raw))
        if key not in self.classes:
            eq, order, frozen, unsafe_hash = flags
            specs = [(f, object, dataclasses.field(repr=r, compare=c)) for f, r, c, _ in raw]
            cls = dataclasses.make_dataclass(name, specs, eq=eq, order=order, frozen=frozen, unsafe_hash=unsafe_hash)
            cls.__module__ = module
            self.classes[key] = cls
        return self.classes[key](**{f[0]: self.value(f[3], depth + 1) for f in raw})

    def when(self, tag: str, rest: list) -> object:
        """``datetime`` values from their fields (the constructors check the ranges)."""
        import datetime as dt

        ints = self.b["int_hex_digits"] + 1
        if tag == "tz":
            if len(rest) != 2 or not (rest[1] is None or isinstance(rest[1], str)) or type(rest[0]) is not list:
                raise BadValue("a malformed timezone")
            offset = self.when(rest[0][0], rest[0][1:])
            return dt.timezone(offset) if rest[1] is None else dt.timezone(offset, rest[1][:64])
        if tag == "td" and len(rest) == 3:
            d, sec, us = (self.number("i", x, ints) for x in rest)
            return dt.timedelta(days=d, seconds=sec, microseconds=us)
        if len(rest) != WHEN[tag] or type(rest[0]) is not list or len(rest[0]) > 8:
            raise BadValue(f"a malformed {tag!r} value")
        f = [self.number("i", x, 12) for x in rest[0]]
        if tag == "da":
            return dt.date(*f)
        tz = None
        if rest[1] is not None:
            if type(rest[1]) is not list or not rest[1] or rest[1][0] != "tz":
                raise BadValue("a tzinfo that is not a timezone")
            tz = self.when("tz", rest[1][1:])
        if tag == "dt":
            return dt.datetime(*f[:7], tzinfo=tz, fold=f[7])
        return dt.time(*f[:4], tzinfo=tz, fold=f[4])


ENUM_BASES = frozenset(("Enum", "IntEnum", "StrEnum", "Flag", "IntFlag"))


def _json_key(x: object) -> object:
    """A hashable key for a decoded-JSON structure (lists to tuples)."""
    return tuple(_json_key(y) for y in x) if type(x) is list else x


WHEN = {"td": 3, "tz": 2, "da": 1, "dt": 2, "tm": 2}  # tag: fields after the tag
FACTORIES = frozenset(("int", "float", "str", "bytes", "bool", "complex", "list", "tuple", "dict", "set", "frozenset"))


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:200]


def decode_values(data: bytes, expected: set[int] | frozenset[int], cap: int,
                  budgets: dict[str, int] | None = None) -> tuple[dict[int, object], dict[int, str], str]:  # fmt: skip
    """Parse the sample's values file: (values by index, errors by index, a problem note or "").

    ``expected``: the indices the sample should send. ``data`` was read with at most ``cap + 1`` bytes; more than
    ``cap`` fails every value, so does a malformed line. A value that cannot be decoded (unknown tag, past a
    budget, an exception of any kind) is an error of that index only. Budgets are per value."""
    values, errors, _, problem = decode_with_state(data, expected, cap, budgets)
    return values, errors, problem


def decode_with_state(data: bytes, expected: set[int] | frozenset[int], cap: int,
                      budgets: dict[str, int] | None = None) -> tuple[dict, dict, dict, str]:  # fmt: skip
    """:func:`decode_values`, and the process-wide state each value came with (:func:`_state`), by index."""
    dec = _Decoder({**BUDGETS, **(budgets or {})})
    if len(data) > cap:
        return {}, {}, {}, f"the values exceed {cap} bytes"
    values: dict[int, object] = {}
    errors: dict[int, str] = {}
    states: dict[int, dict] = {}
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            rec = _json_line(line)
        except (ValueError, StopIteration, RecursionError, MemoryError):
            return {}, {}, {}, "the values file is not JSON lines"
        if type(rec) is not list or len(rec) not in (3, 4) or type(rec[0]) is not int or rec[0] not in expected:
            return {}, {}, {}, "a values line is not [index, kind, value(, state)]"
        i, kind, v = rec[:3]
        if i in values or i in errors:
            return {}, {}, {}, f"value {i} sent twice"
        if kind == "ok":
            try:
                dec.start()
                value = dec.value(v, 0)
                if len(rec) == 4:
                    states[i] = _state(rec[3], dec)
                values[i] = value
            except BadValue as e:
                errors[i] = f"unsupported value ({e})"
            except Exception as e:  # noqa: BLE001 - OverflowError, TypeError, MemoryError ...: the value fails
                errors[i] = f"unsupported value ({_why(e)})"
        elif kind == "err" and isinstance(v, str):
            errors[i] = v[:200]
        else:
            return {}, {}, {}, "a values line has an unknown kind"
    return values, errors, states, ""


DECIMAL_SIGNALS = frozenset(("Clamped", "DivisionByZero", "Inexact", "Overflow", "Rounded", "Underflow",
                             "InvalidOperation", "Subnormal", "FloatOperation"))  # fmt: skip
INT_DIGITS = getattr(sys, "get_int_max_str_digits", lambda: 0)()  # the default (``-I``: no PYTHONINTMAXSTRDIGITS)


def _state(raw: object, dec: _Decoder) -> dict:
    """The sample's process-wide state that a check reads, validated: ``decimal`` (the context's fields, traps by
    name) and ``int_digits`` (``sys.set_int_max_str_digits``); an absent key is the default."""
    if type(raw) is not dict or not set(raw) <= {"decimal", "int_digits"}:
        raise BadValue("a malformed state")
    out: dict = {}
    if "int_digits" in raw:
        out["int_digits"] = dec.number("i", raw["int_digits"], 12)
    if "decimal" in raw:
        c = raw["decimal"]
        if type(c) is not list or len(c) != 7 or not isinstance(c[1], str) or type(c[6]) is not list \
                or not set(c[6]) <= DECIMAL_SIGNALS:  # fmt: skip
            raise BadValue("a malformed decimal context")
        prec, emin, emax, capitals, clamp = (dec.number("i", x, 12) for x in (c[0], *c[2:6]))
        out["decimal"] = {"prec": prec, "rounding": c[1], "Emin": emin, "Emax": emax, "capitals": capitals,
                          "clamp": clamp, "traps": sorted(set(c[6]))}  # fmt: skip
    return out


def _apply_state(state: dict) -> None:
    """Put the sample's state (or the defaults) in place for one check, as Python's check runs in the candidate's
    process; the constructors refuse values out of range (the check then fails with one line)."""
    if INT_DIGITS:  # Python >= 3.11 (3.10 has no limit, and its sample sends none)
        sys.set_int_max_str_digits(state.get("int_digits", INT_DIGITS))
    if "decimal" in state:
        import decimal

        kw = dict(state["decimal"])
        kw["traps"] = [getattr(decimal, name) for name in kw["traps"]]
        decimal.setcontext(decimal.Context(**kw, flags=[]))
    elif "decimal" in sys.modules:
        sys.modules["decimal"].setcontext(sys.modules["decimal"].Context())


def import_env(test_imports: list[str] | tuple[str, ...]) -> dict[str, object]:
    """A fresh namespace with the real builtins and what ``test_imports`` bind (import statements only: the
    evaluator checked them when it split the asserts)."""
    env: dict[str, object] = {"__builtins__": builtins}
    for line in test_imports:
        exec(compile(line, "<test_imports>", "exec", dont_inherit=True), env)  # noqa: S102 - checked import lines
    return env


def judge_job(job: dict[str, object]) -> dict[str, object]:
    """Decode and evaluate one sample's asserts. ``job``: ``checks`` (per assert: the check's source and
    ``[(placeholder index, value index), ...]``), ``test_imports``, ``values`` (the sample's bytes), ``cap``,
    ``budgets``. Returns ``ok``, ``verdicts``, ``detail`` (first failure), ``completed``; never raises."""
    checks = job["checks"]
    try:
        expected = frozenset(i for _, refs in checks for _, i in refs)
        values, errors, states, problem = decode_with_state(job["values"], expected, job["cap"], job.get("budgets"))
        completed = len(values) + len(errors) == len(expected) and not problem
        if problem:
            errors = dict.fromkeys(expected, problem)
        env = import_env(job["test_imports"])
    except Exception as e:  # noqa: BLE001 - the whole sample fails, with one line
        return {"ok": False, "verdicts": [False] * len(checks), "detail": f"trusted side: {_why(e)}",
                "completed": False}  # fmt: skip
    verdicts: list[bool] = []
    first = ""
    for j, (source, refs) in enumerate(checks):
        why = ""
        missing = [i for _, i in refs if i not in values]
        if missing:
            why = errors.get(missing[0], "no value came back (the program ended or timed out first)")
            ok = False
        else:
            scope = {**env, **{f"{PLACEHOLDER}{k}": values[i] for k, i in refs}}  # globals: nested scopes read them
            try:
                _apply_state(states.get(refs[0][1], {}) if refs else {})
                code = compile(source, f"<test {j + 1}>", "eval", dont_inherit=True)
                ok = bool(eval(code, scope))  # noqa: S307 - the dataset's own assert, decoded values
            except Exception as e:  # noqa: BLE001 - a wrong type from the sample, a MemoryError, ...
                ok, why = False, _why(e)
            if not ok and not why:
                why = "assertion failed"
        verdicts.append(ok)
        if not ok and not first:
            first = f"test {j + 1}: {why}"
    return {"ok": all(verdicts), "verdicts": verdicts, "detail": first, "completed": completed}


def _read_exact(stream: object, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def _cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _main() -> None:
    """Serve jobs until stdin closes: 4-byte length + marshal(job) in, the same out. Each job runs under a CPU timer
    (ITIMER_PROF, whose default action ends the process: no handler, so a long C call is cut too)."""
    import marshal
    import resource
    import signal

    budgets = {**BUDGETS, **{k: int(v) for k, v in (a.split("=", 1) for a in sys.argv[1:])}}
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (budgets["memory_bytes"], budgets["memory_bytes"]))
    signal.signal(signal.SIGPROF, signal.SIG_DFL)
    src, dst = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = _read_exact(src, 4)
        if not head:
            return
        data = _read_exact(src, int.from_bytes(head, "little"))
        t0 = _cpu()
        signal.setitimer(signal.ITIMER_PROF, budgets["cpu_s"])
        try:
            job = marshal.loads(data)
            job["budgets"] = budgets
            out = judge_job(job)
        except BaseException as e:  # noqa: BLE001 - MemoryError while loading, ...: one line back
            out = {"ok": False, "verdicts": None, "detail": f"trusted side: {_why(e)}", "completed": False}
        signal.setitimer(signal.ITIMER_PROF, 0)
        t1 = _cpu()
        out["cpu_s"], out["cpu_total"] = t1 - t0, t1
        reply = marshal.dumps(out)
        dst.write(len(reply).to_bytes(4, "little") + reply)
        dst.flush()


if __name__ == "__main__":
    _main()

"""The trusted side of the verdict (issue 28): decode what the sample sent back and evaluate the asserts, under
explicit budgets, in a short-lived child process of the evaluator that never runs candidate code.

The evaluator runs this file as ``python -I -S -B trusted.py`` (a small pool of them, reused:
:func:`tdlm.evaluation.sandbox.verdict.judge`); each job comes on stdin as ``marshal`` of plain data written by the
evaluator (never by the sample), the answer goes to stdout the same way. The sample's bytes are only ever parsed
here, as JSON lines, by :func:`decode_values`: tagged builtins, and dict views, ``range``, ``bytearray``,
``Fraction``, ``Decimal``, ``deque`` and a lazy iterator (the whole value only: its drained items, replayed by a
fresh generator / ``map`` / ``filter`` that ends as the sample's did) rebuilt as those types. Each check is evaluated
with the values bound as globals, so a lambda or a comprehension body reads them as any name (as eval locals a
nested scope could not on 3.11, and a comprehension could on 3.12). Budgets (:data:`BUDGETS`): nesting depth,
elements (every decoded node counts), hex digits of an int / float, characters of a Decimal, CPU seconds per job
(``ITIMER_PROF``, whose default action ends this process mid-call; the evaluator then starts a fresh one) and
address space (``RLIMIT_AS``). A value past a budget fails its sample; so does any exception (OverflowError of
``float.fromhex("0x1p+99999")``, MemoryError, a TypeError of the assert), with one line; a process killed by its CPU
limit is reported by the evaluator. Nothing raises out of here, and the evaluator never spends more than the budget
on one sample: a set of hash-colliding ints costs quadratic time to build, but only up to the CPU limit.

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
    "elements": 200_000,  # decoded nodes of all values of one sample
    "int_hex_digits": 4096,  # one int: 16,384 bits (about 4,900 decimal digits)
    "float_chars": 40,  # one float.hex() string ("-0x1.fffffffffffffp+1023" is 24)
    "decimal_chars": 8192,  # one decimal.Decimal string
    "lazy_items": 50_000,  # items the sample drains from one lazy iterator it returns (then: "cut")
    "lazy_bytes": 1 << 19,  # encoded bytes of those items (then: "cut"): 7 such values fit the 4 MiB of values
    "cpu_s": 1,  # CPU seconds of one job (ITIMER_PROF)
    "memory_bytes": 1 << 30,  # RLIMIT_AS of this process
}
PLACEHOLDER = "_tdlm_v"
SEQUENCES = {"l": list, "t": tuple, "s": set, "z": frozenset}
VIEWS = {"vk": lambda xs: dict.fromkeys(xs).keys(), "vv": lambda xs: dict(enumerate(xs)).values(),
         "vi": lambda xs: dict(xs).items()}  # fmt: skip
LAZY_KINDS = ("generator", "map", "filter", "iterator")
LAZY_ENDS = ("end", "err", "cut")


def _replay(items: list, end: str, why: str):  # noqa: ANN202 - a generator
    """The sample's lazy value as the assert consumes it: its items, then its end (exhausted, the exception it
    raised there, or the cut at the drain budget), at the same place."""
    yield from items
    if end == "err":
        raise RuntimeError(f"the candidate's iterator raised {why} after {len(items)} items")
    if end == "cut":
        raise RuntimeError(f"the candidate's iterator was cut after {len(items)} items (the sample's drain budget)")


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
            items = self.pairs(rest[0], depth) if tag == "vi" else [self.value(v, depth + 1) for v in rest[0]]
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
        if tag == "it" and depth == 0 and len(rest) == 4 and type(rest[1]) is list and rest[0] in LAZY_KINDS \
                and rest[2] in LAZY_ENDS and isinstance(rest[3], str):  # fmt: skip
            return lazy(rest[0], [self.value(v, depth + 1) for v in rest[1]], rest[2], rest[3][:200])
        raise BadValue(f"unknown tag {tag!r}")


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:200]


def decode_values(data: bytes, expected: set[int] | frozenset[int], cap: int,
                  budgets: dict[str, int] | None = None) -> tuple[dict[int, object], dict[int, str], str]:  # fmt: skip
    """Parse the sample's values file: (values by index, errors by index, a problem note or "").

    ``expected``: the indices the sample should send. ``data`` was read with at most ``cap + 1`` bytes; more than
    ``cap`` fails every value, so does a malformed line. A value that cannot be decoded (unknown tag, past a
    budget, an exception of any kind) is an error of that index only."""
    dec = _Decoder({**BUDGETS, **(budgets or {})})
    if len(data) > cap:
        return {}, {}, f"the values exceed {cap} bytes"
    values: dict[int, object] = {}
    errors: dict[int, str] = {}
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            rec = _json_line(line)
        except (ValueError, StopIteration, RecursionError, MemoryError):
            return {}, {}, "the values file is not JSON lines"
        if type(rec) is not list or len(rec) != 3 or type(rec[0]) is not int or rec[0] not in expected:
            return {}, {}, "a values line is not [index, kind, value]"
        i, kind, v = rec
        if i in values or i in errors:
            return {}, {}, f"value {i} sent twice"
        if kind == "ok":
            try:
                values[i] = dec.value(v, 0)
            except BadValue as e:
                errors[i] = f"unsupported value ({e})"
            except Exception as e:  # noqa: BLE001 - OverflowError, TypeError, MemoryError ...: the value fails
                errors[i] = f"unsupported value ({_why(e)})"
        elif kind == "err" and isinstance(v, str):
            errors[i] = v[:200]
        else:
            return {}, {}, "a values line has an unknown kind"
    return values, errors, ""


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
        values, errors, problem = decode_values(job["values"], expected, job["cap"], job.get("budgets"))
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

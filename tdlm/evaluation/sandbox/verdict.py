"""The verdict outside the sample (issue 22, item 1): asserts are split in the trusted process, the sample only
evaluates the calls into its own code, and the values come back through a strict, size-capped serialiser.

Trusted side (this module, in the evaluator's process):

- :func:`split_asserts` parses each MBPP assert with :mod:`ast` and replaces every maximal sub-expression that
  refers to a name the candidate defines (anything not a builtin and not bound by ``test_imports``) with a
  placeholder. ``assert set(similar_elements((3, 4), (4, 5))) == set((4,))`` becomes the call
  ``similar_elements((3, 4), (4, 5))`` for the sample and ``set(_v0) == set((4,))`` for the trusted side;
- :func:`decode_values` reads what the sample wrote (JSON lines, at most ``cap`` bytes) and rebuilds the values from
  tagged builtins only: int, float, complex, str, bytes, bool, None, list, tuple, dict, set, frozenset. Anything
  else (a tag it does not know, a list as a dict key, depth > ``MAX_DEPTH``, a duplicate or missing index) is a
  failure. Nothing is ever unpickled or ``eval``-ed;
- :func:`judge` evaluates each remaining assert expression with those values, the real builtins and the modules of
  ``test_imports``, in a namespace the sample never touched. So patched builtins, frames, tracing, ``gc`` or an
  always-true ``__eq__`` inside the sample cannot change a verdict: the sample can only hand back plain values,
  which is what a correct solution computes anyway.

Sample side: :data:`DRIVER` runs as ``python -I -S -B -c DRIVER`` inside the sandbox. It reads ``main.py`` and the
call expressions from an inherited file, closes it, runs the program as module ``__main__``, evaluates each call in
the program's globals and writes ``[index, "ok", value]`` / ``[index, "err", "Type: message"]`` lines to the
values file, then ends with ``os._exit(0)``. Its serialiser sends the builtin types above; an instance of a
subclass of one of them (a ``Counter``, an ``OrderedDict``, a ``namedtuple``) goes as the base type's value, so
its equality with the expected builtin value is what it was, and no overridden ``__eq__`` travels; anything else
(a generator, a ``map``, a custom class) is a failure. The decoder is the strict part: it trusts nothing the
sample's encoder claims.
"""

from __future__ import annotations

import ast
import builtins
import json
import warnings
from dataclasses import dataclass
from typing import Any

from tdlm.errors import TDLMError

MAX_DEPTH = 64  # nesting of returned values (lists of lists ...)
PLACEHOLDER = "_tdlm_v"
_BUILTINS = frozenset(dir(builtins))


@dataclass(frozen=True)
class Split:
    """One assert, split: ``calls`` (source of the sub-expressions the sample evaluates, in order) and ``check``
    (the assert's test expression with ``_tdlm_v<i>`` in their place, compiled by the trusted side)."""

    source: str
    calls: tuple[str, ...]
    check: Any  # a code object (eval mode)


def _import_names(test_imports: tuple[str, ...] | list[str]) -> tuple[dict[str, Any], set[str]]:
    """Run ``test_imports`` (``import x`` / ``from x import y`` statements only) in a fresh trusted namespace."""
    env: dict[str, Any] = {"__builtins__": builtins}
    for line in test_imports:
        try:
            tree = ast.parse(line)
        except SyntaxError as e:
            raise TDLMError(f"test_imports: {line!r} is not Python ({e.msg}), expected an import statement") from e
        if not all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body):
            raise TDLMError(f"test_imports: {line!r} is not an import statement, expected `import x` / `from ...`")
        exec(compile(tree, "<test_imports>", "exec"), env)  # noqa: S102 - dataset import lines, checked above
    return env, set(env) - {"__builtins__"}


class _Extract(ast.NodeTransformer):
    """Replace each maximal sub-expression that mentions an untrusted name by a placeholder name."""

    def __init__(self, trusted: set[str]) -> None:
        self.trusted = trusted
        self.calls: list[str] = []

    def _untrusted(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id not in self.trusted for n in ast.walk(node))

    def _replace(self, node: ast.expr) -> ast.expr:
        self.calls.append(ast.unparse(node))
        return ast.copy_location(ast.Name(id=f"{PLACEHOLDER}{len(self.calls) - 1}", ctx=ast.Load()), node)

    def visit_Call(self, node: ast.Call) -> ast.expr:
        if self._untrusted(node.func):  # a call into the candidate's code: the sample evaluates it, args and all
            return self._replace(node)
        return self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return self._replace(node) if node.id not in self.trusted else node

    def visit_Lambda(self, node: ast.Lambda) -> ast.expr:
        if self._untrusted(node):
            raise TDLMError(f"test: a lambda that uses the candidate's names is not supported: {ast.unparse(node)}")
        return node


def defined_names(code: str) -> set[str]:
    """Names the candidate's program binds at module level (functions, classes, assignments, imports), from its
    ``ast`` parsed here (never run here); empty if it does not parse (the sample then fails on its own)."""
    try:
        with warnings.catch_warnings():  # invalid escapes etc. in the candidate's code are its own business
            warnings.simplefilter("ignore")
            tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def split_asserts(tests: list[str] | tuple[str, ...], test_imports: list[str] | tuple[str, ...] = (),
                  code: str = "") -> list[Split]:  # fmt: skip
    """Split each test (one ``assert`` statement) into the sample's calls and the trusted check; see the module
    docstring. Raises :class:`TDLMError` for a test that is not a single assert.

    Builtins are the trusted side's, except in an assert that names nothing else of the candidate's: there a
    builtin the candidate redefines (MBPP 126 defines ``sum`` and asserts ``sum(10, 15) == 6``) is the
    candidate's. An assert that does name the candidate's function keeps the real builtins, so a sample that
    rebinds ``set`` cannot make the expected side of ``set(f(x)) == set((4, 5))`` its own.
    """
    _, imported = _import_names(tuple(test_imports))
    trusted = set(_BUILTINS) | imported
    shadowed = defined_names(code) & _BUILTINS if code else set()
    out = []
    for i, test in enumerate(tests):
        try:
            tree = ast.parse(test)
        except SyntaxError as e:
            raise TDLMError(f"test {i + 1}: not Python ({e.msg}): {test[:120]!r}") from e
        if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
            raise TDLMError(f"test {i + 1}: expected one `assert` statement, got {test[:120]!r}")
        names = {n.id for n in ast.walk(tree.body[0].test) if isinstance(n, ast.Name)}
        here = trusted if names - trusted else trusted - shadowed
        ex = _Extract(here)
        expr = ex.visit(tree.body[0].test)
        compiled = compile(ast.fix_missing_locations(ast.Expression(expr)), f"<test {i + 1}>", "eval",
                           dont_inherit=True)  # fmt: skip
        out.append(Split(test, tuple(ex.calls), compiled))
    return out


# ---------------------------------------------------------------------------------------- decoding

class BadValue(ValueError):
    """What the sample sent back is not a value of the allowed builtin types."""


def _decode(x: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise BadValue(f"nested deeper than {MAX_DEPTH}")
    if x is None or isinstance(x, (bool, str)):  # JSON null / true / false / string map to themselves
        return x
    if type(x) is not list or not x or not isinstance(x[0], str):
        raise BadValue(f"not a tagged value: {type(x).__name__}")
    tag, rest = x[0], x[1:]
    if tag in ("i", "f", "b") and len(rest) == 1 and isinstance(rest[0], str) and len(rest[0]) < 1 << 22:
        try:
            if tag == "i":
                return int(rest[0], 16)  # hex: no int/str digit limit, linear time
            if tag == "f":
                return float.fromhex(rest[0])
            return bytes.fromhex(rest[0])
        except ValueError as e:
            raise BadValue(f"bad {tag!r} literal") from e
    if tag == "c" and len(rest) == 2 and all(isinstance(r, str) for r in rest):
        try:
            return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
        except ValueError as e:
            raise BadValue("bad complex literal") from e
    if tag in ("l", "t", "s", "z", "d") and len(rest) == 1 and type(rest[0]) is list:
        items = [_decode(v, depth + 1) for v in rest[0]]
        try:
            if tag == "l":
                return items
            if tag == "t":
                return tuple(items)
            if tag == "s":
                return set(items)
            if tag == "z":
                return frozenset(items)
            if not all(type(kv) is tuple and len(kv) == 2 for kv in items):
                raise BadValue("a dict item is not a (key, value) pair")
            return dict(items)
        except TypeError as e:  # unhashable key / element
            raise BadValue(str(e)) from e
    raise BadValue(f"unknown tag {tag!r}")


def decode_values(data: bytes, n: int, cap: int) -> tuple[dict[int, Any], dict[int, str], str]:
    """Parse the sample's values file: (values by index, errors by index, a problem note or "").

    ``data`` was read with at most ``cap + 1`` bytes; more than ``cap`` is a failure of every value."""
    if len(data) > cap:
        return {}, {}, f"the values exceed {cap} bytes"
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            return {}, {}, "the values file is not JSON lines"
        if type(rec) is not list or len(rec) != 3 or type(rec[0]) is not int or not 0 <= rec[0] < n:
            return {}, {}, "a values line is not [index, kind, value]"
        i, kind, v = rec
        if i in values or i in errors:
            return {}, {}, f"value {i} sent twice"
        if kind == "ok":
            try:
                values[i] = _decode(v, 0)
            except (BadValue, RecursionError) as e:
                errors[i] = f"unsupported value ({e})"
        elif kind == "err" and isinstance(v, str):
            errors[i] = v[:200]
        else:
            return {}, {}, "a values line has an unknown kind"
    return values, errors, ""


def judge(splits: list[Split], values: dict[int, Any], errors: dict[int, str],
          test_imports: list[str] | tuple[str, ...] = ()) -> tuple[bool, list[bool], str]:  # fmt: skip
    """Evaluate every check with the sample's values: (all passed, per-assert verdicts, first failure's reason)."""
    env, _ = _import_names(tuple(test_imports))
    verdicts: list[bool] = []
    first = ""
    k = 0
    for j, s in enumerate(splits):
        idx = range(k, k + len(s.calls))
        k += len(s.calls)
        why = ""
        bad = [i for i in idx if i not in values]
        if bad:
            why = errors.get(bad[0], "no value came back (the program ended or timed out first)")
            ok = False
        else:
            local = {f"{PLACEHOLDER}{i - idx.start}": values[i] for i in idx}
            try:
                ok = bool(eval(s.check, dict(env), local))  # noqa: S307 - the dataset's own assert, trusted values
            except Exception as e:  # a wrong type from the sample, e.g. None where a list was expected
                ok, why = False, f"{type(e).__name__}: {e}"
            if not ok and not why:
                why = "assertion failed"
        verdicts.append(ok)
        if not ok and not first:
            first = f"test {j + 1}: {why}"
    return all(verdicts), verdicts, first


def all_calls(splits: list[Split]) -> list[str]:
    """The call expressions of every assert, flattened in order (the sample's work list)."""
    return [c for s in splits for c in s.calls]


def excerpt(text: str, n: int = 160) -> str:
    """A short, escaped excerpt for result records: the last non-empty line, ``ascii``-escaped, ``n`` chars."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    s = ascii(lines[-1])[1:-1] if lines else ""
    return s if len(s) <= n else s[: n - 3] + "..."


# The sample-side harness (runs in the sandbox as `python -I -S -B -c DRIVER <json>`, stdlib only). Its values are
# only trusted as *values*: whatever it does to itself, it can only report plain data back.
DRIVER = r"""
def _tdlm_driver():
    import marshal, os, sys, types
    payload_fd, out = (int(x) for x in sys.argv[1].split(","))
    chunks = []
    while True:
        c = os.read(payload_fd, 1 << 20)
        if not c:
            break
        chunks.append(c)
    os.close(payload_fd)
    program, calls = marshal.loads(b"".join(chunks))  # written by the trusted side
    del chunks
    path = os.path.abspath("main.py")  # cwd: /tmp of the new root (weak mode: an empty host directory)
    try:
        with open(path, "w", encoding="utf-8") as f:  # for tracebacks / inspect; the run does not read it back
            f.write(program)
    except OSError:
        pass
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv[:] = ["main.py"]
    code = compile(program, path, "exec", dont_inherit=True)
    if calls is None:
        del program
        exec(code, main.__dict__)
        return
    compiled = [compile(c, "<call %d>" % i, "eval", dont_inherit=True) for i, c in enumerate(calls)]
    del program
    try:  # the C string escaper of the json package, without importing json (its import costs ~30 ms)
        from _json import encode_basestring_ascii as quote
    except ImportError:
        def quote(s):
            out = []
            for ch in s:
                n = ord(ch)
                if 0x20 <= n < 0x7F and ch not in '"\\':
                    out.append(ch)
                elif n < 0x10000:
                    out.append("\\u%04x" % n)
                else:
                    out.append("\\u%04x\\u%04x" % (0xD7C0 + (n >> 10), 0xDC00 + (n & 0x3FF)))
            return '"' + "".join(out) + '"'
    write, _hex, _isinstance, _str, _len = os.write, float.hex, isinstance, str, len
    # Exact builtins, and instances of their subclasses as the base type's value (a Counter as a dict, a namedtuple
    # as a tuple): equality with a builtin expected value is unchanged, and no overridden method travels.
    SEQ = ((list, "l"), (tuple, "t"), (set, "s"), (frozenset, "z"))

    def enc(v, depth):
        if v is None:
            return "null"
        if v is True or v is False:
            return "true" if v else "false"
        if depth > 64:
            raise ValueError("nested deeper than 64")
        if _isinstance(v, int):
            return '["i","%s"]' % int.__format__(int(v), "x")
        if _isinstance(v, float):
            return '["f","%s"]' % _hex(float(v))
        if _isinstance(v, complex):
            return '["c","%s","%s"]' % (_hex(complex(v).real), _hex(complex(v).imag))
        if _isinstance(v, str):
            return quote(_str.__str__(v))
        if _isinstance(v, bytes):
            return '["b","%s"]' % bytes(v).hex()
        if _isinstance(v, dict):
            return '["d",[%s]]' % ",".join('["t",[%s,%s]]' % (enc(k, depth + 2), enc(x, depth + 2))
                                           for k, x in dict.items(v))
        for t, tag in SEQ:
            if _isinstance(v, t):
                return '["%s",[%s]]' % (tag, ",".join(enc(x, depth + 1) for x in t.__iter__(v)))
        raise TypeError("unsupported type " + type(v).__name__)

    exec(code, main.__dict__)
    for i, c in enumerate(compiled):
        try:
            rec = '[%d,"ok",%s]' % (i, enc(eval(c, main.__dict__), 0))
        except BaseException as e:  # SystemExit / KeyboardInterrupt too: the value is missing, the run goes on
            rec = '[%d,"err",%s]' % (i, quote((type(e).__name__ + ": " + str(e))[:200]))
        write(out, (rec + "\n").encode())
    for stream in (sys.stdout, sys.stderr):  # os._exit skips the interpreter's own flush
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(0)

_tdlm_driver()
"""


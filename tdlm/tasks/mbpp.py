"""MBPP sanitized, test split (257 hand-verified Python problems, task ids 11-510), zero-shot for Instruct models.

Data: ``google-research-datasets/mbpp`` config ``sanitized`` split ``test`` on the Hub, or
``mbpp_sanitized_test.jsonl`` (``google-research`` ``mbpp/sanitized-mbpp.json`` filtered to ids 11-510).
Fields ``task_id``, ``prompt``, ``code``, ``test_imports``, ``test_list``. Austin et al. 2021, "Program Synthesis
with Large Language Models", arXiv:2108.07732.

Prompt ``mbpp-v1`` (user message, no chat template). As in the original MBPP prompt, the first assert is shown, so
the model learns the function name and signature; all asserts are run when scoring::

    You are an expert Python programmer, and here is your task: {prompt}
    Your code should pass this test:

    {test_list[0]}

    Answer with a single ```python code block that contains the complete solution.

Scoring (:func:`tdlm.evaluation.scoring.score_code`) runs ``test_imports`` + extracted code in
:mod:`tdlm.evaluation.sandbox`. The assert grammar lives here (:func:`plan_assert`, pure :mod:`ast` /
:mod:`symtable`, nothing is run): the names the candidate owns are those the reference solution defines
(:func:`reference_names`, at any depth); the sample evaluates only the sub-expressions rooted at one of them
(``name(.attr)*`` and at most one call, with argument values the evaluator computes), and a trusted child process
of the evaluator evaluates the rest of each assert with the value it sent back (one per assert, from a
sub-expression Python evaluates exactly once, in that order: :func:`plan_assert` refuses the rest). :func:`load`
refuses, naming the problem and the assert, any assert the grammar cannot split or that calls nothing of the
reference's, so a shape that would hand the comparison to the sample, or run the candidate's code in another order
or number than Python, is an error before anything is decoded; so is a check that draws a lazy value partially
(``next``, ``any``, ``in`` ...) or may mutate the value (``pop``, ``heapq.heappop`` ...), which the sandbox, holding
a copy sent back once, cannot judge as Python does (:func:`judged_plan`: the one rule of loading and of the
sandbox's split, so nothing accepted here is refused at scoring), and a task whose ``test_imports`` or reference
import a module outside the standard library (the sandbox runs Python without site-packages). All 776 shipped
asserts split and load. pass@1 means every assert held and the program exited 0 (an early ``sys.exit(0)`` /
``os._exit(0)`` sends no values, so it fails, as in the anchors' harnesses). All 257 canonical solutions pass this
way (tests/test_sandbox_hostile.py).
"""

from __future__ import annotations

import ast
import builtins
import os
import symtable
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tdlm.errors import TDLMError
from tdlm.tasks.base import DatasetSpec, Problem, Task, apply_limit, load_records

NAME = "mbpp"
PROMPT_VERSION = "mbpp-v1"
METRIC = "pass@1"
SPEC = DatasetSpec(
    hub_path="google-research-datasets/mbpp",
    hub_config="sanitized",
    hub_split="test",
    local_file="mbpp_sanitized_test.jsonl",
    expected_count=257,
    required_fields=("task_id", "prompt", "code", "test_imports", "test_list"),
)


def build_prompt(text: str, example_test: str) -> str:
    """The ``mbpp-v1`` user message: task text, one example assert, and the answer-format instruction."""
    return (
        f"You are an expert Python programmer, and here is your task: {text.strip()}\n"
        f"Your code should pass this test:\n\n{example_test.strip()}\n\n"
        "Answer with a single ```python code block that contains the complete solution."
    )


def to_problem(index: int, record: dict[str, Any]) -> Problem:
    """A :class:`Problem` from one raw record; ``answer`` holds the reference solution, ``tests`` the asserts."""
    tests = tuple(record["test_list"])
    return Problem(
        task=NAME,
        id=f"{NAME}/{record['task_id']}",
        index=index,
        prompt=build_prompt(record["prompt"], tests[0]),
        answer=record["code"],
        tests=tests,
        test_imports=tuple(record["test_imports"] or ()),
        raw=record,
    )


def load(data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> Task:
    """Load the MBPP sanitized test split (see :func:`tdlm.tasks.base.load_records` for the source order)."""
    records, source = load_records(SPEC, data_dir)
    problems = [to_problem(i, r) for i, r in enumerate(records)]
    for p in problems:  # a shape the sandbox cannot split is refused here, before anything is decoded
        check_problem(p)
    return Task(NAME, PROMPT_VERSION, METRIC, apply_limit(problems, limit), source)


# ------------------------------------------------------------------------------------------ the assert grammar
# Which parts of an MBPP assert belong to the candidate. Pure ast / symtable (nothing is run here): the sandbox
# (tdlm.evaluation.sandbox.verdict) sends the candidate parts to the sample and evaluates the rest itself, and
# load() refuses a task whose asserts this grammar cannot split, before anything is decoded.
_BUILTINS = frozenset(dir(builtins))
_SINGLETONS = (None, True, False, Ellipsis)


@dataclass(frozen=True)
class CandidateCall:
    """One sub-expression the sample evaluates: ``root`` (a name the candidate defines, looked up in the program's
    globals only: a builtin never stands in for it), attribute reads ``attrs``, then at most one call.

    ``args``: ``("expr", source)`` (a trusted expression: the evaluator computes its value and sends it),
    ``("star", source)`` (the same, unpacked), ``("ref", i)`` (the result of call ``i`` of this assert, kept in the
    sample); ``kwargs``: ``(name, kind, payload)`` with name None for ``**``. None: no call (a global value or an
    attribute read). ``sent``: the value goes back to the evaluator (False for a result only used as an argument).
    """

    root: str
    attrs: tuple[str, ...] = ()
    args: tuple[tuple[str, str | int], ...] | None = None
    kwargs: tuple[tuple[str | None, str, str | int], ...] = ()
    sent: bool = True


@dataclass(frozen=True)
class AssertPlan:
    """One assert, split: ``calls`` for the sample, ``check`` (source of the assert's test with ``_tdlm_v<i>`` in
    place of the value of call ``i``) for the evaluator."""

    source: str
    calls: tuple[CandidateCall, ...]
    check: str


PLACEHOLDER = "_tdlm_v"


def imported_names(test_imports: Sequence[str]) -> frozenset[str]:
    """The names ``test_imports`` bind (``import a.b`` binds ``a``); raises TDLMError for a line that is not an
    import statement or is a star import."""
    out: set[str] = set()
    for line in test_imports:
        try:
            tree = ast.parse(line)
        except SyntaxError as e:
            raise TDLMError(f"test_imports: {line!r} is not Python ({e.msg}), expected an import statement") from e
        for node in tree.body:
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                raise TDLMError(f"test_imports: {line!r} is not an import statement, expected `import x` / `from ...`")
            for a in node.names:
                if a.name == "*":
                    raise TDLMError(f"test_imports: {line!r} is a star import, expected the names spelled out")
                out.add(a.asname or a.name.split(".")[0])
        _stdlib_only(tree, f"test_imports: {line!r}")
    return frozenset(out)


def _stdlib_only(tree: ast.AST, where: str) -> None:
    """TDLMError naming ``where`` for an import of a module outside the standard library (numpy ...): the sample and
    the trusted side run ``python -I -S`` in a root without site-packages, so such a value never comes back and such
    a check never runs, where the plain harness would judge both (refused at load)."""
    for n in ast.walk(tree):
        mods = [a.name for a in n.names] if isinstance(n, ast.Import) else (
            [n.module] if isinstance(n, ast.ImportFrom) and n.module and not n.level else [])  # fmt: skip
        for m in mods:
            if m.split(".")[0] not in sys.stdlib_module_names:
                raise TDLMError(f"{where} imports {m!r}, which is not in the standard library: the sandbox runs "
                                "Python without site-packages (refused at load)")  # fmt: skip


def reference_names(code: str) -> frozenset[str]:
    """The names the reference solution defines: everything it binds in its module scope at any depth (under
    ``if`` / ``for`` / ``try`` / ``with``, and ``global`` names assigned inside its functions), except names it
    only imports (a library's objects are not the candidate's: an assert that uses one needs it in
    ``test_imports``). Raises TDLMError if the reference does not parse."""
    try:
        with warnings.catch_warnings():  # invalid escapes in the dataset's code are not this check's business
            warnings.simplefilter("ignore")
            top = symtable.symtable(code, "<reference>", "exec")
    except (SyntaxError, ValueError) as e:
        raise TDLMError(f"reference solution does not parse ({e}), expected Python") from e
    names = {s.get_name() for s in top.get_symbols() if s.is_assigned() and not s.is_imported()}
    stack = list(top.get_children())
    while stack:
        t = stack.pop()
        stack.extend(t.get_children())
        names.update(s.get_name() for s in t.get_symbols() if s.is_declared_global() and s.is_assigned())
    return frozenset(names)


def _chain(node: ast.AST) -> tuple[str, tuple[str, ...], ast.Call | None] | None:
    """``name(.attr)*`` or ``name(.attr)*(...)`` -> (name, attrs, call); anything else -> None."""
    call = node if isinstance(node, ast.Call) else None
    cur = node.func if call is not None else node
    attrs: list[str] = []
    while isinstance(cur, ast.Attribute):
        attrs.append(cur.attr)
        cur = cur.value
    return (cur.id, tuple(reversed(attrs)), call) if isinstance(cur, ast.Name) else None


# Positions whose sub-expressions Python may evaluate other than exactly once, in order (see plan_assert)
_BRANCH = "an operand after `and` / `or`, which Python skips once the result is known"
_IFEXP = "a branch of a conditional expression, of which Python evaluates one"
_CHAIN = "a later link of a chained comparison, which Python skips once a link is false"
_LAMBDA = "the body of a lambda, which Python evaluates once per call (maybe never)"
_LOOP = "the body of a comprehension or generator expression, which Python evaluates once per element (maybe never)"


class _Splitter:
    def __init__(self, where: str, names: frozenset[str] | None, imported: frozenset[str],
                 rooted: frozenset[str] = frozenset()) -> None:  # fmt: skip
        self.where, self.names, self.imported, self.rooted = where, names, imported, rooted
        self.calls: list[CandidateCall] = []

    def fail(self, why: str, node: ast.AST) -> TDLMError:
        return TDLMError(f"{self.where}: {why}: {ast.unparse(node)[:120]!r} (the sandbox cannot split this assert)")

    def candidate(self, name: str, local: frozenset[str]) -> bool:
        if name in local or name in self.imported:
            return False
        if self.names is None:  # no reference: only a name the assert calls (or reads an attribute of) is the sample's
            return name not in _BUILTINS and name in self.rooted
        return name in self.names

    def touches(self, node: ast.AST, local: frozenset[str]) -> bool:
        return any(isinstance(n, ast.Name) and self.candidate(n.id, local) for n in ast.walk(node))

    def unknown(self, name: str, what: str = "") -> str:
        """Why ``name`` (in ``what``, if given) is refused: neither trusted nor the candidate's."""
        if self.names is None:  # a bare name would take its value from the sample: never the candidate's here
            return (f"{what + ' uses ' if what else ''}{name!r}, which is not a builtin or test_imports name; without "
                    "a reference solution only a name the assert calls is the candidate's")  # fmt: skip
        if what:
            return f"{what} names {name!r}: not a builtin, test_imports or reference name"
        return f"{name!r} is not a builtin, a test_imports name or a name the reference defines"

    def closed(self, node: ast.expr, local: frozenset[str], what: str) -> str:
        """Source of a trusted expression the evaluator can compute before the sample runs."""
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                if n.id in local:
                    raise self.fail(f"{what} uses {n.id!r}, which the assert binds itself", node)
                if self.candidate(n.id, local):
                    raise self.fail(f"{what} mixes the candidate's values into other code", node)
                if n.id not in _BUILTINS and n.id not in self.imported:
                    raise self.fail(self.unknown(n.id, what), node)
            if isinstance(n, (ast.Lambda, ast.NamedExpr)):
                raise self.fail(f"{what} holds a {type(n).__name__.lower()}", node)
        return ast.unparse(node)

    def arg(self, node: ast.expr, local: frozenset[str]) -> tuple[str, str | int]:
        c = _chain(node)
        if c is not None and self.candidate(c[0], local):
            return ("ref", self.extract(node, c, local, sent=False))
        return ("expr", self.closed(node, local, "an argument of the candidate's call"))

    def extract(self, node: ast.expr, c: tuple, local: frozenset[str], sent: bool) -> int:
        root, attrs, call = c
        if attrs and self.names is None:  # without a reference, `math.isclose(...)` would be the sample's own
            raise self.fail(f"an attribute of {root!r}, which is not a builtin or test_imports name (a module "
                            "needs a test_imports line; the candidate's own object, a reference solution)", node)
        args = kwargs = None
        if call is not None:
            args = tuple(("star", self.closed(a.value, local, "a *argument")) if isinstance(a, ast.Starred)
                         else self.arg(a, local) for a in call.args)  # fmt: skip
            kwargs = tuple((k.arg, *(self.arg(k.value, local) if k.arg is not None
                                     else ("dstar", self.closed(k.value, local, "a **argument"))))
                           for k in call.keywords)  # fmt: skip
        self.calls.append(CandidateCall(root, attrs, args, kwargs or (), sent))
        return len(self.calls) - 1

    def identity(self, node: ast.Compare, local: frozenset[str]) -> None:
        """``is`` / ``is not`` needs both operands' identities: refused where one side is the candidate's value or a
        name the assert binds (it may hold one), unless the other side is a singleton (kept by the decoder)."""
        sides = [node.left, *node.comparators]
        for k, op in enumerate(node.ops):
            if not isinstance(op, (ast.Is, ast.IsNot)):
                continue
            a, b = sides[k], sides[k + 1]
            if any(isinstance(s, ast.Constant) and any(s.value is v for v in _SINGLETONS) for s in (a, b)):
                continue
            if any(isinstance(n, ast.Name) and (n.id in local or self.candidate(n.id, local))
                   for s in (a, b) for n in ast.walk(s)):  # fmt: skip
                raise self.fail("identity (`is`) of the candidate's values (or of a name the assert binds): decoded "
                                "values are new objects", node)  # fmt: skip

    def visit(self, node: ast.AST, local: frozenset[str], ctx: str = "") -> ast.AST:
        """The check with placeholders for the candidate's sub-expressions. ``ctx``: why this position is not
        evaluated exactly once, in order, by Python (a candidate's sub-expression there is refused)."""
        if isinstance(node, ast.expr):
            c = _chain(node)
            if c is not None and self.candidate(c[0], local):
                i = self.extract(node, c, local, sent=True)
                if ctx:
                    raise self.fail(f"the candidate's value sits in {ctx}; the sample evaluates it once, before the "
                                    "check", node)  # fmt: skip
                return ast.copy_location(ast.Name(id=f"{PLACEHOLDER}{i}", ctx=ast.Load()), node)
        if isinstance(node, ast.Name):
            if node.id not in local and node.id not in _BUILTINS and node.id not in self.imported:
                raise self.fail(self.unknown(node.id), node)
            return node
        if isinstance(node, ast.NamedExpr):
            raise self.fail("an assignment expression", node)
        if isinstance(node, ast.Compare):
            self.identity(node, local)
            node.left = self.visit(node.left, local, ctx)
            node.comparators = [self.visit(x, local, ctx if k == 0 else ctx or _CHAIN)
                                for k, x in enumerate(node.comparators)]  # fmt: skip
            return node
        if isinstance(node, ast.BoolOp):
            node.values = [self.visit(x, local, ctx if k == 0 else ctx or _BRANCH) for k, x in enumerate(node.values)]
            return node
        if isinstance(node, ast.IfExp):
            node.test = self.visit(node.test, local, ctx)
            node.body, node.orelse = (self.visit(x, local, ctx or _IFEXP) for x in (node.body, node.orelse))
            return node
        if isinstance(node, ast.Lambda):
            a = node.args
            params = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}
            a.defaults = [self.visit(d, local, ctx) for d in a.defaults]
            a.kw_defaults = [self.visit(d, local, ctx) if d is not None else None for d in a.kw_defaults]
            node.body = self.visit(node.body, local | params, ctx or _LAMBDA)
            return node
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            bound = set(local)
            for k, g in enumerate(node.generators):  # only the first iterable is evaluated once, outside the loop
                g.iter = self.visit(g.iter, frozenset(bound), ctx if k == 0 else ctx or _LOOP)
                bound |= {n.id for n in ast.walk(g.target) if isinstance(n, ast.Name)}
                g.ifs = [self.visit(x, frozenset(bound), ctx or _LOOP) for x in g.ifs]
            inner, body = frozenset(bound), ctx or _LOOP
            if isinstance(node, ast.DictComp):
                node.key, node.value = self.visit(node.key, inner, body), self.visit(node.value, inner, body)
            else:
                node.elt = self.visit(node.elt, inner, body)
            return node
        for field, value in ast.iter_fields(node):
            if isinstance(value, list):
                setattr(node, field, [self.visit(v, local, ctx) if isinstance(v, ast.AST) else v for v in value])
            elif isinstance(value, ast.AST):
                setattr(node, field, self.visit(value, local, ctx))
        return node


def _rooted(tree: ast.AST) -> frozenset[str]:
    """The names an assert calls or reads an attribute of (``f(...)``, ``m.g(...)``, ``o.x``): without a reference
    solution, the only names that can be the candidate's."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Call, ast.Attribute)):
            c = _chain(n)
            if c is not None and (c[1] or c[2] is not None):
                out.add(c[0])
    return frozenset(out)


# How the check may use the candidate's value (issue 51: "exactly Python, or refused at load"). The sample sends a
# copy of the value back, once: a lazy value (generator, map, any iterator) is drained there and replayed here, and a
# check's mutation reaches the copy, never the candidate's live object. So the check may read the value, and consume
# a lazy one whole; the rest is refused before anything is decoded.
# Consumers that may stop early, or pull items lazily for someone else, so Python would draw fewer items (or draw
# them interleaved with other code) than a drain does: refused.
_PARTIAL = frozenset({"next", "any", "all", "zip", "enumerate", "iter", "reversed", "map", "filter", "aiter", "anext"})
_PARTIAL_MODULES = frozenset({"itertools"})  # islice, takewhile, tee ...: lazy by design
# Functions that mutate their argument in place: Python mutates the candidate's object, the sandbox a copy.
_MUTATING = frozenset({"heapq.heappop", "heapq.heappush", "heapq.heapify", "heapq.heappushpop", "heapq.heapreplace",
                       "random.shuffle", "bisect.insort", "bisect.insort_left", "bisect.insort_right",
                       "operator.setitem", "operator.delitem", "operator.iadd", "operator.iconcat", "setattr",
                       "delattr"})  # fmt: skip
# Methods that only read their object (of str, bytes, numbers, list, tuple, dict, set, Counter, deque ...); any other
# method called on the candidate's value, or on a part of it, may mutate it: refused.
_READ_ONLY_METHODS = frozenset("""
    count index keys values items get copy startswith endswith find rfind rindex lower upper strip lstrip rstrip split
    rsplit splitlines join replace isdigit isalpha isalnum isspace islower isupper istitle isdecimal isnumeric
    isidentifier isprintable isascii title capitalize casefold swapcase center ljust rjust zfill partition rpartition
    format encode decode hex expandtabs translate removeprefix removesuffix issubset issuperset isdisjoint union
    intersection difference symmetric_difference most_common elements total bit_length bit_count conjugate is_integer
    as_integer_ratio to_bytes isoformat weekday isoweekday date time timestamp utcoffset tzname dst total_seconds
    isocalendar strftime timetuple utctimetuple toordinal ctime astimezone timetz _asdict _replace
""".split())  # fmt: skip


_BUILTIN_TYPES = frozenset(n for n in _BUILTINS if isinstance(getattr(builtins, n), type))


def _dotted(node: ast.expr) -> str:
    c = _chain(node)
    return ".".join((c[0], *c[1])) if c is not None and c[2] is None else ""


def _check_consumers(check: ast.AST, where: str, test: str) -> None:
    """Refuse (TDLMError naming ``where``) a check that uses the candidate's value other than by reading it or
    consuming it whole (see :data:`_PARTIAL`, :data:`_MUTATING`, :data:`_READ_ONLY_METHODS`)."""
    parent = {c: n for n in ast.walk(check) for c in ast.iter_child_nodes(n)}

    def refuse(why: str, node: ast.AST) -> TDLMError:
        return TDLMError(f"{where}: the candidate's value is {why} in {ast.unparse(node)[:80]!r}; the sandbox judges "
                         f"a copy sent back once, so Python's result cannot be reproduced: {test[:120]!r} (refused "
                         "at load)")  # fmt: skip

    def uses(node: ast.expr, whole: bool) -> None:
        """``node`` holds the value (``whole``) or a part of it; check what its parent does with it."""
        q = parent.get(node)
        if isinstance(q, ast.Compare) and node is not q.left:
            k = q.comparators.index(node)
            if whole and isinstance(q.ops[k], (ast.In, ast.NotIn)):
                raise refuse("searched with `in`, which stops at the first match", q)
        elif isinstance(q, ast.Call) and node is not q.func:
            name = _dotted(q.func)
            c = _chain(q.func)
            if whole and (name in _PARTIAL or (c is not None and c[0] in _PARTIAL_MODULES)):
                raise refuse(f"consumed by {name or ast.unparse(q.func)}(), which may stop early", q)
            if name in _MUTATING:
                raise refuse(f"passed to {name}(), which mutates it", q)
            unbound = isinstance(q.func, ast.Attribute) and isinstance(q.func.value, ast.Name) and (
                q.func.value.id in _BUILTIN_TYPES)  # list.append(value, x) is value.append(x)
            if unbound and node in q.args[:1] and q.func.attr not in _READ_ONLY_METHODS:
                raise refuse(f"passed to the method {q.func.attr}(), which may mutate it", q)
            if name == "vars":
                uses(q, False)
        elif isinstance(q, ast.Attribute):
            if isinstance(parent.get(q), ast.Call) and parent[q].func is q and q.attr not in _READ_ONLY_METHODS:
                raise refuse(f"the object of the method {q.attr}(), which may mutate it (or, lazy, draw from it)", q)
            uses(q, False)
        elif isinstance(q, ast.Subscript) and node is q.value:
            uses(q, False)
        elif isinstance(q, ast.comprehension) and node is q.iter and whole:
            comp = parent[q]
            if isinstance(comp, ast.GeneratorExp):  # lazy again: its own consumer decides how far it is drawn
                uses(comp, True)

    for n in ast.walk(check):
        if isinstance(n, ast.Name) and n.id.startswith(PLACEHOLDER):
            uses(n, True)


def plan_assert(test: str, imported: frozenset[str], names: frozenset[str] | None, where: str = "test") -> AssertPlan:
    """Split one assert (see :class:`AssertPlan`). ``names``: the candidate's names (:func:`reference_names`);
    None (no reference solution): the names the assert calls (or reads an attribute of) that are not builtins or
    imported; a bare name used as a value is then refused, never the sample's. Raises TDLMError, naming
    ``where``, for a test that is not one assert or has a shape the sandbox cannot split.

    Python's order, kept or refused. The sample evaluates the candidate's sub-expressions once each, before the
    check, and sends one value back per assert; the rest is the trusted check. So an assert splits only where
    that is what Python does:

    - exactly one value goes back: the candidate's sub-expression the check reads. Calls of the candidate's that
      are its direct arguments (``f(g(1))``) stay in the sample and run in Python's order there (the callable, then
      the arguments left to right, then the call), on the very objects Python would pass. Two values (``f(1) ==
      f(2)``, ``{f(1): g(1)}``, ``f(1) + CONST``) are refused: Python runs the later call between them, and it can
      mutate or alias the earlier result (or a check can mutate it before the later call), which a value sent
      back early cannot show. None (``max(3, 5) == 5``) is refused: the evaluator alone would decide it;
    - a candidate's sub-expression where Python may skip it or evaluate it repeatedly is refused: after ``and`` /
      ``or``, in a branch of ``x if c else y``, in a later link of a chained comparison, in a lambda body or a
      comprehension / generator expression (all but its first iterable). The rule is syntactic: the same on every
      Python version (3.12 inlines comprehensions, which would otherwise change what a placeholder there reads);
    - ``is`` / ``is not`` with a side that is the candidate's value or a name the assert binds is refused unless the
      other side is a singleton.
    """
    try:
        tree = ast.parse(test)
    except SyntaxError as e:
        raise TDLMError(f"{where}: not Python ({e.msg}): {test[:120]!r}") from e
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise TDLMError(f"{where}: expected one `assert` statement, got {test[:120]!r}")
    sp = _Splitter(where, names, imported, _rooted(tree.body[0].test))
    check = sp.visit(tree.body[0].test, frozenset())
    sent = [c for c in sp.calls if c.sent]
    if not sent:
        raise TDLMError(f"{where}: calls nothing of the candidate's, so the evaluator alone would decide it: "
                        f"{test[:120]!r} (the sandbox cannot split this assert)")  # fmt: skip
    if len(sent) > 1:
        raise TDLMError(f"{where}: sends {len(sent)} of the candidate's values back ("
                        f"{', '.join(_source(c) for c in sent)[:120]}): Python would run the later one between them, "
                        "which can change or alias the earlier value; one value per assert: "
                        f"{test[:120]!r} (the sandbox cannot split this assert)")  # fmt: skip
    return AssertPlan(test, tuple(sp.calls), ast.unparse(check))


def judged_plan(test: str, imported: frozenset[str], names: frozenset[str] | None, where: str = "test") -> AssertPlan:
    """:func:`plan_assert`, then refused (TDLMError naming ``where``) where the check uses the candidate's value in
    a way the sandbox cannot judge as Python does (:func:`_check_consumers`: a lazy value drawn partially, a value
    the check mutates). The one rule of both paths: loading (:func:`check_problem`) and scoring
    (:func:`tdlm.evaluation.sandbox.split_asserts`, so ``run_python`` too)."""
    plan = plan_assert(test, imported, names, where=where)
    _check_consumers(ast.parse(plan.check, mode="eval"), where, test)
    return plan


def _source(c: CandidateCall) -> str:
    return ".".join((c.root, *c.attrs)) + ("(...)" if c.args is not None else "")


def check_problem(problem: Problem) -> tuple[AssertPlan, ...]:
    """The plans of one MBPP problem's asserts, with its reference solution's names; TDLMError naming the problem
    when one cannot be split (:func:`plan_assert`: among others, one that calls nothing of the candidate's) or uses
    the candidate's value in a way the sandbox cannot judge as Python does (:func:`_check_consumers`: a lazy value
    drawn partially, a value the check mutates)."""
    names = reference_names(problem.answer)
    try:
        imported = imported_names(problem.test_imports)
        with warnings.catch_warnings():  # it parsed in reference_names; its invalid escapes are not this check's
            warnings.simplefilter("ignore")
            _stdlib_only(ast.parse(problem.answer), "the reference solution")
    except TDLMError as e:
        raise TDLMError(f"{problem.id}: {e}") from e
    return tuple(judged_plan(test, imported, names, where=f"{problem.id} test {k + 1}")
                 for k, test in enumerate(problem.tests))  # fmt: skip

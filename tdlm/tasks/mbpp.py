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
of the evaluator evaluates the rest of each assert with the values it sent back. :func:`load` refuses, naming the
problem and the assert, any assert the grammar cannot split or that calls nothing of the reference's, so a shape
that would hand the comparison to the sample is an error before anything is decoded; all 776 shipped asserts
split. pass@1 means every assert held and the program exited 0 (an early ``sys.exit(0)`` / ``os._exit(0)`` sends
no values, so it fails, as in the anchors' harnesses). All 257 canonical solutions pass this way
(tests/test_sandbox_hostile.py).
"""

from __future__ import annotations

import ast
import builtins
import os
import symtable
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
    return frozenset(out)


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


class _Splitter:
    def __init__(self, where: str, names: frozenset[str] | None, imported: frozenset[str]) -> None:
        self.where, self.names, self.imported = where, names, imported
        self.calls: list[CandidateCall] = []

    def fail(self, why: str, node: ast.AST) -> TDLMError:
        return TDLMError(f"{self.where}: {why}: {ast.unparse(node)[:120]!r} (the sandbox cannot split this assert)")

    def candidate(self, name: str, local: frozenset[str]) -> bool:
        if name in local or name in self.imported:
            return False
        return name not in _BUILTINS if self.names is None else name in self.names

    def touches(self, node: ast.AST, local: frozenset[str]) -> bool:
        return any(isinstance(n, ast.Name) and self.candidate(n.id, local) for n in ast.walk(node))

    def closed(self, node: ast.expr, local: frozenset[str], what: str) -> str:
        """Source of a trusted expression the evaluator can compute before the sample runs."""
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                if n.id in local:
                    raise self.fail(f"{what} uses {n.id!r}, which the assert binds itself", node)
                if self.candidate(n.id, local):
                    raise self.fail(f"{what} mixes the candidate's values into other code", node)
                if n.id not in _BUILTINS and n.id not in self.imported:
                    raise self.fail(f"{what} names {n.id!r}: not a builtin, test_imports or reference name", node)
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

    def visit(self, node: ast.AST, local: frozenset[str]) -> ast.AST:
        if isinstance(node, ast.expr):
            c = _chain(node)
            if c is not None and self.candidate(c[0], local):
                i = self.extract(node, c, local, sent=True)
                return ast.copy_location(ast.Name(id=f"{PLACEHOLDER}{i}", ctx=ast.Load()), node)
        if isinstance(node, ast.Name):
            if node.id not in local and node.id not in _BUILTINS and node.id not in self.imported:
                raise self.fail(f"{node.id!r} is not a builtin, a test_imports name or a name the reference defines",
                                node)  # fmt: skip
            return node
        if isinstance(node, ast.NamedExpr):
            raise self.fail("an assignment expression", node)
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for k, op in enumerate(node.ops):
                a, b = sides[k], sides[k + 1]
                singleton = any(isinstance(s, ast.Constant) and any(s.value is v for v in _SINGLETONS) for s in (a, b))
                if isinstance(op, (ast.Is, ast.IsNot)) and not singleton and (self.touches(a, local)
                                                                              or self.touches(b, local)):
                    raise self.fail("identity (`is`) of the candidate's values: decoded values are new objects", node)
        if isinstance(node, ast.Lambda):
            a = node.args
            params = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}
            a.defaults = [self.visit(d, local) for d in a.defaults]
            a.kw_defaults = [self.visit(d, local) if d is not None else None for d in a.kw_defaults]
            node.body = self.visit(node.body, local | params)
            return node
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            bound = set(local)
            for g in node.generators:
                g.iter = self.visit(g.iter, frozenset(bound))
                bound |= {n.id for n in ast.walk(g.target) if isinstance(n, ast.Name)}
                g.ifs = [self.visit(x, frozenset(bound)) for x in g.ifs]
            inner = frozenset(bound)
            if isinstance(node, ast.DictComp):
                node.key, node.value = self.visit(node.key, inner), self.visit(node.value, inner)
            else:
                node.elt = self.visit(node.elt, inner)
            return node
        for field, value in ast.iter_fields(node):
            if isinstance(value, list):
                setattr(node, field, [self.visit(v, local) if isinstance(v, ast.AST) else v for v in value])
            elif isinstance(value, ast.AST):
                setattr(node, field, self.visit(value, local))
        return node


def plan_assert(test: str, imported: frozenset[str], names: frozenset[str] | None, where: str = "test") -> AssertPlan:
    """Split one assert (see :class:`AssertPlan`). ``names``: the candidate's names (:func:`reference_names`);
    None: every name that is not a builtin or imported (a builtin is then never the candidate's). Raises
    TDLMError, naming ``where``, for a test that is not one assert or has a shape the sandbox cannot split."""
    try:
        tree = ast.parse(test)
    except SyntaxError as e:
        raise TDLMError(f"{where}: not Python ({e.msg}): {test[:120]!r}") from e
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise TDLMError(f"{where}: expected one `assert` statement, got {test[:120]!r}")
    sp = _Splitter(where, names, imported)
    check = sp.visit(tree.body[0].test, frozenset())
    return AssertPlan(test, tuple(sp.calls), ast.unparse(check))


def check_problem(problem: Problem) -> tuple[AssertPlan, ...]:
    """The plans of one MBPP problem's asserts; TDLMError naming the problem when one cannot be split or calls
    nothing of the candidate's (the evaluator alone would decide it)."""
    names = reference_names(problem.answer)
    imported = imported_names(problem.test_imports)
    plans = []
    for k, test in enumerate(problem.tests):
        plan = plan_assert(test, imported, names, where=f"{problem.id} test {k + 1}")
        if not any(c.sent for c in plan.calls):
            raise TDLMError(f"{problem.id} test {k + 1}: calls nothing the reference solution defines: {test[:120]!r}")
        plans.append(plan)
    return tuple(plans)

"""A candidate's call in every position of a comprehension (issue "tests that catch faults one step past the tested
values", item c).

Python evaluates a comprehension's *first* iterable once, outside the loop, and everything else - a later ``for``
iterable, every ``if`` clause, the element (a dict's key and value) - once per element, maybe never. The sample
evaluates the candidate's sub-expression once, before the check (:func:`tdlm.tasks.mbpp.plan_assert`), so only
the first position can be split; in any other, a candidate whose result changes with each call would get one
value where Python sees many. Each position below, in list, set, dict and generator comprehensions (and a
comprehension nested in another's element), is asked of such a stateful wrong sample that the plain harness
(exec the sample, then the assert) fails: the scorer must refuse the assert (one line, nothing run, also when
MBPP loads the task) or fail the sample - never pass it.

Honest controls: in the first position the same stateful sample is right (Python calls it once) and passes, both
in the plain harness and through the sandbox, on both backends; a sample that is always wrong fails there.
"""

from __future__ import annotations

import pytest
from conftest import SANDBOX_BACKENDS, sandbox_limits_for

from tdlm.errors import TDLMError
from tdlm.evaluation.scoring import score_code
from tdlm.tasks.base import Problem
from tdlm.tasks.mbpp import check_problem

REFERENCE = "def f(n):\n    return tuple(range(n))\n"
# right on its first call only; every later call returns one element too many
STATEFUL = "N = [0]\ndef f(n):\n    N[0] += 1\n    return tuple(range(n if N[0] == 1 else n + 1))\n"
WRONG = "def f(n):\n    return tuple(range(n + 1))\n"
ONCE = "comprehension or generator expression, which Python evaluates once per element"

# (comprehension, position, assert): the positions Python evaluates once per element
PER_ELEMENT = [
    ("list", "later_for", "assert [y for x in 'ab' for y in f(3)] == [0, 1, 2, 0, 1, 2]"),
    ("list", "first_if", "assert [x for x in 'ab' if f(3) == (0, 1, 2)] == ['a', 'b']"),
    ("list", "later_if", "assert [x for x in 'ab' for y in 'c' if f(3) == (0, 1, 2)] == ['a', 'b']"),
    ("list", "second_if", "assert [x for x in 'ab' if x if f(3) == (0, 1, 2)] == ['a', 'b']"),
    ("list", "element", "assert [f(3) for x in 'ab'] == [(0, 1, 2), (0, 1, 2)]"),
    ("list", "element_argument", "assert [len(f(3)) for x in 'ab'] == [3, 3]"),
    ("list", "nested_first_for", "assert [[y for y in f(3)] for x in 'ab'] == [[0, 1, 2], [0, 1, 2]]"),
    ("set", "later_for", "assert {y for x in 'ab' for y in f(3)} == {0, 1, 2}"),
    ("set", "first_if", "assert {x for x in 'ab' if f(3) == (0, 1, 2)} == {'a', 'b'}"),
    ("set", "later_if", "assert {x for x in 'ab' for y in 'c' if f(3) == (0, 1, 2)} == {'a', 'b'}"),
    ("set", "element", "assert {f(3) for x in 'ab'} == {(0, 1, 2)}"),
    ("dict", "later_for", "assert {y: x for x in 'ab' for y in f(3)} == {0: 'b', 1: 'b', 2: 'b'}"),
    ("dict", "first_if", "assert {x: 0 for x in 'ab' if f(3) == (0, 1, 2)} == {'a': 0, 'b': 0}"),
    ("dict", "later_if", "assert {x: 0 for x in 'ab' for y in 'c' if f(3) == (0, 1, 2)} == {'a': 0, 'b': 0}"),
    ("dict", "key", "assert {f(3): 0 for x in 'ab'} == {(0, 1, 2): 0}"),
    ("dict", "value", "assert {x: f(3) for x in 'ab'} == {'a': (0, 1, 2), 'b': (0, 1, 2)}"),
    ("generator", "later_for", "assert list(y for x in 'ab' for y in f(3)) == [0, 1, 2, 0, 1, 2]"),
    ("generator", "first_if", "assert list(x for x in 'ab' if f(3) == (0, 1, 2)) == ['a', 'b']"),
    ("generator", "later_if", "assert list(x for x in 'ab' for y in 'c' if f(3) == (0, 1, 2)) == ['a', 'b']"),
    ("generator", "element", "assert all(f(3) == (0, 1, 2) for x in 'ab')"),
]  # fmt: skip
# the first iterable: evaluated once, in the enclosing scope - split, and scored as Python scores it
FIRST_FOR = [
    "assert [y for y in f(3)] == [0, 1, 2]",
    "assert {y for y in f(3)} == {0, 1, 2}",
    "assert {y: 0 for y in f(3)} == {0: 0, 1: 0, 2: 0}",
    "assert list(y for y in f(3)) == [0, 1, 2]",
    "assert [y for y in f(3) for x in 'ab' if x] == [0, 0, 1, 1, 2, 2]",
]


def plain(program: str, test: str) -> bool:
    """The plain MBPP harness for one assert: a fresh namespace, the program, then the assert."""
    env: dict = {}
    exec(program, env)  # noqa: S102 - the test's own samples
    try:
        exec(test, env)  # noqa: S102
    except AssertionError:
        return False
    return True


@pytest.fixture(scope="module")
def limits():
    return sandbox_limits_for("inhouse", timeout_s=30.0, cpu_s=5)


def test_the_table_covers_every_position_of_every_comprehension():
    kinds = {k for k, _, _ in PER_ELEMENT}
    assert kinds == {"list", "set", "dict", "generator"}
    for kind in kinds:
        have = {p for k, p, _ in PER_ELEMENT if k == kind}
        body = {"key", "value"} if kind == "dict" else {"element"}
        assert {"later_for", "first_if", "later_if"} | body <= have, (kind, have)


@pytest.mark.parametrize("kind,position,test", PER_ELEMENT, ids=[f"{k}-{p}" for k, p, _ in PER_ELEMENT])
def test_a_call_evaluated_per_element_is_refused_or_fails(kind, position, test, limits):
    assert plain(REFERENCE, test), "the assert is wrong"  # the reference passes: the assert itself is right
    assert not plain(STATEFUL, test), "the stateful sample is not caught by the plain harness"
    try:
        s = score_code(STATEFUL, [test], limits=limits, reference=REFERENCE)
    except TDLMError as e:  # refused before anything runs: one line naming why, and MBPP refuses it at load
        assert ONCE in str(e) and "\n" not in str(e), str(e)
        with pytest.raises(TDLMError, match=r"mbpp/1 test 1: .*once per element"):
            check_problem(Problem("mbpp", "mbpp/1", 0, "", REFERENCE, (test,)))
    else:
        assert not s.correct, (kind, position, "a wrong stateful sample passed", s.sandbox)


@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_control_the_first_iterable_is_split_and_scored_as_python_scores_it(backend):
    lim = sandbox_limits_for(backend, timeout_s=30.0, cpu_s=5)
    assert all(plain(STATEFUL, t) for t in FIRST_FOR) and not any(plain(WRONG, t) for t in FIRST_FOR)
    assert check_problem(Problem("mbpp", "mbpp/1", 0, "", REFERENCE, tuple(FIRST_FOR)))
    # one program per assert, as the plain harness: the stateful sample is right on the one call Python makes
    right = [score_code(STATEFUL, [t], limits=lim, reference=REFERENCE) for t in FIRST_FOR]
    assert all(s.correct for s in right), [s.detail for s in right if not s.correct]
    wrong = score_code(WRONG, FIRST_FOR, limits=lim, reference=REFERENCE)
    assert not wrong.correct and wrong.sandbox.checks == (False,) * len(FIRST_FOR), wrong.sandbox

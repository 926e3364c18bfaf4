"""Python's evaluation order, or a refusal (issue items 4 and 5).

The sample evaluates the candidate's sub-expressions of an assert once each, before the trusted check, and sends
one value back (:func:`tdlm.tasks.mbpp.plan_assert`). So an assert is split only where Python itself evaluates the
candidate's code exactly once, in that order, with nothing of the candidate's running between that value and the
check:

- refused at load (one line, nothing runs): two values sent back (a dict display with calls on both sides, a
  returned list that a later call mutates, ``f(1) == CONST``); a candidate's sub-expression after ``and`` / ``or``,
  in a branch of ``x if c else y``, in a later link of a chained comparison, in a lambda body or a comprehension
  body (3.12 inlines comprehensions: the old split then passed a wrong stateful answer); ``is`` between names
  the assert binds; an assert that sends nothing (``max(3, 5) == 5``), with or without a reference; without a
  reference, a bare name used as a value (``f(10) == EXPECTED_10`` took its expected value from the sample).
- kept, in Python's order: calls that are direct arguments of the sent call stay in the sample and run as Python
  runs them - the callable first (a ``g`` that rebinds ``f`` does not change which ``f`` is called), then the
  arguments left to right, on the objects Python would pass.

Each hostile shape is paired with a wrong stateful sample that the plain MBPP harness fails; each refusal has an
honest control: the same question asked in an accepted shape gets the plain harness's verdict through the scorer.
"""

from __future__ import annotations

import pytest
from conftest import SANDBOX_BACKENDS, sandbox_limits_for
from test_lazy_values_wire import plain

from tdlm.errors import TDLMError
from tdlm.evaluation.sandbox import split_asserts
from tdlm.evaluation.scoring import score_code
from tdlm.tasks.base import Problem
from tdlm.tasks.mbpp import check_problem

# A wrong, stateful answer: each call returns the next of 1, 2, 3 ... (the reference always returns 1)
COUNTER = "N = [0]\ndef f(x):\n    N[0] += 1\n    return N[0]\ndef g(x):\n    return f(x)\n"
ALIASED = "S = [[1]]\nL = [1]\ndef f(x):\n    return S if x else L\ndef g(x):\n    L.append(2)\n    return [1]\n"
REFERENCE = "def f(x):\n    return 1\ndef g(x):\n    return 1\nCONST = 1\n"
NAMES = {"f", "g", "CONST"}
# (a wrong sample, asserts it fails in the plain harness but that a split running each call once, unconditionally
#  and in its own order, would pass; the words of the one-line refusal)
HOSTILE = [
    ("dict_display", COUNTER, ["assert {1: f(1), f(1): 0} == {1: 0}"], "sends 2 of the candidate's values"),
    ("after_or", COUNTER, ["assert f(1) == 1 or f(1) == 5", "assert f(1) == 3"], "after `and` / `or`"),
    ("after_and", COUNTER, ["assert f(1) == 5 and f(1) == 2"], "after `and` / `or`"),
    ("chain", COUNTER, ["assert not (2 < 1 < f(1))", "assert f(1) == 2"], "later link of a chained comparison"),
    ("conditional", COUNTER, ["assert (f(1) if False else 1) == 1", "assert f(1) == 2"], "branch of a conditional"),
    ("comprehension", COUNTER, ["assert [f(1) for _ in 'ab'] == [1, 1]"], "body of a comprehension"),
    ("generator", COUNTER, ["assert all(f(1) == 1 for _ in 'ab')"], "body of a comprehension"),
    ("lambda", COUNTER, ["assert (lambda: f(1))() + (lambda: f(1))() == 2"], "body of a lambda"),
    ("later_call_mutates", ALIASED, ["assert f(0) == g(0)"], "sends 2 of the candidate's values"),
    ("two_calls", COUNTER, ["assert f(1) + f(1) == 2"], "sends 2 of the candidate's values"),
    ("bound_names_alias", ALIASED, ["assert all(v is not w for v, w in zip(f(1), f(1)))"], "identity (`is`)"),
]  # fmt: skip
CONTROLS = ["assert f(1) == 1", "assert g(1) == 1", "assert CONST == 1", "assert {1: f(1)} == {1: 1}",
            "assert [f(1)] * 2 == [1, 1]", "assert 0 < f(1) < 2", "assert (1 if f(1) else 0) == 1",
            "assert (lambda v: v == 1)(f(1))", "assert all(v == 1 for v in [f(1)])"]  # fmt: skip


@pytest.mark.parametrize("name,sample,tests,why", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_shapes_whose_order_the_split_cannot_keep_are_refused_at_load(name, sample, tests, why):
    """Hostile: the sample is wrong (the plain harness fails an assert) and the shape is refused with one line,
    before anything runs, both by the scorer and when MBPP loads the task."""
    assert not all(plain(sample, tests)), name
    with pytest.raises(TDLMError, match="test 1") as e:
        score_code(sample, tests, reference=REFERENCE)
    assert why in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(TDLMError, match=r"mbpp/1 test 1"):
        check_problem(Problem("mbpp", "mbpp/1", 0, "", REFERENCE, tuple(tests)))


def test_an_expected_value_from_the_sample_is_refused():
    """``f(1) == CONST`` with CONST the reference's: the sample's CONST would be the expected side (the plain
    harness passes COUNTER with its own CONST = 2 on the second assert: it trusts the sample)."""
    tests = ["assert f(1) + 1 == CONST", "assert f(1) == CONST"]
    assert plain(COUNTER + "CONST = 2\n", tests) == (True, True)
    for t in tests:
        with pytest.raises(TDLMError, match="sends 2 of the candidate's values"):
            score_code(COUNTER + "CONST = 2\n", [t], reference=REFERENCE)


@pytest.fixture(scope="module", params=SANDBOX_BACKENDS)
def limits(request):
    return sandbox_limits_for(request.param, timeout_s=30.0, cpu_s=5)


def test_control_the_accepted_shapes_score_as_the_plain_harness_on_both_backends(limits):
    """The same candidates in shapes Python evaluates once each, in order (one value sent back; the comparison, a
    chain around it, a conditional on it, a lambda or comprehension over it all trusted): the wrong COUNTER gets
    the plain harness's verdict per assert, the reference passes."""
    expect = plain(COUNTER + "CONST = 1\n", CONTROLS)
    assert expect[:3] == (True, False, True) and False in expect[3:], expect  # the state moves on
    wrong = score_code(COUNTER + "CONST = 1\n", CONTROLS, limits=limits, reference=REFERENCE)
    assert wrong.sandbox.checks == expect and not wrong.correct, wrong.sandbox
    assert score_code(REFERENCE, CONTROLS, limits=limits, reference=REFERENCE).correct
    assert check_problem(Problem("mbpp", "mbpp/1", 0, "", REFERENCE, tuple(CONTROLS)))


# Calls kept in the sample in Python's order: the callable first, then the arguments left to right
REBIND = """
def f(x):
    return "old f"
def g(x):
    global f
    f = lambda y: "new f"
    return x
LOG = []
def h(*xs):
    return LOG + list(xs)
def a(x):
    LOG.append("a")
    return x
def b(x):
    LOG.append("b")
    return LOG[:]
def m(xs):
    xs.append(0)
    return xs
def s(x):
    return [x]
"""
ORDERED = ["assert f(g(1)) == 'old f'", "assert h(a(1), b(2)) == ['a', 'b', 1, ['a', 'b']]",
           "assert m(s(3)) == [3, 0]", "assert h(a(1), k=b(2)) if False else True"]  # fmt: skip


def test_calls_kept_in_the_sample_run_in_pythons_order(limits):
    """Hostile: ``g`` rebinds ``f`` while ``f``'s argument is computed; Python has already loaded the old ``f``
    (before this change the driver looked ``f`` up after running ``g``: 'new f'). ``a`` and ``b`` log their order;
    ``m`` mutates the very list ``s`` returned. The plain harness and the scorer agree on each."""
    tests = ORDERED[:3]
    expect = plain(REBIND, tests)
    assert expect == (True, True, True)
    got = score_code(REBIND, tests, limits=limits, reference=REBIND)
    assert got.correct and got.sandbox.checks == expect, got.sandbox
    with pytest.raises(TDLMError, match="branch of a conditional"):  # the same calls where Python may skip them
        split_asserts(ORDERED[3:], [], {"h", "a", "b"})


# ------------------------------------------------------------------------------------------ item 5: no reference
WRONG = "EXPECTED_10 = 0\ndef f(x):\n    return 0\n"
HONEST = "def f(x):\n    return 2 * x\n"


@pytest.mark.parametrize("test,why", [
    ("assert f(10) == EXPECTED_10", "without a reference solution only a name the assert calls"),
    ("assert f(EXPECTED_10) == 0", "without a reference solution only a name the assert calls"),
    ("assert max(3, 5) == 5", "calls nothing of the candidate's"),
    ("assert f(10) == f(5) * 2", "sends 2 of the candidate's values"),
])  # fmt: skip
def test_without_a_reference_nothing_is_delegated_to_the_sample(test, why):
    """Hostile: WRONG would pass each of these if the bare name were the sample's, or if an assert that calls
    nothing passed without a solution. Refused, one line, before anything runs (split_asserts, not only
    mbpp.load). Control: an assert that calls the candidate, with a trusted expected side, scores WRONG as failed
    and HONEST as passed without a reference."""
    with pytest.raises(TDLMError, match="test 1") as e:
        score_code(WRONG, [test])
    assert why in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(TDLMError, match="test 1"):
        split_asserts([test])


def test_without_a_reference_a_called_name_is_still_the_candidates(limits):
    tests = ["assert f(10) == 20", "assert f(f(1)) == 4"]
    assert split_asserts(tests)[1].calls == ("f(1)", "f(<0>)")
    assert not score_code(WRONG, tests, limits=limits).correct
    assert score_code(HONEST, tests, limits=limits).correct


def test_an_assert_that_calls_nothing_is_refused_with_a_reference_too():
    with pytest.raises(TDLMError, match="calls nothing of the candidate's"):
        split_asserts(["assert max(3, 5) == 5"], [], {"f"})
    with pytest.raises(TDLMError, match="calls nothing of the candidate's"):
        split_asserts(["assert sum([1, 2]) == 3"], [], {"f"})  # a builtin the reference does not define
    assert split_asserts(["assert sum([1, 2]) == 3"], [], {"sum"})[0].calls == ("sum([1, 2])",)  # mbpp/126 style

"""The assert grammar's refusal of identity (``is`` / ``is not``) between the candidate's values, in its mirror forms.

Values come back from the sample decoded, as new objects, so the trusted side cannot decide ``is`` between the
candidate's values and anything but a singleton (:func:`tdlm.tasks.mbpp.plan_assert`, used by
:func:`tdlm.evaluation.sandbox.split_asserts`): such an assert is refused when MBPP loads, before anything runs.
tests/test_sandbox_verdict_bounds.py refuses ``f(1) is f(1)`` and ``f(1) is not f(1)``; here the candidate's value
stands on either side alone (``f(1) is [2]`` and its mirror ``[2] is f(1)``), on both, inside a chain, reached
through a subscript or an attribute, and the grammar refuses each mirror form the same way, with one line; the
singleton forms it allows (``f(1) is None``) are allowed mirrored too, with the same call sent to the sample.
"""

from __future__ import annotations

import pytest

from tdlm.errors import TDLMError
from tdlm.evaluation.sandbox import split_asserts
from tdlm.evaluation.scoring import score_code
from tdlm.tasks.mbpp import plan_assert

REFERENCE = "def f(x):\n    return 2 * x\n"
NAMES = frozenset({"f"})
# A sample that would answer any delegated identity with the "right" object: refused before it runs.
SAMPLE = "CACHE = [2]\ndef f(x):\n    return CACHE\n"
CANDIDATE = ["f(1)", "f(1)[0]", "f(1).real", "(f(1),)", "[f(1)]", "f"]  # the candidate's values, as an assert has them
TRUSTED = ["[2]", "()", "2", "'py'", "len([])", "(None,)"]  # anything the evaluator computes that is not a singleton
SINGLETONS = ["None", "True", "False", "..."]
OPS = ["is", "is not"]


def _refusal(test: str) -> str | None:
    """The grammar's one-line refusal of ``test`` (None: it splits)."""
    try:
        plan_assert(test, frozenset(), NAMES)
    except TDLMError as e:
        return str(e)
    return None


MIRRORS = [(f"assert {c} {op} {t}", f"assert {t} {op} {c}") for c in CANDIDATE for t in TRUSTED for op in OPS]


@pytest.mark.parametrize("left,right", MIRRORS, ids=[m[1] for m in MIRRORS])
def test_identity_with_the_candidates_value_on_either_side_is_refused_alike(left, right):
    """``c is t`` and its mirror ``t is c`` (and ``is not``): both refused, with the same one-line reason."""
    for test in (left, right):
        why = _refusal(test)
        assert why is not None, f"{test!r} was split: the trusted side would decide `is` on decoded values"
        assert "identity (`is`) of the candidate's values" in why and "test" in why and "\n" not in why, why
    assert _refusal(left).replace(left[7:], "") == _refusal(right).replace(right[7:], "")


BOTH = [f"assert {a} {op} {b}" for a in ("f(1)", "f(2)[0]", "(f(1),)") for b in ("f(1)", "f(3).real") for op in OPS]
CHAINS = [  # the candidate's value in an identity link at every place of a chain, the other links plain
    "assert 2 == f(1) is [2]", "assert [2] is f(1) == 2", "assert 1 < 2 is f(1)", "assert f(1) is not 2 < 3",
    "assert 0 <= f(1) is not [2] != 1", "assert f(1) == 2 is not f(1)", "assert [2] == [2] is f(1)",
    "assert not (3 is f(1))", "assert [x for x in [1] if x is f(1)]", "assert (lambda v: [2] is f(v))(1)",
]  # fmt: skip


@pytest.mark.parametrize("test", BOTH + CHAINS)
def test_identity_with_the_candidates_values_on_both_sides_or_inside_a_chain_is_refused(test):
    why = _refusal(test)
    assert why is not None and "identity (`is`)" in why and "\n" not in why, (test, why)


SPLIT = [(f"assert {c} {op} {s}", f"assert {s} {op} {c}") for c in ("f(1)", "f(1)[0]") for s in SINGLETONS
         for op in OPS]  # fmt: skip


@pytest.mark.parametrize("left,right", SPLIT, ids=[m[1] for m in SPLIT])
def test_identity_with_a_singleton_splits_on_either_side(left, right):
    """A singleton keeps its identity through the decoder: ``f(1) is None`` and ``None is f(1)`` both split, send
    the same call to the sample, and keep the comparison (mirrored) on the trusted side."""
    a, b = split_asserts([left, right], [], NAMES)
    assert a.calls == b.calls == ("f(1)",), (a.calls, b.calls)
    op = " is not " if " is not " in left else " is "
    x, y = a.check.split(op)
    assert b.check == f"{y}{op}{x}", (a.check, b.check)


@pytest.mark.parametrize("test", [MIRRORS[1][1], MIRRORS[0][1], BOTH[0], CHAINS[0]])
def test_mirror_forms_are_refused_before_the_sample_runs(test):
    """Through the scorer, as tests/test_sandbox_verdict_bounds.py refuses ``f(1) is f(1)``: TDLMError naming the
    test, one line, before the sample (which would make every identity hold) runs."""
    with pytest.raises(TDLMError, match="test 1") as e:
        score_code(SAMPLE, [test], [], reference=REFERENCE)
    assert "identity" in str(e.value) and "\n" not in str(e.value), str(e.value)


BOUND = [  # a name the assert binds may hold the candidate's value (issue item 4: `zip(f(1), f(1))` pairs)
    ("assert [x for x in f(1) if x is [2]]", "assert [x for x in f(1) if [2] is x]"),
    ("assert (lambda v: v is not (2,))(f(1))", "assert (lambda v: (2,) is not v)(f(1))"),
    ("assert all(v is w for v, w in zip(f(1), [2]))", "assert all(w is v for v, w in zip(f(1), [2]))"),
]


@pytest.mark.parametrize("left,right", BOUND, ids=[b[0] for b in BOUND])
def test_identity_with_a_name_the_assert_binds_is_refused_on_either_side(left, right):
    for test in (left, right):
        why = _refusal(test)
        assert why is not None and "identity (`is`)" in why and "a name the assert binds" in why, (test, why)


@pytest.mark.parametrize("test", ["assert all([x is None for x in f(1)])",
                                  "assert all([None is not x for x in f(1)])",
                                  "assert (lambda v: v is True)(f(1))", "assert (lambda v: False is v)(f(1))"])
def test_a_bound_name_against_a_singleton_splits_on_either_side(test):
    assert _refusal(test) is None and split_asserts([test], [], NAMES)[0].calls == ("f(1)",)

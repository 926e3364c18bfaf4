"""A scoring error on one task is recorded on that task and never ends the scoring run (issue "allow what MBPP
needs and nothing else", item f).

:class:`tdlm.evaluation.scoring.Scorer` (the driver's ``_score_all``) and :func:`tdlm.evaluation.scoring.score`
(the lm-evaluation-harness task's ``process_results``) score many problems in one run. Whatever goes wrong with
one of them - an assert the sandbox cannot split, the sandbox failing on that one run (an ``OSError``), anything
else raised on the way, Math-Verify raising - is that problem's :class:`Score`: wrong, status ``error``, a
one-line ``detail`` naming the problem. The other problems of the run are scored as usual. Controls: the
sandbox's refusal (the machine's, not a task's) and an unknown task still raise, so nothing fails open.
"""

from __future__ import annotations

import pytest
from conftest import sandbox_limits_for

from tdlm.errors import TDLMError
from tdlm.evaluation import scoring
from tdlm.evaluation.sandbox import core
from tdlm.evaluation.scoring import Score, Scorer, score
from tdlm.tasks.base import Problem

REFERENCE = "def f(x):\n    return 2 * x\n"
GOOD = "def f(x):\n    return 2 * x\n"
WRONG = "def f(x):\n    return x\n"
FINE = ("assert f(2) == 4", "assert f(3) == 6")
UNSPLITTABLE = ("assert f(1) == 2 or f(1) == 5",)  # after `or`: refused before anything runs
BAD_ARGUMENT = ("assert f(1 // 0) == 0",)  # the argument is computed on the trusted side: ZeroDivisionError


def problem(pid: str, tests: tuple[str, ...], task: str = "mbpp", answer: str = REFERENCE) -> Problem:
    return Problem(task=task, id=pid, index=0, prompt="", answer=answer, tests=tests)


def assert_error_recorded(s: Score, pid: str, words: str) -> None:
    assert (s.correct, s.status) == (False, "error"), s
    assert s.detail.startswith(f"{pid}: scoring error: ") and words in s.detail, s.detail
    assert "\n" not in s.detail and len(s.detail) <= 260, s.detail


@pytest.fixture(scope="module")
def limits():
    return sandbox_limits_for("inhouse", timeout_s=20.0, cpu_s=5)


@pytest.fixture
def flaky_sandbox(monkeypatch):
    """The sandbox raises on runs of a sample that holds ``RAISE:<exception name>`` (a full /tmp, EMFILE ...)."""
    real = scoring.run_python

    def run_python(code, *a, **k):
        if "RAISE:OSError" in code:
            raise OSError(28, "No space left on device")
        if "RAISE:ValueError" in code:
            raise ValueError("multi\nline\nmessage")
        return real(code, *a, **k)

    monkeypatch.setattr(scoring, "run_python", run_python)


def test_one_tasks_errors_are_recorded_and_the_rest_of_the_run_is_scored(limits, flaky_sandbox):
    problems = [problem("mbpp/ok", FINE), problem("mbpp/split", UNSPLITTABLE), problem("mbpp/arg", BAD_ARGUMENT),
                problem("mbpp/os", FINE), problem("mbpp/value", FINE), problem("mbpp/wrong", FINE)]  # fmt: skip
    completions = [GOOD, GOOD, GOOD, GOOD + "# RAISE:OSError\n", GOOD + "# RAISE:ValueError\n", WRONG]
    with Scorer(1, sandbox=limits) as scorer:
        got = scorer.score_many(problems, completions, threads=2)
    assert [(s.correct, s.status) for s in got] == [(True, "passed"), (False, "error"), (False, "error"),
                                                    (False, "error"), (False, "error"), (False, "failed")]  # fmt: skip
    assert_error_recorded(got[1], "mbpp/split", "after `and` / `or`")
    assert_error_recorded(got[2], "mbpp/arg", "ZeroDivisionError")
    assert_error_recorded(got[3], "mbpp/os", "OSError: [Errno 28] No space left on device")
    assert_error_recorded(got[4], "mbpp/value", "ValueError: multi line message")
    assert got[3].extracted == scoring.extract_code(completions[3])  # the code that was to run, as any code Score
    # the in-process path (the harness task's process_results) records the same errors the same way
    for p, c, g in zip(problems, completions, got, strict=True):
        s = score(p, c, limits=limits)
        assert (s.correct, s.status, s.detail) == (g.correct, g.status, g.detail), (p.id, s, g)


def test_a_math_error_is_recorded_on_its_problem(monkeypatch):
    def broken(task, completion, answer):
        raise RecursionError("maximum recursion depth exceeded in comparison")

    monkeypatch.setattr(scoring, "score_math", broken)
    s = score(problem("gsm8k/7", (), task="gsm8k", answer="18"), "\\boxed{18}")
    assert_error_recorded(s, "gsm8k/7", "RecursionError")
    assert s.extracted is None


def test_control_the_sandboxs_refusal_and_an_unknown_task_still_raise(limits, monkeypatch):
    # fail closed: a machine without a guarantee refuses every problem (one line), it is no problem's error
    refusal = "sandbox: refusing to score code: missing network (test)"
    monkeypatch.setattr(core, "_required", {core._plan_key(limits): {"missing": ["network"], "refusal": refusal}})
    with Scorer(1, sandbox=limits) as scorer:
        for tests in (FINE, UNSPLITTABLE):
            with pytest.raises(TDLMError, match="refusing to score code"):
                scorer.score(problem("mbpp/ok", tests), GOOD)
    for tests in (FINE, UNSPLITTABLE):
        with pytest.raises(TDLMError, match="refusing to score code"):
            score(problem("mbpp/ok", tests), GOOD, limits=limits)
    with pytest.raises(TDLMError, match="unknown 'nope'"):
        score(problem("x/1", FINE, task="nope"), GOOD)

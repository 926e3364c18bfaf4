"""Scoring (tdlm.evaluation.scoring): Math-Verify on every GSM8K / MATH-500 gold, wrong answers, MBPP reference
solutions."""

from __future__ import annotations

import ast
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

from tdlm.errors import TDLMError
from tdlm.evaluation.scoring import Score, Scorer, build_program, extract_code, gold_text, score, score_code, score_math
from tdlm.tasks import load_task
from tdlm.tasks.base import default_data_dir

DATA = default_data_dir()

# MATH-500 pairs (gold problem, other problem) whose *different* answer strings Math-Verify rightly accepts as
# equal: "5" vs "x=5" (an assignment to the answer's variable). Found by the rejection sweep below.
KNOWN_EQUIVALENT_ANSWERS = {("test/algebra/1837.json", "test/algebra/2193.json")}


@pytest.fixture(scope="module")
def gsm():
    return load_task("gsm8k", data_dir=DATA)


@pytest.fixture(scope="module")
def math500():
    return load_task("math500", data_dir=DATA)


@pytest.fixture(scope="module")
def mbpp():
    return load_task("mbpp", data_dir=DATA)


@pytest.fixture(scope="module")
def scorer():
    # One worker for the whole module: each spawned worker imports tdlm (and so torch), ~3 s of CPU.
    with Scorer(workers=1) as s:
        yield s


def _score_all(cases):
    # In-process (pytest runs tests in the main thread): ~4 ms per case. Routing the sweeps through Scorer
    # workers was slower on 2 shared cores (each worker also imports torch via tdlm); Scorer is tested below.
    return [score(p, t) for p, t in cases]


def test_every_gsm8k_gold_verifies_in_model_formats(gsm):
    cases = []
    for p in gsm:
        cases.append((p, f"Let me think step by step. ... The answer is \\boxed{{{p.answer}}}."))
        cases.append((p, f"Step 1 ... step 2 gives 7 more.\n#### {p.answer}"))
        with_commas = p.raw["answer"].split("####")[-1].strip()
        if with_commas != p.answer:  # the model may keep the thousands separator
            cases.append((p, f"So the total is $\\boxed{{{with_commas}}}$"))
    scores = _score_all(cases)
    bad = [(p.id, t[-40:], s) for (p, t), s in zip(cases, scores, strict=True) if not (s.correct and s.extracted)]
    assert not bad, bad[:5]
    assert len(scores) > 2 * 1319


def test_gsm8k_rejects_wrong_answers(gsm):
    cases = []
    for i, p in enumerate(gsm):
        cases.append((p, f"The answer is \\boxed{{{float(p.answer) + 1:g}}}."))
        other = gsm[(i + 1) % len(gsm)].answer
        if float(other) != float(p.answer):
            cases.append((p, f"\\boxed{{{other}}}"))
    scores = _score_all(cases)
    bad = [(p.id, t, s) for (p, t), s in zip(cases, scores, strict=True) if s.correct or s.status != "wrong"]
    assert not bad, bad[:5]
    assert len(cases) > 2500


def test_every_math500_answer_verifies_against_its_solution(math500):
    scores = _score_all([(p, p.raw["solution"]) for p in math500])
    bad = [(p.id, p.answer, s) for p, s in zip(math500, scores, strict=True) if not s.correct]
    assert not bad, bad


def test_math500_rejects_other_problems_answers(math500):
    others = []
    for i, p in enumerate(math500):
        j = (i + 1) % len(math500)
        while math500[j].answer == p.answer:  # the same string is the same answer: take the next different one
            j = (j + 1) % len(math500)
        others.append(math500[j])
    texts = [f"Thus the final answer is $\\boxed{{{o.answer}}}$." for o in others]
    scores = _score_all(list(zip(math500, texts, strict=True)))
    assert all(s.status in ("correct", "wrong") for s in scores)
    accepted = {
        (p.raw["unique_id"], o.raw["unique_id"]) for p, o, s in zip(math500, others, scores, strict=True) if s.correct
    }
    assert accepted == KNOWN_EQUIVALENT_ANSWERS


def test_math_edge_cases():
    assert gold_text("math500", "\\frac{1}{2}") == "\\boxed{\\frac{1}{2}}"
    assert gold_text("gsm8k", "1,000") == "1000"
    for text in ("", "I do not know.", "The answer is \\boxed{", "no digits at all"):
        s = score_math("gsm8k", text, "18")
        assert s == Score(False, "unparsed", None, s.seconds), text
    assert score_math("math500", "so $x = \\boxed{0.5}$", "\\frac{1}{2}").correct
    assert score_math("math500", "\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}").correct
    assert not score_math("math500", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt3}{2}").correct
    assert score_math("gsm8k", "The answer is 17. Final answer: \\boxed{18}", "18").correct
    assert score_math("gsm8k", "\\boxed{18}, so again \\boxed{18}", "18").correct
    # Math-Verify reads *all* boxed answers (normalization boxed="all") as one set: two different ones are wrong
    s = score_math("gsm8k", "First I thought \\boxed{17}, but actually \\boxed{18}.", "18")
    assert (s.correct, s.extracted) == (False, "17,18")
    with pytest.raises(TDLMError, match="no math gold"):
        gold_text("mbpp", "x")


def test_score_math_refuses_other_threads():
    errors = []
    t = threading.Thread(target=lambda: errors.append(_catch(lambda: score_math("gsm8k", "\\boxed{1}", "1"))))
    t.start()
    t.join()
    assert isinstance(errors[0], TDLMError) and "Scorer" in str(errors[0])


def _catch(fn):
    try:
        fn()
    except Exception as e:
        return e
    return None


def test_scorer_from_threads_matches_in_process(gsm, math500, mbpp, scorer):
    problems = list(gsm)[:60] + list(math500)[:40] + list(mbpp)[:4]
    completions = (
        [f"... so \\boxed{{{p.answer}}}" if i % 3 else "I give up" for i, p in enumerate(list(gsm)[:60])]
        + [p.raw["solution"] if i % 2 else "\\boxed{42}" for i, p in enumerate(list(math500)[:40])]
        + [f"```python\n{p.answer}\n```" if i % 2 else "def f(): pass" for i, p in enumerate(list(mbpp)[:4])]
    )
    expected = [score(p, c) for p, c in zip(problems, completions, strict=True)]
    got = scorer.score_many(problems, completions, threads=4)
    for e, g in zip(expected, got, strict=True):
        assert (g.correct, g.status, g.extracted) == (e.correct, e.status, e.extracted)
    assert sum(g.correct for g in got) == 40 + 20 + 2


def test_scorer_hard_timeout_kills_and_recovers(gsm, scorer):
    scorer.call(time.sleep, 0)  # make sure the worker runs, so the timeout below hits a job, not the start-up
    proc = scorer._all[0]._proc
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        scorer.call(time.sleep, 30, timeout_s=0.5)
    assert time.monotonic() - t0 < 3
    assert not proc.is_alive() and scorer._all[0]._proc is None  # killed; the next call starts a fresh one
    assert scorer.score(gsm[0], "\\boxed{18}").correct
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        scorer.call(divmod, 1, 0)
    assert scorer.score(gsm[0], "\\boxed{17}").status == "wrong"  # the worker survived fn's exception
    timed = Scorer(workers=1, hard_timeout_s=0.001)  # shorter than a worker's start-up: every call overruns
    try:
        s = timed.score(gsm[0], "\\boxed{18}")
        assert (s.correct, s.status) == (False, "timeout")
    finally:
        timed.close()
    with pytest.raises(TDLMError, match="after close"):
        timed.score(gsm[0], "\\boxed{18}")


def test_extract_code():
    assert extract_code("Sure!\n```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1"
    assert extract_code("```Python3\nx = 1\n```") == "x = 1"
    assert extract_code("```py\nx = 1\n```") == "x = 1"
    assert extract_code("```\nx = 2\n```") == "x = 2"
    assert extract_code("text\n```python\na = 1\n```\nand\n```python\nb = 2\n```") == "a = 1"
    assert extract_code("```bash\nls\n```\n```python\nc = 3\n```") == "c = 3"  # python block wins
    assert extract_code("```python\ndef g():\n    return 2") == "def g():\n    return 2"  # cut by the budget
    assert extract_code("def h(): return 3") == "def h(): return 3"
    assert build_program("def f(): return 1", ["assert f() == 1"], ["import math"]) == (
        "import math\n\ndef f(): return 1\n\nassert f() == 1\n"
    )
    with pytest.raises(TDLMError, match="tests is empty"):
        score_code("x", [])


def _target_function(p) -> str:
    """The top-level def of the reference solution that the tests call."""
    with warnings.catch_warnings():  # some references have invalid string escapes such as "\\w"
        warnings.simplefilter("ignore")
        tree = ast.parse(p.answer)
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    return next(n for n in reversed(names) if any(f"{n}(" in t for t in p.tests))


def test_mbpp_reference_passes_and_wrong_solutions_fail(mbpp):
    probs = [mbpp[i] for i in range(0, len(mbpp), 13)][:20]  # 20 problems spread over the split
    assert len(probs) == 20 and sum(bool(p.test_imports) for p in probs) >= 2  # some need test_imports

    def run(p):
        name = _target_function(p)
        good = score(p, f"Here you go:\n```python\n{p.answer}\n```\nThis passes the test.")
        wrong = score(p, f"```python\n{p.answer}\n\ndef {name}(*args, **kwargs):\n    return None\n```")
        other = score(p, f"```python\n{mbpp[(p.index + 1) % len(mbpp)].answer}\n```")
        return p.id, good, wrong, other

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, probs))
    for pid, good, wrong, other in results:
        assert good.correct and good.status == "passed", (pid, good.detail, good.sandbox)
        assert not wrong.correct and wrong.status == "failed", pid
        # the verdict is computed outside the sample: a wrong value is "assertion failed", a crash names its error
        assert "assertion failed" in wrong.detail or "Error" in wrong.detail, (pid, wrong.detail)
        assert not other.correct, pid


def test_mbpp_test_imports_are_prepended(mbpp):
    p = next(p for p in mbpp if p.test_imports)
    s = score(p, p.answer)
    assert s.correct, s.sandbox
    assert p.test_imports[0] in build_program(p.answer, p.tests, p.test_imports)
    # Through the scorer itself: the asserts use a module only test_imports provides.
    code, tests = "def area(r):\n    return math.pi * r * r", ["assert math.isclose(area(1.0), math.pi)"]
    assert score_code(code, tests, ["import math"]).correct
    # without it, `math` would be the sample's own name and the comparison its own: refused before anything runs
    with pytest.raises(TDLMError, match="'math', which is not a builtin or test_imports name"):
        score_code(code, tests)


def test_unknown_task_in_score(gsm):
    from dataclasses import replace

    with pytest.raises(TDLMError, match="unknown 'nope'"):
        score(replace(gsm[0], task="nope"), "x")


def test_mbpp_early_exit_with_status_0_is_not_a_pass(mbpp):
    p = mbpp[0]
    wrong = mbpp[1].answer  # another problem's solution: the asserts would fail
    for tail in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"):
        s = score(p, f"```python\n{wrong}\n{tail}\n```")
        assert not s.correct and s.status == "failed" and s.sandbox.returncode == 0, (tail, s)
        # the sample never sent the values of the asserts' calls, so the trusted side has nothing to judge
        assert "no value came back" in s.detail and s.sandbox.checks_completed is False
        # even the right solution fails when it exits before the asserts ran (as in human-eval's harness)
        s = score(p, f"```python\n{p.answer}\n{tail}\n```")
        assert not s.correct and s.sandbox.checks_completed is False
    assert score(p, f"```python\n{p.answer}\n```").sandbox.checks_completed is True

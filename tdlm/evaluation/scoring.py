"""Scoring of completions: Math-Verify for GSM8K / MATH-500, sandboxed execution for MBPP.

Math (Kydlíček et al., huggingface/Math-Verify; the settings of its README and of open-r1):

- prediction: ``parse(completion, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])``
  (last ``\\boxed{}`` / "final answer is" LaTeX first, else a plain expression such as ``#### 18``);
- gold: GSM8K ``Problem.answer`` (the number after ``####``, commas removed) with ``ExprExtractionConfig()``;
  MATH-500 ``\\boxed{<answer>}`` with ``LatexExtractionConfig(boxed_match_priority=0)``. All 500 MATH-500 golds
  parse this way and verify against their own reference solutions (tests/test_scoring.py);
- ``verify(gold, pred)``, gold first: the comparison is asymmetric;
- ``multi`` (the toy task with many surface forms): the prediction is the ``\\boxed{}`` content only
  (``LatexExtractionConfig(boxed_match_priority=0)``), so a garbled response without a box never matches by accident.

An empty parse is *unparsed* and counts as wrong. :attr:`Score.extracted` records the string Math-Verify matched.

Threads. Math-Verify bounds parse / verify time with ``signal.alarm``, which only works in the main thread of the
main interpreter, and a SIGALRM handler cannot interrupt a long C-level SymPy call anyway. So:

- :func:`score_math` runs in-process with Math-Verify's own timeouts and refuses to run off the main thread;
- :class:`Scorer` (for the driver, safe from any thread) sends math jobs to worker processes whose *main thread*
  runs :func:`score_math`, and adds a hard wall-clock limit: a worker that overruns is killed and replaced and the
  sample scores as ``timeout`` (wrong). Workers are started with ``spawn`` (never ``fork`` a threaded parent).
  Code samples run in :mod:`tdlm.evaluation.sandbox`, which is thread-safe, directly from the calling thread.

MBPP: :func:`extract_code` takes the first fenced ```` ```python ```` block, else the first ```` ``` ```` block,
else the raw text (an unterminated fence runs to the end: generations are cut at the token budget). Then
``test_imports`` + code run as ``main.py`` in :mod:`tdlm.evaluation.sandbox`; the sample only evaluates the
sub-expressions of the asserts rooted at the names the reference solution defines and sends the values back, and
a trusted child process of this one decodes them and evaluates each assert under budgets
(:func:`tdlm.evaluation.sandbox.split_asserts`; whatever a sample sends fails it with one line, never raises).
pass@1 means every assert held and the program exited 0. Code scoring fails closed on every path - :class:`Scorer`,
:func:`score`, :func:`score_code`, and so the lm-evaluation-harness task - because the sandbox itself does
(:func:`tdlm.evaluation.sandbox.run_python`): when it lacks a guarantee, a code sample raises :class:`TDLMError`
with one line naming what the kernel refused and nothing runs, unless ``allow_weak_sandbox`` is passed explicitly;
then every :class:`Score` of code carries ``weakened`` (the guarantees it did not get). A run that lost a guarantee
after the one-time probe is an ``error`` (never correct) with a one-line ``detail``. ``Score.detail`` for code is a
short escaped excerpt, never the sample's full output. An error of one problem (a test the sandbox cannot split,
the sandbox failing on one run, Math-Verify raising) is that problem's Score (status ``error``, wrong, a one-line
``detail``) in :class:`Scorer` and :func:`score`, never the end of the scoring run; :func:`score_code`, which has
no problem to record it on, raises it.
"""

from __future__ import annotations

import functools
import multiprocessing
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tdlm.errors import TDLMError
from tdlm.evaluation.sandbox import SandboxLimits, SandboxResult, excerpt, require_sandbox, run_python
from tdlm.tasks.base import Problem
from tdlm.tasks.mbpp import reference_names

MATH_TASKS = ("gsm8k", "math500", "arith", "multi")
CODE_TASKS = ("mbpp",)
MATH_TIMEOUT_S = 5  # Math-Verify's per-parse / per-comparison limit (its default)
HARD_TIMEOUT_S = 60.0  # Scorer: whole math job, incl. up to 2 parses and a few comparisons


@dataclass(frozen=True)
class Score:
    """Outcome of scoring one completion.

    ``status``: math: correct | wrong | unparsed | timeout | error; code: passed | failed | timeout | error
    (the sandbox statuses). ``extracted``: math: the answer string Math-Verify matched (None if unparsed);
    code: the program body that was run (the extracted code).
    """

    correct: bool
    status: str
    extracted: str | None
    seconds: float
    detail: str = ""
    sandbox: SandboxResult | None = None

    @property
    def weakened(self) -> tuple[str, ...]:
        """The sandbox guarantees this code sample did not get (empty for math and for a full sandbox)."""
        return self.sandbox.weakened if self.sandbox is not None else ()


# --------------------------------------------------------------------------------------------------- math


@functools.lru_cache(maxsize=1)
def _configs() -> dict[str, Any]:
    # lazy: math_verify (+ sympy) costs ~1 s to import, and code-only callers never need it
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return {
        "pred": [LatexExtractionConfig(), ExprExtractionConfig()],
        "gsm8k": [ExprExtractionConfig()],
        "math500": [LatexExtractionConfig(boxed_match_priority=0)],
        "arith": [ExprExtractionConfig()],
        "multi": [ExprExtractionConfig()],
        # multi-v1 is scored by its boxed result only: no fallback to the last number of a garbled response
        "pred:multi": [LatexExtractionConfig(boxed_match_priority=0)],
    }


def gold_text(task: str, answer: str) -> str:
    """The string that is parsed as gold: the GSM8K number as is, the MATH-500 answer inside ``\\boxed{}``."""
    if task in ("gsm8k", "arith", "multi"):
        return answer.replace(",", "").strip()
    if task == "math500":
        return f"\\boxed{{{answer}}}"
    raise TDLMError(f"task: {task!r} has no math gold, expected one of {list(MATH_TASKS)}")


@functools.lru_cache(maxsize=4096)
def _parse_gold(task: str, answer: str, timeout_s: int) -> tuple[Any, ...]:
    from math_verify import parse

    return tuple(parse(gold_text(task, answer), extraction_config=_configs()[task], parsing_timeout=timeout_s))


def parse_gold(task: str, answer: str, timeout_s: int = MATH_TIMEOUT_S) -> list[Any]:
    """Math-Verify parse of a gold answer (cached); empty list if it cannot be parsed. Main thread only."""
    _require_main_thread("parse_gold")
    return list(_parse_gold(task, answer, timeout_s))


def _require_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise TDLMError(f"{what}: called off the main thread; Math-Verify uses signal.alarm, "
                        "use tdlm.evaluation.scoring.Scorer")


def _extracted_string(pred: Sequence[Any]) -> str:
    # parse() returns [sympy_expr, matched_string] on success (fallback_mode="first_match")
    return next((p for p in pred if isinstance(p, str)), str(pred[0]))


def score_math(task: str, completion: str, answer: str, timeout_s: int = MATH_TIMEOUT_S) -> Score:
    """Math-Verify a completion against the gold ``answer`` of a GSM8K / MATH-500 problem. Main thread only."""
    _require_main_thread("score_math")
    from math_verify import parse, verify

    t0 = time.perf_counter()
    gold = parse_gold(task, answer, timeout_s)
    if not gold:
        return Score(False, "error", None, time.perf_counter() - t0, f"gold answer unparseable: {answer!r}")
    pred_config = _configs().get(f"pred:{task}", _configs()["pred"])
    pred = parse(completion, extraction_config=pred_config, parsing_timeout=timeout_s)
    if not pred:
        return Score(False, "unparsed", None, time.perf_counter() - t0)
    ok = bool(verify(gold, pred, timeout_seconds=timeout_s))
    return Score(ok, "correct" if ok else "wrong", _extracted_string(pred), time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------------- code

_PY_FENCE = re.compile(r"```[ \t]*(?:python3?|py)\b[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_ANY_FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The first ```` ```python ```` block, else the first ```` ``` ```` block, else ``text`` itself."""
    for pattern in (_PY_FENCE, _ANY_FENCE):
        m = pattern.search(text)
        if m:
            return m.group(1).strip("\n")
    return text


def build_program(code: str, tests: Sequence[str], test_imports: Sequence[str] = ()) -> str:
    """``test_imports`` + ``code`` + ``tests`` as one script: the plain MBPP harness, for reading and reproducing a
    result outside the sandbox. Scoring does not run this text (the sample would judge itself); it runs
    :func:`build_setup` in the sandbox and evaluates the asserts outside it (:func:`score_code`)."""
    parts = ["\n".join(test_imports), code, "\n".join(tests)]
    return "\n\n".join(p for p in parts if p) + "\n"


def build_setup(code: str, test_imports: Sequence[str] = ()) -> str:
    """``test_imports`` + ``code``: the ``main.py`` the sandbox runs before evaluating the asserts' calls."""
    parts = ["\n".join(test_imports), code]
    return "\n\n".join(p for p in parts if p) + "\n"


def score_code(
    completion: str, tests: Sequence[str], test_imports: Sequence[str] = (), limits: SandboxLimits | None = None,
    reference: str | None = None, *, allow_weak_sandbox: bool = False,
) -> Score:
    """Extract the code from ``completion``, run it in the sandbox and judge each assert outside it. Thread-safe.

    ``reference``: the task's reference solution (MBPP ``Problem.answer``); the names it defines are the
    candidate's (:func:`tdlm.tasks.mbpp.reference_names`), so a builtin it redefines (MBPP 126's ``sum``) is the
    candidate's too; without it, the names the asserts call that are not builtins or imported (a bare name used as a
    value, ``EXPECTED``, is refused rather than taken from the sample). Correct only if every assert held
    (evaluated by a trusted child process with the values the sample sent back) and the program exited 0.
    ``detail``: the sandbox's short escaped reason (first failed assert or last stderr line). A sample never makes
    this raise: whatever it sends back fails it with one line in ``detail``; a test shape the sandbox cannot split
    raises TDLMError (a task error, refused when MBPP loads). Fails closed: raises the sandbox's one-line
    TDLMError, running nothing, when a sandbox guarantee is missing on this machine, unless ``allow_weak_sandbox``.
    """
    if not tests:
        raise TDLMError("score_code: tests is empty, expected at least one assert")
    code = extract_code(completion)
    names = _reference_names(reference) if reference else None
    result = run_python(build_setup(code, test_imports), limits, checks=list(tests), test_imports=list(test_imports),
                        names=names, allow_weak=allow_weak_sandbox)  # fmt: skip
    return Score(result.passed, result.status, code, result.seconds, result.detail, result)


@functools.lru_cache(maxsize=1024)
def _reference_names(reference: str) -> frozenset[str]:
    return reference_names(reference)


def _scoring_error(problem: Problem, completion: str, t0: float, e: Exception) -> Score:
    """The record of a scoring error on one (problem, completion): wrong, status ``error``, one escaped line."""
    code = extract_code(completion) if problem.task in CODE_TASKS else None
    why = excerpt(" ".join(f"{type(e).__name__}: {e}".split()), 200)
    return Score(False, "error", code, time.perf_counter() - t0, f"{problem.id}: scoring error: {why}")


def _score_code_recorded(problem: Problem, completion: str, limits: SandboxLimits | None,
                         allow_weak_sandbox: bool) -> Score:  # fmt: skip
    """:func:`score_code` for one problem, where an error of that problem (an assert the sandbox cannot split, an
    argument that does not evaluate, the sandbox failing on this one run) is recorded on its Score instead of
    raised: one task never aborts a scoring run. The sandbox's refusal is the machine's, not the task's: it still
    raises (fail closed; probed once per limits, so checking it first costs nothing after the first sample)."""
    require_sandbox(limits or SandboxLimits(), allow_weak_sandbox)
    t0 = time.perf_counter()
    try:
        return score_code(completion, problem.tests, problem.test_imports, limits, reference=problem.answer,
                          allow_weak_sandbox=allow_weak_sandbox)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - any error of this one task is its record, never the run's end
        return _scoring_error(problem, completion, t0, e)


def score(problem: Problem, completion: str, *, limits: SandboxLimits | None = None,
          allow_weak_sandbox: bool = False) -> Score:
    """Score ``completion`` for ``problem`` in-process (math needs the main thread; see :class:`Scorer`). Code fails
    closed as in :func:`score_code`. An error of this one problem (a test shape the sandbox cannot split, Math-Verify
    failing on it ...) is a Score with status ``error`` and a one-line ``detail``, never raised; what concerns every
    problem (an unknown task, the sandbox's refusal, the wrong thread) raises :class:`TDLMError`."""
    if problem.task in MATH_TASKS:
        _require_main_thread("score_math")
        t0 = time.perf_counter()
        try:
            return score_math(problem.task, completion, problem.answer)
        except Exception as e:  # noqa: BLE001 - recorded on this problem
            return _scoring_error(problem, completion, t0, e)
    if problem.task in CODE_TASKS:
        return _score_code_recorded(problem, completion, limits, allow_weak_sandbox)
    raise TDLMError(f"problem.task: unknown {problem.task!r}, expected one of {list(MATH_TASKS + CODE_TASKS)}")


# --------------------------------------------------------------------------------------------------- workers


def _worker_main(conn: Any) -> None:
    """Worker process loop: run ``fn(*args)`` in this process's main thread, reply (ok, value)."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        if msg is None:
            return
        fn, args = msg
        try:
            reply = (True, fn(*args))
        except Exception as e:  # reported to the caller, the worker lives on
            reply = (False, f"{type(e).__name__}: {e}")
        conn.send(reply)


class _Worker:
    """One worker process, restarted when it overruns a call or dies. Used by one thread at a time."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._proc: Any = None
        self._conn: Any = None

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_worker_main, args=(child,), daemon=True, name="tdlm-score")
        self._proc.start()
        child.close()
        self._conn = parent

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> Any:
        """``fn(*args)`` in the worker; TimeoutError after ``timeout_s`` (the worker is killed), RuntimeError if
        ``fn`` raised or the worker died."""
        if self._proc is None or not self._proc.is_alive():
            self._start()
        try:
            self._conn.send((fn, args))
            done = self._conn.poll(timeout_s)
            if done:
                ok, value = self._conn.recv()
        except (EOFError, OSError) as e:
            self.stop(kill=True)
            raise RuntimeError(f"scoring worker died: {type(e).__name__}") from e
        if not done:
            self.stop(kill=True)
            raise TimeoutError(f"math scoring exceeded {timeout_s:g} s")
        if not ok:
            raise RuntimeError(value)
        return value

    def stop(self, kill: bool = False) -> None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is None:
            return
        if not kill:
            try:
                conn.send(None)
            except OSError:
                kill = True
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
        conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop(kill=True)


class Scorer:
    """Thread-safe scoring for the evaluation driver.

    Math goes to ``workers`` spawned processes (Math-Verify's ``signal.alarm`` timeouts work there, and a hard
    ``hard_timeout_s`` limit kills runaway SymPy); code runs in the sandbox from the calling thread. Workers start
    lazily on the first math call (each imports ``tdlm`` and Math-Verify: a few seconds). Use as a context manager
    or call :meth:`close`; leftover workers are daemonic and also die with the interpreter. Code scoring fails
    closed: the first code sample raises :class:`TDLMError` (the sandbox's one-line refusal) when a sandbox guarantee
    is missing, unless ``allow_weak_sandbox`` (then each code :class:`Score` records ``weakened``).
    """

    def __init__(
        self,
        workers: int = 1,
        *,
        math_timeout_s: int = MATH_TIMEOUT_S,
        hard_timeout_s: float = HARD_TIMEOUT_S,
        sandbox: SandboxLimits | None = None,
        allow_weak_sandbox: bool = False,
    ) -> None:
        if workers < 1:
            raise TDLMError(f"Scorer.workers: got {workers}, expected >= 1")
        if hard_timeout_s <= 0:
            raise TDLMError(f"Scorer.hard_timeout_s: got {hard_timeout_s}, expected > 0")
        self.workers = workers
        self.math_timeout_s = math_timeout_s
        self.hard_timeout_s = hard_timeout_s
        self.sandbox = sandbox or SandboxLimits()
        self.allow_weak_sandbox = allow_weak_sandbox
        ctx = multiprocessing.get_context("spawn")
        self._all = [_Worker(ctx) for _ in range(workers)]
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for w in self._all:
            self._idle.put(w)
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_all, self._all)

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """Run a picklable top-level ``fn(*args)`` in a worker's main thread (blocks while all are busy)."""
        if self._closed:
            raise TDLMError("Scorer: used after close()")
        worker = self._idle.get()
        try:
            return worker.call(fn, args, self.hard_timeout_s if timeout_s is None else timeout_s)
        finally:
            self._idle.put(worker)

    def score(self, problem: Problem, completion: str) -> Score:
        """Score one completion; never raises for a bad completion (timeouts / crashes score as wrong) nor for an
        error of its problem (status ``error``, one-line ``detail``: the run goes on); raises :class:`TDLMError`
        only for what concerns every problem (an unknown task, the sandbox's refusal, a closed Scorer)."""
        if problem.task in CODE_TASKS:
            # fail closed (in the sandbox itself): raises TDLMError (one line) if the sandbox lacks a guarantee and
            # weak is not allowed; probed once per limits, so this costs nothing after the first code sample
            return _score_code_recorded(problem, completion, self.sandbox, self.allow_weak_sandbox)
        if problem.task not in MATH_TASKS:
            raise TDLMError(f"problem.task: unknown {problem.task!r}, expected one of {list(MATH_TASKS + CODE_TASKS)}")
        t0 = time.perf_counter()
        try:
            return self.call(score_math, problem.task, completion, problem.answer, self.math_timeout_s)
        except TimeoutError as e:
            return Score(False, "timeout", None, time.perf_counter() - t0, str(e))
        except RuntimeError as e:
            return Score(False, "error", None, time.perf_counter() - t0, str(e))

    def score_many(
        self, problems: Sequence[Problem], completions: Sequence[str], threads: int | None = None
    ) -> list[Score]:
        """Score pairs concurrently (``threads`` defaults to ``workers``); results in input order."""
        if len(problems) != len(completions):
            raise TDLMError(f"score_many: {len(problems)} problems but {len(completions)} completions, expected equal")
        with ThreadPoolExecutor(max_workers=threads or self.workers) as pool:
            return list(pool.map(self.score, problems, completions))

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if not self._closed:
            self._closed = True
            for w in self._all:
                w.stop()
            self._finalizer.detach()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

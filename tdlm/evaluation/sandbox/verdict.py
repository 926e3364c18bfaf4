"""The verdict outside the sample (issues 22 and 28): the evaluator splits each assert, the sample evaluates only
the sub-expressions rooted at a name the candidate defines, and a trusted child process decodes the values that
come back and evaluates the rest, under budgets.

- :func:`split_asserts` (evaluator, before the sample runs) applies the assert grammar of
  :func:`tdlm.tasks.mbpp.plan_assert`: the candidate's names come from the task's reference solution (bound at
  any depth; without one, the names the assert calls that are not builtins or imported: a bare name used as a
  value is then refused, never the sample's). Each maximal ``name(.attr)*`` or ``name(.attr)*(args)`` rooted at
  such a name goes to the sample; its arguments are computed here, from the dataset's text, and sent as values
  (marshal, builtins only), or are the result of another such call, kept in the sample. Everything else - the
  comparison, the expected side, lambdas, methods of the returned values, subscripts, ``test_imports`` modules -
  is the trusted check. ``assert set(similar((3, 4), (4, 5))) == set((4,))`` sends ``similar`` with the
  arguments ``(3, 4)``, ``(4, 5)`` and keeps ``set(_tdlm_v0) == set((4,))``; ``f(x).startswith("PY")`` sends
  ``f(x)`` only. Exactly one value per assert comes back, from a sub-expression Python evaluates exactly once
  and unconditionally; a shape the grammar cannot split that way (two values back, a call after ``and`` / ``or``
  or in a lambda or comprehension body, a call whose arguments use names the assert binds, ``is`` between the
  candidate's values, an assert that calls nothing of the candidate's ...) raises :class:`TDLMError` before
  anything runs; MBPP refuses such a task when it loads.
- :func:`judge` hands the sample's bytes to :mod:`.trusted` in a child process (``python -I -S -B``, one of a
  reused pool; a CPU timer per job, RLIMIT_AS, a wall clock; a process that dies is replaced): strict decoding
  of tagged builtins with depth / element / digit budgets, then each check with the real builtins and the
  ``test_imports`` modules. Any failure there fails the sample with one line; nothing raises into the caller,
  and the evaluator's own process never parses the sample's values.

Sample side: :data:`.sample.DRIVER` (the harness the sandboxed process runs; re-exported here).
"""

from __future__ import annotations

import atexit
import functools
import marshal
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from tdlm.errors import TDLMError
from tdlm.tasks.mbpp import AssertPlan, imported_names, judged_plan

from .sample import DRIVER as DRIVER  # noqa: F401 - re-exported: the wire tests import it from here
from .trusted import BUDGETS, TRUSTED_FILE, import_env

TRUSTED_TIMEOUT_S = 20.0  # wall clock of one trusted child (CPU-bounded by RLIMIT_CPU; this is for a stalled one)
_PLAIN = (int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset)


@dataclass(frozen=True)
class Split:
    """One assert, split: ``plan`` (the grammar's calls and check), ``ops`` (the calls as the sample gets them, with
    argument values; indices local to this assert) and ``check`` (source, ``_tdlm_v<i>`` for call ``i``)."""

    source: str
    plan: AssertPlan
    ops: tuple[tuple, ...]

    @property
    def calls(self) -> tuple[str, ...]:
        """The source of each sub-expression the sample evaluates (for reading a split)."""
        return tuple(_call_source(c) for c in self.plan.calls)

    @property
    def check(self) -> str:
        return self.plan.check


def _call_source(c: Any) -> str:
    text = ".".join((c.root, *c.attrs))
    if c.args is None:
        return text
    parts = [f"<{p}>" if k == "ref" else ("*" if k == "star" else "") + str(p) for k, p in c.args]
    parts += [f"{n}=" + (f"<{p}>" if k == "ref" else str(p)) if n else f"**{p}" for n, k, p in c.kwargs]
    return f"{text}({', '.join(parts)})"


def _plain(v: Any, depth: int = 0) -> bool:
    if depth > BUDGETS["depth"] or type(v) not in _PLAIN:
        return False
    if type(v) is dict:
        return all(_plain(k, depth + 1) and _plain(x, depth + 1) for k, x in v.items())
    if type(v) in (list, tuple, set, frozenset):
        return all(_plain(x, depth + 1) for x in v)
    return True


def _argument(source: str, env: dict[str, Any], where: str) -> Any:
    try:
        value = eval(compile(source, "<argument>", "eval", dont_inherit=True), dict(env))  # noqa: S307 - dataset
    except Exception as e:
        raise TDLMError(f"{where}: the argument {source[:80]!r} does not evaluate ({type(e).__name__}: {e})") from e
    if not _plain(value):
        raise TDLMError(f"{where}: the argument {source[:80]!r} is a {type(value).__name__}, expected builtin values "
                        "(numbers, str, bytes, containers of them) that can be sent to the sample")  # fmt: skip
    return value


@functools.lru_cache(maxsize=4096)
def _split_cached(tests: tuple[str, ...], test_imports: tuple[str, ...], names: frozenset[str] | None) -> tuple:
    imported = imported_names(test_imports)
    env = import_env(test_imports)
    out = []
    for i, test in enumerate(tests):
        where = f"test {i + 1}"
        plan = judged_plan(test, imported, names, where=where)
        ops = []
        for c in plan.calls:
            call = None
            if c.args is not None:
                args = [("r", p) if k == "ref" else ("s" if k == "star" else "v", _argument(p, env, where))
                        for k, p in c.args]  # fmt: skip
                kwargs = [(n, "r", p) if k == "ref" else (n, "d" if k == "dstar" else "v", _argument(p, env, where))
                          for n, k, p in c.kwargs]  # fmt: skip
                call = (args, kwargs)
            ops.append((c.root, list(c.attrs), call, c.sent))
        out.append(Split(test, plan, tuple(ops)))
    return tuple(out)


def split_asserts(tests: list[str] | tuple[str, ...], test_imports: list[str] | tuple[str, ...] = (),
                  names: frozenset[str] | set[str] | None = None) -> list[Split]:  # fmt: skip
    """Split each test (one ``assert`` statement); see the module docstring. ``names``: the names the candidate
    defines (:func:`tdlm.tasks.mbpp.reference_names` of the reference solution); None: every name in the asserts
    that is not a builtin or imported. Raises :class:`TDLMError` (one line) for a test that is not a single assert,
    a shape the grammar cannot split, or an argument that is not a builtin value. Cached per arguments."""
    return list(_split_cached(tuple(tests), tuple(test_imports), frozenset(names) if names is not None else None))


def sample_ops(splits: list[Split]) -> list[tuple]:
    """The sample's work list: every assert's calls, flattened, with ``ref`` indices made global."""
    ops: list[tuple] = []
    for s in splits:
        base = len(ops)
        for root, attrs, call, sent in s.ops:
            if call is not None:
                args = [(k, x + base if k == "r" else x) for k, x in call[0]]
                kwargs = [(n, k, x + base if k == "r" else x) for n, k, x in call[1]]
                call = (args, kwargs)
            ops.append((root, attrs, call, sent))
    return ops


def _checks(splits: list[Split]) -> list[tuple[str, list[tuple[int, int]]]]:
    out = []
    base = 0
    for s in splits:
        refs = [(k, base + k) for k, op in enumerate(s.ops) if op[3]]
        out.append((s.check, refs))
        base += len(s.ops)
    return out


@dataclass(frozen=True)
class Verdict:
    """What the trusted child decided: per-assert ``verdicts``, ``detail`` (first failure), whether every value
    came back (``completed``), and the child's CPU seconds (``cpu_s``, user + system)."""

    ok: bool
    verdicts: tuple[bool, ...]
    detail: str
    completed: bool
    cpu_s: float


class _Worker:
    """One trusted child serving jobs (:func:`.trusted._main`); replaced when it dies or has served its share."""

    JOBS = 500  # then a fresh process: nothing a job left in memory accumulates
    BIG = 1 << 18  # values bytes past which the process is replaced after the job (its heap may have grown)

    def __init__(self, python: str) -> None:
        argv = [python, "-I", "-S", "-B", TRUSTED_FILE]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     cwd="/", env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"})  # fmt: skip
        self.python, self.jobs, self.cpu_total = python, 0, 0.0

    def run(self, job: bytes) -> tuple[dict | None, float, int | None]:
        """(answer, CPU seconds of this job, exit status if the process died); kills it past the wall clock."""
        timer = threading.Timer(TRUSTED_TIMEOUT_S, self.kill)
        timer.start()
        try:
            self.proc.stdin.write(len(job).to_bytes(4, "little") + job)
            self.proc.stdin.flush()
            head = self.proc.stdout.read(4)
            reply = self.proc.stdout.read(int.from_bytes(head, "little")) if len(head) == 4 else b""
        except OSError:
            reply = b""
        finally:
            timer.cancel()
        self.jobs += 1
        if reply:
            try:
                out = marshal.loads(reply)
                self.cpu_total = float(out["cpu_total"])
                return out, float(out["cpu_s"]), None
            except (ValueError, EOFError, TypeError, KeyError):
                pass
        return None, *self.reap()

    def kill(self) -> None:
        # os.kill, not Popen.kill: that polls first and would reap the process, and its rusage with it
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def reap(self) -> tuple[float, int]:
        """Kill and wait for the process: (CPU seconds since its last answer, exit status)."""
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:  # wait4, not wait(): the CPU time of the job that killed it is the measurement
            _, status, usage = os.wait4(self.proc.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime - self.cpu_total, self.proc.returncode
        except ChildProcessError:
            return 0.0, self.proc.wait()


_idle: list[_Worker] = []
_idle_lock = threading.Lock()


def _close_idle() -> None:
    with _idle_lock:
        workers, _idle[:] = list(_idle), []
    for w in workers:
        w.reap()


atexit.register(_close_idle)


def judge(splits: list[Split], values_data: bytes, test_imports: list[str] | tuple[str, ...], cap: int,
          python: str | None = None) -> Verdict:  # fmt: skip
    """Decode ``values_data`` (the sample's bytes) and evaluate every check in a trusted child process under
    :data:`.trusted.BUDGETS` (one of a pool, one job at a time each; thread-safe); never raises: anything that goes
    wrong fails every assert with one line."""
    n = len(splits)
    job = marshal.dumps({"checks": _checks(splits), "test_imports": list(test_imports), "values": values_data,
                         "cap": cap})  # fmt: skip
    python = python or sys.executable

    def failed(why: str, cpu: float = 0.0) -> Verdict:
        return Verdict(False, (False,) * n, f"trusted side: {why}", False, cpu)

    with _idle_lock:
        worker = next((w for w in _idle if w.python == python), None)
        if worker is not None:
            _idle.remove(worker)
    try:
        worker = worker or _Worker(python)
    except OSError as e:
        return failed(f"cannot start {python}: {e}")
    res, cpu, status = worker.run(job)
    if status is None and worker.jobs < _Worker.JOBS and len(values_data) < _Worker.BIG:
        with _idle_lock:
            _idle.append(worker)
    elif status is None:
        worker.reap()
    if status is not None:
        sig = -status
        if sig in (signal.SIGPROF, signal.SIGXCPU) or (sig == signal.SIGKILL and cpu >= BUDGETS["cpu_s"]):
            return failed(f"the values exceed the CPU budget ({cpu:.2f} CPU-s)", cpu)
        if sig == signal.SIGKILL:
            return failed(f"killed after {TRUSTED_TIMEOUT_S:g} s of wall clock", cpu)
        return failed(f"the child exited with status {status}", cpu)
    try:
        verdicts = tuple(bool(v) for v in res["verdicts"]) if res["verdicts"] is not None else (False,) * n
        if len(verdicts) != n:
            raise ValueError("wrong number of verdicts")
        return Verdict(bool(res["ok"]) and all(verdicts), verdicts, str(res["detail"]), bool(res["completed"]), cpu)
    except (ValueError, TypeError, KeyError) as e:
        return failed(f"unreadable answer ({type(e).__name__})", cpu)


def excerpt(text: str, n: int = 160) -> str:
    """A short, escaped excerpt for result records: the last non-empty line, ``ascii``-escaped, ``n`` chars."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    s = ascii(lines[-1])[1:-1] if lines else ""
    return s if len(s) <= n else s[: n - 3] + "..."

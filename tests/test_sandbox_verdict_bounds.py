"""The verdict against values and assert shapes (issue 28), on both backends: hostile samples aimed at the design
in which the sample sends values back and the evaluator decides.

- **A bounded trusted side** (item 1): values that would cost the evaluator minutes (a set of hash-colliding
  ints, through the real MBPP shape ``set(f(x)) == set(...)`` and forged directly as a set) fail that sample
  with one line, for at most the trusted child's CPU budget; values forged on the values channel that make the
  decoder raise (``float.fromhex("0x1p+99999")``, an over-long int) fail only their assert, and never reach
  ``score_many``.
- **The comparison never delegated** (item 2): a lambda, a method of the returned value, a builtin the sample
  redefines under ``if True:``, a builtin-named candidate the sample does not define, ``is`` between the
  candidate's values, a module missing from ``test_imports``, an unknown name on the expected side. Each is
  phrased so that it passes only if the sample decided its own assert; the shapes the grammar cannot split are
  refused before anything runs.

All 776 shipped MBPP asserts split into calls of the reference's names only, and the 257 canonical solutions pass
through this path: tests/test_sandbox_hostile.py, next to the canonical run (one load of the task).

The namespace findings (item 3: nested user namespaces, netlink / vsock / packet sockets, the inode flood under
bubblewrap) are entries of the hostile catalogue in tests/test_sandbox_hostile.py, so the settings tests replay
them unprivileged too.
"""

from __future__ import annotations

import pytest
from conftest import SANDBOX_BACKENDS, sandbox_limits_for

from tdlm.errors import TDLMError
from tdlm.evaluation.sandbox import split_asserts
from tdlm.evaluation.sandbox.trusted import BUDGETS
from tdlm.evaluation.scoring import Scorer, score_code
from tdlm.tasks.base import Problem

REFERENCE = "def f(x):\n    return 2 * x\n"
FIND_VALUES_FD = """
import fcntl, os, stat
def values_fd():
    # the one regular file the driver holds open for writing (payload and main.py are closed by now)
    for fd in range(3, 64):
        try:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY and stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
        except OSError:
            pass
"""


@pytest.fixture(scope="module", params=SANDBOX_BACKENDS)
def limits(request):
    return sandbox_limits_for(request.param, timeout_s=30.0, cpu_s=5)


# ------------------------------------------------------------------------------------------ item 1: bounded
COLLIDING_LIST = """
def f(x):
    m = (1 << 61) - 1  # hash(k * m) == 0 for every int k: a set of them is built in quadratic time
    return [k * m for k in range(1, 130_000)]
"""
COLLIDING_FORGED = FIND_VALUES_FD + """
import os
m = (1 << 61) - 1
items = ",".join('["i","%x"]' % (k * m) for k in range(1, 130_000))
os.write(values_fd(), ('[0,"ok",["s",[%s]]]\\n' % items).encode())
os._exit(0)
def f(x):
    return x
"""


@pytest.mark.parametrize("code", [COLLIDING_LIST, COLLIDING_FORGED], ids=["set-of-f-x", "forged-set"])
def test_hash_colliding_values_cost_at_most_the_cpu_budget(code, limits):
    r = score_code(code, ["assert set(f(1)) == set((2,))"], limits=limits, reference=REFERENCE).sandbox
    assert not r.passed and "exceed the CPU budget" in r.detail, r.detail
    # the worst-case cost of one sample to the evaluator: its trusted child's CPU time, killed at the budget
    assert r.verdict_cpu_s is not None and BUDGETS["cpu_s"] / 2 <= r.verdict_cpu_s <= 2.0, r.verdict_cpu_s


FORGED = FIND_VALUES_FD + """
import os
os.write(values_fd(), b'[0,"ok",["f","0x1p+99999"]]\\n[1,"ok",["i","2"]]\\n[2,"ok",["i","%s"]]\\n' % (b"f" * 5000))
os._exit(0)
def f(x):
    return 0
"""


def test_forged_values_fail_their_assert_and_never_reach_score_many(limits):
    tests = ("assert f(1) == 2.0", "assert f(1) == 2", "assert f(3) > 0")
    probs = [Problem(task="mbpp", id=f"mbpp/x{i}", index=i, prompt="", answer=REFERENCE, tests=tests)
             for i in range(2)]  # fmt: skip
    with Scorer(1, sandbox=limits) as scorer:
        forged, honest = scorer.score_many(probs, [f"```python\n{FORGED}\n```", REFERENCE], threads=2)
    assert not forged.correct and forged.sandbox.checks == (False, True, False), forged
    assert "OverflowError" in forged.detail and "\n" not in forged.detail, forged.detail
    assert honest.correct, honest


# ------------------------------------------------------------------------------------------ item 2: never delegated
ALWAYS_EQUAL = """
class E:
    def __eq__(self, other): return True
    def __bool__(self): return True
    __hash__ = object.__hash__
class S(str):
    def startswith(self, *a): return True
    def endswith(self, *a): return True
    def upper(self): return S(str.upper(self))
    def __eq__(self, other): return True
    __hash__ = str.__hash__
"""
UPPER = "def f(x):\n    return x.upper() if isinstance(x, str) else 2 * x\n"
DELEGATION = [
    # (name, reference, sample, tests, honest tests): every test holds only if the sample decided it; an honest
    # solution (UPPER) passes the honest tests through the same shapes
    ("lambda", REFERENCE, ALWAYS_EQUAL + "def f(x):\n    return E()\n", ["assert (lambda v: v == 40)(f(20))"],
     ["assert (lambda v: v == 40)(f(20))"]),
    ("lambda_on_a_plain_wrong_value", REFERENCE, "def f(x):\n    return 41\n",
     ["assert (lambda v: v == 40)(f(20))"], ["assert (lambda v: v == 40)(f(20))"]),
    ("method_of_the_result", REFERENCE, ALWAYS_EQUAL + "def f(x):\n    return S('py')\n",
     ["assert f('py').startswith('PY')", "assert f('py').upper().endswith('THON')"],
     ["assert f('py').startswith('PY')", "assert f('py').lower().endswith('y')"]),
    ("builtin_redefined_under_if", REFERENCE,
     "if True:\n    def max(x):\n        return 9\ndef f(x):\n    return [x]\n", ["assert max(f(3)) == 9"],
     ["assert max([f(3)]) == 6"]),
    ("builtin_named_candidate_missing", "def sum(xs):\n    return 25\n", "def f(xs):\n    return 0\n",
     ["assert sum([10, 15]) == 25"], None),
]


@pytest.mark.parametrize("case", DELEGATION, ids=[c[0] for c in DELEGATION])
def test_the_sample_never_decides_its_own_assert(case, limits):
    name, reference, sample, tests, honest_tests = case
    s = score_code(sample, tests, limits=limits, reference=reference)
    assert not s.correct and s.status == "failed" and s.sandbox.checks_completed, (name, s)
    if name == "builtin_named_candidate_missing":
        assert "NameError: name 'sum' is not defined" in s.detail, s.detail
    if honest_tests:
        assert score_code(UPPER, honest_tests, limits=limits, reference=reference).correct, name


REFUSED = [
    # (reference, test_imports, assert, what the one-line refusal says)
    (REFERENCE, [], "assert f(1) is not f(1)", "identity"),
    (REFERENCE, [], "assert f(1) is f(1)", "identity"),
    ("import math\n" + REFERENCE, [], "assert math.isclose(f(1), 2.0)", "'math' is not a builtin"),
    (REFERENCE, [], "assert f(1) == EXPECTED", "'EXPECTED' is not a builtin"),
    (REFERENCE, [], "assert all(f(x) == 2 * x for x in range(3))", "binds itself"),
    (REFERENCE, [], "assert f(len(f(1))) == 2", "mixes the candidate's values"),
    (REFERENCE, [], "assert f(lambda: 1) == 2", "lambda"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[2] for c in REFUSED])
def test_shapes_the_grammar_cannot_split_are_refused_before_anything_runs(case):
    reference, imports, test, why = case
    with pytest.raises(TDLMError, match="test 1") as e:
        # a sample that would answer every delegated question with True: refused before it runs
        score_code("import math\nmath.isclose = lambda *a, **k: True\nEXPECTED = 0\ndef f(x):\n    return 0\n",
                   [test], imports, reference=reference)  # fmt: skip
    assert why in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_singleton_identity_and_trusted_sides_are_fine():
    s = split_asserts(["assert f(1) is None", "assert f(1) is not True", "assert (lambda v: v == 2)(f(1))",
                       "assert sorted(f([2, 1]), key=lambda v: -v) == [2, 1]"], [], {"f"})  # fmt: skip
    assert [x.calls for x in s] == [("f(1)",), ("f(1)",), ("f(1)",), ("f([2, 1])",)]

"""The same decision on every Python that ``requires-python`` allows (issue item 4): 3.11, 3.12 and 3.13.

For each installed interpreter (found on PATH as ``python3.X`` or under ``$PYENV_ROOT`` / ``~/.pyenv/versions``;
a version that is not installed is skipped, with that reason):

- the split (:func:`tdlm.tasks.mbpp.plan_assert`, :func:`~tdlm.tasks.mbpp.reference_names`) run under it refuses
  and accepts exactly what it does in the evaluator's interpreter, with the same checks, for the hostile and control
  shapes of tests/test_assert_order_refusals.py and all 776 shipped MBPP asserts;
- the trusted side (the judge's child process) and the sample-side driver run under it give the plain harness's
  verdict, under the same interpreter, for every lazy and non-builtin value of tests/test_lazy_values_wire.py;
- a check that reads a value from a nested scope (a comprehension, a generator expression, a lambda) holds the
  same on every version. Control: with the values bound as eval *locals* (before this change) the comprehension
  read raised NameError on 3.11 and held on 3.12 / 3.13 (PEP 709 inlines comprehensions); as globals it holds on
  all three.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
from test_assert_order_refusals import CONTROLS, HOSTILE, NAMES
from test_lazy_values_wire import CONSUMED, IMPORTS, LAZY, NOT_CONSUMED, plain, verdicts

from tdlm.evaluation.sandbox.trusted import TRUSTED_FILE
from tdlm.tasks.base import default_data_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSIONS = ("3.11", "3.12", "3.13")


def interpreter(version: str) -> str | None:
    """An installed ``python<version>`` that runs and is that version: on PATH (a pyenv shim that is not set to it
    does not run), else the newest under the pyenv root."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    pyenv = sorted(glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}")), reverse=True)
    for exe in [shutil.which(f"python{version}"), *pyenv]:
        if exe is None:
            continue
        r = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                           text=True, check=False)  # fmt: skip
        if r.returncode == 0 and r.stdout.strip() == version:
            return exe
    return None


@pytest.fixture(params=VERSIONS)
def python(request):
    exe = interpreter(request.param)
    if exe is None:
        pytest.skip(f"Python {request.param} is not installed (no python{request.param} that runs on PATH or under "
                    f"{os.environ.get('PYENV_ROOT', '~/.pyenv')}/versions)")  # fmt: skip
    return exe


DECIDE = r"""
import json, sys
from tdlm.errors import TDLMError
from tdlm.tasks.mbpp import imported_names, plan_assert, reference_names
out = []
for test, imports, names, reference in json.load(sys.stdin):
    if reference is not None:
        names = sorted(reference_names(reference))
    try:
        p = plan_assert(test, imported_names(imports), frozenset(names) if names is not None else None)
        out.append([names, "split", p.check, [[c.root, list(c.attrs), c.sent] for c in p.calls]])
    except TDLMError as e:
        out.append([names, "refused", str(e), []])
print(json.dumps(out))
"""


def _cases() -> list:
    cases = [(t, [], sorted(NAMES), None) for *_, tests, _ in HOSTILE for t in tests]
    cases += [(t, [], sorted(NAMES), None) for t in CONTROLS]
    cases += [(t, list(IMPORTS), None, None) for t in CONSUMED + NOT_CONSUMED]
    cases += [("assert f(10) == EXPECTED_10", [], None, None), ("assert max(3, 5) == 5", [], None, None)]
    path = default_data_dir() / "mbpp_sanitized_test.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            cases += [(t, r["test_imports"], None, r["code"]) for t in r["test_list"]]
    return cases


def _decide(exe: str, cases: list) -> list:
    r = subprocess.run([exe, "-I", "-c", f"import sys; sys.path.insert(0, {REPO!r})\n" + DECIDE],
                       input=json.dumps(cases), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_the_split_decides_the_same_on_every_version(python):
    cases = _cases()
    here, there = _decide(sys.executable, cases), _decide(python, cases)
    differ = [(c[0], a, b) for c, a, b in zip(cases, here, there, strict=True) if a != b]
    assert not differ, differ[:3]
    refused = sum(d[1] == "refused" for d in there)
    assert refused >= len(HOSTILE) + 2 and len(cases) - refused >= 776 + len(CONTROLS), refused


def test_the_trusted_side_and_the_driver_agree_with_the_plain_harness_on_every_version(python):
    tests = CONSUMED + NOT_CONSUMED
    expect = plain(LAZY, tests, IMPORTS, python=python)
    assert expect == (True,) * len(CONSUMED) + (False,) * len(NOT_CONSUMED), expect
    got, _ = verdicts(LAZY, tests, IMPORTS, None, python=python)
    assert got == expect, [(t, g) for t, g, e in zip(tests, got, expect, strict=True) if g != e]


NESTED = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("trusted", sys.argv[1])
trusted = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trusted)
line = b'[0,"ok",["l",[["i","1"],["i","2"]]]]'
checks = ["[_tdlm_v0 for _ in range(2)] == [[1, 2]] * 2", "all(x in _tdlm_v0 for x in [1, 2])",
          "(lambda: _tdlm_v0)() == [1, 2]", "_tdlm_v0 == [1, 2]"]
out = {"globals": [], "locals": []}
for check in checks:
    job = {"checks": [(check, [(0, 0)])], "test_imports": [], "values": line, "cap": 1 << 20}
    out["globals"].append(trusted.judge_job(job)["ok"])
    try:  # how the values were bound before: as eval locals
        out["locals"].append(bool(eval(check, {"__builtins__": __builtins__}, {"_tdlm_v0": [1, 2]})))
    except NameError:
        out["locals"].append("NameError")
print(json.dumps([list(sys.version_info[:2]), out]))
"""


def test_a_value_read_from_a_nested_scope_holds_the_same_on_every_version(python):
    r = subprocess.run([python, "-I", "-S", "-c", NESTED, TRUSTED_FILE], capture_output=True, text=True, timeout=60,
                       check=True)  # fmt: skip
    version, out = json.loads(r.stdout)
    assert out["globals"] == [True, True, True, True], out
    # the control: the old binding depended on the version (3.12 inlines the comprehension, not the generator)
    first = True if tuple(version) >= (3, 12) else "NameError"
    assert out["locals"] == [first, "NameError", "NameError", True], (version, out)

"""The shipped MBPP asserts, one by one (issue 51): each of the 776 asserts of the 257 canonical solutions gets,
through the sandbox (the split, the sample's values, the trusted check), the verdict the plain harness gives - the
solution, its ``test_imports`` and the assert run together in one ordinary Python process. None is refused at load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tdlm.evaluation.sandbox import SandboxLimits
from tdlm.evaluation.scoring import score
from tdlm.tasks.base import default_data_dir

DATA = default_data_dir()
MBPP_FILE = DATA / "mbpp_sanitized_test.jsonl"

# the plain harness: the program, then each assert in order in the same process; its verdict per assert
PLAIN = """
import json, sys
src = json.loads(sys.stdin.read())
g = {"__name__": "__main__"}
exec(compile("\\n".join(src["imports"]) + "\\n" + src["code"], "main.py", "exec"), g)
out = []
for t in src["tests"]:
    try:
        exec(compile(t, "assert", "exec"), g)
        out.append(True)
    except Exception:
        out.append(False)
print(json.dumps(out))
"""


def plain_verdicts(problem) -> list[bool]:
    src = json.dumps({"imports": list(problem.test_imports), "code": problem.answer, "tests": list(problem.tests)})
    out = subprocess.run([sys.executable, "-I", "-c", PLAIN], input=src, capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    return json.loads(out.stdout)


@pytest.mark.slow
def test_each_shipped_mbpp_assert_gets_the_plain_harness_verdict():
    if not MBPP_FILE.exists():
        pytest.skip(f"MBPP not in {DATA}")
    from tdlm.tasks import load_task

    mbpp = load_task("mbpp", data_dir=DATA)  # refuses at load any assert it could not judge as Python does
    assert len(mbpp) == 257
    lim = SandboxLimits(timeout_s=60.0, cpu_s=11)
    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda p: score(p, p.answer, limits=lim), mbpp.problems))
    n = 0
    differ = []
    for p, s in zip(mbpp.problems, scores, strict=True):
        plain = plain_verdicts(p)
        sandboxed = list(s.sandbox.checks or ()) if s.sandbox is not None else []
        n += len(plain)
        if sandboxed != plain or not s.correct:
            differ.append((p.id, plain, sandboxed, s.detail))
    assert n == 776, n
    assert differ == [], f"{len(differ)} problems differ from the plain harness: {differ[:5]}"

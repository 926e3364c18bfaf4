"""All 776 shipped MBPP asserts with lazy canonical solutions (issue item 6): the split path agrees with the plain
MBPP harness on every assert.

Each canonical solution is rewritten so that the functions its asserts call return, at the outermost call (a
recursive call inside still gets the plain value), a lazy or non-builtin form of the same result: a list, tuple or
set as a generator, a ``map``, a ``filter`` or a list iterator (by problem, in turn), a dict as its keys or items
view, a float as the exact ``Fraction``. The plain harness (program and asserts in one Python process) decides each
assert: it passes where the assert only consumes the value (the nine ``set(f(...)) == set(...)`` asserts of
mbpp/111, 140 and 232; ``math.isclose`` of a Fraction ...) and fails where it compares the object itself. The split
path (the sample-side driver, then the trusted judge) must give the same verdict on all 776, and the canonical
solutions themselves, unchanged, must pass all 776 there (the control).

The driver runs in plain subprocesses (no sandbox: the programs are the dataset's) and the judge in the evaluator's
pool of trusted children (tests/test_lazy_values_wire.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_lazy_values_wire import CAP, drive

from tdlm.evaluation.sandbox.verdict import judge, split_asserts
from tdlm.tasks.base import default_data_dir
from tdlm.tasks.mbpp import reference_names

MBPP_FILE = default_data_dir() / "mbpp_sanitized_test.jsonl"
LAZY_WRAPPER = '''

import fractions as _tdlm_fractions
_tdlm_changed = []  # one entry per value returned in a lazy / non-builtin form
def _tdlm_lazy(fn, kind):
    depth = 0
    def outermost(*a, **k):
        nonlocal depth
        depth += 1
        try:
            r = fn(*a, **k)
        finally:
            depth -= 1
        if depth or type(r) not in (float, dict, list, tuple, set, frozenset):
            return r
        _tdlm_changed.append(type(r).__name__)
        if type(r) is float:
            return _tdlm_fractions.Fraction(r)
        if type(r) is dict:
            return r.items() if kind % 2 else r.keys()
        xs = list(r)
        return ((x for x in xs), map(lambda x: x, xs), filter(lambda x: True, xs), iter(xs))[kind]
    return outermost
for _tdlm_name in {names!r}:
    globals()[_tdlm_name] = _tdlm_lazy(globals()[_tdlm_name], {kind})
'''
PLAIN = r"""
import io, json, sys
jobs = json.load(sys.stdin)
out = []
for program, tests in jobs:
    ns = {"__name__": "__main__"}
    sys.stdout = io.StringIO()
    try:
        exec(compile(program, "main.py", "exec"), ns)
        ok = True
    except BaseException:
        ok = False
    row = []
    for t in tests:
        before = len(ns.get("_tdlm_changed", ()))
        try:
            exec(compile(t, "<assert>", "exec"), ns) if ok else 1 / 0
            passed = True
        except BaseException:
            passed = False
        row.append((passed, len(ns.get("_tdlm_changed", ())) > before))
    sys.stdout = sys.__stdout__
    out.append(row)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def problems():
    if not MBPP_FILE.exists():
        pytest.skip(f"MBPP not in {MBPP_FILE.parent}")
    records = [json.loads(line) for line in MBPP_FILE.read_text().splitlines() if line.strip()]
    out = []
    for k, r in enumerate(records):
        imports, names = tuple(r["test_imports"]), reference_names(r["code"])
        splits = split_asserts(r["test_list"], imports, names)
        called = sorted({op[0] for s in splits for op in s.ops})
        program = "\n".join(imports) + "\n\n" + r["code"] + "\n"
        out.append((r["task_id"], program, list(r["test_list"]), imports, splits,
                    program + LAZY_WRAPPER.format(names=called, kind=k % 4)))  # fmt: skip
    assert sum(len(p[2]) for p in out) == 776
    return out


def _split_path(problems: list, lazy: bool) -> list[tuple[bool, ...]]:
    def one(p):
        _, program, _, imports, splits, lazy_program = p
        values = drive(lazy_program if lazy else program, splits)
        return judge(splits, values, imports, CAP).verdicts

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, problems))


@pytest.fixture(scope="module")
def plain(problems):
    """The plain harness on the lazy solutions: per problem, per assert (passed, its value was made lazy)."""
    def run(part):
        jobs = json.dumps([(p[5], p[2]) for p in problems[part::2]])
        r = subprocess.run([sys.executable, "-c", PLAIN], input=jobs, capture_output=True, text=True, timeout=120,
                           check=True)  # fmt: skip
        return [[tuple(x) for x in row] for row in json.loads(r.stdout.strip().splitlines()[-1])]

    with ThreadPoolExecutor(2) as pool:
        even, odd = pool.map(run, (0, 1))
    return [even[k // 2] if k % 2 == 0 else odd[k // 2] for k in range(len(problems))]


def test_lazy_canonical_solutions_get_the_plain_harness_verdict_on_all_776_asserts(problems, plain):
    """Every problem with an assert whose value was made lazy runs on the split path; an assert whose value was not
    is the canonical solution's own (passed by the plain harness here, and on the split path by the control below
    and tests/test_sandbox_hostile.py)."""
    lazy = [k for k, row in enumerate(plain) if any(changed for _, changed in row)]
    got = dict(zip(lazy, _split_path([problems[k] for k in lazy], lazy=True), strict=True))
    differ, passing, changed_n, changed_pass = [], 0, 0, 0
    for k, (p, row) in enumerate(zip(problems, plain, strict=True)):
        for j, (expect, changed) in enumerate(row):
            verdict = got[k][j] if k in got else expect
            if not changed and not expect:
                differ.append((p[0], p[2][j], "the plain harness fails an assert whose value was not made lazy"))
            if verdict != expect:
                differ.append((p[0], p[2][j], expect, verdict))
            passing += verdict
            changed_n += changed
            changed_pass += changed and verdict
    assert not differ, f"{len(differ)} asserts differ from the plain harness: {differ[:5]}"
    print(f"lazy canonical solutions: {passing} of 776 asserts pass, as in the plain harness; {changed_n} asserts "
          f"got a lazy / non-builtin value, {changed_pass} of them pass")  # fmt: skip
    sets = {p[0] for k, p in enumerate(problems) if k in got and all(got[k]) and "set(" in p[2][0]}
    assert {111, 140, 232} <= sets, sets  # the generator answers the plain harness passes pass here too
    assert 9 <= changed_pass < changed_n, (changed_pass, changed_n)  # both directions are exercised


def test_control_the_same_problems_unchanged_pass_on_the_split_path(problems, plain):
    sample = [problems[k] for k, row in enumerate(plain) if any(changed for _, changed in row)]
    got = _split_path(sample, lazy=False)
    failed = [(p[0], row) for p, row in zip(sample, got, strict=True) if not all(row)]
    assert not failed and len(sample) > 50, (failed[:5], len(sample))

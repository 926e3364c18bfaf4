"""Lazy and non-builtin values on the wire (issue item 6): a correct answer that returns a generator, a ``map`` /
``filter`` object, another iterator, a dict view, a ``range``, a ``bytearray``, a ``Fraction``, a ``Decimal`` or a
``deque`` is scored as the plain MBPP harness scores it.

The sample's driver (:data:`tdlm.evaluation.sandbox.verdict.DRIVER`) sends such a value tagged; the trusted side
(:mod:`tdlm.evaluation.sandbox.trusted`) rebuilds the same type: a lazy iterator (only as the whole value) is
drained where the call returns - the call is the last thing its assert runs in the sample - within a list's budgets
(:data:`~tdlm.evaluation.sandbox.trusted.BUDGETS` ``elements`` / ``value_bytes``) and replayed as an iterator of the
same kind that ends the same way (exhausted, the exception it raised, or cut at the budget). Each case is judged
against the plain harness (the program and the assert in one Python process): same verdict. Hostile: an infinite
generator ends at the budget in well under a second; a late exception fails only an assert that reaches it; an
iterator inside a container, a forged lazy tag inside a container, a forged zero-denominator fraction fail their
value with one line. The checks read the values as globals, so a lambda or generator body can read one too.

These tests run the driver in a plain subprocess (no sandbox: the programs are the tests' own) and the trusted
side in the evaluator's pool of trusted children, as scoring does after the sandbox returns.
"""

from __future__ import annotations

import json
import marshal
import os
import subprocess
import sys
import tempfile
import time

import pytest

from tdlm.evaluation.sandbox.trusted import BUDGETS, decode_values, judge_job
from tdlm.evaluation.sandbox.verdict import DRIVER, judge, sample_ops, split_asserts

CAP = 4 << 20  # SandboxLimits.value_bytes


def drive(program: str, splits: list, python: str = sys.executable, timeout: float = 60.0) -> bytes:
    """Run the sample-side driver on ``program`` as scoring does inside the sandbox (``python -I -S -B -c DRIVER``,
    the payload and the values file as inherited fds, cwd a fresh directory), without the sandbox. Returns the
    values file's bytes."""
    with tempfile.TemporaryDirectory() as cwd:
        payload = os.memfd_create("payload")
        os.write(payload, marshal.dumps((program, sample_ops(splits))))
        os.lseek(payload, 0, os.SEEK_SET)
        values_path = os.path.join(cwd, "values")
        out = os.open(values_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            subprocess.run([python, "-I", "-S", "-B", "-c", DRIVER, f"{payload},{out}"], pass_fds=(payload, out),
                           cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout,
                           check=False)  # fmt: skip
        finally:
            os.close(payload)
            os.close(out)
        with open(values_path, "rb") as f:
            return f.read()


def verdicts(program: str, tests: list[str], imports: tuple[str, ...] = (), names: set[str] | None = None,
             python: str = sys.executable) -> tuple[tuple[bool, ...], str]:  # fmt: skip
    """(per-assert verdicts, first failure) of the split path: the driver, then the trusted judge."""
    splits = split_asserts(tests, imports, frozenset(names) if names is not None else None)
    v = judge(splits, drive("\n".join(imports) + "\n" + program, splits, python), imports, CAP, python=python)
    return v.verdicts, v.detail


PLAIN_HARNESS = r"""
import sys
program, tests = sys.argv[1], sys.argv[2:]
ns = {"__name__": "__main__"}
exec(compile(program, "main.py", "exec"), ns)
out = []
for t in tests:
    try:
        exec(compile(t, "<assert>", "exec"), ns)
        out.append(True)
    except BaseException:
        out.append(False)
print("".join("1" if x else "0" for x in out))
"""


def plain(program: str, tests: list[str], imports: tuple[str, ...] = (), python: str = sys.executable) -> tuple:
    """The plain MBPP harness: the program, then each assert, in one Python process (each assert's verdict)."""
    r = subprocess.run([python, "-c", PLAIN_HARNESS, "\n".join(imports) + "\n" + program, *tests],
                       capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    return tuple(c == "1" for c in r.stdout.strip().splitlines()[-1])


LAZY = """
import collections, decimal, fractions, itertools
def gen(n):
    return (i for i in range(n))
def mp(n):
    return map(lambda x: 2 * x, range(n))
def fl(n):
    return filter(lambda x: x % 2, range(n))
def it(n):
    return iter([n, n])
def zp(n):
    return zip(range(n), "abc")
def keys(n):
    return {i: 0 for i in range(n)}.keys()
def vals(n):
    return collections.OrderedDict((i, i * i) for i in range(n)).values()
def items(n):
    return {i: str(i) for i in range(n)}.items()
def rng(n):
    return range(1, n, 2)
def ba(n):
    return bytearray(b"ab" * n)
def frac(n):
    return fractions.Fraction(n, 6)
def dec(n):
    return decimal.Decimal(n) / 8
def dq(n):
    return collections.deque(range(n), 2)
def count(n):
    return itertools.count(n)
def late(n):
    yield n
    raise ValueError("late")
def nested(n):
    return [iter([n])]
"""
IMPORTS = ("import collections, decimal, fractions",)
# every assert holds in the plain harness: the value crosses the wire as the value the assert consumes
CONSUMED = [
    "assert set(gen(3)) == {0, 1, 2}", "assert sorted(mp(3)) == [0, 2, 4]", "assert list(fl(6)) == [1, 3, 5]",
    "assert tuple(it(4)) == (4, 4)", "assert dict(zp(2)) == {0: 'a', 1: 'b'}", "assert keys(3) == {0, 1, 2}",
    "assert list(vals(3)) == [0, 1, 4]", "assert items(2) == {(0, '0'), (1, '1')}", "assert rng(6) == range(1, 6, 2)",
    "assert ba(2) == b'abab'", "assert frac(3) == fractions.Fraction(1, 2)",
    "assert dec(1) == decimal.Decimal('0.125')",
    "assert dq(4) == collections.deque([2, 3])", "assert list(it(5)) == [5, 5]", "assert late(7) is not None",
    "assert sum(gen(5)) == 10", "assert isinstance(mp(1), map)", "assert isinstance(fl(1), filter)",
    "assert 2 in list(gen(3))", "assert max(mp(4)) == 6", "assert frac(2) + 1 == fractions.Fraction(4, 3)",
    "assert dq(3).maxlen == 2", "assert any([x > 1 for x in gen(3)])", "assert keys(2) & {1, 5} == {1}",
]  # fmt: skip
# every assert fails in the plain harness, and must here: a lazy value is not the list it yields, a late exception
# fails an assert that reaches it, a Fraction is not its float
NOT_CONSUMED = [
    "assert gen(2) == [0, 1]", "assert mp(1) == [0]", "assert keys(1) == [0]", "assert list(late(1)) == [1]",
    "assert vals(2) == [0, 1]", "assert str(frac(3)) == '0.5'", "assert len(gen(3)) == 3", "assert rng(3) == [1]",
]  # fmt: skip


def test_lazy_and_other_values_cross_the_wire_as_the_plain_harness_consumes_them():
    """Control first: the plain harness passes every CONSUMED assert and fails every NOT_CONSUMED one; the split
    path gives the same verdict for each (item 6: these values were an 'unsupported type', scored wrong)."""
    tests = CONSUMED + NOT_CONSUMED
    expect = (True,) * len(CONSUMED) + (False,) * len(NOT_CONSUMED)
    assert plain(LAZY, tests, IMPORTS) == expect
    got, detail = verdicts(LAZY, tests, IMPORTS, None)
    assert got == expect, [(t, g) for t, g, e in zip(tests, got, expect, strict=True) if g != e]


def test_an_infinite_generator_is_cut_at_the_budget_quickly_and_fails_only_where_consumed_past_it():
    t0 = time.monotonic()
    tests = ["assert list(count(0)) == []"] + [f"assert late({k}) is not None" for k in range(3)]
    got, detail = verdicts(LAZY, tests, IMPORTS)  # (partial consumers such as next() are refused at load)
    assert got == (False, True, True, True) and time.monotonic() - t0 < 10, (got, detail)
    n = int(detail.split("cut after ")[1].split()[0])  # ints of ~12 bytes: a list's element budget ends it first
    assert n == BUDGETS["elements"] - 1 and "\n" not in detail, detail


def test_a_late_exception_fails_only_an_assert_that_reaches_it():
    got, detail = verdicts(LAZY, ["assert list(late(1)) == [1]", "assert late(2) is not None"], IMPORTS)
    assert got == (False, True), got
    assert "raised ValueError: late after 1 items" in detail, detail


def test_an_iterator_inside_a_container_fails_with_one_line():
    """Only the whole value may be lazy: draining an iterator inside a container could reorder what the assert
    consumes (two iterators of one source). Control: the same iterator as the whole value passes."""
    got, detail = verdicts(LAZY, ["assert list(nested(1)[0]) == [1]", "assert list(it(1)) == [1, 1]"], IMPORTS)
    assert got == (False, True), got
    assert "a lazy iterator inside a container" in detail and "\n" not in detail, detail


@pytest.mark.parametrize("line,why", [
    ('[0,"ok",["l",[["it","generator",[],"end",""]]]]', "unknown tag 'it'"),  # lazy only as the whole value
    ('[0,"ok",["it","list",[],"end",""]]', "unknown tag 'it'"),  # an unknown kind
    ('[0,"ok",["it","generator",[],"later",""]]', "unknown tag 'it'"),  # an unknown end
    ('[0,"ok",["q","1","0"]]', "ZeroDivisionError"),
    ('[0,"ok",["q","1","%s"]]' % ("f" * 5000), "longer than"),
    ('[0,"ok",["D","%s"]]' % ("9" * 9000), "unknown tag 'D'"),
    ('[0,"ok",["D","1e"]]', "InvalidOperation"),
    ('[0,"ok",["vi",[["i","1"]]]]', "not a (key, value) pair"),
    ('[0,"ok",["vk",[["l",[]]]]]', "unhashable"),
    ('[0,"ok",["r","1","2","0"]]', "must not be zero"),
    ('[0,"ok",["dq",[],"-1"]]', "maxlen must be non-negative"),
])  # fmt: skip
def test_forged_tags_fail_their_value_with_one_line(line, why):
    values, errors, problem = decode_values(line.encode(), {0}, CAP)
    assert not values and not problem and why in errors[0] and "\n" not in errors[0], errors


def test_a_lazy_value_counts_against_the_element_budget():
    items = json.dumps([0, "ok", ["it", "generator", [["i", "1"]] * 50, "end", ""]]).encode()
    assert "more than 40 elements" in decode_values(items, {0}, CAP, {"elements": 40})[1][0]
    assert list(decode_values(items, {0}, CAP)[0][0]) == [1] * 50


def test_the_check_reads_values_as_globals_so_nested_scopes_see_them():
    """A placeholder read from a lambda or generator body (as eval locals it raised NameError there). Control: the
    same value read at the top level."""
    line = b'[0,"ok",["l",[["i","1"],["i","2"]]]]'
    for check in ("all(x in _tdlm_v0 for x in [1, 2])", "(lambda: _tdlm_v0)() == [1, 2]", "_tdlm_v0 == [1, 2]",
                  "[y for y in range(2) if _tdlm_v0[y] == y + 1] == [0, 1]"):  # fmt: skip
        out = judge_job({"checks": [(check, [(0, 0)])], "test_imports": [], "values": line, "cap": CAP})
        assert out["ok"], (check, out)

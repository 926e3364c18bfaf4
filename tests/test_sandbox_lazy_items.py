"""A lazy value's items as Python's consumer finds them, within a list's budgets (issue 51, "Lazy values").

The sample drains a lazy value right after its call and encodes each item when it is yielded
(:data:`tdlm.evaluation.sandbox.sample.DRIVER`). A consumer that keeps the items (``list(v)``) sees each in its
state at the end of the drain, one that reads each as it comes (a comprehension) in its state at yield time. Where
the two differ - one buffer yielded again and again, an item changed after it was yielded - the value ends at the
first such item with one line, so an assert that consumes it fails (Python fails ``list(f(3)) == [[0], [0, 1],
[0, 1, 2]]`` for a repeated buffer; the sandbox must never pass it); a check that does not consume it is judged as
Python judges it. Honest controls: fresh lists per yield, immutable items and a buffer yielded again unchanged get
the plain harness's verdict, both verdicts among them.

Budgets: a drained value gets a list's (:data:`~tdlm.evaluation.sandbox.trusted.BUDGETS` ``elements`` per value,
``value_bytes`` for the values file), so a generator of 100,000 small items is judged like the list of them, and
at the element budget the generator and the list get one verdict. An endless generator is still cut in bounded
time (tests/test_lazy_values_wire.py; here one of large items, cut by bytes).
"""

from __future__ import annotations

import functools
import re
import time

import pytest
from conftest import SANDBOX_BACKENDS, sandbox_limits_for
from test_lazy_values_wire import plain, verdicts

from tdlm.evaluation.sandbox import run_python
from tdlm.evaluation.sandbox.trusted import BUDGETS

PROGRAM = """
def buf(n):
    b = []
    for i in range(n):
        b.append(i)
        yield b
def dbuf(n):
    d = {}
    for i in range(n):
        d[i] = i * i
        yield d
def later(n):
    items = [[i] for i in range(n)]
    yield from items
    items[-1].append(-1)
def inner(n):
    b = []
    for i in range(n):
        b.append(i)
        yield (i, b)
def fresh(n):
    for i in range(n):
        yield list(range(i + 1))
def same(n):
    b = [7]
    for _ in range(n):
        yield b
def ints(n):
    return (i * 3 for i in range(n))
def pairs(n):
    return map(lambda i: (i, str(i), (i,)), range(n))
def small(n):
    return (i % 5 for i in range(n))
def small_list(n):
    return [i % 5 for i in range(n)]
"""

CASES = {
    # Python fails each: list() keeps n references to one object in its final state
    "a buffer yielded again and again": [
        "assert list(buf(3)) == [[0], [0, 1], [0, 1, 2]]", "assert sorted(dbuf(2), key=len) == [{0: 0}, {0: 0, 1: 1}]",
        "assert list(inner(2)) == [(0, [0]), (1, [0, 1])]", "assert buf(2) is not None"],
    "an item changed after it was yielded": [
        "assert list(later(3)) == [[0], [1], [2]]", "assert [x for x in list(later(2))] == [[0], [1]]",
        "assert later(1) is not None"],
    # honest controls: the plain harness's verdict, both verdicts among them
    "fresh items and immutable items": [
        "assert list(fresh(3)) == [[0], [0, 1], [0, 1, 2]]", "assert list(fresh(2)) == [[0], [1]]",
        "assert list(same(3)) == [[7], [7], [7]]", "assert list(same(2)) == [[7]]",
        "assert sum(ints(4)) == 18", "assert list(ints(3)) == [0, 3, 7]",
        "assert list(pairs(2)) == [(0, '0', (0,)), (1, '1', (1,))]", "assert set(pairs(1)) == {(0, '0', 0)}"],
    "100,000 small items, like the list of them": [
        "assert sum(small(100_000)) == 200_000", "assert small_list(100_000) == [0, 1, 2, 3, 4] * 20_000",
        "assert list(small(100_000)) == [0, 1, 2, 3, 4] * 19_999"],  # ~1 MB each: the 4 MiB values file holds 3
}  # fmt: skip
CHANGED = ("a buffer yielded again and again", "an item changed after it was yielded")


@functools.cache
def plain_verdicts(kind: str) -> tuple[bool, ...]:
    return plain(PROGRAM, CASES[kind])


@pytest.mark.parametrize("kind", list(CASES), ids=list(CASES))
def test_each_case_gets_the_plain_harness_verdict(kind):
    """The split path (the driver, then the trusted judge) gives the plain harness's verdict on every assert; where
    an item changed, the first failure is the one line that says so."""
    tests = CASES[kind]
    expect = plain_verdicts(kind)
    assert True in expect and False in expect, expect  # honest: each class has both verdicts
    got, detail = verdicts(PROGRAM, tests)
    assert got == expect, (kind, [(t, g) for t, g, e in zip(tests, got, expect, strict=True) if g != e], detail)
    if kind in CHANGED:
        said = re.search(r"a lazy value's item changed after it was yielded: item \d+ \(a (list|dict|tuple)\)$", detail)
        assert said and "\n" not in detail, detail


# Python passes these (its consumer reads each item as it comes, or keeps n copies of the final state); judged on
# one state only, the sandbox would pass one and fail the other, so both fail with the one line, never pass wrongly
REFUSED = ["assert [len(x) for x in buf(3)] == [1, 2, 3]", "assert list(buf(3)) == [[0, 1, 2]] * 3",
           "assert [x[-1] for x in later(2)] == [0, 1]"]  # fmt: skip


def test_a_changed_item_fails_in_one_line_whichever_state_the_consumer_reads():
    assert plain(PROGRAM, REFUSED) == (True,) * len(REFUSED)
    got, detail = verdicts(PROGRAM, REFUSED)
    assert got == (False,) * len(REFUSED) and "changed after it was yielded" in detail and "\n" not in detail, detail


@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_the_same_verdicts_through_the_sandbox_on_each_backend(backend):
    limits = sandbox_limits_for(backend, timeout_s=30.0)
    for kind, tests in CASES.items():
        r = run_python(PROGRAM, limits, checks=tests)
        assert r.checks == plain_verdicts(kind), (backend, kind, r.checks, r.detail)


def test_a_generator_and_a_list_get_one_verdict_at_the_element_budget():
    """One number (``elements``, the decoder's nodes per value; the value's own node counts one): n - 1 items
    pass as a generator and as a list, n items fail both (Python passes all four: a budget, never a pass it
    would not give)."""
    n = BUDGETS["elements"]
    program = "def g(n):\n    return (1 for _ in range(n))\ndef l(n):\n    return [1] * n\n"
    tests = [f"assert sum(g({n - 1})) == {n - 1}", f"assert sum(l({n - 1})) == {n - 1}",
             f"assert sum(g({n})) == {n}", f"assert sum(l({n})) == {n}"]  # fmt: skip
    got = [verdicts(program, [t])[0][0] for t in tests]  # one sample each: two ~2 MB values fill the values file
    assert got == [True, True, False, False], got


def test_an_endless_generator_of_large_items_is_cut_at_the_values_cap_quickly():
    """Cut by bytes where a list that long would exceed the values file's cap: the file fails as that list's
    would, in bounded time; the values file never holds more than the cap and one item."""
    program = "def big():\n    while True:\n        yield 'x' * 4000\n"
    t0 = time.monotonic()
    got, detail = verdicts(program, ["assert big() is not None", "assert len(list(big())) > 0"])
    assert got == (False, False) and "the values exceed" in detail and time.monotonic() - t0 < 20, (got, detail)

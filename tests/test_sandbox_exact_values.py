"""Values judged exactly as Python judges them, or refused in one line (issue 51, "exactly Python, or refused at
load": subclasses, process-wide state, stdlib values, nan identity, per-value budgets, numpy).

Each assert below is judged by the plain MBPP harness (the program and the assert in one Python process), by the
split path (the sample-side driver, then the trusted child) and through ``run_python`` sandboxed on each backend,
and the verdicts must agree. Both verdicts occur in every class, so a path that passes or fails everything is
caught:

- **subclasses travel as themselves**: an ``OrderedDict`` in the wrong order fails against an ``OrderedDict`` (as
  a plain dict it passed), ``move_to_end`` order is kept, ``Counter`` methods and missing keys work, so does a
  ``defaultdict`` of a builtin type, a namedtuple keeps its fields, ``_asdict`` and ``repr``;
- **process-wide state**: the candidate's decimal precision and its int-digit limit are in force when the check
  runs (a 700-digit ``str()`` under a 640-digit limit raises, as in Python);
- **stdlib values**: ``date``, ``datetime`` with a fixed-offset ``timezone`` (its name kept), ``timedelta``; an
  ``Enum`` member (plain, ``IntEnum``, ``Flag``, aliases; a standard library class such as ``http.HTTPStatus`` as
  that very class, its methods included) and a dataclass instance (``repr`` / ``compare`` flags, ``frozen``,
  ``order``);
- **nan identity**: ``[x] == [x]`` is True for one nan object and False for two, ``math.nan`` is the check's own;
- **budgets per value**: three asserts on one 80,000-element list each get the whole element budget.

What cannot be judged exactly fails with one line (never a pass): a subclass with its own methods or equality, a
``defaultdict`` whose factory is the candidate's function, an Enum or dataclass with methods of its own, a
``tzinfo`` that is not a ``datetime.timezone``. A module outside the standard library (numpy: the
sandbox's Python has no site-packages) is refused at load, in test_imports and in the reference solution.
"""

from __future__ import annotations

import functools
import json

import pytest
from conftest import SANDBOX_BACKENDS, sandbox_limits_for
from test_lazy_values_wire import CAP, drive, plain, verdicts

from tdlm.errors import TDLMError
from tdlm.evaluation.sandbox import run_python, split_asserts
from tdlm.evaluation.sandbox.trusted import BUDGETS, decode_values
from tdlm.tasks.mbpp import check_problem, to_problem

PROGRAM = """
import collections, dataclasses, datetime, decimal, enum, http, math, sys
def od_wrong():
    return collections.OrderedDict([("b", 2), ("a", 1)])
def od_moved():
    d = collections.OrderedDict([("a", 1), ("b", 2), ("c", 3)])
    d.move_to_end("a")
    return d
def od_view():
    return od_moved().items()
def ctr(s):
    return collections.Counter(s)
def ddict():
    d = collections.defaultdict(list)
    d["a"].append(1)
    return d
Point = collections.namedtuple("Point", "x y")
def pt(x, y):
    return Point(x, y)
def prec(p):
    decimal.getcontext().prec = p
    return decimal.Decimal(1)
def digits(n):
    sys.set_int_max_str_digits(n)
    return 10 ** 700
def day():
    return datetime.date(2024, 2, 29)
def stamp():
    return datetime.datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=datetime.timezone(datetime.timedelta(hours=1), "CET"))
def span():
    return datetime.timedelta(days=1, seconds=5)
def one_nan():
    x = float("nan")
    return [x, x]
def two_nans():
    return [float("nan"), float("nan")]
def math_nan():
    return [math.nan]
def big():
    return list(range(80_000))
class Color(enum.Enum):
    RED = 1
    GREEN = 2
    CRIMSON = 1
class Level(enum.IntEnum):
    LOW = 1
class Perm(enum.Flag):
    R = 4
    W = 2
def color(name):
    return Color[name]
def level():
    return Level.LOW
def perm():
    return Perm.R | Perm.W
def status(code):
    return http.HTTPStatus(code)
@dataclasses.dataclass
class Item:
    name: str
    qty: int = 0
@dataclasses.dataclass(frozen=True, order=True)
class Pair:
    a: int
    b: int = dataclasses.field(repr=False, default=0)
def item(n):
    return Item("x", n)
def pair():
    return Pair(1, 2)
"""
IMPORTS = ("import collections, dataclasses, datetime, decimal, enum, http, math",)
CASES = {  # class: asserts, each judged by the plain harness and by the split path
    "OrderedDict": [
        "assert od_wrong() == collections.OrderedDict([('a', 1), ('b', 2)])", "assert od_wrong() == {'a': 1, 'b': 2}",
        "assert list(od_moved()) == ['b', 'c', 'a']", "assert list(od_moved().values()) == [2, 3, 1]",
        "assert type(od_view()).__name__ == 'odict_items'", "assert list(od_view())[0] == ('b', 2)",
        "assert od_moved() == collections.OrderedDict([('b', 2), ('c', 3), ('a', 1)])",
        "assert od_moved() == collections.OrderedDict([('a', 1), ('b', 2), ('c', 3)])"],
    "Counter": [
        "assert ctr('aab').most_common(1) == [('a', 2)]", "assert ctr('ab')['z'] == 0",
        "assert ctr('ab') == collections.Counter({'a': 1, 'b': 1, 'c': 0})", "assert ctr('ab') == {'a': 2}",
        "assert ctr('ab').total() == 2"],
    "defaultdict": [
        "assert ddict()['missing'] == []", "assert ddict() == {'a': [1]}", "assert ddict().default_factory == list",
        "assert ddict() == {'a': [2]}"],
    "namedtuple": [
        "assert pt(1, 2).x == 1", "assert pt(1, 2) == (1, 2)", "assert pt(1, 2)._asdict() == {'x': 1, 'y': 2}",
        "assert repr(pt(1, 2)) == 'Point(x=1, y=2)'", "assert pt(1, 2) == (2, 1)",
        "assert pt(3, 4)._fields == ('x', 'y')"],
    "decimal context": [
        "assert prec(5) / 3 == decimal.Decimal('0.33333')", "assert prec(28) / 3 == decimal.Decimal('0.33333')",
        "assert str(prec(3) / 7) == '0.143'"],
    "int-digit limit": [
        "assert str(digits(640))[:2] == '10'", "assert str(digits(4300))[:2] == '10'",
        "assert len(str(digits(800))) == 701"],
    "date / datetime / timedelta": [
        "assert day() == datetime.date(2024, 2, 29)", "assert day().isoformat() == '2024-02-28'",
        "assert stamp().utcoffset() == datetime.timedelta(hours=1)", "assert stamp().tzname() == 'CET'",
        "assert str(stamp()) == '2024-01-02 03:04:05.000006+01:00'", "assert span().total_seconds() == 86405",
        "assert span() == datetime.timedelta(days=1)"],
    "nan identity": [
        "assert (lambda v: [v[0]] == [v[1]])(one_nan())", "assert (lambda v: [v[0]] == [v[1]])(two_nans())",
        "assert math_nan() == [math.nan]", "assert two_nans()[:1] == [math.nan]"],
    "Enum": [
        "assert color('RED').name == 'RED'", "assert color('CRIMSON').name == 'RED'",
        "assert color('GREEN').value == 1", "assert color('RED') == 1", "assert level() == 1",
        "assert str(level()) == '1'", "assert repr(color('GREEN')) == '<Color.GREEN: 2>'", "assert perm().value == 6",
        "assert str(perm()) == 'Perm.R|W'",
        "assert type(status(404)) == http.HTTPStatus", "assert status(404).phrase == 'Not Found'",
        "assert status(200) == http.HTTPStatus.NOT_FOUND"],
    "dataclass": [
        "assert item(2).qty == 2", "assert repr(item(3)) == \"Item(name='x', qty=3)\"", "assert item(2) == (2,)",
        "assert dataclasses.asdict(item(1)) == {'name': 'x', 'qty': 1}", "assert repr(pair()) == 'Pair(a=1)'",
        "assert dataclasses.astuple(pair()) == (1, 2)", "assert hash(pair()) == hash((1, 2))",
        "assert dataclasses.replace(item(1), qty=5).qty == 4"],
    "budget per value": [
        "assert len(big()) == 80_000", "assert big()[-1] == 79_999", "assert sum(big()) == 3_199_960_000"],
}  # fmt: skip


@functools.cache
def plain_verdicts(kind: str) -> tuple[bool, ...]:
    return plain(PROGRAM, CASES[kind], IMPORTS)


@pytest.mark.parametrize("kind", list(CASES), ids=list(CASES))
def test_each_class_gets_the_plain_harness_verdict(kind):
    tests = CASES[kind]
    expect = plain_verdicts(kind)
    assert True in expect and (False in expect or kind == "budget per value"), expect  # honest controls
    got, detail = verdicts(PROGRAM, tests, IMPORTS)
    assert got == expect, (kind, [(t, g) for t, g, e in zip(tests, got, expect, strict=True) if g != e], detail)


@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
def test_the_same_verdicts_through_the_sandbox_on_each_backend(backend):
    """The run_python path, sandboxed: every class above, one run per class, gets the plain harness's verdict on
    each assert."""
    limits = sandbox_limits_for(backend, timeout_s=30.0)
    for kind, tests in CASES.items():
        expect = plain_verdicts(kind)
        r = run_python("\n".join(IMPORTS) + "\n" + PROGRAM, limits, checks=tests, test_imports=IMPORTS)
        assert r.checks == expect, (backend, kind, r.checks, expect, r.detail)


def test_default_state_adds_nothing_to_the_value_line():
    """The decimal context and the int-digit limit travel only when the candidate changed them (the hot path's
    lines stay as they were); a changed one travels, and the trusted side reads it back."""
    program = "def d(p):\n    if p:\n        decimal.getcontext().prec = p\n    return decimal.Decimal(1)\n"
    tests = ["assert d(0) == 1", "assert d(7) == 1"]
    splits = split_asserts(tests, ["import decimal"], frozenset({"d"}))
    lines = [json.loads(x) for x in drive("import decimal\n" + program, splits).splitlines()]
    assert [len(x) for x in lines] == [3, 4], lines
    assert lines[1][3]["decimal"][0] == "7", lines[1]


FAILS_IN_ONE_LINE = {  # Python passes these; the sandbox cannot carry the value exactly, so it fails, never passes
    "a subclass with its own equality": ("class L(list):\n    def __eq__(self, o):\n        return True\n"
                                         "def f():\n    return L([1])\n", "assert f() == [2]", "unsupported type L"),
    "a defaultdict of the candidate's function": (
        "import collections\ndef f():\n    return collections.defaultdict(lambda: 7, {'a': 1})\n",
        "assert f() == {'a': 1}", "default_factory is not a builtin type"),
    "an Enum with a method of its own": (
        "import enum\nclass E(enum.Enum):\n    A = 1\n    @property\n    def twice(self):\n        return 2\n"
        "def f():\n    return E.A\n", "assert f().twice == 2", "an Enum with its own twice"),
    "a dataclass with a method of its own": (
        "import dataclasses\n@dataclasses.dataclass\nclass D:\n    x: int\n    def __post_init__(self):\n"
        "        self.x += 1\ndef f():\n    return D(1)\n", "assert f().x == 2",
        "a dataclass with its own __post_init__"),
    "a tzinfo that is not a timezone": (
        "import datetime\nclass Z(datetime.tzinfo):\n    def utcoffset(self, d):\n"
        "        return datetime.timedelta(0)\ndef f():\n    return datetime.time(1, tzinfo=Z())\n",
        "assert f().hour == 1", "not a datetime.timezone"),
}  # fmt: skip


@pytest.mark.parametrize("shape", list(FAILS_IN_ONE_LINE), ids=list(FAILS_IN_ONE_LINE))
def test_what_cannot_travel_exactly_fails_with_one_line(shape):
    program, test, words = FAILS_IN_ONE_LINE[shape]
    assert plain(program, [test]) == (True,)
    got, detail = verdicts(program, [test])
    assert got == (False,) and words in detail and "\n" not in detail, detail


@pytest.mark.parametrize("line", [
    '[0,"ok",["n",0,["i","1"]]]', '[0,"ok",["n",1,["f","nan"]]]', '[0,"ok",["n","os"]]',
    '[0,"ok",["dd","print",[]]]', '[0,"ok",["nt","P","m",["x","1x"],[1,2]]]', '[0,"ok",["da",["7e8","d","1"]]]',
    '[0,"ok",["i","1"],{"decimal":["1c","ROUND_HALF_EVEN","-1","1","1","0",["Nope"]]}]',
    '[0,"ok",["i","1"],{"env":1}]', '[0,"ok",["en","Enum","E","m",0,"list",[],["i","1"]]]',
    '[0,"ok",["en","Enum","Status","tdlm_no_such_module",2,"object",[],["i","c8"]]]',
    '[0,"ok",["dc","D","m",[true,false,false,false],[["1x",true,true,["i","1"]]]]]',
])  # fmt: skip
def test_forged_tags_fail_their_value(line):
    """A forged tag (nan around a number, a nan numbered ahead, a module that is not math / cmath, a factory that
    is not a type, a field that is not a name, a month 13, an unknown trap, an unknown state key, an Enum mixin
    that is not a number or str, a standard library Enum the check did not import, a dataclass field that is not a
    name): that value fails."""
    values, errors, problem = decode_values(line.encode(), {0}, CAP)
    assert not values and not problem and errors[0].startswith("unsupported value"), (values, errors, problem)


def test_budgets_are_per_value():
    line = '[0,"ok",["l",[{}]]]'.format(",".join(['["i","1"]'] * 30))
    two = (line + "\n" + line.replace("[0,", "[1,", 1)).encode()
    values, errors, _ = decode_values(two, {0, 1}, CAP, {"elements": 40})
    assert set(values) == {0, 1} and not errors, errors  # 62 in all, 31 each: each fits 40
    assert "more than 20 elements" in decode_values(line.encode(), {0}, CAP, {"elements": 20})[1][0]
    assert BUDGETS["elements"] < 3 * 80_000  # the 80,000-element case above needs the budget per value


def _problem(test_imports: list[str], code: str = "def f(n):\n    return n\n"):
    return to_problem(0, {"task_id": 901, "prompt": "p", "code": code, "test_imports": test_imports,
                          "test_list": ["assert f(1) == 1"]})  # fmt: skip


@pytest.mark.parametrize("imports,code", [
    (["import numpy as np"], "def f(n):\n    return n\n"),
    (["from numpy import array"], "def f(n):\n    return n\n"),
    ([], "import numpy as np\ndef f(n):\n    return np.int64(n)\n"),
    ([], "def f(n):\n    from scipy import special\n    return n\n"),
])  # fmt: skip
def test_a_module_outside_the_standard_library_is_refused_at_load_in_one_line(imports, code):
    with pytest.raises(TDLMError) as e:
        check_problem(_problem(imports, code))
    msg = str(e.value)
    assert msg.startswith("mbpp/901: ") and "not in the standard library" in msg and "refused at load" in msg, msg
    assert "\n" not in msg and ("numpy" in msg or "scipy" in msg), msg
    assert len(check_problem(_problem(["import math", "from collections import Counter"]))) == 1  # control


def test_scoring_applies_the_load_refusals_through_the_one_rule():
    """split_asserts (run_python's path) refuses what check_problem refuses, with the same line: nothing accepted
    by one is refused by the other."""
    for test in ("assert next(f(3)) == 0", "assert f(3).pop() == 2", "assert 2 in f(3)"):
        with pytest.raises(TDLMError) as at_load:
            check_problem(to_problem(0, {"task_id": 9, "prompt": "p", "code": "def f(n):\n    return n\n",
                                         "test_imports": [], "test_list": [test]}))  # fmt: skip
        with pytest.raises(TDLMError) as at_scoring:
            split_asserts([test], [], frozenset({"f"}))
        assert str(at_load.value).split(": ", 1)[1] == str(at_scoring.value).split(": ", 1)[1], test
    with pytest.raises(TDLMError, match="refused at load"):
        run_python("def f(n):\n    return iter(range(n))\n", checks=["assert next(f(3)) == 0"])
    assert split_asserts(["assert list(f(3)) == [0, 1, 2]"], [], frozenset({"f"}))  # control: consumed whole

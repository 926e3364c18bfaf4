"""Shapes the sandbox cannot judge as Python does are refused when MBPP loads (issue 51, "exactly Python, or
refused at load"), one line naming the task, the assert and the shape; the shapes it judges exactly still load.

The sample sends the candidate's value back once, as a copy: a lazy value (generator, ``map``, any iterator) is
drained there and replayed here, and a check's mutation reaches the copy, not the live object. So:

- **lazy values drawn partially**: ``next``, ``any``, ``all``, ``zip``, ``enumerate``, ``iter``, ``reversed``,
  ``map``, ``filter``, ``itertools.*`` (``islice`` ...), ``x in value``, a generator expression over the value
  that one of those draws from, and ``send`` / ``__next__``. Python would draw fewer items than a drain does, so a
  generator with side effects, an endless or expensive one, would be judged differently;
- **checks that mutate the value**: a method outside the read-only list (``pop``, ``append``, ``sort`` ...) on the
  value or a part of it (``value[0].append``, ``vars(value).update``), the same through the type
  (``list.append(value, x)``), and functions that mutate their argument (``heapq.heappop``, ``random.shuffle``,
  ``bisect.insort``, ``operator.setitem``, ``setattr`` ...). Python would change the candidate's live object, which
  the next assert may read.

Controls: reading the value (``==``, ``value in [...]``, ``value[0]``, ``value.count(1)``, ``math.isclose``) or
consuming it whole (``list``, ``set``, ``sorted``, ``sum``, ``str.join``, a list comprehension, a generator
expression that ``list`` drains, ``any`` of a list comprehension, which Python builds whole first) loads, and all
776 shipped asserts load (none refused).
"""

from __future__ import annotations

import pytest

from tdlm.errors import TDLMError
from tdlm.tasks.mbpp import check_problem, to_problem

REFERENCE = "def f(n):\n    return list(range(n))\n"
IMPORTS = ["import heapq", "import itertools", "import math", "import random", "import bisect", "import operator"]

REFUSED = {  # shape: (assert, what the one line must name)
    "next": ("assert next(f(3)) == 0", "next()"),
    "any": ("assert any(f(3))", "any()"),
    "all": ("assert all(f(3))", "all()"),
    "zip": ("assert list(zip(f(3), 'ab')) == [(0, 'a'), (1, 'b')]", "zip()"),
    "enumerate": ("assert list(enumerate(f(2))) == [(0, 0), (1, 1)]", "enumerate()"),
    "iter": ("assert list(iter(f(2))) == [0, 1]", "iter()"),
    "reversed": ("assert list(reversed(f(2))) == [1, 0]", "reversed()"),
    "map": ("assert list(map(str, f(2))) == ['0', '1']", "map()"),
    "filter": ("assert list(filter(None, f(3))) == [1, 2]", "filter()"),
    "islice": ("assert list(itertools.islice(f(3), 2)) == [0, 1]", "itertools.islice()"),
    "in": ("assert 2 in f(3)", "`in`"),
    "not in": ("assert 5 not in f(3)", "`in`"),
    "genexp under any": ("assert any(x > 1 for x in f(3))", "any()"),
    "genexp under next": ("assert next(x for x in f(3) if x) == 1", "next()"),
    "send": ("assert f(3).send(None) == 0", "send()"),
    "__next__": ("assert f(3).__next__() == 0", "__next__()"),
    "pop": ("assert f(3).pop() == 2", "pop()"),
    "sort": ("assert f(3).sort() is None", "sort()"),
    "method of a part": ("assert f(3)[0].append(4) is None", "append()"),
    "unbound method": ("assert list.append(f(3), 4) is None", "append()"),
    "vars update": ("assert vars(f(3)).update() is None", "update()"),
    "heappop": ("assert heapq.heappop(f(3)) == 0", "heapq.heappop()"),
    "shuffle": ("assert random.shuffle(f(3)) is None", "random.shuffle()"),
    "insort": ("assert bisect.insort(f(3), 1) is None", "bisect.insort()"),
    "setitem": ("assert operator.setitem(f(3), 0, 5) is None", "operator.setitem()"),
    "setattr": ("assert setattr(f(3), 'x', 1) is None", "setattr()"),
}
ACCEPTED = [
    "assert f(3) == [0, 1, 2]", "assert f(3) != [0]", "assert f(3) in [[0, 1, 2]]", "assert f(3)[0] == 0",
    "assert f(3).count(1) == 1", "assert f(3).index(2) == 2", "assert math.isclose(sum(f(3)), 3.0)",
    "assert list(f(3)) == [0, 1, 2]", "assert set(f(3)) == {0, 1, 2}", "assert sorted(f(3)) == [0, 1, 2]",
    "assert ','.join(map(str, sorted(f(2)))) == '0,1'", "assert [x for x in f(3)] == [0, 1, 2]",
    "assert list(x for x in f(3)) == [0, 1, 2]", "assert any([x > 1 for x in f(3)])", "assert len(f(3)) == 3",
    "assert max(f(3)) == 2", "assert f(3)",
]  # fmt: skip


def problem(test: str):
    return to_problem(0, {"task_id": 900, "prompt": "p", "code": REFERENCE, "test_imports": IMPORTS,
                          "test_list": [test]})  # fmt: skip


@pytest.mark.parametrize("shape", list(REFUSED), ids=list(REFUSED))
def test_each_shape_python_judges_otherwise_is_refused_at_load_in_one_line(shape):
    test, named = REFUSED[shape]
    with pytest.raises(TDLMError) as e:
        check_problem(problem(test))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("mbpp/900 test 1: ") and "refused at load" in msg, msg
    assert named in msg and test in msg, (named, msg)


@pytest.mark.parametrize("test", ACCEPTED)
def test_reading_or_consuming_the_value_whole_loads(test):
    assert len(check_problem(problem(test))) == 1


def test_every_shipped_mbpp_assert_loads():
    from tdlm.tasks import load_task
    from tdlm.tasks.base import default_data_dir

    data = default_data_dir()
    if not (data / "mbpp_sanitized_test.jsonl").exists():
        pytest.skip(f"MBPP not in {data}")
    mbpp = load_task("mbpp", data_dir=data)  # check_problem on every problem: none refused
    assert len(mbpp) == 257 and sum(len(p.tests) for p in mbpp.problems) == 776

"""The synthetic reasoning task of the embedded default: short arithmetic chains with a worked answer.

A problem is four one-digit operands joined by + and - (``3+5-2+9=?``); the reference response
computes left to right and ends with a boxed result that Math-Verify checks::

    3+5=8 8-2=6 6+9=15 \\boxed{15}

Intermediate results stay in 0..99. Later steps depend on earlier results, so committing many
tokens in one denoising step is risky: exactly the regime where the threshold baseline loses quality
as tau falls and temporal history can help. Problems are drawn from a seeded generator; the held-out
test split is disjoint from everything the backbone or the adapters train on (checked by string).

A second task, ``multi-v1``: the arithmetic chains of ``arith-v1`` written in one of many equally valid surface forms.

The question is ``3+5-2+9 = ?`` (spaced ``= ?``, so its prompt hash never equals an ``arith-v1`` question). The
response computes the same three steps left to right and ends with the boxed result, but its *form* is drawn at
random for every training example (:func:`random_style`):

* per response: compact (``3+5=8``) or spaced (``3 + 5 = 8``) steps; the separator between steps (``" "``, ``", "``,
  ``"; "``); the lead-in of the box (``" "``, ``", so "``, ``" => "``);
* per step: a ``+`` step may put its operands in either order (``3+5`` / ``5+3``; ``-`` steps may not), and any
  step may put its result first (``8=3+5``).

So one problem has 18 * 8 * 2**(number of + steps) = 144 to 1,152 styles (fewer distinct strings when a + has equal
operands), 27 to 51 characters long (e.g. ``15=6+9`` vs ``6 + 9 = 15``),
all scoring to the same ``\\boxed{15}``. Before its neighbours are committed, a position's distribution is split
between forms (which operand comes first, whether a digit or a space or an operator stands there, where the answer
and the end-of-text fall), which is what makes parallel commits risky.

Splits. The shipped ``tiny-multi`` backbone is fine-tuned from ``tiny-arith``, whose training stream
(``split("train", ARITH_TRAIN_DRAWS)``) contains 44,751 of the 45,785 possible chains. The held-out pool is the rest
(1,034 chains, among them the 500 ``arith-v1`` test questions), shuffled with the seed: ``test`` is its first
``MULTI_TEST_SIZE``, ``validation`` the following ones. ``train`` and ``prompts`` are generator streams that never
draw a pool chain, so neither backbone has trained on any validation or test chain.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

TASK_VERSION = "arith-v1"


@dataclass(frozen=True)
class ArithProblem:
    id: str
    question: str  # the user message, e.g. "3+5-2+9=?"
    solution: str  # worked response, e.g. "3+5=8 8-2=6 6+9=15 \\boxed{15}"
    answer: int


def make_problem(rng: random.Random, index: int, prefix: str) -> ArithProblem:
    while True:
        nums = [rng.randint(0, 9) for _ in range(4)]
        ops = [rng.choice("+-") for _ in range(3)]
        acc, steps, ok = nums[0], [], True
        for op, n in zip(ops, nums[1:], strict=True):
            new = acc + n if op == "+" else acc - n
            if new < 0:
                ok = False
                break
            steps.append(f"{acc}{op}{n}={new}")
            acc = new
        if ok:
            question = str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(ops, nums[1:], strict=True)) + "=?"
            return ArithProblem(f"{prefix}/{index:06d}", question, " ".join(steps) + f" \\boxed{{{acc}}}", acc)


def split(name: str, n: int, seed: int = 0) -> list[ArithProblem]:
    """Problems of split ``name`` ('train', 'test', 'prompts'); test never overlaps the others."""
    offsets = {"train": 1, "test": 2, "prompts": 3}
    if name not in offsets:
        raise ValueError(f"unknown split {name!r}; expected one of {sorted(offsets)}")
    rng = random.Random(seed * 1000 + offsets[name])
    if name == "test":
        out: list[ArithProblem] = []
        seen: set[str] = set()
        i = 0
        while len(out) < n:
            p = make_problem(rng, i, "arith-test")
            i += 1
            if p.question not in seen:
                seen.add(p.question)
                out.append(p)
        return out
    test_questions = {p.question for p in split("test", TEST_SIZE, seed)}
    out = []
    i = 0
    while len(out) < n:
        p = make_problem(rng, i, f"arith-{name}")
        i += 1
        if p.question not in test_questions:
            out.append(p)
    return out


TEST_SIZE = 500


# ------------------------------------------------------------------------------------------------------------------
# multi-v1: the same chains, many equally valid surface forms
# ------------------------------------------------------------------------------------------------------------------

MULTI_TASK_VERSION = "multi-v1"
MULTI_GEN_LENGTH = 56  # longest form: 51 characters + <|eot|>, EOS padding after it
MULTI_TEST_SIZE = 500
MULTI_VALIDATION_SIZE = 300
ARITH_TRAIN_DRAWS = 200_000  # the arith-v1 training stream scripts/train_tiny_backbone.py trains tiny-arith on
MULTI_SEPARATORS = (" ", ", ", "; ")
MULTI_LEADINS = (" ", ", so ", " => ")
_EQUATION = re.compile(r"(\d+) ?= ?(\d+) ?([+-]) ?(\d+)|(\d+) ?([+-]) ?(\d+) ?= ?(\d+)")  # c=x+y | x+y=c


@dataclass(frozen=True)
class MultiStyle:
    """One surface form of a three-step solution."""

    spaced: bool  # "3 + 5 = 8" instead of "3+5=8"
    separator: str  # between steps, one of MULTI_SEPARATORS
    leadin: str  # before \\boxed{}, one of MULTI_LEADINS
    swap: tuple[bool, ...]  # per step: second operand first ("5+3"); only for "+" steps
    result_first: tuple[bool, ...]  # per step: "8=3+5"


@dataclass(frozen=True)
class MultiProblem:
    id: str
    question: str  # the user message, e.g. "3+5-2+9 = ?"
    nums: tuple[int, ...]
    ops: tuple[str, ...]
    answer: int
    solution: str  # one surface form (drawn with the problem): a reference, not the only correct response

    def steps(self) -> list[tuple[int, str, int, int]]:
        """(running value, operator, operand, new value) of each step, left to right."""
        acc, out = self.nums[0], []
        for op, n in zip(self.ops, self.nums[1:], strict=True):
            new = acc + n if op == "+" else acc - n
            out.append((acc, op, n, new))
            acc = new
        return out

    def render(self, style: MultiStyle) -> str:
        sp = " " if style.spaced else ""
        parts = []
        for (acc, op, n, new), swap, first in zip(self.steps(), style.swap, style.result_first, strict=True):
            if swap and op != "+":
                raise ValueError(f"{self.id}: only '+' steps may swap operands, step {acc}{op}{n}")
            x, y = (n, acc) if swap else (acc, n)
            expr = f"{x}{sp}{op}{sp}{y}"
            parts.append(f"{new}{sp}={sp}{expr}" if first else f"{expr}{sp}={sp}{new}")
        return style.separator.join(parts) + style.leadin + f"\\boxed{{{self.answer}}}"

    def styles(self) -> list[MultiStyle]:
        """Every valid style of this problem (swaps only where the step is a '+')."""
        k = len(self.ops)
        swaps = [s for s in itertools.product((False, True), repeat=k)
                 if all(op == "+" or not w for op, w in zip(self.ops, s, strict=True))]
        return [MultiStyle(sp, sep, lead, sw, rf)
                for sp in (False, True) for sep in MULTI_SEPARATORS for lead in MULTI_LEADINS
                for sw in swaps for rf in itertools.product((False, True), repeat=k)]

    def surface_forms(self) -> list[str]:
        """All correct responses of this problem (distinct strings)."""
        return sorted({self.render(s) for s in self.styles()})

    def sample_solution(self, rng: random.Random) -> str:
        return self.render(random_style(self, rng))

    def is_worked_solution(self, text: str) -> bool:
        """``text`` shows this problem's three steps as true equations, in order, and ends with the boxed result.

        Looser than membership in :meth:`surface_forms`: the style may change between steps (a parallel decoder's
        mix of forms still counts); operand order and result side are checked per step (a '-' never swaps).
        """
        if not text.strip().endswith(f"\\boxed{{{self.answer}}}"):
            return False
        eqs = _EQUATION.findall(text)
        if len(eqs) != len(self.ops):
            return False
        for g, (acc, op, n, new) in zip(eqs, self.steps(), strict=True):
            c, x, o, y = (g[0], g[1], g[2], g[3]) if g[0] else (g[7], g[4], g[5], g[6])
            if o != op or int(c) != new or sorted((int(x), int(y))) != sorted((acc, n)):
                return False
            if op == "-" and (int(x), int(y)) != (acc, n):
                return False
        return True


def random_style(problem: MultiProblem, rng: random.Random) -> MultiStyle:
    """A style drawn uniformly: every choice independent and uniform, as in training."""
    k = len(problem.ops)
    return MultiStyle(
        spaced=rng.random() < 0.5,
        separator=rng.choice(MULTI_SEPARATORS),
        leadin=rng.choice(MULTI_LEADINS),
        swap=tuple(op == "+" and rng.random() < 0.5 for op in problem.ops),
        result_first=tuple(rng.random() < 0.5 for _ in range(k)),
    )


def _chain(nums: Sequence[int], ops: Sequence[str]) -> int | None:
    acc = nums[0]
    for op, n in zip(ops, nums[1:], strict=True):
        acc = acc + n if op == "+" else acc - n
        if acc < 0:
            return None
    return acc


def multi_question(nums: Sequence[int], ops: Sequence[str]) -> str:
    return str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(ops, nums[1:], strict=True)) + " = ?"


def _multi_problem(
    nums: Sequence[int], ops: Sequence[str], index: int, prefix: str, rng: random.Random
) -> MultiProblem:
    answer = _chain(nums, ops)
    if answer is None:
        raise ValueError(f"chain {nums} {ops} goes negative")
    p = MultiProblem(f"{prefix}/{index:06d}", multi_question(nums, ops), tuple(nums), tuple(ops), answer, "")
    return dataclasses.replace(p, solution=p.sample_solution(rng))


@functools.lru_cache(maxsize=4)
def held_out_pool(seed: int = 0) -> tuple[tuple[tuple[int, ...], tuple[str, ...]], ...]:
    """The (nums, ops) chains that ``tiny-arith``'s training stream never drew, shuffled with ``seed``."""
    seen = {p.question for p in split("train", ARITH_TRAIN_DRAWS, seed)}
    pool = []
    for nums in itertools.product(range(10), repeat=4):
        for ops in itertools.product("+-", repeat=3):
            if _chain(nums, ops) is not None:
                q = str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(ops, nums[1:], strict=True)) + "=?"
                if q not in seen:
                    pool.append((nums, ops))
    random.Random(seed * 1000 + 12).shuffle(pool)
    return tuple(pool)


def multi_split(name: str, n: int, seed: int = 0) -> list[MultiProblem]:
    """Problems of ``multi-v1`` split ``name``: 'train' / 'prompts' (streams outside the held-out pool),
    'validation' / 'test' (disjoint slices of the pool; see the module docstring)."""
    offsets = {"train": 11, "prompts": 13, "validation": 14, "test": 15}
    if name not in offsets:
        raise ValueError(f"unknown split {name!r}; expected one of {sorted(offsets)}")
    rng = random.Random(seed * 1000 + offsets[name])
    pool = held_out_pool(seed)
    if name in ("validation", "test"):
        lo, hi = (0, MULTI_TEST_SIZE) if name == "test" else (MULTI_TEST_SIZE, len(pool))
        if n > hi - lo:
            raise ValueError(f"split {name!r} holds at most {hi - lo} problems (held-out pool of {len(pool)}); "
                             f"asked for {n}")
        return [_multi_problem(nums, ops, i, f"multi-{name}", rng) for i, (nums, ops) in enumerate(pool[lo:lo + n])]
    held = set(pool)
    out: list[MultiProblem] = []
    i = 0
    while len(out) < n:
        nums = tuple(rng.randint(0, 9) for _ in range(4))
        ops = tuple(rng.choice("+-") for _ in range(3))
        if _chain(nums, ops) is not None and (nums, ops) not in held:
            out.append(_multi_problem(nums, ops, i, f"multi-{name}", rng))
            i += 1
    return out

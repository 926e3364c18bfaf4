"""The synthetic reasoning task of the embedded default: short arithmetic chains with a worked answer.

A problem is four one-digit operands joined by + and - (``3+5-2+9=?``); the reference response
computes left to right and ends with a boxed result that Math-Verify checks::

    3+5=8 8-2=6 6+9=15 \\boxed{15}

Intermediate results stay in 0..99. Later steps depend on earlier results, so committing many
tokens in one denoising step is risky: exactly the regime where the threshold baseline loses quality
as tau falls and temporal history can help. Problems are drawn from a seeded generator; the held-out
test split is disjoint from everything the backbone or the adapters train on (checked by string).
"""

from __future__ import annotations

import random
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

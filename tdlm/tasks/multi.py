"""The ``multi-v1`` task (``tdlm.tasks.toydata``): arithmetic chains whose responses have many equally valid
surface forms.

Prompt ``multi-v1`` is the bare question (``3+5-2+9 = ?``), the user message ``tiny-multi`` was trained on. Gold =
the integer result; a generation is correct when Math-Verify finds it (any surface form ending with
``\\boxed{result}``), exactly as for ``arith``. The registered task is the held-out **test** split
(:data:`~tdlm.tasks.toydata.MULTI_TEST_SIZE` problems), which only ``make demo`` evaluates; recipe choices and backbone
checks use :func:`load_split` with ``"validation"``. Nothing is downloaded; ``data_dir`` is ignored.
"""

from __future__ import annotations

import os

from tdlm.tasks.base import Task, generated_task
from tdlm.tasks.toydata import MULTI_TASK_VERSION, MULTI_TEST_SIZE, MULTI_VALIDATION_SIZE, multi_split

NAME = "multi"
PROMPT_VERSION = MULTI_TASK_VERSION
METRIC = "accuracy"
SPLIT_SIZES = {"test": MULTI_TEST_SIZE, "validation": MULTI_VALIDATION_SIZE}


def load_split(split: str, limit: int | None = None, seed: int = 0) -> Task:
    """``split`` ('test' or 'validation') as a :class:`Task`; ``limit`` keeps the first N problems."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"multi: unknown split {split!r}; expected one of {sorted(SPLIT_SIZES)}")
    n = SPLIT_SIZES[split] if limit is None else min(limit, SPLIT_SIZES[split])
    problems = multi_split(split, n, seed)
    # validation ids carry the split name, so records of the two splits can never be mixed up
    prefix = NAME if split == "test" else f"{NAME}-{split}"
    rows = [(p.question, str(p.answer), {"question": p.question, "solution": p.solution, "nums": list(p.nums),
                                         "ops": list(p.ops)}) for p in problems]  # fmt: skip
    return generated_task(NAME, PROMPT_VERSION, METRIC, prefix, rows,
                          f"generated:{MULTI_TASK_VERSION} split={split} seed={seed} n={SPLIT_SIZES[split]}")


def load(data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> Task:
    """The registered task: the held-out test split."""
    return load_split("test", limit)

"""The embedded default's held-out task: arithmetic chains (``tdlm.tasks.toydata``), scored with Math-Verify.

Prompt ``arith-v1`` is the bare question (``3+5-2+9=?``): the tiny backbone was trained on exactly that
user message. Gold = the integer result; a generation is correct when Math-Verify finds it (the
response ends with ``\\boxed{result}``). The split is generated, not downloaded; ``data_dir`` is ignored.
"""

from __future__ import annotations

import os

from tdlm.tasks.base import Task, generated_task
from tdlm.tasks.toydata import TASK_VERSION, TEST_SIZE, split

NAME = "arith"
PROMPT_VERSION = TASK_VERSION
METRIC = "accuracy"


def load(data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> Task:
    problems = split("test", TEST_SIZE)[:limit]
    rows = [(p.question, str(p.answer), {"question": p.question, "solution": p.solution}) for p in problems]
    return generated_task(NAME, PROMPT_VERSION, METRIC, NAME, rows, f"generated:{TASK_VERSION} seed=0 n={TEST_SIZE}")

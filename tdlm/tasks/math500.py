"""MATH-500 (the PRM800K test subset of MATH, 500 problems), zero-shot for Instruct models.

Data: ``HuggingFaceH4/MATH-500`` split ``test`` on the Hub, or ``math500_test.jsonl`` (the ``openai/prm800k``
``math_splits/test.jsonl`` file). Fields ``problem``, ``solution``, ``answer``, ``subject``, ``level``,
``unique_id``. Hendrycks et al. 2021 (MATH, arXiv:2103.03874); Lightman et al. 2023 (PRM800K, arXiv:2305.20050).

Prompt ``math500-v1`` (user message, no chat template)::

    {problem}
    Please reason step by step, and put your final answer within \\boxed{}.

The gold answer is the ``answer`` field (LaTeX); :mod:`tdlm.evaluation.scoring` parses it as ``\\boxed{answer}``.
"""

from __future__ import annotations

import os
from typing import Any

from tdlm.tasks.base import DatasetSpec, Problem, Task, apply_limit, load_records

NAME = "math500"
PROMPT_VERSION = "math500-v1"
METRIC = "accuracy"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SPEC = DatasetSpec(
    hub_path="HuggingFaceH4/MATH-500",
    hub_config=None,
    hub_split="test",
    local_file="math500_test.jsonl",
    expected_count=500,
    required_fields=("problem", "solution", "answer", "unique_id"),
)


def build_prompt(problem: str) -> str:
    """The ``math500-v1`` user message for one problem."""
    return f"{problem.strip()}\n{INSTRUCTION}"


def to_problem(index: int, record: dict[str, Any]) -> Problem:
    """A :class:`Problem` from one raw record; the id is the dataset's ``unique_id`` (e.g. ``test/algebra/1.json``)."""
    return Problem(
        task=NAME,
        id=f"{NAME}/{record['unique_id']}",
        index=index,
        prompt=build_prompt(record["problem"]),
        answer=record["answer"].strip(),
        raw=record,
    )


def load(data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> Task:
    """Load the MATH-500 test split (see :func:`tdlm.tasks.base.load_records` for the source order)."""
    records, source = load_records(SPEC, data_dir)
    problems = [to_problem(i, r) for i, r in enumerate(records)]
    return Task(NAME, PROMPT_VERSION, METRIC, apply_limit(problems, limit), source)

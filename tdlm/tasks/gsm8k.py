"""GSM8K test split (1,319 grade-school word problems), zero-shot for Instruct models.

Data: ``openai/gsm8k`` config ``main`` split ``test`` on the Hub, or ``gsm8k_test.jsonl`` (the byte-identical
``openai/grade-school-math`` test file). Fields ``question``, ``answer``; every answer ends with ``#### <number>``.
Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems", arXiv:2110.14168.

Prompt ``gsm8k-v1`` (user message, no chat template)::

    {question}
    Please reason step by step, and put your final answer within \\boxed{}.

This is the zero-shot instruction used by the Qwen2.5-Math / Dream evaluations; scoring reads the last
``\\boxed{}`` (or any final number) with Math-Verify, see :mod:`tdlm.evaluation.scoring`.
"""

from __future__ import annotations

import os
from typing import Any

from tdlm.errors import TDLMError
from tdlm.tasks.base import DatasetSpec, Problem, Task, apply_limit, load_records

NAME = "gsm8k"
PROMPT_VERSION = "gsm8k-v1"
METRIC = "accuracy"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SPEC = DatasetSpec(
    hub_path="openai/gsm8k",
    hub_config="main",
    hub_split="test",
    local_file="gsm8k_test.jsonl",
    expected_count=1319,
    required_fields=("question", "answer"),
)


def build_prompt(question: str) -> str:
    """The ``gsm8k-v1`` user message for one question."""
    return f"{question.strip()}\n{INSTRUCTION}"


def gold_answer(answer_field: str) -> str:
    """The final number after ``####`` with thousands separators removed (``"1,000"`` -> ``"1000"``)."""
    if "####" not in answer_field:
        raise TDLMError(f"gsm8k answer field: no '####' marker in {answer_field[-60:]!r}, expected '... #### <number>'")
    return answer_field.rsplit("####", 1)[1].strip().replace(",", "")


def to_problem(index: int, record: dict[str, Any]) -> Problem:
    """A :class:`Problem` from one raw record; GSM8K has no native id, so the id is the split position."""
    return Problem(
        task=NAME,
        id=f"{NAME}/{index:04d}",
        index=index,
        prompt=build_prompt(record["question"]),
        answer=gold_answer(record["answer"]),
        raw=record,
    )


def load(data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> Task:
    """Load the GSM8K test split (see :func:`tdlm.tasks.base.load_records` for the source order)."""
    records, source = load_records(SPEC, data_dir)
    problems = [to_problem(i, r) for i, r in enumerate(records)]
    return Task(NAME, PROMPT_VERSION, METRIC, apply_limit(problems, limit), source)

"""Evaluation tasks, one module per task (the nanochat ``tasks/`` layout).

``load_task(name)`` returns a :class:`~tdlm.tasks.base.Task` whose problems carry the zero-shot user message
(``Problem.prompt``; the chat template is applied by the decoder) and the gold answer / tests. Scoring lives in
:mod:`tdlm.evaluation.scoring`; code execution in :mod:`tdlm.evaluation.sandbox`.

| name      | split                        | problems | prompt version | metric   |
|-----------|------------------------------|----------|----------------|----------|
| gsm8k     | openai/gsm8k main test       | 1,319    | gsm8k-v1       | accuracy |
| math500   | HuggingFaceH4/MATH-500 test  | 500      | math500-v1     | accuracy |
| mbpp      | mbpp sanitized test          | 257      | mbpp-v1        | pass@1   |
| arith     | generated (tdlm.tasks.toydata)     | 500      | arith-v1       | accuracy |
| multi     | generated (tdlm.tasks.toydata)     | 500      | multi-v1       | accuracy |
"""

from __future__ import annotations

import os
from collections.abc import Callable

from tdlm.errors import TDLMError
from tdlm.tasks import arith, gsm8k, math500, mbpp, multi
from tdlm.tasks.base import DATA_DIR_ENV, Problem, Task

_LOADERS: dict[str, Callable[..., Task]] = {
    gsm8k.NAME: gsm8k.load, math500.NAME: math500.load, mbpp.NAME: mbpp.load, arith.NAME: arith.load,
    multi.NAME: multi.load,
}
TASK_NAMES: tuple[str, ...] = tuple(_LOADERS)
PROMPT_VERSIONS: dict[str, str] = {
    gsm8k.NAME: gsm8k.PROMPT_VERSION,
    math500.NAME: math500.PROMPT_VERSION,
    mbpp.NAME: mbpp.PROMPT_VERSION,
    arith.NAME: arith.PROMPT_VERSION,
    multi.NAME: multi.PROMPT_VERSION,
}


def load_task(name: str, data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> Task:
    """Load task ``name`` (one of :data:`TASK_NAMES`); ``limit`` keeps the first N problems of the split.

    With ``data_dir`` (or ``$TDLM_DATA_DIR``) the local JSONL file is used; otherwise the Hub when reachable and
    ``HF_HUB_OFFLINE`` is unset, else the pinned copies in ``data/benchmarks``.
    """
    try:
        loader = _LOADERS[name]
    except KeyError:
        raise TDLMError(f"task: unknown name {name!r}, expected one of {list(TASK_NAMES)}") from None
    return loader(data_dir=data_dir, limit=limit)


__all__ = ["DATA_DIR_ENV", "PROMPT_VERSIONS", "Problem", "TASK_NAMES", "Task", "load_task"]

"""lm-evaluation-harness integration: the registered model ``tdlm`` and task files that run offline.

Importing this package registers the model (``lm_eval.api.registry``). The harness's own CLI has no plugin hook for
models, so ``python -m tdlm.harness`` is lm-eval's CLI with ``tdlm`` registered and the shipped tasks included::

    python -m tdlm.harness --model tdlm --model_args pretrained=GSAI-ML/LLaDA-8B-Instruct,\\
    adapter=me/tdlm-llada-16d,policy=tdlm,threshold=0.9,gen_length=256,block_size=32 \\
        --tasks tdlm_gsm8k --batch_size 8 --output_path runs/lm-eval

From Python: ``import tdlm.harness; lm_eval.simple_evaluate(model="tdlm", model_args=..., tasks=[...],
task_manager=lm_eval.tasks.TaskManager(include_path=tdlm.harness.TASKS_DIR))``.

Shipped tasks (``tdlm/harness/tasks``; tdlm's prompts and scoring, local benchmark copies): ``tdlm_gsm8k``,
``tdlm_math500``, ``tdlm_mbpp`` (tag ``tdlm_table1``), ``tdlm_arith`` (the tiny-arith backbone's held-out split) and
``tdlm_multi`` (tiny-multi's multi-v1 test split; tag ``tdlm_tiny`` for both). The harness's own generative tasks
(``gsm8k_cot_zeroshot`` ...) work too where the Hub is reachable.
"""

from pathlib import Path

from tdlm.harness.model import HarnessConfig, TDLMHarnessLM

TASKS_DIR = str(Path(__file__).resolve().parent / "tasks")

__all__ = ["TASKS_DIR", "HarnessConfig", "TDLMHarnessLM"]

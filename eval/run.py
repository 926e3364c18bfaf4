"""Evaluate a backbone and TDLM adapters on GSM8K / MATH-500 / MBPP (logic: tdlm/evaluation/).

Commands (from the repository root, venv active; benchmark files in data/benchmarks)::

    # smoke test on CPU: tiny random backbone, 6 problems, short budget (accuracy ~0: plumbing only)
    python eval/run.py --backbone tiny-llada --tasks gsm8k mbpp --limit 6 --gen-length 32 --block-size 8 \\
        --data-dir data/benchmarks --output-dir runs/eval-tiny

    # Table 1 (one backbone): original, Fast-dLLM tau 0.9, entropy H 0.5, TDLM; one worker per GPU
    python eval/run.py --backbone /data/LLaDA-8B-Instruct --adapter runs/llada-tdlm/adapter \\
        --tasks gsm8k math500 mbpp --policies original threshold entropy tdlm \\
        --output-dir runs/eval/llada-table1 --group table1
    python eval/run.py --backbone /data/Dream-v0-Instruct-7B --adapter runs/dream-tdlm/adapter \\
        --tasks gsm8k math500 mbpp --policies original threshold entropy tdlm \\
        --tdlm-thresholds 0.95 --entropy-thresholds 0.4 --output-dir runs/eval/dream-table1 --group table1

    # Figure 1: threshold sweep -> pareto_gsm8k.png (accuracy vs seconds and vs NFE, frontier marked)
    python eval/run.py --backbone /data/LLaDA-8B-Instruct --adapter runs/llada-tdlm/adapter \\
        --thresholds 0.5 0.6 0.7 0.8 0.9 0.95 --output-dir runs/eval/llada-sweep --group pareto

    # Fast-dLLM as published (threshold + dual KV cache) and TDLM with and without the cache
    python eval/run.py --backbone /data/LLaDA-8B-Instruct --adapter runs/llada-tdlm/adapter \\
        --policies original threshold tdlm --cache none dual --cache-policies threshold tdlm \\
        --output-dir runs/eval/llada-cache --group cache

    # Table 2: history restriction of one adapter at inference
    python eval/run.py --backbone /data/LLaDA-8B-Instruct --adapter runs/llada-tdlm/adapter \\
        --policies original tdlm --history current last:1 last:3 last:5 full \\
        --output-dir runs/eval/llada-history --group history

    # Table 4: layer allocations (one adapter per allocation, LABEL=DIR)
    python eval/run.py --backbone /data/LLaDA-8B-Instruct --policies original tdlm \\
        --adapter 8-dispersed=runs/a8d/adapter 16-middle=runs/a16m/adapter 16-dispersed=runs/a16d/adapter \\
        --output-dir runs/eval/llada-alloc --group allocation

    # the same from a YAML file (keys = EvalConfig fields; flags override it)
    python eval/run.py --config configs/eval_tiny.yaml --limit 4

    # tables again from the JSON summaries, no W&B server needed
    python eval/compare.py runs/eval/llada-table1 runs/eval/dream-table1

On a multi-node Ray cluster (``--ray-address``) the output dir, checkpoint and adapters must be on shared
storage: workers append their own shard files. Rerunning a command resumes: samples already in
``runs/<task>/<run>/shards/*.jsonl`` are skipped, changed settings are refused. W&B logs offline without an
API key (``WANDB_MODE`` is respected); ``wandb sync`` uploads later. Errors print one line and exit with
status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout run without the editable install

# The command line lives in the library (tdlm.evaluation.config / .cli), so the console script tdlm-eval is the same.
from tdlm.evaluation.cli import main  # noqa: E402
from tdlm.evaluation.config import FLAGS, build_parser, parse_args  # noqa: E402, F401

if __name__ == "__main__":  # spawned scoring workers re-import this file: keep the guard
    sys.exit(main())  # after a lost Ray head main() leaves with os._exit itself (tdlm.evaluation.cli)

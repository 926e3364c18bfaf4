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

import argparse
import logging
import os
import sys

from tdlm.config import Flag, SuggestingParser, add_dataclass_flags, from_dict, load_yaml
from tdlm.decoding import CACHE_MODES, POLICIES
from tdlm.errors import TDLMError
from tdlm.evaluation import EvalConfig, evaluate
from tdlm.evaluation.config import DTYPES
from tdlm.tasks import TASK_NAMES

# How the EvalConfig fields appear on the command line; the help of every flag is the field's own comment in
# tdlm/evaluation/config.py, so a field added there gets a flag here without an edit (tests/test_first_contact.py
# pins field <-> flag). Only names, choices and groups that the fields cannot say themselves are listed.
MODEL, TASKS, GRID, RUN, SCORING, OUTPUT = ("model", "tasks", "decoding grid", "measurement and workers", "scoring",
                                            "output and tracking")
FLAGS: dict[str, Flag] = {
    "backbone": Flag(group=MODEL), "adapters": Flag(name="--adapter", metavar="[LABEL=]DIR", extend=True, group=MODEL),
    "dtype": Flag(choices=DTYPES, group=MODEL), "allow_other_backbone": Flag(group=MODEL),
    "device": Flag(group=MODEL),
    "tasks": Flag(choices=TASK_NAMES, group=TASKS), "limit": Flag(group=TASKS), "data_dir": Flag(group=TASKS),
    "chat": Flag(name="--no-chat", negate=True, group=TASKS),
    "policies": Flag(choices=POLICIES, group=GRID), "thresholds": Flag(group=GRID),
    "tdlm_thresholds": Flag(group=GRID), "entropy_thresholds": Flag(group=GRID),
    "histories": Flag(name="--history", group=GRID), "caches": Flag(name="--cache", choices=CACHE_MODES, group=GRID),
    "cache_policies": Flag(choices=POLICIES, group=GRID), "gen_length": Flag(group=GRID),
    "block_size": Flag(group=GRID), "stop_at_eos": Flag(group=GRID),
    **{k: Flag(group=RUN) for k in ("batch_size", "warmup", "workers", "threads", "ray_address", "max_restarts",
                                    "max_task_retries", "max_shard_attempts")},
    **{k: Flag(group=SCORING) for k in ("score_workers", "code_timeout_s", "code_cpu_s", "allow_weak_sandbox")},
    **{k: Flag(group=OUTPUT) for k in ("output_dir", "group", "project", "tags", "reference_tau")},
    "wandb_mode": Flag(choices=("online", "offline", "disabled"), group=OUTPUT),
}


def build_parser() -> argparse.ArgumentParser:
    # Every flag defaults to None so that a --config file's values survive unless the flag is given;
    # the real defaults live in EvalConfig and are shown in the help.
    p = SuggestingParser(
        description="Decode every problem of the chosen tasks once per run of the grid (policy x tau x adapter "
        "x history), score it, and write per-sample JSONL, summary.json, table.md and Pareto plots.",
    )
    p.add_argument("--config", help="YAML file of EvalConfig fields (configs/eval_*.yaml); flags override it")
    add_dataclass_flags(p, EvalConfig, FLAGS, dict.fromkeys((MODEL, TASKS, GRID, RUN, SCORING, OUTPUT)))
    return p


def parse_args(argv: list[str] | None = None) -> EvalConfig:
    args = vars(build_parser().parse_args(argv))
    path = args.pop("config")
    raw = load_yaml(path)
    raw.update({k: v for k, v in args.items() if v is not None})
    for name in ("backbone", "output_dir"):
        if not raw.get(name):
            raise TDLMError(f"--{name.replace('_', '-')} is required (or set {name} in --config)")
    return from_dict(EvalConfig, raw, str(path) if path else "arguments")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    # One W&B run per grid point: its console summary block per run would drown the progress output.
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        result = evaluate(parse_args(argv))
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.table)
    print(f"{result.computed} samples decoded, {result.skipped} resumed; results in {result.output_dir} "
          f"(summary.json, table.md, {', '.join(p.rsplit('/', 1)[-1] for p in result.plots)})")  # fmt: skip
    return 0


if __name__ == "__main__":  # spawned scoring workers re-import this file: keep the guard
    sys.exit(main())

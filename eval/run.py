"""Evaluate a backbone and TDLM adapters on GSM8K / MATH-500 / MBPP (logic: tdlm/evaluation/).

Commands (from the repository root, venv active; benchmark files in ../shared/benchmarks)::

    # smoke test on CPU: tiny random backbone, 6 problems, short budget (accuracy ~0: plumbing only)
    python eval/run.py --backbone tiny-llada --tasks gsm8k mbpp --limit 6 --gen-length 32 --block-size 8 \\
        --data-dir ../shared/benchmarks --output-dir runs/eval-tiny

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
import dataclasses
import logging
import os
import sys

from tdlm.config import from_dict, load_yaml
from tdlm.decoding import CACHE_MODES, POLICIES
from tdlm.errors import TDLMError
from tdlm.evaluation import EvalConfig, evaluate
from tdlm.tasks import TASK_NAMES

_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())  # type: ignore[misc]
             for f in dataclasses.fields(EvalConfig)
             if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}  # fmt: skip


def _d(name: str) -> str:
    return f" (default: {_DEFAULTS[name]})"


def build_parser() -> argparse.ArgumentParser:
    # Every flag defaults to None so that a --config file's values survive unless the flag is given;
    # the real defaults live in EvalConfig and are shown in the help.
    p = argparse.ArgumentParser(
        description="Decode every problem of the chosen tasks once per run of the grid (policy x tau x adapter "
        "x history), score it, and write per-sample JSONL, summary.json, table.md and Pareto plots.",
    )
    p.add_argument("--config", help="YAML file of EvalConfig fields (configs/eval_*.yaml); flags override it")
    g = p.add_argument_group("model")
    g.add_argument("--backbone", help="preset (tiny-llada, tiny-dream) or checkpoint folder (required)")
    g.add_argument("--adapter", dest="adapters", nargs="+", action="extend", metavar="[LABEL=]DIR",
                   help="TDLM adapter folder(s) (TDLM.save_adapter); several = layer-allocation comparison; "
                   "label defaults to the folder name")  # fmt: skip
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default: the checkpoint's torch_dtype)")  # fmt: skip
    g.add_argument("--allow-other-backbone", action="store_const", const=True,
                   help="attach adapters although they were trained on another backbone (their recorded family, "
                   "vocabulary or weight fingerprint differs); refused by default")  # fmt: skip
    g.add_argument("--device", help="device of the in-process worker (default: cuda if available, else cpu)")
    g = p.add_argument_group("tasks")
    g.add_argument("--tasks", nargs="+", choices=TASK_NAMES, help="benchmarks" + _d("tasks"))
    g.add_argument("--limit", type=int, help="evaluate the first N problems of each task (default: all)")
    g.add_argument("--data-dir", help="folder with gsm8k_test.jsonl, math500_test.jsonl, mbpp_sanitized_test.jsonl "
                   "(default: $TDLM_DATA_DIR, else the Hub, else ../shared/benchmarks)")  # fmt: skip
    g.add_argument("--no-chat", dest="chat", action="store_const", const=False,
                   help="feed raw prompt text instead of the backbone's chat template")  # fmt: skip
    g = p.add_argument_group("decoding grid")
    g.add_argument("--policies", nargs="+", choices=POLICIES,
                   help="commit rules: original (1 token/step), threshold (Fast-dLLM), entropy (d3LLM rule), "
                   "tdlm (needs --adapter) (default: original threshold, plus tdlm with --adapter)")  # fmt: skip
    g.add_argument("--thresholds", nargs="+", type=float,
                   help="tau sweep of threshold (and tdlm unless --tdlm-thresholds)" + _d("thresholds"))  # fmt: skip
    g.add_argument("--tdlm-thresholds", nargs="+", type=float, help="tau sweep of tdlm (default: --thresholds)")
    g.add_argument("--entropy-thresholds", nargs="+", type=float,
                   help="H sweep of policy entropy" + _d("entropy_thresholds"))  # fmt: skip
    g.add_argument("--history", dest="histories", nargs="+",
                   help="tdlm history restriction(s): full, last:k, current (Table 2) (default: the adapter's own)")
    g.add_argument("--cache", dest="caches", nargs="+", choices=CACHE_MODES,
                   help="spatial KV cache(s), each its own run: none, prefix, dual (Fast-dLLM's prefix / dual cache)"
                   + _d("caches"))  # fmt: skip
    g.add_argument("--cache-policies", nargs="+", choices=POLICIES,
                   help="policies run with each --cache (others run uncached) (default: every policy)")
    g.add_argument("--gen-length", type=int, help="response tokens" + _d("gen_length"))
    g.add_argument("--block-size", type=int, help="semi-autoregressive block size" + _d("block_size"))
    g.add_argument("--stop-at-eos", action="store_const", const=True,
                   help="stop a request once EOS is committed (paper: off)")  # fmt: skip
    g = p.add_argument_group("measurement and workers")
    g.add_argument("--batch-size", type=int, help="prompts per decode call; 1 = the paper's latency" + _d("batch_size"))
    g.add_argument("--warmup", type=int, help="untimed decodes per worker and run" + _d("warmup"))
    g.add_argument("--workers", type=int,
                   help="shards / Ray actors (one per GPU; CPU actors without GPUs); 1 = in-process, no Ray "
                   "(default: number of visible GPUs, at least 1)")  # fmt: skip
    g.add_argument("--threads", type=int, help="torch threads per CPU worker (default: 1 per Ray CPU actor)")
    g.add_argument("--ray-address", help="Ray cluster (host:6379 or auto) (default: RAY_ADDRESS, else local)")
    g.add_argument("--max-restarts", type=int, help="Ray restarts of a dead actor" + _d("max_restarts"))
    g.add_argument("--max-task-retries", type=int, help="Ray retries of its shard" + _d("max_task_retries"))
    g.add_argument("--max-shard-attempts", type=int,
                   help="driver-level attempts per shard after Ray's" + _d("max_shard_attempts"))  # fmt: skip
    g = p.add_argument_group("scoring")
    g.add_argument("--score-workers", type=int, help="Math-Verify processes / sandbox threads" + _d("score_workers"))
    g.add_argument("--code-timeout-s", type=float, help="MBPP sandbox wall clock per program" + _d("code_timeout_s"))
    g.add_argument("--code-cpu-s", type=int, help="MBPP sandbox CPU seconds per program" + _d("code_cpu_s"))
    g = p.add_argument_group("output and tracking")
    g.add_argument("--output-dir", help="where runs/, summary.json, table.md and pareto_*.png go (required)")
    g.add_argument("--group", help="W&B group = the comparison (default: the output dir's name)")
    g.add_argument("--project", help="W&B project (the training runs' project)" + _d("project"))
    g.add_argument("--tags", nargs="+", help="extra W&B tags (backbone:, layers:, history:, policy: are always added)")
    g.add_argument("--wandb-mode", choices=["online", "offline", "disabled"],
                   help="default: WANDB_MODE, else online with an API key, else offline")  # fmt: skip
    g.add_argument("--reference-tau", type=float,
                   help="tau of the threshold run the 'vs threshold' speedup uses" + _d("reference_tau"))  # fmt: skip
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

"""Teacher trajectory generation on a Ray cluster: resumable, fault-tolerant (logic: tdlm/generation/).

Commands (from the repository root, venv active)::

    # local: starts a fresh Ray cluster on this machine (CPU replicas, or one per GPU); GSM8K *train*
    # (the default --prompt-split) from the Hub or the local HF cache
    python ray_jobs/generate_trajectories.py --backbone tiny-llada \\
        --prompts openai/gsm8k --prompt-config main --prompt-field question --num-prompts 64 \\
        --policy original --gen-length 32 --block-size 8 --shard-size 16 --batch-size 8 \\
        --output-dir runs/traj-tiny

    # a smoke test on the pinned GSM8K *test* copy: evaluation problems, so the flag is required
    # (trajectories from it must not train an adapter that is evaluated on GSM8K)
    python ray_jobs/generate_trajectories.py --backbone tiny-llada \\
        --prompts ../shared/benchmarks/gsm8k_test.jsonl --allow-eval-prompts --num-prompts 64 \\
        --gen-length 32 --block-size 8 --shard-size 16 --output-dir runs/traj-smoke

    # a cluster: start the head (and workers with `ray start --address <head>:6379`), then submit.
    # Paths are read on the cluster: give an absolute --output-dir (the job runs in a temporary copy of
    # the working dir; a relative one is refused), and the checkpoint / adapter must exist on every
    # node. The entrypoint runs `python` from the head's PATH: it must be the environment with tdlm's
    # dependencies (on a venv-only machine write its absolute path, e.g. /work/main/.venv/bin/python).
    ray start --head --dashboard-host 0.0.0.0
    ray job submit --address http://<head>:8265 --working-dir . -- \\
        python ray_jobs/generate_trajectories.py --backbone /data/LLaDA-8B-Instruct \\
        --prompts openai/gsm8k --prompt-config main --prompt-split train --prompt-field question \\
        --policy threshold --tau 0.9 --gen-length 256 --block-size 32 \\
        --shard-size 256 --batch-size 16 --output-dir /data/traj/llada-gsm8k-train
    ray job logs --follow <submission id>      # progress lines: prompts done / total, traj/s, ETA

    # the paper recipes (3,500 GSM8K-train prompts, LLaDA-8B / Dream-7B): flags override the YAML
    python ray_jobs/generate_trajectories.py --config configs/gen_llada_8b.yaml --output-dir /data/traj/llada-8b

    # TDLM teacher (policy tdlm) with a trained adapter
    python ray_jobs/generate_trajectories.py --backbone tiny-llada --adapter runs/adapter \\
        --policy tdlm --prompts openai/gsm8k --prompt-config main --output-dir runs/traj-tdlm

Teacher prompts must not be evaluation problems: the default split is ``train``, and a source that
is (by name) or contains (by normalised-text hash) problems the evaluator scores - GSM8K test,
MATH-500, MBPP test, the arith held-out split - is refused unless ``--allow-eval-prompts`` is given
(tdlm/data/contamination.py). manifest.json records the prompt source, split, one hash per prompt and
the overlap found; the training preflight checks the same hashes.

Rerunning the same command resumes: finished shards are verified (sha256 in manifest.json) and
skipped; changed settings are refused. Without ``--address`` the script uses ``RAY_ADDRESS`` (set by
``ray job submit``), else starts a local cluster. Errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

import datasets

from tdlm.config import from_dict, load_yaml
from tdlm.decoding import CACHE_MODES, POLICIES, DecodeConfig
from tdlm.errors import TDLMError
from tdlm.generation import GenerationConfig, generate


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Show a default only where there is one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> GenerationConfig:
    d = GenerationConfig  # defaults live in the dataclass only
    p = argparse.ArgumentParser(
        description="Decode every prompt once with a frozen backbone on Ray replicas and write "
        "trajectory shards (shard-NNNNN.parquet) + manifest.json. Prompts that are evaluation problems "
        "(GSM8K test, MATH-500, MBPP test, arith held-out) are refused unless --allow-eval-prompts.",
        formatter_class=_Help,
    )
    p.add_argument("--config", default=None,
                   help="YAML of GenerationConfig fields (configs/gen_llada_8b.yaml, configs/gen_dream_7b.yaml); "
                   "flags given on the command line override it")  # fmt: skip
    g = p.add_argument_group("model")
    g.add_argument("--backbone", default=None,
                   help="preset (tiny-llada, tiny-dream) or checkpoint folder (required, here or in --config)")
    g.add_argument("--adapter", default=None, help="TDLM adapter folder (TDLM.save_adapter); required by --policy tdlm")
    g.add_argument("--allow-other-backbone", action="store_true",
                   help="attach the adapter although it was trained on another backbone (refused by default)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default: the checkpoint's torch_dtype)")  # fmt: skip
    g = p.add_argument_group("prompts")
    g.add_argument("--prompts", default=None,
                   help="local .jsonl/.json/.parquet file, or a Hugging Face dataset name (required, here or in "
                   "--config)")  # fmt: skip
    g.add_argument("--prompt-field", default=d.prompt_field, help="field / column holding the prompt text")
    g.add_argument("--prompt-config", default=None, help="dataset config name (Hugging Face datasets)")
    g.add_argument("--prompt-split", default=d.prompt_split,
                   help=f"dataset split (Hugging Face datasets; ignored for local files). The default, "
                   f"{d.prompt_split!r}, keeps teacher prompts out of the splits the evaluator scores")  # fmt: skip
    g.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (default: all)")
    g.add_argument("--allow-eval-prompts", action="store_true",
                   help="allow prompts that are evaluation problems (GSM8K test, MATH-500, MBPP test, arith "
                   "held-out; matched by source name and by hash of the whitespace-normalised text). "
                   "Without it such a source is refused; trajectories made with it must not train an adapter "
                   "that is evaluated on those tasks")  # fmt: skip
    g.add_argument("--no-chat", dest="chat", action="store_false",
                   help="feed raw prompt text instead of the tokenizer's chat template")  # fmt: skip
    g = p.add_argument_group("decoding (tdlm.decode)")
    g.add_argument("--policy", default=DecodeConfig.policy, choices=POLICIES, help="commit rule")
    g.add_argument("--tau", dest="threshold", type=float, default=DecodeConfig.threshold,
                   help="confidence threshold of policies threshold / tdlm")  # fmt: skip
    g.add_argument("--entropy-threshold", type=float, default=DecodeConfig.entropy_threshold,
                   help="entropy bound H of policy entropy")  # fmt: skip
    g.add_argument("--gen-length", type=int, default=DecodeConfig.gen_length, help="response tokens")
    g.add_argument("--block-size", type=int, default=DecodeConfig.block_size, help="semi-autoregressive block size")
    g.add_argument("--stop-at-eos", action="store_true", help="stop a row once EOS is committed (paper: off)")
    g.add_argument("--cache", default=DecodeConfig.cache, choices=CACHE_MODES,
                   help="spatial KV cache: none, or Fast-dLLM's prefix / dual cache (tdlm/models/kv_cache.py)")
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", default=None,
                   help="shards + manifest.json (absolute under ray job submit; required, here or in --config)")
    g.add_argument("--shard-size", type=int, default=d.shard_size, help="prompts per shard; shard i = [i*S, (i+1)*S)")
    g = p.add_argument_group("cluster (may change when resuming)")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="prompts per decode call in a replica")
    g.add_argument("--actors", type=int, default=None,
                   help="replicas (default: one per GPU; without GPUs one per --cpus-per-actor CPUs)")  # fmt: skip
    g.add_argument("--cpus-per-actor", type=int, default=d.cpus_per_actor,
                   help="CPUs (= torch threads on CPU replicas) reserved per replica")  # fmt: skip
    g.add_argument("--address", default=None,
                   help="Ray cluster (host:6379 or 'auto'); default: RAY_ADDRESS, else a local cluster")  # fmt: skip
    g.add_argument("--max-restarts", type=int, default=d.max_restarts, help="Ray restarts of a dead replica")
    g.add_argument("--max-task-retries", type=int, default=d.max_task_retries,
                   help="Ray retries of the shard a dead replica held")  # fmt: skip
    g.add_argument("--max-shard-attempts", type=int, default=d.max_shard_attempts,
                   help="driver-level attempts per shard once Ray's retries are spent")  # fmt: skip
    g.add_argument("--log-interval", type=float, default=d.log_interval, help="seconds between progress lines")
    args = p.parse_args(argv)
    raw: dict = {}
    if args.config:
        raw = load_yaml(args.config)
        # Only flags actually given override the file: parse again with every default suppressed.
        for action in p._actions:
            action.default = argparse.SUPPRESS
        raw.update({k: v for k, v in vars(p.parse_args(argv)).items() if k != "config"})
    else:
        raw = {k: v for k, v in vars(args).items() if k != "config"}
    missing = [f"--{k.replace('_', '-')}" for k in ("backbone", "prompts", "output_dir") if raw.get(k) is None]
    if missing:
        p.error(f"{', '.join(missing)} required (as flags or as fields of --config)")
    return from_dict(GenerationConfig, raw, args.config or "arguments")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")
    datasets.disable_progress_bars()  # one bar per shard write would drown the progress lines
    try:
        cfg = parse_args(argv)
        summary = generate(cfg)
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {summary.num_prompts} trajectories to {summary.output_dir} "
          f"({len(summary.computed_shards)} shards computed, {summary.skipped_shards} already finished)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
        --prompts data/benchmarks/gsm8k_test.jsonl --allow-eval-prompts --num-prompts 64 \\
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

from tdlm.config import Flag, SuggestingParser, add_dataclass_flags, from_dict, load_yaml
from tdlm.decoding import CACHE_MODES, POLICIES
from tdlm.errors import TDLMError
from tdlm.generation import GenerationConfig, generate

# How the GenerationConfig fields appear on the command line; each flag's help is the field's own comment in
# tdlm/generation/config.py, so a new field gets a flag without an edit here (tests/test_first_contact.py pins
# field <-> flag). Only names, choices and groups the fields cannot say themselves are listed.
MODEL, PROMPTS, DECODING, OUTPUT, CLUSTER = ("model", "prompts", "decoding (tdlm.decode)", "output",
                                             "cluster (may change when resuming)")
FLAGS: dict[str, Flag] = {
    **{k: Flag(group=MODEL) for k in ("backbone", "adapter", "allow_other_backbone")},
    "dtype": Flag(choices=("float32", "bfloat16", "float16"), group=MODEL),
    **{k: Flag(group=PROMPTS) for k in ("prompts", "prompt_field", "prompt_config", "prompt_split", "num_prompts",
                                        "allow_eval_prompts")},
    "chat": Flag(name="--no-chat", negate=True, group=PROMPTS),
    "policy": Flag(choices=POLICIES, group=DECODING), "threshold": Flag(name="--tau", group=DECODING),
    **{k: Flag(group=DECODING) for k in ("entropy_threshold", "gen_length", "block_size", "stop_at_eos", "compile")},
    "cache": Flag(choices=CACHE_MODES, group=DECODING),
    **{k: Flag(group=OUTPUT) for k in ("output_dir", "shard_size")},
    **{k: Flag(group=CLUSTER) for k in ("batch_size", "actors", "cpus_per_actor", "address", "max_restarts",
                                        "max_task_retries", "max_shard_attempts", "log_interval")},
}


def build_parser() -> argparse.ArgumentParser:
    # Every flag defaults to None so that a --config file's values survive unless the flag is given; the real
    # defaults live in GenerationConfig and are shown in the help.
    p = SuggestingParser(
        description="Decode every prompt once with a frozen backbone on Ray replicas and write "
        "trajectory shards (shard-NNNNN.parquet) + manifest.json. Prompts that are evaluation problems "
        "(GSM8K test, MATH-500, MBPP test, arith held-out) are refused unless --allow-eval-prompts.",
    )
    p.add_argument("--config", default=None,
                   help="YAML of GenerationConfig fields (configs/gen_llada_8b.yaml, configs/gen_dream_7b.yaml, "
                   "configs/gen_tiny_multi.yaml); flags given on the command line override it")  # fmt: skip
    add_dataclass_flags(p, GenerationConfig, FLAGS, dict.fromkeys((MODEL, PROMPTS, DECODING, OUTPUT, CLUSTER)))
    return p


def parse_args(argv: list[str] | None = None) -> GenerationConfig:
    p = build_parser()
    args = vars(p.parse_args(argv))
    path = args.pop("config")
    raw = load_yaml(path) if path else {}
    raw.update({k: v for k, v in args.items() if v is not None})
    missing = [f"--{k.replace('_', '-')}" for k in ("backbone", "prompts", "output_dir") if raw.get(k) is None]
    if missing:
        p.error(f"{', '.join(missing)} required (as flags or as fields of --config)")
    return from_dict(GenerationConfig, raw, path or "arguments")


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

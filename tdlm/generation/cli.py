"""The teacher-generation command line (``ray_jobs/generate_trajectories.py``, console script ``tdlm-generate``):
flags generated from :class:`tdlm.generation.config.GenerationConfig`, a ``--config`` YAML under them, one-line
errors with exit status 2. What the command does is described in ``ray_jobs/generate_trajectories.py``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tdlm.config import Flag, SuggestingParser, add_dataclass_flags, from_dict, load_yaml, nest_flags
from tdlm.decoding import POLICIES
from tdlm.decoding.config import decode_flags
from tdlm.errors import TDLMError
from tdlm.generation.config import GenerationConfig
from tdlm.generation.driver import HeadLost, generate

# How the GenerationConfig fields appear on the command line; each flag's help is the field's own comment in
# tdlm/generation/config.py, so a new field gets a flag without an edit here (tests/test_first_contact.py pins
# field <-> flag). Only names, choices and groups the fields cannot say themselves are listed.
MODEL, PROMPTS, DECODING, OUTPUT, CLUSTER = ("model", "prompts", "decoding (tdlm.decode)", "output",
                                             "cluster (may change when resuming)")
ROLLOUT = "on-policy roll-out (set by ray_jobs/onpolicy.py)"
FLAGS: dict[str, Flag] = {
    **{k: Flag(group=MODEL) for k in ("backbone", "adapter", "allow_other_backbone")},
    **{k: Flag(group=PROMPTS) for k in ("prompts", "prompt_field", "prompt_config", "prompt_split", "num_prompts",
                                        "allow_eval_prompts")},
    "chat": Flag(name="--no-chat", negate=True, group=PROMPTS),
    # the decode section (tdlm.decoding.config.DecodeSettings): one flag per field, named after it
    **decode_flags(DECODING, threshold=Flag(name="--tau"), dtype=Flag(group=MODEL), batch_size=Flag(group=CLUSTER)),
    **{k: Flag(group=OUTPUT) for k in ("output_dir", "shard_size")},
    **{k: Flag(group=ROLLOUT) for k in ("switch", "switch_seed", "round", "adapter_version", "gap_prompts")},
    "teacher_policy": Flag(choices=[p for p in POLICIES if p != "tdlm"], group=ROLLOUT),
    **{k: Flag(group=CLUSTER) for k in ("actors", "cpus_per_actor", "address", "max_restarts",
                                        "max_task_retries", "max_shard_attempts", "log_interval", "head_timeout_s")},
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
    add_dataclass_flags(p, GenerationConfig, FLAGS, dict.fromkeys((MODEL, PROMPTS, DECODING, OUTPUT, ROLLOUT, CLUSTER)))
    return p


def parse_args(argv: list[str] | None = None) -> GenerationConfig:
    p = build_parser()
    args = vars(p.parse_args(argv))
    path = args.pop("config")
    raw = nest_flags(load_yaml(path) if path else {}, args)
    missing = [f"--{k.replace('_', '-')}" for k in ("backbone", "prompts", "output_dir") if raw.get(k) is None]
    if missing:
        p.error(f"{', '.join(missing)} required (as flags or as fields of --config)")
    return from_dict(GenerationConfig, raw, path or "arguments")


def main(argv: list[str] | None = None) -> int:
    import datasets

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")
    datasets.disable_progress_bars()  # one bar per shard write would drown the progress lines
    try:
        cfg = parse_args(argv)
        summary = generate(cfg)
    except HeadLost as e:
        # Leave without Ray's teardown: with the head gone it exits from C++ or waits for the GCS; the line is all.
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {summary.num_prompts} trajectories to {summary.output_dir} "
          f"({len(summary.computed_shards)} shards computed, {summary.skipped_shards} already finished)")  # fmt: skip
    return 0

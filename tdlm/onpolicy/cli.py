"""The on-policy command line (``ray_jobs/onpolicy.py``, console script ``tdlm-onpolicy``): flags generated from
:class:`tdlm.onpolicy.config.OnPolicyConfig`, a ``--config`` YAML under them, one-line errors with exit status 2."""

from __future__ import annotations

import argparse
import logging
import sys

from tdlm.config import Flag, SuggestingParser, add_dataclass_flags, load_yaml, nest_flags
from tdlm.decoding import POLICIES
from tdlm.decoding.config import decode_flags
from tdlm.errors import TDLMError
from tdlm.onpolicy.config import OnPolicyConfig

RECIPE, ROUNDS, DECODING, MIX, TRACKING, CLUSTER = (
    "recipe", "rounds and prompts", "decoding", "the training mix", "W&B", "cluster (may change when resuming)")
FLAGS: dict[str, Flag] = {
    **{k: Flag(group=RECIPE) for k in ("train_config", "ds", "launcher", "train_overrides", "round_overrides",
                                       "round0_trajectories", "round0_adapter", "output_dir", "seed")},
    **{k: Flag(group=ROUNDS) for k in ("prompts", "prompt_field", "prompt_config", "prompt_split", "rounds",
                                       "prompts_per_round", "updates_per_round")},
    "chat": Flag(name="--no-chat", negate=True, group=ROUNDS),
    **{k: Flag(group=DECODING) for k in ("rollout_tau", "switch", "gap_prompts")},
    # the decode section (tdlm.decoding.config.DecodeSettings): its policy is the teacher's (--teacher-policy)
    **decode_flags(DECODING, policy=Flag(name="--teacher-policy", choices=[p for p in POLICIES if p != "tdlm"]),
                   threshold=Flag(name="--tau"), batch_size=Flag(group=CLUSTER)),
    **{k: Flag(group=MIX) for k in ("mix_lambda", "mix_size", "replay_window", "staleness")},
    **{k: Flag(group=TRACKING) for k in ("wandb_project", "wandb_group", "wandb_mode")},
    **{k: Flag(group=CLUSTER) for k in ("shard_size", "actors", "cpus_per_actor", "address")},
}


def build_parser() -> argparse.ArgumentParser:
    import tdlm.onpolicy.job as job

    p = SuggestingParser(prog="python ray_jobs/onpolicy.py", description=job.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="YAML of OnPolicyConfig fields (configs/onpolicy_tiny_multi.yaml, "
                        "configs/onpolicy_llada_8b.yaml); flags given on the command line override it")  # fmt: skip
    add_dataclass_flags(p, OnPolicyConfig, FLAGS, dict.fromkeys((RECIPE, ROUNDS, DECODING, MIX, TRACKING, CLUSTER)))
    return p


def main(argv: list[str] | None = None) -> int:
    import datasets

    from tdlm.onpolicy.job import Job, load_job_config

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")
    datasets.disable_progress_bars()
    p = build_parser()
    args = vars(p.parse_args(argv))
    path = args.pop("config")
    given = {k: v for k, v in args.items() if v is not None}
    try:
        raw = nest_flags(load_yaml(path) if path else {}, given)
        missing = [f"--{k.replace('_', '-')}" for k in ("train_config", "prompts", "output_dir") if raw.get(k) is None]
        if missing:
            p.error(f"{', '.join(missing)} required (as flags or as fields of --config)")
        cfg, where = load_job_config(path, given)
        state = Job(cfg, where).run_all()
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    last = max(int(k) for k in state["rounds"])
    print(f"on-policy job done: {last + 1} rounds in {cfg.output_dir}; adapter version {last}: "
          f"{cfg.output_dir}/rounds/{last:02d}/adapter", flush=True)
    return 0

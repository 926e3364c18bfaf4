"""Train TDLM temporal modules on a frozen backbone with DeepSpeed.

Launch (GPU cluster, one node, 8 GPUs; 32-layer allocation):
    deepspeed launcher/train.py --ds ds_configs/zero3.json --config configs/llada_8b.yaml model.layers=all
The embedded default (shipped tiny-arith backbone; its teacher trajectories are generated on first use):
    deepspeed launcher/train.py --ds ds_configs/zero3.json
On this CPU machine (2 ranks, embedded tiny default):
    deepspeed --num_gpus 2 launcher/train.py --ds ds_configs/zero3.json --config configs/tiny.yaml
Also works with torchrun:
    torchrun --nproc_per_node 2 launcher/train.py --ds ds_configs/zero2.json --config configs/tiny.yaml
Resume the run in --output-dir from its latest checkpoint:
    deepspeed --num_gpus 2 launcher/train.py --ds ds_configs/zero3.json --config configs/tiny.yaml --resume

Overrides are `section.key=value` (e.g. `train.max_steps=100 model.layers=dispersed:8 data.states=8`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    from tdlm.config import apply_overrides, from_dict, load_yaml
    from tdlm.demo import ensure_toy_trajectories
    from tdlm.errors import TDLMError
    from tdlm.training import train
    from tdlm.training.config import RunConfig
    from tdlm.training.ds_config import load_ds_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ds", required=True,
                    help="DeepSpeed JSON (ds_configs/zero3.json, zero2.json, zero3_offload.json)")
    ap.add_argument("--config", default=None,
                    help="run config YAML (configs/llada_8b.yaml, configs/dream_7b.yaml, configs/tiny.yaml); "
                         "fields of tdlm.training.config")
    ap.add_argument("--output-dir", default=None,
                    help="run folder (checkpoints/, adapter/, metrics.jsonl, summary.json)")
    ap.add_argument("--max-steps", type=int, default=None, help="optimizer updates (sets train.max_steps)")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides of the run config")
    args = ap.parse_args(argv)
    try:
        raw = load_yaml(args.config)
        extra = list(args.overrides)
        if args.output_dir:
            extra.append(f"output_dir={args.output_dir}")
        if args.max_steps is not None:
            extra.append(f"train.max_steps={args.max_steps}")
        run = from_dict(RunConfig, apply_overrides(raw, extra), args.config or "config")
        ds_raw = load_ds_json(args.ds)
        ensure_toy_trajectories(run.data.trajectories, run.model.backbone)
        train(run, ds_raw, resume=args.resume)
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # torch's gloo thread can abort interpreter shutdown ("terminate called without an active
    # exception", ~1 run in 15 on CPU); skipping the shutdown avoids it (see shared notes).
    os._exit(rc)

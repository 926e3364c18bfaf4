"""Train TDLM temporal modules on a frozen backbone with DeepSpeed.

The paper's recipes (GPU node, 8 GPUs; teacher trajectories from configs/gen_*.yaml first):
    deepspeed launcher/train.py --ds ds_configs/zero3.json --config configs/llada_8b.yaml
    deepspeed launcher/train.py --ds ds_configs/zero3.json --config configs/dream_7b.yaml
Table 4's allocations, one override each (the 32-layer one ran out of memory in the paper):
    deepspeed launcher/train.py --ds ds_configs/zero3.json --config configs/llada_8b.yaml model.layers=all
    (model.layers=dispersed:8 | middle:16 | dispersed:16 | all)
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

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Bit-reproducible CPU training: without it MKL picks kernels by buffer alignment, and two launches with the same
# trajectories and seed ended with adapters differing by ~6e-8 (measured; identical with it). Must be set before
# torch loads MKL. STRICT = the same result on this CPU type; another CPU type may still differ (see docs).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def main(argv: list[str] | None = None) -> int:
    from tdlm.data.toy_trajectories import ensure_toy_trajectories
    from tdlm.errors import TDLMError
    from tdlm.training import train
    from tdlm.training.config import DataConfig
    from tdlm.training.launch import parse_launch, preflight_before_work
    from tdlm.training.run_dir import stop_with_launcher

    stop_with_launcher()  # if the deepspeed / torchrun process above this rank dies, so does this rank
    try:
        launch = parse_launch(argv, __doc__)
        preflight_before_work(launch)  # every field, the DS JSON and the backbone, before any trajectory is made
        if launch.run.data.trajectories == DataConfig.trajectories:  # only the embedded default's own folder:
            ensure_toy_trajectories(launch.run.data.trajectories, launch.run.model.backbone)  # a typo is an error
        train(launch.run, launch.ds_raw, resume=launch.resume, source=launch.source, ds_source=launch.ds_path,
              allow_recipe_change=launch.allow_recipe_change)
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

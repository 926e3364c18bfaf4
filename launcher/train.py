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

Ctrl-C (SIGINT), SIGTERM or SIGUSR1 (Slurm preemption) to the launcher or any rank: every rank finishes the current
update, they save a checkpoint together and exit with status 75 ("preempted at step N; resume with --resume").
Exit status: 0 done, 2 bad input (one line, before any work), 75 stopped at a checkpoint, 74 a checkpoint could not be
written (disk full; the previous one is intact), 76 a rank / node was lost (resume with --resume), 1 anything else.
Two nodes with torchrun (the same command on each; train.dist_timeout_s bounds a wait on a silent peer):
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint gpu-001:29500 --rdzv_id run1 \
        launcher/train.py --ds ds_configs/zero3.json --config configs/llada_8b.yaml train.micro_batch_size=2

Overrides are `section.key=value` (e.g. `train.max_steps=100 model.layers=dispersed:8 data.states=8`).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Bit-reproducible CPU training: without it MKL picks kernels by buffer alignment, and two launches with the same
# trajectories and seed ended with adapters differing by ~6e-8 (measured; identical with it). Must be set before
# torch loads MKL. STRICT = the same result on this CPU type; another CPU type may still differ (see docs).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

# A stop signal during the imports of run() (torch + DeepSpeed: seconds) is remembered and handled like one during
# training, not a KeyboardInterrupt traceback from inside an import.
_EARLY: list[int] = []
for _s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
    signal.signal(_s, lambda signum, frame: _EARLY.append(signum))

# Everything else (the command line, the checks, training, exit statuses and their one-line messages) is the
# library's: tdlm/training/entry.py.
from tdlm.training.entry import run  # noqa: E402 - after the environment and the handlers above

if __name__ == "__main__":
    rc = run(None, __doc__, _EARLY)
    sys.stdout.flush()
    sys.stderr.flush()
    # torch's gloo thread can abort interpreter shutdown ("terminate called without an active
    # exception", ~1 run in 15 on CPU); skipping the shutdown avoids it (see shared notes).
    os._exit(rc)

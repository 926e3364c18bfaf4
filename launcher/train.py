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

import contextlib
import io
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Bit-reproducible CPU training: without it MKL picks kernels by buffer alignment, and two launches with the same
# trajectories and seed ended with adapters differing by ~6e-8 (measured; identical with it). Must be set before
# torch loads MKL. STRICT = the same result on this CPU type; another CPU type may still differ (see docs).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

# A stop signal during the imports below (torch + DeepSpeed: seconds) is remembered and handled like one during
# training, not a KeyboardInterrupt traceback from inside an import.
_EARLY: list[int] = []
for _s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
    signal.signal(_s, lambda signum, frame: _EARLY.append(signum))

RANK = int(os.environ.get("RANK", "0"))  # set by deepspeed / torchrun before this process starts
PEER_REPORT_WAIT_S = 20.0  # how long a rank > 0 leaves rank 0 to report an input error (its launcher ends us)


def _quiet_unless_rank0():
    """Ranks > 0 keep their messages (argparse usage, errors) to themselves while the input is checked: every rank
    checks the same input, rank 0 reports it, once."""
    return contextlib.nullcontext(None) if RANK == 0 else contextlib.redirect_stderr(io.StringIO())


def _peer_exit(stop, message: str) -> int:
    """A rank > 0 with an input error: rank 0 prints the same one line, and the launcher then ends this rank
    (SIGTERM, a stop request). Only if that never comes is the message printed here, naming the rank."""
    stop.immediate = False  # this exit is an input error's (2), not a stop's
    deadline = time.monotonic() + PEER_REPORT_WAIT_S
    while time.monotonic() < deadline and not stop.requested:
        time.sleep(0.1)
    if not stop.requested and message:
        print(f"rank {RANK}: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    from tdlm.training.run_dir import (
        EXIT_BAD_INPUT,
        EXIT_FAILED,
        EXIT_PREEMPTED,
        STOP,
        RunAborted,
        Stopped,
        stop_with_launcher,
    )

    stop = STOP.install()
    stop.immediate = True  # nothing written yet: a stop ends the process (tdlm.training.run_dir.StopRequest)
    if _EARLY:
        stop.handler(_EARLY[0])
    from tdlm.errors import TDLMError

    stop_with_launcher()  # if the deepspeed / torchrun process above this rank dies, this rank stops (checkpoint)
    buffered = _quiet_unless_rank0()
    try:
        # Validation first, before trajectories, weights or a process group: the command line, every field, the DS
        # JSON through DeepSpeed's own config model, the backbone and the allocation (tdlm.training.launch).
        with buffered as err:
            from tdlm.training.launch import parse_launch, preflight_before_work

            launch = parse_launch(argv, __doc__)
            if launch.resume:
                stop.hint = "resume with --resume"
            preflight_before_work(launch)
    except SystemExit as e:  # argparse: usage or --help, printed by rank 0 only
        stop.immediate = False
        code = e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
        if RANK != 0 and code:
            lines = (err.getvalue() if err is not None else "").strip().splitlines()
            return _peer_exit(stop, lines[-1] if lines else "")
        return code
    except TDLMError as e:
        if RANK != 0:
            return _peer_exit(stop, f"error: {e}")
        stop.immediate = False
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    try:
        from tdlm.data.toy_trajectories import ensure_toy_trajectories
        from tdlm.training import train
        from tdlm.training.config import DataConfig

        if launch.run.data.trajectories == DataConfig.trajectories:  # only the embedded default's own folder:
            ensure_toy_trajectories(launch.run.data.trajectories, launch.run.model.backbone)  # a typo is an error
        train(launch.run, launch.ds_raw, resume=launch.resume, source=launch.source, ds_source=launch.ds_path,
              allow_recipe_change=launch.allow_recipe_change)
    except Stopped as e:
        stop.immediate = False
        if RANK == 0:
            print(e.message, file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    except RunAborted as e:  # a full disk at a checkpoint, a lost peer: every rank knows; one prints
        stop.immediate = False
        if RANK == e.printer:
            print(f"error: {e.message}", file=sys.stderr, flush=True)
        return e.exit_code
    except TDLMError as e:
        stop.immediate = False
        if RANK == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        return _peer_exit(stop, f"error: {e}")
    except Exception as e:
        stop.immediate = False
        if not stop.requested:
            raise
        # Stopping, a peer rank ended first (its collective broke): one line, not a gloo traceback.
        from tdlm.training.run_dir import signal_name

        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        print(f"rank {RANK}: stopped by {signal_name(stop.signum)} before the ranks could agree on a checkpoint "
              f"({type(e).__name__}: {first}); resume with --resume (from the newest verified checkpoint)",
              file=sys.stderr, flush=True)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # torch's gloo thread can abort interpreter shutdown ("terminate called without an active
    # exception", ~1 run in 15 on CPU); skipping the shutdown avoids it (see shared notes).
    os._exit(rc)

"""The process group, with the rules NCCL enforces and gloo does not (docs/gpu.md).

* **Bind, then meet.** ``deepspeed.init_distributed`` binds rank k's NCCL group to ``cuda:LOCAL_RANK`` (it passes
  ``device_id``) but does not make that the *current* device. An object collective (``broadcast_object_list``,
  ``all_gather_object``) stages its bytes on ``torch.cuda.current_device()``, which is cuda:0 on every rank until
  ``set_device`` runs: ranks 1..n then fail ("Tensor found on device cuda:0 but backend constrained to cuda:k"), or,
  unbound, NCCL sees the same GPU twice. :func:`start_process_group` binds the rank first, and the object collectives
  of this package name their device too.
* **Every tensor a collective sends is on the rank's own device** (``Session.device``).
* **A broken collective must reach Python.** Under NCCL's default error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING``
  3, SkipCleanUp) the watchdog tears the process down (SIGABRT) when a collective times out or a peer is gone, so
  the one-line "lost rank" exit (76, :func:`peer_lost`) never runs. :func:`nccl_error_handling` chooses 2
  (CleanUpOnly): the communicators are aborted and the next collective raises in Python, as gloo's do.
"""

from __future__ import annotations

import datetime
import os
import re
import time
from collections.abc import MutableMapping

import torch

from tdlm.errors import TDLMError
from tdlm.training.run_dir import EXIT_PEER_LOST, STOP, RunAborted
from tdlm.training.session import Session

# torch's switches for NCCL errors, set before the process group exists (ProcessGroupNCCL reads them when it is
# built); a value the user exported wins. 2 = CleanUpOnly: abort the communicators, raise in the waiting rank.
NCCL_ERROR_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def nccl_error_handling(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set :data:`NCCL_ERROR_ENV` where the user has not; returns what is now in force."""
    for key, value in NCCL_ERROR_ENV.items():
        environ.setdefault(key, value)
    return {key: environ[key] for key in NCCL_ERROR_ENV}


def rank_device(acc, local_rank: int) -> torch.device:
    """The device this rank computes on: ``<accelerator>:LOCAL_RANK``, or the CPU. One line if the rank cannot see
    its device (a launcher that gives each process one GPU through CUDA_VISIBLE_DEVICES: DeepSpeed binds the group to
    cuda:LOCAL_RANK all the same, so every process must see every GPU of its node)."""
    name = acc.device_name()
    if name == "cpu":
        return torch.device("cpu")
    count = acc.device_count()
    if not 0 <= local_rank < count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise TDLMError(f"LOCAL_RANK={local_rank} but this process sees {count} {name} device(s)"
                        + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                        + "; start one process per GPU with every GPU of the node visible to each (deepspeed and "
                          "torchrun do), or fewer processes per node")
    return torch.device(name, local_rank)


def start_process_group(acc, timeout_s: float) -> tuple[int, int, torch.device]:
    """Bind this rank to its device, then start the process group (``deepspeed.init_distributed``). Returns
    (rank, world size, device). The order matters under NCCL only (module docstring): with gloo any order works,
    which is why tests/test_gpu_world.py replays this under NCCL's rules."""
    import deepspeed
    import torch.distributed as dist

    device = rank_device(acc, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type != "cpu":
        if acc.communication_backend_name() == "nccl":
            nccl_error_handling()
        acc.set_device(device.index)
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name(), verbose=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def broadcast_launch_id(device: torch.device) -> str:
    """Rank 0's name for this launch, on every rank (the roll call's key). An object collective: its bytes travel
    on ``device``, named rather than left to the current device."""
    import torch.distributed as dist

    launch_id = [f"{int(time.time())}-{os.getpid()}"]
    dist.broadcast_object_list(launch_id, src=0, device=device)
    return launch_id[0]


def agree_to_stop(sess: Session) -> tuple[int, bool]:
    """One all-reduce (MAX) between updates: the stop signal any rank received (0 = none) and whether rank 0's clock
    says a timed checkpoint is due (``train.save_every_minutes``). Each rank decides from the same result, so none
    stops, checkpoints or waits alone."""
    import torch.distributed as dist

    minutes = sess.run.train.save_every_minutes
    due = sess.rank == 0 and minutes > 0 and time.monotonic() - sess.saved_at >= minutes * 60
    flags = torch.tensor([float(STOP.signum or 0), float(due)], device=sess.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return int(flags[0].item()), bool(flags[1].item())


START_TIMEOUT_S = 600.0  # the process-group timeout until the first update (the ranks meet, load, build engines)


def set_collective_timeout(seconds: float) -> None:
    """Every rank at the first update: from here a collective waits at most ``train.dist_timeout_s`` for a silent
    peer. (torch's own default is 30 minutes; the start-up phase keeps START_TIMEOUT_S.)"""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    dist.barrier()  # under the start-up timeout: no rank is still loading when the short one applies
    if hasattr(distributed_c10d, "_set_pg_timeout"):  # torch >= 2.2; otherwise START_TIMEOUT_S stays
        distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


# -- a lost peer ------------------------------------------------------------------------------------
PEER_FAILURE_HINTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
                      "timed out", "gloo", "NCCL", "ProcessGroup", "Socket")


def is_peer_failure(e: BaseException) -> bool:
    """A collective that failed because another rank is gone or silent (gloo / NCCL / the c10d store)."""
    import torch.distributed as dist

    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError)
                                             and any(k in str(e) for k in PEER_FAILURE_HINTS))


def peer_lost(sess: Session, e: BaseException) -> RunAborted:
    """The one line for a rank whose collective broke: which ranks are gone (:class:`RollCall`), during which
    update, and what ``--resume`` will redo. The lowest surviving rank prints it."""
    lost, alive = sess.roll.missing(wait_s=min(15.0, sess.run.train.dist_timeout_s))
    who = ", ".join(sess.roll.describe(r) for r in lost) or "no rank (every rank answered the roll call)"
    if sess.saved_step is not None:
        redo = max(0, sess.step - sess.saved_step)
        then = (f"the newest verified checkpoint is step-{sess.saved_step} ({redo} update{'s' * (redo != 1)} to "
                f"redo); start every node's command again with --resume")
    else:
        then = "no checkpoint yet; start every node's command again (without --resume)"
    return RunAborted(f"rank {sess.rank}: lost {who} during update {sess.step + 1} ({first_line(e)}); "
                      f"{then}", EXIT_PEER_LOST, printer=min(alive))


def first_line(e: BaseException, limit: int = 160) -> str:
    """``Type: message`` of an exception on one line, without C++ source-location prefixes (gloo, torch.save)."""
    text = re.sub(r"\[(enforce fail at )?[^\]]*\.(cc|cpp|hpp|h):\d+\] ?\.? ?", "", str(e).strip())
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"

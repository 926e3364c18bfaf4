"""One rank of a simulated multi-GPU node (tests/test_gpu_world.py): the launcher's real start-up path
(``tdlm.training.setup``) on a DeepSpeed accelerator that says it is CUDA with N devices, over collectives that
enforce NCCL's rules and then run on gloo.

    RANK=k LOCAL_RANK=k WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \
        python tests/_gpu_world_rank.py OUT RUN_DIR TRAJ

The rules, as NCCL applies them and gloo does not (tdlm/training/distributed.py, docs/gpu.md):
* the rank is bound to its own device (``set_device(LOCAL_RANK)``) before its first collective;
* ``init_process_group`` binds the group to ``device_id`` = cuda:LOCAL_RANK (DeepSpeed passes it): a collective whose
  tensor lies on another device fails with NCCL's message;
* an object collective stages its bytes on the ``device`` it is given, else on the *current* device;
* the NCCL error-handling switch is in the environment when the group is built.

Set-up runs until the frozen backbone would be loaded onto the (simulated) GPU, then stops: everything before that
is the real code. The rank writes OUT/rank<k>.json: what it did, in order, and how it ended. ``TDLM_ROOT`` names the
source tree to import (a copy with a planted fault, in the test).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("TDLM_ROOT", Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(ROOT))


class ReachedWeights(Exception):
    """Set-up got as far as loading the backbone onto the rank's device: the start-up is done."""


def main() -> int:
    out, run_dir, traj = (Path(a) for a in sys.argv[1:4])
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    local_rank = int(os.environ["LOCAL_RANK"])
    events: list = []

    class SimulatedGPUs(CPU_Accelerator):
        """DeepSpeed's CPU accelerator that calls itself CUDA with ``n`` devices and keeps a current device."""

        def __init__(self, n: int) -> None:
            super().__init__()
            self._name = "cuda"
            self._communication_backend_name = "nccl"
            self.n, self.current = n, 0  # CUDA's current device is 0 until set_device

        def device_name(self, device_index=None):
            return "cuda" if device_index is None else f"cuda:{device_index}"

        def device(self, device_index=None):
            return torch.device("cuda", self.current if device_index is None else device_index)

        def current_device(self):
            return self.current

        def current_device_name(self):
            return f"cuda:{self.current}"

        def set_device(self, device_index):
            events.append(["set_device", int(device_index)])
            self.current = int(device_index)

        def device_count(self):
            return self.n

        def is_available(self):
            return True

        def communication_backend_name(self):
            return "nccl"

    acc = SimulatedGPUs(int(os.environ.get("SIM_GPUS", os.environ["WORLD_SIZE"])))
    set_accelerator(acc)
    own = torch.device("cuda", local_rank)
    state = {"bound": None}

    def nccl_error(where: str, dev) -> RuntimeError:
        return RuntimeError(f"{where}: Tensor found on device {dev} but backend constrained to {state['bound'] or own}")

    real_init = dist.init_process_group

    @functools.wraps(real_init)  # DeepSpeed reads its signature: device_id is passed only where it exists
    def init_process_group(backend=None, **kw):
        device_id = kw.pop("device_id", None)
        events.append(["init_process_group", backend, str(device_id) if device_id is not None else None,
                       os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")])
        if device_id is not None:
            state["bound"] = torch.device(device_id)
        return real_init("gloo" if backend == "nccl" else backend, **kw)

    def check_current(name: str) -> None:
        if acc.current != local_rank:  # unbound: NCCL would see cuda:<current> on several ranks
            raise nccl_error(f"{name} before set_device({local_rank})", f"cuda:{acc.current}")

    def object_collective(name: str, real):
        takes_device = "device" in inspect.signature(real).parameters

        def wrapped(*args, device=None, **kw):
            staging = torch.device(device) if device is not None else torch.device("cuda", acc.current)
            events.append([name, str(staging)])
            check_current(name)
            if staging != (state["bound"] or own):
                raise nccl_error(name, staging)
            return real(*args, **kw, **({"device": None} if takes_device else {}))  # the bytes go by gloo
        return wrapped

    def plain_collective(name: str, real):
        def wrapped(*args, **kw):
            events.append([name])
            check_current(name)
            return real(*args, **kw)
        return wrapped

    dist.init_process_group = init_process_group
    for name in ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list"):
        setattr(dist, name, object_collective(name, getattr(dist, name)))
    for name in ("barrier", "all_reduce", "broadcast", "all_gather", "reduce", "all_gather_into_tensor",
                 "reduce_scatter_tensor"):
        setattr(dist, name, plain_collective(name, getattr(dist, name)))

    import tdlm.models.loading as loading
    import tdlm.training.ds_config as ds_config

    def no_weights(*a, **kw):
        raise ReachedWeights

    loading.load_backbone = loading.load_backbone_partitioned = no_weights
    real_check = ds_config.check_jit_op
    ds_config.check_jit_op = lambda op, rank=0: (events.append(["jit_op", op]), real_check(op, rank))[1]

    from tdlm.config import apply_overrides, from_dict, load_yaml
    from tdlm.training import RunConfig, setup
    from tdlm.training.ds_config import load_ds_json

    run = from_dict(RunConfig, apply_overrides(load_yaml(ROOT / "configs" / "tiny.yaml"), [
        f"data.trajectories={traj}", f"output_dir={run_dir}", "wandb.mode=disabled", "train.micro_batch_size=2",
        "data.states=2"]), "configs/tiny.yaml")
    result: dict = {"rank": int(os.environ["RANK"]), "local_rank": local_rank}
    try:
        setup(run, load_ds_json(ROOT / "ds_configs" / "zero3.json"))
        result["end"] = "set-up finished without loading weights (the simulation missed the load)"
    except ReachedWeights:
        result["end"] = "reached the weights"
    except Exception as e:  # noqa: BLE001 - the test reads how it ended
        result["end"] = f"{type(e).__name__}: {e}"
    result["events"] = events
    (out / f"rank{local_rank}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # a rank whose peer failed must not wait in gloo's shutdown

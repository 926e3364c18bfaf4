"""GPU-only behaviour of training, decoding and evaluation set-up, checked on this CPU under the GPU's rules
(docs/gpu.md lists each behaviour beside its test, or says that nothing here can test it).

* The launcher's real start-up (``tdlm.training.setup``) on a simulated 2-GPU node (tests/_gpu_world_rank.py): a
  DeepSpeed accelerator that says CUDA, collectives that enforce NCCL's rules. It passes, and the defect it was
  written for (the launch id broadcast before ``set_device``: every multi-GPU launch failed at start-up), planted
  back into a copy of the source, fails on rank 1 with NCCL's message.
* No DeepSpeed op is JIT-built at a GPU launch (FusedAdam needs nvcc matching torch's CUDA, and ninja).
* NCCL's error handling is switched to raise in Python before the group exists; NCCL's errors read as a lost peer.
* ``compile=True`` on CUDA checks what triton's runtime needs (a C compiler, Python's headers), in one line.
* The paper-table evaluation configs decode compiled.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tdlm.errors import TDLMError

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def traj(tmp_path_factory) -> Path:
    """Teacher trajectories for the simulated launches (generated once for the module)."""
    from tdlm.data.toy_trajectories import ensure_toy_trajectories

    path = tmp_path_factory.mktemp("gpu-world") / "traj"
    ensure_toy_trajectories(path, "tiny-arith", n=4)
    return path


def _simulated_launch(tmp_path: Path, root: Path, traj: Path, world: int = 2,
                      timeout: float = 240.0) -> dict[int, dict]:
    """Start ``world`` ranks of tests/_gpu_world_rank.py (as deepspeed / torchrun would: RANK, LOCAL_RANK...) and
    return each rank's record. A rank that fails leaves its peers waiting in a collective: they are stopped once
    every rank that can finish has written its record."""
    out = tmp_path / f"out-{root.name}"
    out.mkdir()
    port = str(_free_port())
    procs = []
    for r in range(world):
        env = os.environ | {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE":
                            str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                            "TDLM_ROOT": str(root), "WANDB_MODE": "disabled"}  # fmt: skip
        env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
        env.pop("DS_ACCELERATOR", None)
        procs.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "_gpu_world_rank.py"), str(out),
                                       str(tmp_path / f"run-{root.name}"), str(traj)], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            records = {r: out / f"rank{r}.json" for r in range(world)}
            if all(p.exists() for p in records.values()):
                break
            failed = [json.loads(p.read_text()) for p in records.values() if p.exists()]
            if any(rec["end"] != "reached the weights" for rec in failed):
                time.sleep(2)  # the peers of a failed rank wait in a collective for ever: read what came, stop them
                break
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        logs = [p.communicate()[0] for p in procs]
    got = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world) if (out / f"rank{r}.json").exists()}
    assert got, "no rank wrote its record:\n" + "\n".join(log[-3000:] for log in logs)
    return got


def _order(events: list, name: str) -> int:
    return next(i for i, e in enumerate(events) if e[0] == name)


@pytest.mark.slow  # two DeepSpeed ranks (and, on a fresh machine, its CPU comm op's first build)
def test_two_rank_gpu_launch_binds_each_rank_before_its_first_collective(tmp_path, traj):
    recs = _simulated_launch(tmp_path, REPO, traj)
    assert sorted(recs) == [0, 1]
    for r, rec in recs.items():
        ev = rec["events"]
        assert rec["end"] == "reached the weights", rec
        assert ev[0] == ["set_device", r], ev  # bound before anything else
        init = ev[_order(ev, "init_process_group")]
        assert init == ["init_process_group", "nccl", f"cuda:{r}", "2"], init  # bound group, NCCL errors reach Python
        assert ["broadcast_object_list", f"cuda:{r}"] in ev  # the launch id travels on the rank's own GPU
        assert not [e for e in ev if e[0] == "jit_op"], ev  # no FusedAdam nvcc build at a GPU launch


@pytest.mark.slow  # two DeepSpeed ranks (and, on a fresh machine, its CPU comm op's first build)
def test_the_start_up_defect_planted_back_fails_on_rank_1(tmp_path, traj):
    """The order before the fix: process group, launch id broadcast (no device given), *then* set_device. Rank 1's
    broadcast stages on cuda:0 while its group is bound to cuda:1: NCCL's error, as on every multi-GPU node."""
    copy = tmp_path / "planted"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "bench", "docs", "tests",
                                                                "__pycache__", "*.egg-info"))  # fmt: skip
    dist_py = copy / "tdlm" / "training" / "distributed.py"
    src = dist_py.read_text()
    bind = "        acc.set_device(device.index)\n"
    assert bind in src and "src=0, device=device)" in src
    dist_py.write_text(src.replace(bind, "").replace("src=0, device=device)", "src=0)"))
    loop_py = copy / "tdlm" / "training" / "loop.py"
    src = loop_py.read_text()
    roll = "    roll = RollCall(run.output_dir, broadcast_launch_id(device), rank, world)\n"
    assert roll in src
    loop_py.write_text(src.replace(roll, roll + "    if device.type != 'cpu':\n        acc.set_device(device.index)\n"))
    recs = _simulated_launch(tmp_path, copy, traj)
    assert recs[1]["end"].startswith("RuntimeError: broadcast_object_list before set_device(1): Tensor found on "
                                     "device cuda:0 but backend constrained to cuda:1"), recs[1]


def test_a_rank_that_cannot_see_its_gpu_is_one_line():
    from tdlm.training.distributed import rank_device

    class OneVisible:
        def device_name(self, index=None):
            return "cuda"

        def device_count(self):
            return 1

    assert rank_device(OneVisible(), 0) == torch.device("cuda", 0)
    with pytest.raises(TDLMError, match=r"^LOCAL_RANK=3 but this process sees 1 cuda device\(s\).*every GPU of the "
                                        r"node visible"):
        rank_device(OneVisible(), 3)


class _FakeCuda:
    """A DeepSpeed accelerator that says CUDA/NCCL with ``count`` devices; records set_device calls in ``log``."""

    def __init__(self, count: int, log: list | None = None):
        self.count, self.log = count, log if log is not None else []

    def device_name(self, index=None):
        return "cuda"

    def device_count(self):
        return self.count

    def communication_backend_name(self):
        return "nccl"

    def set_device(self, index):
        self.log.append(("set_device", index))


@pytest.mark.parametrize("local_rank", [2, 3, -1])
def test_local_rank_at_or_past_the_device_count_or_negative_is_one_line(monkeypatch, local_rank):
    """Two visible GPUs are cuda:0 and cuda:1: LOCAL_RANK=2 (the count itself, one past the last index) is refused
    as LOCAL_RANK=3 is, and so is a negative rank (torch.device would take -1 as "the current device")."""
    from tdlm.training.distributed import rank_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert rank_device(_FakeCuda(2), 1) == torch.device("cuda", 1)  # the last visible index still binds
    with pytest.raises(TDLMError) as e:
        rank_device(_FakeCuda(2), local_rank)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"LOCAL_RANK={local_rank} but this process sees 2 cuda device(s) "
                                   f"(CUDA_VISIBLE_DEVICES=0,1); ")


def test_nccl_error_handling_is_in_the_environment_before_the_group_is_built(monkeypatch):
    """ProcessGroupNCCL reads TORCH_NCCL_ASYNC_ERROR_HANDLING when it is built, inside deepspeed.init_distributed:
    set afterwards, the watchdog's SIGABRT stays (module docstring of tdlm.training.distributed). A stub deepspeed
    records the environment it is called with; the rank is bound (set_device) before it too."""
    import types

    import torch.distributed as dist

    from tdlm.training.distributed import NCCL_ERROR_ENV, start_process_group

    log: list = []

    def init_distributed(**kw):
        log.append(("init_distributed", kw["dist_backend"], {k: os.environ.get(k) for k in NCCL_ERROR_ENV}))

    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(init_distributed=init_distributed))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    for key in NCCL_ERROR_ENV:  # setenv first: monkeypatch then removes what start_process_group sets, at teardown
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    assert start_process_group(_FakeCuda(2, log), 60.0) == (1, 2, torch.device("cuda", 1))
    assert log == [("set_device", 1), ("init_distributed", "nccl", NCCL_ERROR_ENV)]
    assert NCCL_ERROR_ENV == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


# -- DeepSpeed's ops at a GPU launch ----------------------------------------------------------------------------
def test_a_gpu_launch_uses_torch_adamw_and_builds_no_op_unless_asked():
    from tdlm.training.config import RunConfig
    from tdlm.training.ds_config import jit_ops_needed, load_ds_json, resolve_ds_config

    run = RunConfig()
    for name in ("zero2.json", "zero3.json"):
        cfg = resolve_ds_config(load_ds_json(REPO / "ds_configs" / name), run, 8, on_gpu=True)
        assert cfg["optimizer"]["params"]["torch_adam"] is True and jit_ops_needed(cfg, on_gpu=True) == []
    asked = load_ds_json(REPO / "ds_configs" / "zero3.json")
    asked["optimizer"]["params"]["torch_adam"] = False  # FusedAdam on purpose: the build is announced, as before
    assert jit_ops_needed(resolve_ds_config(asked, run, 8, on_gpu=True), on_gpu=True) == ["fused_adam"]
    offload = resolve_ds_config(load_ds_json(REPO / "ds_configs" / "zero3_offload.json"), run, 8, on_gpu=True)
    assert jit_ops_needed(offload, on_gpu=True) == ["cpu_adam"]  # DeepSpeedCPUAdam stays the offload optimizer


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_an_offloaded_optimizer_keeps_deepspeed_cpu_adam_on_either_offload_device(tmp_path, device):
    """ZeRO offloads the optimizer to the CPU or, through the CPU, to NVMe: both step with DeepSpeedCPUAdam, so
    neither gets torch_adam (which would replace it) and both announce the cpu_adam build, never fused_adam."""
    from tdlm.training.config import RunConfig
    from tdlm.training.ds_config import jit_ops_needed, load_ds_json, resolve_ds_config

    raw = load_ds_json(REPO / "ds_configs" / "zero3_offload.json")
    raw["zero_optimization"]["offload_optimizer"] = {"device": device, "pin_memory": True,
                                                     **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
    cfg = resolve_ds_config(raw, RunConfig(), 8, on_gpu=True)
    assert "torch_adam" not in cfg["optimizer"]["params"]
    assert jit_ops_needed(cfg, on_gpu=True) == ["cpu_adam"]


# -- NCCL errors ------------------------------------------------------------------------------------------------
def test_nccl_error_handling_raises_in_python_and_a_users_choice_wins():
    from tdlm.training.distributed import nccl_error_handling

    env: dict[str, str] = {}
    assert nccl_error_handling(env) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}  # CleanUpOnly: no SIGABRT
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert nccl_error_handling(env) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


@pytest.mark.parametrize("make", [
    lambda: torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1."),
    lambda: RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, "
                         "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600045 milliseconds"),
    lambda: RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1968, remote process exited or there was a network "
                         "error, NCCL version 2.27.3"),
])
def test_nccl_failures_read_as_a_lost_peer(make):
    from tdlm.training.distributed import first_line, is_peer_failure

    e = make()
    assert is_peer_failure(e)
    assert "\n" not in first_line(e) and len(first_line(e)) < 200


def test_a_cuda_out_of_memory_is_not_a_lost_peer():
    from tdlm.training.distributed import is_peer_failure

    assert not is_peer_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))


# -- torch.compile on CUDA --------------------------------------------------------------------------------------
@pytest.fixture
def triton_present(monkeypatch):
    """``torch.utils._triton.has_triton`` says yes for this test only. The modules check_compile's path imports
    are imported first, under the real one: inductor modules bind ``has_triton`` by name when first imported, and
    one bound to the fake would leave every later compile in this process looking for triton (a test file that
    runs first in its pytest-xdist worker did exactly that to test_compile.py)."""
    import torch.utils._triton as triton_probe

    from tdlm.decoding.loop import check_compile

    check_compile(True, "cpu")
    monkeypatch.setattr(triton_probe, "has_triton", lambda: True)


def test_compile_on_cuda_names_a_missing_c_compiler(monkeypatch, tmp_path, triton_present):
    from tdlm.decoding.loop import check_compile

    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(TDLMError, match=r"^compile=True: triton builds its kernel launcher with a C compiler .* "
                                        r"install gcc or set CC"):
        check_compile(True, "cuda")
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert check_compile(True, "cuda") == ("inductor", None)
    assert check_compile(False, "cuda") is None  # eager needs nothing


def test_compile_on_cuda_names_missing_python_headers(monkeypatch, tmp_path, triton_present):
    import sysconfig

    from tdlm.decoding.loop import check_compile

    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"include": str(tmp_path)})
    with pytest.raises(TDLMError, match=r"this Python's headers are missing .*Python\.h"):
        check_compile(True, "cuda")


# -- timed evaluations compile ----------------------------------------------------------------------------------
def test_the_paper_table_configs_decode_compiled_and_eager_stays_a_flag():
    from tdlm.config import load_config
    from tdlm.evaluation.config import EvalConfig, parse_args

    for name in ("eval_llada_table1.yaml", "eval_dream_table1.yaml"):
        cfg = load_config(EvalConfig, REPO / "configs" / name)
        assert cfg.decode.compile is True and cfg.warmup >= 1, name
        eager = parse_args(["--config", str(REPO / "configs" / name), "--compile", "false"])
        assert eager.decode.compile in (False, "false"), name


def test_cuda_graph_modes_refuse_a_spatial_kv_cache_of_the_dynamic_plan_in_one_line(monkeypatch):
    """reduce-overhead / max-autotune record CUDA graphs; the KV cache the dynamic plan's first refresh creates would
    live in the trees' pool and be overwritten by the next recorded call. Refused before any decode, on every device;
    the static plan allocates it before the first step, at a fixed address."""
    from tdlm.decoding.loop import DecodeConfig

    for mode in ("reduce-overhead", "max-autotune"):
        for cache in ("prefix", "dual"):
            with pytest.raises(TDLMError, match=rf"^compile='{mode}' captures CUDA graphs, which keep the spatial KV "
                                                rf"cache \(cache='{cache}'\) between steps only at a fixed address; "
                                                rf"use storage='static' with it, or compile=True$"):
                DecodeConfig(compile=mode, cache=cache).validate()
            DecodeConfig(compile=mode, cache=cache, storage="static").validate()
        DecodeConfig(compile=mode, cache="none").validate()
    DecodeConfig(compile=True, cache="dual").validate()


@pytest.mark.parametrize("on_gpu", [False, True])
def test_fp16_is_refused_on_every_device(on_gpu):
    from tdlm.training.config import RunConfig
    from tdlm.training.ds_config import load_ds_json, resolve_ds_config

    raw = load_ds_json(REPO / "ds_configs" / "zero3.json")
    raw["fp16"] = {"enabled": True}
    run = RunConfig()
    run.model.dtype = "float32"
    with pytest.raises(TDLMError, match=r"fp16.enabled=true is not supported"):
        resolve_ds_config(raw, run, 8, on_gpu=on_gpu)


def test_an_unindexed_cuda_load_goes_to_the_current_device_not_cuda_0(monkeypatch, tmp_path):
    """safetensors reads device "cuda" as cuda:0; a rank or harness whose current device is cuda:1 would put a
    transient 16 GB copy on GPU 0. The loader names the current device."""
    import tdlm
    import tdlm.models.loading as loading

    seen = []

    class Stop(Exception):
        pass

    def fake_open(path, framework, device):
        seen.append(device)
        raise Stop

    monkeypatch.setattr(loading, "safe_open", fake_open)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    folder = Path(tdlm.__file__).parent / "assets" / "tiny-arith"
    with pytest.raises(Stop):
        loading.load_backbone(str(folder), device="cuda", dtype="float32")
    assert seen == ["cuda:1"]


def test_non_finite_logits_stop_the_decode_in_one_line():
    """fp16 overflows the bf16-trained releases on a GPU: NaN logits would make every greedy token id 0, committed
    without a word. The decode's one host read per evaluation also says whether each row's logits were finite."""
    import tdlm

    bb = tdlm.load_backbone("tiny-arith", dtype="float32")
    ok = tdlm.decode(bb, [[3, 4, 40]], gen_length=8, block_size=8)
    assert ok[0].nfe >= 1
    handle = bb.register_forward_hook(lambda m, i, out: out * float("nan"))
    try:
        with pytest.raises(TDLMError, match=r"^decode: the backbone's logits are not finite \(NaN\) at evaluation 1 "
                                            r"of 1 row\(s\), dtype torch.float32; float16 overflows"):
            tdlm.decode(bb, [[3, 4, 40]], gen_length=8, block_size=8)
    finally:
        handle.remove()

"""GPU placement of the Ray generation replicas and evaluation workers, proven on a machine without GPUs.

A local Ray cluster that *declares* 2 GPUs (``ray.init(num_gpus=2)``; Ray hands out GPU ids 0 and 1 and sets each
actor's CUDA_VISIBLE_DEVICES whether or not the GPUs exist). The generation pool and the evaluation pool are sized
and started by the drivers' own code (:func:`tdlm.generation.driver.replica_launcher`,
:func:`tdlm.evaluation.driver.num_workers` / :func:`~tdlm.evaluation.driver.worker_launcher`), and each actor says
from inside (its ``placement()``) what Ray gave it and where its replica went: its own GPU, i.e. CUDA_VISIBLE_DEVICES
"0" for one actor and "1" for the other, ``ray.get_gpu_ids()`` equal to it, and the device ``cuda:0`` (the only one
it sees), never ``cuda:<actor index>``. Without CUDA the load onto cuda:0 then fails inside the actor; the worker
keeps that error (its ``info()`` would raise it), which shows it really tried the GPU. The driver process itself sees
no GPU here, so the pools' size comes from the cluster's resources, as on a head node without GPUs.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from tdlm.models.placement import actor_device

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
DECLARED_GPUS = 2


def test_actor_device_outside_ray(monkeypatch):
    """In-process (no Ray actor; the driver's own view): an explicit device wins, else the first GPU torch sees,
    else the CPU."""
    assert actor_device("cpu") == "cpu"
    assert actor_device("cuda:3") == "cuda:3"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert actor_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert actor_device() == "cuda:0"


@pytest.fixture(scope="module")
def gpu_cluster():
    """In-process cluster with 2 CPUs and 2 declared (absent) GPUs; short temp dir (AF_UNIX paths <= 107 bytes)."""
    ray = pytest.importorskip("ray")
    temp = f"/tmp/ray_tdlm_gpu_{os.getpid()}"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in RAY_ENV.items():
            mp.setenv(k, v)
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # Ray would hand out only the ids listed there
        ray.init(address="local", num_cpus=2, num_gpus=DECLARED_GPUS, include_dashboard=False,
                 object_store_memory=200 * 1024**2, _temp_dir=temp, logging_level=logging.WARNING)  # fmt: skip
        try:
            assert ray.cluster_resources().get("GPU") == DECLARED_GPUS
            yield ray
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


def _placements(ray, actors: list) -> list[dict]:
    try:
        return ray.get([a.placement.remote() for a in actors], timeout=90)
    finally:
        for a in actors:  # frees the GPUs for the next pool
            ray.kill(a, no_restart=True)


def assert_own_gpu_each(placements: list[dict]) -> None:
    """Every actor sees exactly its own GPU, and places its replica on cuda:0 of that view."""
    assert len(placements) == DECLARED_GPUS, placements
    assert sorted(p["cuda_visible_devices"] or "" for p in placements) == ["0", "1"], placements  # distinct, its own
    for p in placements:
        assert p["ray_gpu_ids"] == [p["cuda_visible_devices"]], p  # what Ray says it gave == what the actor sees
        assert p["device"] == "cuda:0", p  # its own GPU: the only one visible, whatever the actor's index
        # No CUDA here: the load onto cuda:0 failed inside the actor (on a GPU node: no error).
        assert p["error"] is None or "CUDA" in p["error"] or "cuda" in p["error"], p


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_generation_replicas_get_one_gpu_each(gpu_cluster, tmp_path):
    from tdlm.generation.config import GenerationConfig
    from tdlm.generation.driver import replica_launcher

    cfg = GenerationConfig(backbone="tiny-llada", prompts=str(tmp_path / "unused.jsonl"), output_dir=str(tmp_path))
    n, resources, launch = replica_launcher(cfg, shards_todo=8)
    assert n == DECLARED_GPUS, (n, resources)  # one replica per cluster GPU
    assert_own_gpu_each(_placements(gpu_cluster, [launch() for _ in range(n)]))
    assert resources.get("num_gpus") == 1, resources


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_evaluation_workers_get_one_gpu_each(gpu_cluster, tmp_path):
    from tdlm.evaluation.config import EvalConfig
    from tdlm.evaluation.driver import num_workers, worker_launcher

    cfg = EvalConfig(backbone="tiny-llada", output_dir=str(tmp_path))
    n = num_workers(cfg)  # the cluster's GPUs, although this driver process sees none here
    assert n == DECLARED_GPUS, n
    opts, launch = worker_launcher(cfg, n)
    assert_own_gpu_each(_placements(gpu_cluster, [launch() for _ in range(n)]))
    assert opts.get("num_gpus") == 1, opts

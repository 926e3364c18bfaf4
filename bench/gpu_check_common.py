"""What the GPU check's processes share: the stage JSONs' reader and writer, the stage order, and which prediction
rows of ``bench/results/true_shape.json`` a GPU is held to.

A leaf module (standard library only, imports nothing of ``bench/``): the parent (``gpu_check.py``), its stage child
(``gpu_check_stages.py``) and the comparison (``gpu_check_compare.py``) all import it, so none of them has to import
another that imports it back (tests/test_layers.py holds the whole tree to no import cycle).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREDICTION = ROOT / "bench" / "results" / "true_shape.json"
STAGE_ORDER = ("train", "deepspeed", "nfe")
# What host_us_per_launch means: the launch profile writes it into its rows, the comparison prints it as the source.
HOST_US_PER_LAUNCH_IS = (
    "host wall inside the compiled regions / the kernels launched there: the host's issue interval per kernel, "
    "which bench/true_shape.py's launch term means (step_ms adds kernels x launch_us; overlapped_ms issues one "
    "kernel every launch_us). The launch API call alone (launch_api_us_mean) leaves out what the host also spends "
    "between two launches (inductor's Python wrapper, argument packing); the profiler's per-launch callbacks add to "
    "both, so both are upper bounds of the unprofiled cost")


# Each decode mode timed against another of the same (model, batch, cache), one factor apart: reduce-overhead
# (CUDA graphs, storage="static") against compile=True on the same static plan, so the ratio is the CUDA graphs'
# alone; compile=True static against compile=True dynamic, the storage plan's alone. (reduce-overhead against the
# dynamic compile=True would mix the two.) The stage child's summary and the comparison both pair by this.
RATIOS = (("reduce-overhead", "compiled-static"), ("compiled-static", "compiled"))


# -- the stage JSONs: the parent, the child and the comparison read and write them ----------------------------
def write_json(path: Path, obj: dict) -> None:
    """Atomic: a reader (or a kill) sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# -- GPU identity: which prediction rows apply ----------------------------------------------------------------
# The GPUs bench/true_shape.py computes time predictions for (its GPUS; true_shape.json's "gpus" names the same).
GPU_KINDS = ("h200", "gh200", "h100")


def gpu_kind(name: str | None) -> str | None:
    """"h200", "gh200" or "h100" (the rows of bench/true_shape.py's GPUS), or None: a GPU whose time the
    predictions do not model. A GH200's name contains "H200" too, so it is tested first. An H200 NVL runs at a
    lower power limit than the SXM part the H200 rows assume (989 TFLOP/s, 4.8 TB/s); an H100 PCIe (756 TFLOP/s,
    2.0 TB/s) and an H100 NVL (3.9 TB/s, 94 GB) are not the SXM part the H100 rows assume (989 TFLOP/s, 3.35 TB/s,
    80 GB, reported as "NVIDIA H100 80GB HBM3")."""
    n = (name or "").upper()
    if "GH200" in n:
        return "gh200"
    if "H200" in n and "NVL" not in n:
        return "h200"
    if "H100" in n and "NVL" not in n and "PCIE" not in n:
        return "h100"
    return None


def _for_gpu(value, kind: str | None):
    """A prediction value kept per GPU ({"h200": ..., "h100": ...}) -> this GPU's (None for an unknown GPU); any
    other value as it is."""
    if isinstance(value, dict) and (set(GPU_KINDS) & set(value)):
        return value.get(kind) if kind else None
    return value


def select_predictions(pred: dict, kind: str | None) -> dict:
    """The prediction rows that hold for a GPU of ``kind`` (None: none do), from true_shape.json:

    GPU-independent, given for every GPU (an unknown one included: a memory peak, a kernel count or the planner's
    figure does not depend on which GPU runs it):

    * ``decode_memory``: bytes of a decode, keyed (model, policy, history, cache, batch);
    * ``kernels``: kernels per NFE of the compiled graphs (bench/dispatch_count.py), per model;
    * ``launch_us``: the stated host cost of one launch (the host's, not the GPU's).

    The time rows, only for a GPU of ``kind`` (None, an unknown GPU: none):

    * ``gpu_check``: ms per NFE of the nfe stage's settings, keyed (model, batch, cache); a row's GPU is its own
      ``gpu`` field, else its section's;
    * ``per_nfe``: ``nfe.<model>.per_nfe_ms`` (prompt 256 + 256, batch 1), keyed (model, label, cache) -> the
      {graphs, launch, overlap, eager} of this GPU;
    * ``launch_us_at_target``: the launch cost each target holds up to on this GPU (a roofline time)."""
    out: dict = {"kind": kind, "gpu_check": {}, "per_nfe": {}, "decode_memory": {}, "kernels": {},
                 "launch_us": pred.get("launch_us"), "launch_us_at_target": {}}  # fmt: skip
    for model, n in (pred.get("nfe") or {}).items():
        out["kernels"][model] = n.get("compiled_kernels") or {}
    for model, m in (pred.get("decode_memory") or {}).items():
        for r in m.get("rows", []):
            out["decode_memory"][(model, r["policy"], r.get("history"), r["cache"], r["batch"])] = r
    if kind is None:
        return out
    sec = pred.get("gpu_check") or {}
    for r in sec.get("rows", []):
        if r.get("gpu", sec.get("gpu")) == kind:
            out["gpu_check"][(r["model"], r["batch"], r["cache"])] = r
    for model, n in (pred.get("nfe") or {}).items():
        for key, v in (n.get("per_nfe_ms") or {}).items():
            label, cache = key.split("|")
            if _for_gpu(v, kind) is not None:
                out["per_nfe"][(model, label, cache)] = _for_gpu(v, kind)
        # per GPU where the file has it; an older file's single table was computed for the H200
        by_gpu = n.get("launch_us_at_target_by_gpu") or {"h200": n.get("launch_us_at_target") or {}}
        out["launch_us_at_target"][model] = by_gpu.get(kind) or {}
    return out

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
def gpu_kind(name: str | None) -> str | None:
    """"h200" or "gh200" (the rows of bench/true_shape.py's GPUS), or None: a GPU the predictions do not model.
    A GH200's name contains "H200" too, so it is tested first; an H200 NVL runs at a lower power limit than the
    SXM part the H200 rows assume (989 TFLOP/s, 4.8 TB/s)."""
    n = (name or "").upper()
    if "GH200" in n:
        return "gh200"
    if "H200" in n and "NVL" not in n:
        return "h200"
    return None


def _for_gpu(value, kind: str):
    """A prediction value kept per GPU ({"h200": ..., "gh200": ...}) -> this GPU's; any other value as it is."""
    if isinstance(value, dict) and ({"h200", "gh200"} & set(value)):
        return value.get(kind)
    return value


def select_predictions(pred: dict, kind: str | None) -> dict:
    """The prediction rows that hold for a GPU of ``kind`` (None: none do), from true_shape.json:

    * ``gpu_check``: ms per NFE of the nfe stage's settings, keyed (model, batch, cache); a row's GPU is its own
      ``gpu`` field, else its section's (today the section is "h200");
    * ``per_nfe``: ``nfe.<model>.per_nfe_ms`` (prompt 256 + 256, batch 1), keyed (model, label, cache) -> the
      {graphs, launch, overlap, eager} of this GPU;
    * ``decode_memory``, ``kernels``, ``launch_us``: device-independent counts and the stated launch cost, given
      only for a known GPU (an unknown one is compared with nothing)."""
    out: dict = {"kind": kind, "gpu_check": {}, "per_nfe": {}, "decode_memory": {}, "kernels": {}, "launch_us": None,
                 "launch_us_at_target": {}}  # fmt: skip
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
        out["kernels"][model] = n.get("compiled_kernels") or {}
        out["launch_us_at_target"][model] = n.get("launch_us_at_target") or {}
    for model, m in (pred.get("decode_memory") or {}).items():
        for r in m.get("rows", []):
            out["decode_memory"][(model, r["policy"], r.get("history"), r["cache"], r["batch"])] = r
    out["launch_us"] = pred.get("launch_us")
    return out

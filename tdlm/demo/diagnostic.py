"""The demo's diagnostic (:mod:`tdlm.decoding.prediction_history`): does a position that stays masked keep its
earlier predictions? Computed for the backbone and for TDLM, cached per adapter file and plan, and rendered for the
report."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from tdlm.data.toy_trajectories import DTYPE
from tdlm.demo.findings import BASELINE_TAU
from tdlm.demo.plan import DEMO_BACKBONE, DemoPlan


def run_diagnostic(adapter: Path, plan: DemoPlan, min_masked: int = 3) -> list[dict]:
    """Prediction-change statistics (tdlm.decoding.prediction_history) on the first test problems, backbone and TDLM.

    Both decode with the threshold rule at tau 0.9 (threshold with the plain backbone, tdlm with the adapter), so
    the only difference is the temporal path; content positions only (the final token is not end-of-text / EOS).
    """
    import torch

    from tdlm.data.tokenizer import encode_prompts, load_tokenizer, stop_token_ids
    from tdlm.decoding.prediction_history import change_statistics, decode_histories
    from tdlm.models.loading import load_backbone
    from tdlm.tasks.multi import load_split
    from tdlm.temporal.model import TDLM

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    task = load_split("test", plan.diagnostic_problems)
    bb = load_backbone(DEMO_BACKBONE, dtype=DTYPE)
    tok = load_tokenizer(DEMO_BACKBONE)
    stop = stop_token_ids(tok, bb.eos_token_id)
    excluded = sorted(stop | {bb.pad_token_id})
    prompts = encode_prompts(tok, [p.prompt for p in task])
    rows = []
    for label, model, policy in (("backbone (threshold)", bb, "threshold"),
                                 ("TDLM", TDLM.from_adapter(bb, adapter), "tdlm")):
        t0 = time.time()
        _, histories = decode_histories(model, prompts, policy, BASELINE_TAU, plan.block_size, plan.block_size,
                                        tokenizer=tok, stop_ids=stop, batch_size=plan.eval_batch_size)
        stats = change_statistics(histories, min_masked, exclude_tokens=excluded)
        rows.append({"method": label, "policy": policy, "tau": BASELINE_TAU, "problems": len(task), **stats})
        print(f"diagnostic {label}: {stats['positions']} positions masked >= {min_masked} evaluations "
              f"({time.time() - t0:.0f} s)", flush=True)
    return rows


def _lags(row: dict) -> dict[int, float]:
    """``final_equals_lag`` with int keys (int in process, str after a JSON round trip)."""
    return {int(k): v for k, v in row["final_equals_lag"].items()}


def diagnostic_summary(rows: list[dict]) -> str:
    """One sentence per decoder from the diagnostic rows (numbers of this run only)."""
    parts = []
    for r in rows:
        if not r.get("positions"):
            parts.append(f"{r['method']}: no position stayed masked three or more evaluations.")
            continue
        lags = _lags(r)
        text = (f"{r['method']}: {r['positions']} positions waited {r['mean_masked_evaluations']:.1f} evaluations on "
                f"average and {100 * r['changed']:.0f}% of them changed their argmax while masked; the committed token "
                f"was the first evaluation's argmax {100 * r['final_equals_first']:.0f}% of the time")
        if 1 in lags:
            text += f", the previous evaluation's {100 * lags[1]:.0f}%"
        parts.append(text + ".")
    return " ".join(parts)


def diagnostic_table(rows: list[dict]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = ["| decoder (tau 0.9) | positions | mean evaluations masked | argmax changed | final = argmax of "
             "each earlier evaluation | final = first argmax | final = argmax at a-1 / a-2 / a-4 / a-8 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["positions"]:
            lines.append(f"| {r['method']} | 0 | | | | | |")
            continue
        lags = " / ".join(pct(_lags(r).get(k)) for k in (1, 2, 4, 8))
        lines.append(f"| {r['method']} | {r['positions']} | {r['mean_masked_evaluations']:.1f} | "
                     f"{pct(r['changed'])} | {pct(r['final_equals_earlier'])} | {pct(r['final_equals_first'])} | "
                     f"{lags} |")
    return "\n".join(lines)


def cached_diagnostic(path: Path, adapter: Path, plan: DemoPlan) -> tuple[dict, list[dict] | None]:
    """(key, rows) where rows come from ``path`` when it was computed for this adapter file and plan."""
    key = {"adapter_sha256": hashlib.sha256((adapter / "adapter.safetensors").read_bytes()).hexdigest(),
           "problems": plan.diagnostic_problems, "tau": BASELINE_TAU, "block_size": plan.block_size}
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return key, None
    return key, (saved.get("rows") if saved.get("key") == key else None)

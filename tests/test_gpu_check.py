"""bench/gpu_check.sh --dry-run: every stage of the prepared GPU check runs at toy size on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_every_stage(tmp_path):
    env = os.environ | {"OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stages = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("gpu_*_dryrun.json")}
    assert set(stages) == {"gpu_train_dryrun.json", "gpu_nfe_dryrun.json", "gpu_deepspeed_dryrun.json"}
    assert all(s["status"] == "ok" for s in stages.values()), {k: s.get("error") for k, s in stages.items()}
    train = stages["gpu_train_dryrun.json"]
    assert [r["layers"] for r in train["rows"]] == ["all", "dispersed:4"]
    for row in train["rows"]:  # measured peak of real steps next to the plan
        assert row["status"] == "ok" and 0.75 <= row["ratio"] <= 1.25, row
    nfe = stages["gpu_nfe_dryrun.json"]["rows"]  # tdlm.decode: both models, batch 1 / 8, caches, eager / compiled
    settings = {(r["model"], r["batch"], r["cache"], r["mode"]) for r in nfe}
    assert {(m, b, c, "eager") for m in ("llada-8b", "dream-7b") for b in (1, 8) for c in ("none", "dual")} <= settings
    assert ("llada-8b", 1, "none", "compiled") in settings
    for r in nfe:
        assert r["tdlm_over_backbone"] > 0 and r["threshold_nfe"] == r["tdlm_nfe"], r
        assert len(r["tdlm_nfe"]) == r["batch"]
        if r["mode"] == "compiled":  # the launch profile (on a CPU: operator events, no device kernels)
            for policy in ("threshold", "tdlm"):
                prof = r[f"{policy}_launches"]
                assert prof["nfe"] == max(r[f"{policy}_nfe"]) and prof["cpu_events_per_nfe"] > 0, prof
    ds = stages["gpu_deepspeed_dryrun.json"]
    assert ds["zero_stage"] == 3 and len(ds["losses"]) == 3 and all(x == x for x in ds["losses"])


def test_a_failing_stage_is_recorded_and_the_next_still_runs(tmp_path):
    env = os.environ | {"OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    code = ("import sys\n"
            "import bench.gpu_check as g\n"
            "def boom(ctx): raise RuntimeError('planted')\n"
            "g.STAGES['train'] = boom\n"
            "raise SystemExit(g.main(['--dry-run', '--stages', 'train,nfe']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    train = json.loads((tmp_path / "gpu_train_dryrun.json").read_text())
    assert train["status"] == "failed" and "planted" in train["error"]
    assert json.loads((tmp_path / "gpu_nfe_dryrun.json").read_text())["status"] == "ok"

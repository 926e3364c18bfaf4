"""Allocation sweeps: the sweep config and its W&B sweep file, and a two-allocation sweep end to end on the embedded
tiny-arith default (real 2-rank DeepSpeed launches, the real evaluator, W&B offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tdlm.errors import TDLMError
from tdlm.sweep import grid, load_sweep_config, plan, table4, wandb_sweep_spec, wandb_sweep_yaml
from tdlm.temporal.attention import temporal_parameter_count

REPO = Path(__file__).resolve().parents[1]
TINY = "configs/sweep_tiny.yaml"


def _env() -> dict:
    return os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "DS_ACCELERATOR": "cpu",
                         "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _sweep(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launcher/sweep.py", *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_sweep_config_plans_every_allocation_and_names_bad_ones(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_sweep_config(TINY)
    p = plan(cfg, "middle:3", TINY)
    assert p.layers == [1, 2, 3] and p.slug == "middle-3" and p.num_layers == 6
    assert p.parameters == temporal_parameter_count(128, 3, 2, 32)  # L_t (4 d d_t + 1)
    assert plan(cfg, "3", TINY).layers == [3]  # an explicit index, not a number
    with pytest.raises(TDLMError, match=r"^configs/sweep_tiny.yaml: allocations: 'dispersed:8' on tiny-arith: .*1..6"):
        plan(cfg, "dispersed:8", TINY)
    with pytest.raises(TDLMError, match=r"train_overrides must be free of model.layers"):
        load_sweep_config(TINY, ["train_overrides=[model.layers=all]"])
    with pytest.raises(TDLMError, match=r"eval.baselines must be a list of original, threshold, entropy, credit, soft"):
        load_sweep_config(TINY, ["eval.baselines=[tdlm]"])
    with pytest.raises(TDLMError, match=r"^override 'allocation=all': unknown key 'allocation'; did you mean "
                                        r"'allocations'\?$"):
        load_sweep_config(TINY, ["allocation=all"])
    default = load_sweep_config("configs/sweep_llada_table4.yaml")
    assert default.allocations == ["dispersed:8", "middle:16", "dispersed:16", "all"]  # Table 4


def test_sweep_override_mistakes_blame_the_override_and_file_mistakes_name_file_and_key(monkeypatch, tmp_path):
    """Issue 30: an override's mistake was reported as the sweep YAML's (``configs/sweep_tiny.yaml.eval: ...``)."""
    monkeypatch.chdir(REPO)
    for override, pattern in (
        ("eval.limt=50", r"^override 'eval.limt=50': unknown key 'eval.limt'; did you mean 'eval.limit'\?$"),
        ("eval.limit=many", r"^override 'eval.limit=many': expected an integer or null; got 'many'$"),
        ("eval.thresholds=[1.5]", r"^override 'eval.thresholds=\[1.5\]': eval.thresholds must be a non-empty list "
                                  r"of taus in \[0, 1\]; got \[1.5\]$"),
        ("experiment=a b", r"^override 'experiment=a b': experiment must be a name"),
        ("ds=nope.json", r"^override 'ds=nope.json': ds must be an existing file; got 'nope.json'$"),
        ("train_overrides=[train.max_steps=many]",
         r"^override 'train_overrides=\[train.max_steps=many\]': item 'train.max_steps=many': expected an integer; "
         r"got 'many'$"),
    ):
        with pytest.raises(TDLMError, match=pattern):
            load_sweep_config(TINY, [override])
    bad = tmp_path / "sweep.yaml"
    bad.write_text((REPO / TINY).read_text().replace("  limit: 200", "  limt: 200"))
    with pytest.raises(TDLMError, match=rf"^{bad}: unknown key\(s\) \['eval.limt'\]; allowed in eval: .*did you mean "
                                        r"'eval.limit'\?$"):
        load_sweep_config(bad)
    bad.write_text((REPO / TINY).read_text().replace("train.max_steps=100", "train.max_stpes=100"))
    with pytest.raises(TDLMError, match=rf"^{bad}: train_overrides 'train.max_stpes=100': unknown key\(s\) "
                                        r"\['train.max_stpes'\].*did you mean 'train.max_steps'\?$"):
        load_sweep_config(bad)


def test_wandb_sweep_file_runs_the_trial_command_the_local_runner_runs(monkeypatch):
    monkeypatch.chdir(REPO)
    for path in (TINY, "configs/sweep_llada_table4.yaml"):
        cfg = load_sweep_config(path)
        shipped = (REPO / path.replace(".yaml", ".wandb.yaml")).read_text()
        assert shipped == wandb_sweep_yaml(cfg, path), f"regenerate it: launcher/sweep.py wandb-file --config {path}"
        spec = yaml.safe_load(shipped)
        assert spec["method"] == "grid" and spec["program"] == "launcher/sweep.py" and spec["project"] == cfg.project
        assert [p["allocation"] for p in grid(spec, path)] == cfg.allocations
    from tdlm.sweep.runner import agent_command

    spec = wandb_sweep_spec(load_sweep_config(TINY), TINY, ["eval.limit=5"])
    cmd = agent_command(spec, {"allocation": "middle:3"})
    assert cmd == ["/usr/bin/env", sys.executable, str(REPO / "launcher" / "sweep.py"), "trial", "--config", TINY,
                   "eval.limit=5", "allocation=middle:3"]


def test_failed_training_keeps_its_row_and_the_agents_run_is_the_trials(tmp_path):
    out = tmp_path / "sweep"
    traj = tmp_path / "traj"
    from tdlm.data.toy_trajectories import ensure_toy_trajectories

    ensure_toy_trajectories(traj, "tiny-arith", n=8)
    # a launcher that records the environment training would get, then fails
    launcher = tmp_path / "launch.sh"
    launcher.write_text(f"#!/bin/sh\nenv > {tmp_path / 'train_env.txt'}\nexit 3\n")
    launcher.chmod(0o755)
    agent = {"WANDB_RUN_ID": "agentrun01"}  # what `wandb agent` sets for the run it started this trial for
    cmd = [sys.executable, "launcher/sweep.py", "trial", "--config", TINY, "allocation=all", f"output_dir={out}",
           f"launcher=[{launcher}]", f"train_overrides=[data.trajectories={traj}]"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env() | agent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "WANDB_RUN_ID" not in (tmp_path / "train_env.txt").read_text()  # training gets its own W&B run ...
    assert json.loads((out / "trials" / "all" / "wandb_run.json").read_text())["id"] == "agentrun01"  # ... the trial
    trial = json.loads((out / "trials" / "all" / "trial.json").read_text())
    assert trial["status"] == "training failed" and "exited with status 3" in trial["error"]
    assert "| 6, all (0, 1, 2, 3, 4, 5) | 196,614 | training failed: launcher exited with status 3" in table4(out)
    # the sweep folder now belongs to these settings: a trial with other trajectories is refused, before training
    other = tmp_path / "traj2"
    ensure_toy_trajectories(other, "tiny-arith", n=4)
    proc = _sweep("trial", "--config", TINY, "allocation=all", f"output_dir={out}", "launcher=[/bin/false]",
                  f"train_overrides=[data.trajectories={other}]", "wandb_mode=disabled", timeout=300)
    assert proc.returncode == 2 and "holds a sweep with other settings or trajectories" in proc.stderr
    assert proc.stderr.strip().startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1


def _offline_run(run_dir: Path) -> bytes:
    (f,) = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    return f.read_bytes()


@pytest.mark.slow
def test_two_allocation_sweep_end_to_end(tmp_path):
    from tdlm.data.toy_trajectories import ensure_toy_trajectories

    traj = tmp_path / "traj"
    ensure_toy_trajectories(traj, "tiny-arith", n=16)
    out = tmp_path / "sweep"
    port = str(29600 + os.getpid() % 300)
    proc = _sweep("run", "--config", TINY, "allocations=[dispersed:2, all]", f"output_dir={out}", "eval.limit=6",
                  f"train_overrides=[train.max_steps=6, train.save_every=0, train.micro_batch_size=4, data.states=4, "
                  f"data.trajectories={traj}]", f'launcher=[deepspeed, --num_gpus, "2", --master_port, "{port}"]')
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["trajectories"]["path"] == str(traj.resolve()) and sweep["seeds"] == {"train": 0, "data": 0}
    rows = {}
    for slug, layers in (("dispersed-2", [1, 4]), ("all", [0, 1, 2, 3, 4, 5])):
        trial = json.loads((out / "trials" / slug / "trial.json").read_text())
        assert trial["status"] == "done" and trial["layers"] == layers
        params = temporal_parameter_count(128, len(layers), 2, 32)
        assert trial["temporal_parameters"] == params
        # training: one project, group = the experiment, tags, resolved layers + parameter count, adapter artifact
        train = json.loads((out / "train" / slug / "wandb_run.json").read_text())
        assert (train["project"], train["group"], train["job_type"]) == ("tdlm", "tiny-table4", "train")
        alloc = "dispersed:2" if slug != "all" else "all"
        assert train["tags"] == ["backbone:tiny-arith", f"layers:{alloc}", "history:full"]
        assert train["artifacts_logged"] == [f"tdlm-adapter-{train['id']}"]
        raw = _offline_run(out / "train" / slug)
        for needle in (train["id"], "tiny-table4", f"layers:{alloc}", "temporal_parameters", str(params),
                       f"tdlm-adapter-{train['id']}"):
            assert needle.encode() in raw, needle
        adapter_cfg = json.loads((out / "train" / slug / "adapter" / "tdlm_adapter.json").read_text())
        assert adapter_cfg["training"]["wandb"]["id"] == train["id"] and adapter_cfg["layers"] == layers
        # evaluation: same project and group, and it records the training run it evaluates
        (run_dir,) = list((out / "eval" / slug / "runs" / "arith").glob("tdlm-*"))
        ev = json.loads((run_dir / "wandb_run.json").read_text())
        assert (ev["project"], ev["group"], ev["job_type"]) == ("tdlm", "tiny-table4", "eval")
        assert f"layers:{alloc}" in ev["tags"] and "policy:tdlm" in ev["tags"]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["trained_by"]["id"] == train["id"]
        assert summary["trained_by"]["run_dir"] == str((out / "train" / slug).resolve())
        assert b"trained_by" in _offline_run(run_dir) and train["id"].encode() in _offline_run(run_dir)
        rows[slug] = summary
        # the trial's own W&B run (the sweep's run under `wandb agent`) carries the sweep metric
        sweep_run = json.loads((out / "trials" / slug / "wandb_run.json").read_text())
        assert sweep_run["job_type"] == "sweep-trial" and sweep_run["group"] == "tiny-table4"
        assert b"accuracy" in _offline_run(out / "trials" / slug)
        card = (out / "train" / slug / "adapter" / "README.md").read_text()
        assert "**TDLM τ=0.9**" in card and "Original (one token per step)" in card
    # Table 4 from the local JSON alone
    cmp = subprocess.run([sys.executable, "eval/compare.py", str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert cmp.returncode == 0, cmp.stderr
    assert "| Temporal layers | Parameters | Accuracy (%) | NFE | Avg. sec | Speedup |" in cmp.stdout
    original = json.loads(next((out / "eval" / "baselines" / "runs" / "arith").glob("original/summary.json"))
                          .read_text())
    for slug, name in (("dispersed-2", "2, dispersed (1, 4)"), ("all", "6, all (0, 1, 2, 3, 4, 5)")):
        r = rows[slug]
        params = f"{temporal_parameter_count(128, len(r['allocation']['layers']), 2, 32):,}"
        line = (f"| {name} | {params} | {100 * r['accuracy']:.2f} | {r['nfe_mean']:.2f} | {r['seconds_mean']:.3f} | "
                f"{original['seconds_mean'] / r['seconds_mean']:.2f}× |")
        assert line in cmp.stdout, (line, cmp.stdout)
    assert (out / "table4.md").read_text() in cmp.stdout
    # the comparison figure: both allocations against the baselines, redrawn by each trial and by `run`
    assert (out / "pareto_arith.png").stat().st_size > 10_000
    last = json.loads((out / "trials" / "all" / "trial.json").read_text())
    assert last["sweep_plots"] == [str(out / "pareto_arith.png")]

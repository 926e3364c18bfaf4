"""First contact with the training launcher under a real ``deepspeed --num_gpus 2`` launch: an input error is one
line, printed once (by rank 0), before any process group or DeepSpeed engine exists; checkpoint rotation and the
stop request in-process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tdlm.errors import TDLMError
from tdlm.training.ds_config import load_ds_json
from tdlm.training.run_dir import STOP_SIGNALS, SUMS, StopRequest, rotate_checkpoints, write_checksums

REPO = Path(__file__).resolve().parents[1]
Z3 = REPO / "ds_configs" / "zero3.json"


def _deepspeed(tmp: Path, name: str, *args: str) -> subprocess.Popen:
    env = os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu",
                        "PYTHONUNBUFFERED": "1"}
    port = str(29100 + (os.getpid() + len(name)) % 300)
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", port,
           str(REPO / "launcher" / "train.py"), "--config", str(REPO / "configs" / "tiny.yaml"),
           "--output-dir", str(tmp / name), *args]
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.mark.slow
def test_deepspeed_launch_reports_an_input_error_once_before_any_process_group(tmp_path):
    """A DS JSON typo and a bad run-config field, each under `deepspeed --num_gpus 2` (both launches at once, to keep
    the suite short): the one-line error appears once - rank 0's -, no rank prints a traceback or starts a process
    group, and the command exits with status 2."""
    raw = load_ds_json(Z3)
    raw["zero_optimisation"] = raw.pop("zero_optimization")
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps(raw))
    cases = {
        "ds": (["--ds", str(typo)],
               f"error: {typo}: unknown DeepSpeed key 'zero_optimisation'; did you mean 'zero_optimization'?"),
        "field": (["--ds", str(Z3), "optim.beta1=1.5"],
                  f"error: {REPO / 'configs' / 'tiny.yaml'}: optim.beta1 must be in [0, 1); got 1.5"),
    }
    procs = {name: _deepspeed(tmp_path, name, *args) for name, (args, _) in cases.items()}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        want = cases[name][1]
        assert proc.returncode == 2, out[-3000:]
        ours = [line for line in out.splitlines() if not line.startswith("[20")]  # DeepSpeed's runner's own lines
        errors = [line for line in ours if "error:" in line]
        assert errors == [want], out[-3000:]  # once: rank 1 kept its copy to itself
        assert "Traceback" not in out and "rank 1:" not in out, out[-3000:]
        # no process group, no engine: nothing of torch.distributed / DeepSpeed's initialisation ran on a rank
        assert "Initializing TorchBackend" not in out and "DeepSpeed info" not in out, out[-3000:]
        assert not (tmp_path / name / "run_config.json").exists()


def _tag(ckpt: Path, step: int) -> Path:
    d = ckpt / f"step-{step}"
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(f"weights {step}".encode())
    write_checksums(d)
    return d


def test_rotation_keeps_the_newest_and_deletes_only_after_the_new_one_verified(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for s in (8, 16):
        _tag(ckpt, s)
    (ckpt / "latest").write_text("step-16")
    new = _tag(ckpt, 24)
    (new / "mp_rank_00_model_states.pt").write_bytes(b"weights 99")  # same size, other bytes: does not verify
    with pytest.raises(TDLMError, match="sha256"):
        rotate_checkpoints(ckpt, "step-24", keep_last=2)
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-16", "step-24", "step-8"]  # nothing deleted
    (new / "mp_rank_00_model_states.pt").write_bytes(b"weights 24")
    assert rotate_checkpoints(ckpt, "step-24", keep_last=2) == ["step-8"]
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-16", "step-24"]
    _tag(ckpt, 32)
    (ckpt / "latest").write_text("step-16")
    assert rotate_checkpoints(ckpt, "step-32", keep_last=1) == ["step-24", "step-16"]
    assert (ckpt / "latest").read_text() == "step-32" and (ckpt / "step-32" / SUMS).exists()
    _tag(ckpt, 40)
    assert rotate_checkpoints(ckpt, "step-40", keep_last=0) == []  # 0 = keep all


def test_stop_request_records_the_first_signal_only():
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        stop = StopRequest().install()
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # the handler runs between bytecodes of the main thread
        os.kill(os.getpid(), signal.SIGTERM)  # what DeepSpeed's launch.py sends after a Ctrl-C
        time.sleep(0.05)
        assert stop.requested and stop.signum == signal.SIGUSR1
        assert StopRequest().install(pending=signal.SIGINT).signum == signal.SIGINT  # caught during the imports
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def test_run_config_checks_the_checkpoint_fields():
    from tdlm.config import from_dict
    from tdlm.training import validate_run
    from tdlm.training.config import RunConfig

    for field, value, want in (("save_every_minutes", -1, ">= 0 (0 = off)"),
                               ("keep_last", -2, ">= 0 (0 = keep every checkpoint)")):
        run = from_dict(RunConfig, {"train": {field: value}}, "x.yaml")
        with pytest.raises(TDLMError, match=rf"x.yaml: train.{field} must be {want}".replace("(", r"\(")
                           .replace(")", r"\)")):
            validate_run(run, "x.yaml")


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # the Tracker's setdefault must not leak into other tests
    # wandb.init exports WANDB_SERVICE (its in-process service's socket) into os.environ; set-then-delete makes
    # monkeypatch remove it again at teardown, or every later subprocess (DeepSpeed ranks) would try a socket
    # that the service-killing test below has closed
    monkeypatch.setenv("WANDB_SERVICE", "")
    monkeypatch.delenv("WANDB_SERVICE")
    yield tmp_path
    import wandb

    wandb.teardown()


def test_a_resumed_tracker_continues_the_wandb_run_and_records_how_each_launch_ended(wandb_dir):
    """Real W&B, offline: a stopped launch closes its run with an exit record; the resume opens the same id."""
    from tdlm.tracking import RUN_RECORD, Tracker, previous_run_id

    run = wandb_dir / "run"
    first = Tracker(run, "tdlm", "g", None, {"a": 1}, "offline")
    first.log({"loss": 1.0}, 1)
    first.stop(1, "preempted", "SIGTERM")
    rid = previous_run_id(run)
    assert rid == first.record["id"]
    time.sleep(1.05 - time.time() % 1)  # W&B names a launch's folder by the second: two launches in one collide
    second = Tracker(run, "tdlm", "g", None, {"a": 1}, "offline", resume_id=rid)
    assert second.run.id == rid
    second.log({"loss": 0.5}, 2)
    second.finish({"steps": 2})
    exits = json.loads((run / RUN_RECORD).read_text())["exits"]
    assert [(e["state"], e["step"], e["exit_code"]) for e in exits] == [("preempted", 1, 75), ("finished", 2, 0)]
    launches = sorted((run / "wandb").glob(f"offline-run-*-{rid}"))
    assert len(launches) == 2
    stopped = next(launches[0].glob("run-*.wandb")).read_bytes()
    assert b"stopped_at_step" in stopped and b"preempted" in stopped


def test_training_goes_on_when_the_wandb_service_dies(wandb_dir, capsys):
    """A preemption's SIGTERM reaches W&B's service too: logging then goes on locally, and the run ends with one
    warning instead of a traceback."""
    import psutil

    from tdlm.tracking import Tracker

    run = wandb_dir / "run"
    tracker = Tracker(run, "tdlm", "g", None, {"a": 1}, "offline")
    tracker.log({"loss": 1.0}, 1)
    (core,) = [p for p in psutil.Process().children(recursive=True) if "wandb-core" in p.name()]
    core.terminate()
    core.wait(30)
    for step in range(2, 5):
        tracker.log({"loss": 1.0 / step}, step)
    tracker.finish({"steps": 4})
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    err = capsys.readouterr().err
    assert "warning: W&B stopped responding during the run" in err and "Traceback" not in err


AGREE = """
import os, signal, time, types
import torch, torch.distributed as dist
from tdlm.training.config import RunConfig
from tdlm.training.distributed import agree_to_stop
from tdlm.training.run_dir import STOP
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
run = RunConfig()
sess = types.SimpleNamespace(run=run, rank=0, device=torch.device("cpu"), saved_at=time.monotonic())
print(agree_to_stop(sess))                       # nothing due
sess.saved_at -= 31 * 60
print(agree_to_stop(sess))                       # 31 minutes since the last checkpoint: train.save_every_minutes=30
run.train.save_every_minutes = 0
print(agree_to_stop(sess))                       # 0 = off
STOP.install(pending=signal.SIGUSR1)
print(agree_to_stop(sess))
"""


def test_the_update_boundary_decides_timed_checkpoints_and_stops(tmp_path):
    """agree_to_stop in a real (one-rank) gloo group: rank 0's clock makes a checkpoint due after
    train.save_every_minutes, 0 turns that off, a received stop signal is what every rank gets back."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PORT": str(29400 + os.getpid() % 500)}
    proc = subprocess.run([sys.executable, "-c", AGREE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:4] == ["(0, False)", "(0, True)", "(0, False)", f"({int(signal.SIGUSR1)}, False)"]


@pytest.mark.slow
def test_ctrl_c_while_the_ranks_meet_ends_at_once_with_one_line(tmp_path):
    """SIGINT while rank 0 waits in the rendezvous for a rank that never comes (a blocking call that never returns to
    Python): nothing is saved yet, so the process ends itself within seconds, with one line and status 75, instead
    of waiting out the rendezvous timeout."""
    from tdlm.data.toy_trajectories import ensure_toy_trajectories
    from tdlm.training.run_dir import EXIT_PREEMPTED

    traj = tmp_path / "traj"
    ensure_toy_trajectories(traj, "tiny-arith", n=4)
    out = tmp_path / "run"
    env = os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu", "RANK": "0",
                        "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(29700 + os.getpid() % 200)}
    proc = subprocess.Popen([sys.executable, str(REPO / "launcher" / "train.py"), "--ds", str(Z3), "--output-dir",
                             str(out), f"data.trajectories={traj}", "train.micro_batch_size=2", "data.states=2"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / ".lock").exists():  # rank 0 holds the folder: validation passed, set-up begins
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    time.sleep(3)  # into deepspeed.init_distributed, waiting for rank 1
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED and time.monotonic() - t0 < 15, err[-2000:]
    lines = [line for line in err.splitlines() if "before the first update" in line]
    assert lines == ["interrupted (SIGINT) before the first update; nothing saved; run the same command again"], err
    assert "Traceback" not in err and not (out / "run_config.json").exists()

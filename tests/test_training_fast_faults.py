"""Fast tests (seconds, no DeepSpeed launch) of the training fault paths that only slow launches reached, or none:

* the stop vote at the update boundary between two real ranks (a one-rank group gives the same answer for every
  reduction op);
* ``train.save_every_minutes`` read in minutes, at its edges;
* a stop right after an earlier checkpoint still saves the step it stops at;
* a full disk inside ``torch.save`` (a ``RuntimeError``, no errno) is exit 74 on every rank, partial tag removed;
* rank 0 lost: the lowest surviving rank names it.

The multi-rank tests run two (three for the lost rank) plain Python processes in a real gloo group
(tests/_fast_fault_rank.py, forked from one server per module so that torch is imported once) that call the real
functions of tdlm.training on a small Session whose engine writes files the way DeepSpeed's does. Each test was seen
failing with its fault planted in tdlm/training (the vote as MIN or SUM, minutes read as seconds, every rank's clock,
a stop that saves only when nothing was saved yet, a write guard that catches only OSError, the partial tag kept,
the lost-peer line printed by rank 0 or by every survivor).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tdlm.training.config import RunConfig
from tdlm.training.distributed import agree_to_stop
from tdlm.training.run_dir import EXIT_NO_SPACE, EXIT_PEER_LOST, STOP
from tdlm.training.session import Session

REPO = Path(__file__).resolve().parents[1]
RANK_BODY = REPO / "tests" / "_fast_fault_rank.py"
pytestmark = pytest.mark.timeout(120)


class RankServer:
    """tests/_fast_fault_rank.py's server: torch and tdlm imported once per module, the ranks of each test forked
    from it (a fresh interpreter per rank costs seconds of imports each, 20 s and more on a loaded machine)."""

    def __init__(self) -> None:
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        self.proc = subprocess.Popen([sys.executable, str(RANK_BODY), "serve"], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=1)
        assert self._reply(180) == {"ready": True}

    def _reply(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"the rank server did not answer within {timeout} s"
        line = self.proc.stdout.readline()
        assert line, f"the rank server died (status {self.proc.poll()})"
        return json.loads(line)

    def run(self, scenario: str, tmp_path: Path, world: int = 2, timeout_s: float = 60.0) -> list[dict]:
        """Ranks 0 .. world-1 of ``scenario``; returns each rank's record."""
        self.proc.stdin.write(json.dumps({"scenario": scenario, "dir": str(tmp_path), "world": world,
                                          "timeout_s": timeout_s}) + "\n")
        status = self._reply(timeout_s + 30)["status"]
        out = []
        for rank in range(world):
            record = tmp_path / f"rank-{rank}.json"
            log = tmp_path / f"rank-{rank}.log"
            text = log.read_text()[-3000:] if log.exists() else ""
            assert record.exists(), f"rank {rank} wrote no record (status {status[rank]}):\n{text}"
            out.append(json.loads(record.read_text()))
        uncaught = [f"rank {rank}: {r['uncaught']}\n{r['traceback']}" for rank, r in enumerate(out) if "uncaught" in r]
        assert not uncaught, "\n".join(uncaught)
        return out

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def ranks():
    server = RankServer()
    try:
        yield server
    finally:
        server.stop()


# -- the vote at the update boundary, between two ranks ---------------------------------------------------------
def test_a_sigterm_on_rank_1_and_rank_0s_clock_reach_every_rank(ranks, tmp_path):
    """Only rank 1 received SIGTERM, only rank 0's clock says a timed checkpoint is due: both ranks must come out
    with (SIGTERM, True) - the maximum. A minimum would outvote the signal and the clock (each is 0 on the other
    rank). Before that, with nothing pending and only rank 1's clock old, both get (0, False): rank 0's clock alone
    decides timed checkpoints. When every rank has the SIGTERM (a preemption signals them all) it is still SIGTERM,
    not a sum of signal numbers."""
    r0, r1 = ranks.run("agree", tmp_path)
    assert r0["own_signal"] is None and r1["own_signal"] == signal.SIGTERM  # the signal reached rank 1 only
    assert r0["quiet"] == r1["quiet"] == [0, False]
    assert r0["split"] == r1["split"] == [int(signal.SIGTERM), True]
    assert r0["both"] == r1["both"] == [int(signal.SIGTERM), False]


# -- train.save_every_minutes: the unit and the edges (rank 0 alone: the clock is rank 0's) ----------------------
@pytest.mark.parametrize(("minutes", "elapsed_s", "due"), [
    (30, 31, False),  # 31 seconds: read as seconds, 30 would already be due
    (30, 29 * 60, False),
    (30, 31 * 60, True),
    (0.5, 29, False),  # fractions of a minute are minutes too
    (0.5, 31, True),
    (0, 10**6, False),  # 0 = off
])
def test_save_every_minutes_is_in_minutes(monkeypatch, minutes, elapsed_s, due):
    """agree_to_stop on rank 0 of a one-rank group (the all-reduce of one rank returns its own flags): a timed
    checkpoint is due once ``train.save_every_minutes`` minutes have passed since the last one, not seconds."""
    import torch.distributed as dist

    ops = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None: ops.append(op))  # one rank: the tensor as it is
    monkeypatch.setattr(STOP, "signum", None)
    run = RunConfig()
    run.train.save_every_minutes = minutes
    sess = Session(run, {}, None, None, None, torch.device("cpu"), 0, 1, None)
    sess.saved_at = time.monotonic() - elapsed_s
    assert agree_to_stop(sess) == (0, due)
    sess.rank = 1  # only rank 0's clock counts (the other ranks vote 0; the all-reduce carries rank 0's)
    assert agree_to_stop(sess) == (0, False)
    assert len(ops) == 2


# -- a stop right after an earlier checkpoint ----------------------------------------------------------------------
def test_a_stop_after_an_earlier_checkpoint_saves_the_step_it_stops_at(ranks, tmp_path):
    """A ``save_every`` save at step 3, then SIGTERM at the next boundary (step 4): every rank saves step-4 (verified,
    ``latest``) and the stop line names step-4. A stop at the step just saved saves nothing twice. After --resume
    from step-4 (saved_step = 4), a stop at step 5 saves step-5."""
    ckpt = tmp_path / "run" / "checkpoints"
    for r in ranks.run("stop_after_checkpoint", tmp_path):
        assert r["after_save"] == {"saved_step": 3, "saves": ["step-3"]}
        stop4 = r["stop4"]
        assert stop4["raised"] == "Stopped" and stop4["step"] == 4, stop4
        assert stop4["saves"] == ["step-3", "step-4"] and stop4["saved_step"] == 4, stop4
        assert stop4["tags"] == ["step-3", "step-4"] and stop4["latest"] == "step-4", stop4
        assert stop4["message"] == (f"preempted at step 4 (SIGTERM; checkpoint {ckpt / 'step-4'}); resume with "
                                    f"--resume"), stop4
        again = r["again4"]
        assert again["raised"] == "Stopped" and again["saves"] == ["step-3", "step-4"], again  # no second save
        assert again["message"] == stop4["message"] and again["latest"] == "step-4", again
        resumed = r["resumed5"]
        assert resumed["raised"] == "Stopped" and resumed["step"] == 5, resumed
        assert resumed["saves"] == ["step-5"] and resumed["saved_step"] == 5, resumed
        assert resumed["tags"] == ["step-3", "step-4", "step-5"] and resumed["latest"] == "step-5", resumed
        assert resumed["message"] == (f"preempted at step 5 (SIGUSR1; checkpoint {ckpt / 'step-5'}); resume with "
                                      f"--resume"), resumed
    for step in (4, 5):
        assert (ckpt / f"step-{step}" / "SHA256SUMS.json").exists()


# -- a full disk inside torch.save --------------------------------------------------------------------------------
def test_a_runtime_error_from_torch_save_on_one_rank_is_exit_74_on_every_rank(ranks, tmp_path):
    """torch.save reports a full disk as ``RuntimeError`` (caffe2's stream writer; no errno). Raised on rank 1 while
    writing step-4: every rank raises RunAborted with exit code 74 (what launcher/train.py returns), rank 0 prints
    one line naming the tag, the rank and the error without its C++ location; the partial step-4 is removed,
    ``latest`` still names step-3, which still verifies, and no rank counts step-4 as saved."""
    ckpt = tmp_path / "run" / "checkpoints"
    r0, r1 = ranks.run("torch_save_fails", tmp_path)
    for r in (r1, r0):  # rank 1's own write failed: what it raised shows first
        assert r["raised"] == "RunAborted" and r["exit_code"] == EXIT_NO_SPACE == 74, r
        assert r["printer"] == 0 and r["message"] == r0["message"], r
        assert r["saved_step"] == 3 and r["saves"] == ["step-3", "step-4"], r
        assert r["tags"] == ["step-3"] and r["latest"] == "step-3", r
    assert r0["step3_verified"] is True
    msg = r0["message"]
    assert msg.startswith(f"{ckpt}: ") and "while saving checkpoint step-4 (rank 1: RuntimeError: " \
        "PytorchStreamWriter failed writing file data/0: file write failed; " in msg, msg
    assert "inline_container.cc" not in msg and "\n" not in msg, msg
    assert "removed the partial step-4; the previous checkpoint step-3 is intact (verified)" in msg, msg
    assert msg.endswith("then resume with --resume"), msg


# -- rank 0 lost ------------------------------------------------------------------------------------------------
def test_rank_0_lost_is_named_by_rank_1(ranks, tmp_path):
    """Three ranks; rank 0 (which also hosts the c10d store) dies before a collective of update 7 and the others'
    collective breaks. The failure counts as a lost peer; each survivor's peer_lost line names rank 0 by host and pid
    and exits 76, and both name rank 1 - the lowest surviving rank - as the one that prints it (launcher/train.py
    prints where RANK == printer): one line, from rank 1, not none (rank 0 is gone) and not two."""
    r0, r1, r2 = ranks.run("rank0_lost", tmp_path, world=3)
    for rank, r in ((1, r1), (2, r2)):
        assert r["peer_failure"] is True, r
        assert r["raised"] == "RunAborted" and r["exit_code"] == EXIT_PEER_LOST == 76, r
        assert r["printer"] == 1, r
        assert r["message"].startswith(f"rank {rank}: lost rank 0 (host {r0['host']}, pid {r0['pid']}) during update "
                                       f"7 ("), r
        assert r["message"].endswith("the newest verified checkpoint is step-4 (2 updates to redo); start every "
                                     "node's command again with --resume"), r

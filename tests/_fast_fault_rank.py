"""Rank body of tests/test_training_fast_faults.py: one process per rank in a real gloo group (no DeepSpeed engine, no
launcher), calling the real training functions on a small :class:`Session` whose engine only writes files the way
``DeepSpeedEngine.save_checkpoint`` does (through ``checkpoint_engine.save`` and ``_copy_recovery_script``, the two
calls ``checkpoint._WriteGuard`` wraps).

    python tests/_fast_fault_rank.py serve

imports torch and tdlm once (~3 s idle, 20 s and more on a loaded 2-core machine), then for each request line
``{"scenario": ..., "dir": ..., "world": 2}`` on stdin forks the ranks (fresh processes, a fresh group on a free
port; nothing has started a thread before the fork), waits for rank 0 first, then the others (so that a rank that
died is reaped and gone from /proc, as on a real node), and answers one line ``{"status": [...]}``. One rank alone:

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/_fast_fault_rank.py SCENARIO DIR

Each rank writes what it saw to ``DIR/rank-<r>.json`` (an uncaught exception as ``{"uncaught": ...}``), its output to
``DIR/rank-<r>.log``, and ends with ``os._exit`` (no gloo thread teardown at exit; see the DeepSpeed-on-CPU notes).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tdlm.tracking import NullTracker  # noqa: E402
from tdlm.training.config import RunConfig  # noqa: E402
from tdlm.training.session import Session  # noqa: E402

GROUP_TIMEOUT_S = 20.0  # a planted fault that leaves one rank waiting fails in seconds, not torch's 30 minutes
# What torch.save raises when the disk fills under it: a RuntimeError with no errno (caffe2's stream writer).
TORCH_SAVE_FULL = ("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/0: "
                   "file write failed")


class FakeCheckpointEngine:
    """DeepSpeed's TorchCheckpointEngine.save; raises ``fail`` (after a partial write) for a path containing
    ``fail_in``."""

    def __init__(self) -> None:
        self.fail_in: str | None = None
        self.fail: BaseException | None = None

    def save(self, state_dict, path: str) -> None:
        if self.fail_in is not None and self.fail_in in path:
            Path(path).write_bytes(b"PK\x03\x04 half a zip")  # torch.save got this far before the disk filled
            raise self.fail
        torch.save(state_dict, path)


class FakeEngine:
    """The file-writing shape of ``DeepSpeedEngine.save_checkpoint``: a barrier, the model states (rank 0), this
    rank's optimizer states, the recovery script (rank 0), a barrier. ``saves`` lists the tags it was asked for."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.checkpoint_engine = FakeCheckpointEngine()
        self.saves: list[str] = []

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        assert save_latest is False  # `latest` is rank 0's, after verifying
        self.saves.append(tag)
        dist.barrier()
        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self.checkpoint_engine.save(state_dict={"module": {"w": torch.ones(3)}, **(client_state or {})},
                                        path=str(path / "mp_rank_00_model_states.pt"))
        self.checkpoint_engine.save({"optimizer_state_dict": {"step": len(self.saves)}},
                                    str(path / f"zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt"))
        if self.rank == 0:
            self._copy_recovery_script(str(path))
        dist.barrier()
        return True

    def _copy_recovery_script(self, save_path):
        (Path(save_path) / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script\n")


def session(rank: int, world: int, out: Path, **train) -> Session:
    run = RunConfig(output_dir=str(out / "run"))
    for key, value in train.items():
        setattr(run.train, key, value)
    return Session(run, {}, FakeEngine(rank), None, None, torch.device("cpu"), rank, world, NullTracker())


def listing(out: Path) -> dict:
    ckpt = out / "run" / "checkpoints"
    latest = ckpt / "latest"
    return {"tags": sorted(p.name for p in ckpt.glob("step-*")),
            "latest": latest.read_text() if latest.exists() else None}


def caught(fn, *args) -> dict:
    """What ``fn(*args)`` raised (type, message, exit code, printer, step), or {"raised": None}."""
    try:
        fn(*args)
    except Exception as e:
        return {"raised": type(e).__name__, "message": getattr(e, "message", str(e)),
                "exit_code": getattr(e, "exit_code", None), "printer": getattr(e, "printer", None),
                "step": getattr(e, "step", None)}
    return {"raised": None}


# -- scenarios ----------------------------------------------------------------------------------------
def agree(rank: int, world: int, out: Path) -> dict:
    """The update boundary's vote, three rounds: nothing pending (only rank 1's clock is old: rank 0's alone counts);
    only rank 1 has a SIGTERM and only rank 0's clock is due; every rank has a SIGTERM (a preemption signals all)."""
    from tdlm.training.distributed import agree_to_stop
    from tdlm.training.run_dir import STOP

    sess = session(rank, world, out)  # save_every_minutes = 30
    now = time.monotonic()
    sess.saved_at = now - 31 * 60 if rank == 1 else now
    quiet = agree_to_stop(sess)
    if rank == 1:
        STOP.install(pending=signal.SIGTERM)
    own = STOP.signum
    sess.saved_at = now - 31 * 60 if rank == 0 else now
    split = agree_to_stop(sess)
    STOP.install(pending=signal.SIGTERM)
    sess.saved_at = now
    both = agree_to_stop(sess)
    return {"quiet": list(quiet), "split": list(split), "both": list(both), "own_signal": own}


def stop_after_checkpoint(rank: int, world: int, out: Path) -> dict:
    """A save_every save at step 3, then a SIGTERM at the boundary before update 5 (step 4): step-4 must be saved.
    Then a stop at step 4 again (saved_step == 4): no second save. Then a new launch "resumed" from step-4 (saved_step
    set as setup does) stopped at step 5: step-5 must be saved."""
    from tdlm.training.checkpoint import save_checkpoint, stop_at_boundary

    res: dict = {}
    sess = session(rank, world, out, keep_last=0)
    save_checkpoint(sess, 3)
    res["after_save"] = {"saved_step": sess.saved_step, "saves": list(sess.engine.saves)}
    res["stop4"] = caught(stop_at_boundary, sess, 4, signal.SIGTERM)
    res["stop4"] |= {"saves": list(sess.engine.saves), "saved_step": sess.saved_step, **listing(out)}
    res["again4"] = caught(stop_at_boundary, sess, 4, signal.SIGTERM)
    res["again4"] |= {"saves": list(sess.engine.saves), **listing(out)}
    resumed = session(rank, world, out, keep_last=0)
    resumed.saved_step = resumed.start_step = 4  # what setup() does after load_checkpoint
    res["resumed5"] = caught(stop_at_boundary, resumed, 5, signal.SIGUSR1)
    res["resumed5"] |= {"saves": list(resumed.engine.saves), "saved_step": resumed.saved_step, **listing(out)}
    return res


def torch_save_fails(rank: int, world: int, out: Path) -> dict:
    """step-3 saved; step-4's torch.save on rank 1 raises RuntimeError (no errno) after a partial write."""
    from tdlm.training.checkpoint import save_checkpoint
    from tdlm.training.run_dir import verify_checksums

    sess = session(rank, world, out, keep_last=1)
    save_checkpoint(sess, 3)
    if rank == 1:
        sess.engine.checkpoint_engine.fail_in = "step-4"
        sess.engine.checkpoint_engine.fail = RuntimeError(TORCH_SAVE_FULL)
    res = caught(save_checkpoint, sess, 4)
    if res["raised"] != "RunAborted":  # the ranks did not fail together: the group is no longer in step
        return res
    dist.barrier()  # rank 0 looks at the folder once every rank is past the failed save
    res |= {"saved_step": sess.saved_step, "saves": list(sess.engine.saves), **listing(out)}
    if rank == 0:
        verify_checksums(out / "run" / "checkpoints" / "step-3")  # raises if the previous one was touched
        res["step3_verified"] = True
    return res


def rank0_lost(rank: int, world: int, out: Path) -> dict:
    """The roll call is taken, then rank 0 dies (os._exit) before a collective of update 7; the others' collective
    (a broadcast from rank 0: each survivor hears of the loss at once, none waits on another survivor) breaks and
    each names the lost rank with peer_lost."""
    from tdlm.training.distributed import broadcast_launch_id, is_peer_failure, peer_lost
    from tdlm.training.run_dir import RollCall

    sess = session(rank, world, out, dist_timeout_s=5.0)
    sess.roll = RollCall(sess.run.output_dir, broadcast_launch_id(sess.device), rank, world)
    sess.saved_step, sess.step = 4, 6
    dist.barrier()  # every roll-call record is written
    if rank == 0:
        (out / "rank-0.json").write_text(json.dumps({"pid": os.getpid(), "host": sess.roll.host}))
        sys.stdout.flush()
        os._exit(9)  # a node lost: no Python teardown, no goodbye to the group
    try:
        dist.broadcast(torch.ones(1), src=0)
    except Exception as e:
        error = e
    else:
        return {"collective": "returned"}
    aborted = peer_lost(sess, error)
    return {"peer_failure": is_peer_failure(error), "raised": type(aborted).__name__, "message": aborted.message,
            "exit_code": aborted.exit_code, "printer": aborted.printer, "pid": os.getpid()}


SCENARIOS = {f.__name__: f for f in (agree, stop_after_checkpoint, torch_save_fails, rank0_lost)}


def rank_main(scenario: str, out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        result = SCENARIOS[scenario](rank, world, out)
    except BaseException as e:
        result = {"uncaught": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, out: Path, world: int, timeout_s: float) -> list:
    """Fork ``world`` ranks of ``scenario``; their exit statuses (None: killed at the deadline)."""
    port = str(_free_port())
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            try:
                log = os.open(out / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)  # the reply pipe (fd 1) is the server's alone
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                rank_main(scenario, out)
            finally:
                os._exit(70)
        pids.append(pid)
    deadline = time.monotonic() + timeout_s
    status: list = [None] * world
    for i, pid in enumerate(pids):  # rank 0 first
        while status[i] is None and time.monotonic() < deadline:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status[i] = os.waitstatus_to_exitcode(code)
            else:
                time.sleep(0.02)
    for i, pid in enumerate(pids):
        if status[i] is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return status


def serve() -> None:
    import threading

    import tdlm.training.checkpoint  # noqa: F401  (imported once here, not in every forked rank)
    import tdlm.training.distributed  # noqa: F401

    assert threading.active_count() == 1, "a thread before fork: the forked ranks would inherit its locks"
    reply = sys.stdout
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        status = run_ranks(req["scenario"], Path(req["dir"]), req.get("world", 2), req.get("timeout_s", 60.0))
        print(json.dumps({"status": status}), file=reply, flush=True)
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        rank_main(sys.argv[1], Path(sys.argv[2]))

"""One evaluator per output folder (tdlm.data.folder_lock.FolderLock in tdlm.evaluation.evaluate).

Two ``eval/run.py`` runs into one ``--output-dir`` once appended the same samples to one shard file and the merge
refused the duplicates at the end. Here: the lock itself (refusal names the holder, a clean release leaves no stale
holder, a SIGKILLed holder is reported and taken over), then real evaluator runs: a second run started while the
first holds the folder is refused in one line before it writes anything, and the first finishes and merges; a run
SIGKILLed mid-evaluation leaves a stale lock that the next run reports and takes over, resuming to a complete merge
with each sample exactly once. The first run is paused with SIGSTOP while the second starts, so the overlap does not
depend on how fast this loaded machine is.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tdlm.data.folder_lock import LOCK, FolderLock
from tdlm.errors import TDLMError
from tdlm.evaluation.records import merge, read_records, shard_path
from tdlm.tasks.base import default_data_dir

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "eval" / "run.py"
DATA = default_data_dir()
needs_data = pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists(), reason=f"benchmarks not in {DATA}")
LIMIT = 4
IDS = [f"gsm8k/{i:04d}" for i in range(LIMIT)]


def _args(out: Path, *policies: str) -> list[str]:
    return ["--backbone", "tiny-llada", "--tasks", "gsm8k", "--limit", str(LIMIT), "--gen-length", "16",
            "--block-size", "8", "--policies", *(policies or ("threshold",)), "--workers", "1", "--threads", "1",
            "--warmup", "0", "--score-workers", "1", "--data-dir", str(DATA), "--output-dir", str(out),
            "--wandb-mode", "disabled"]  # fmt: skip


def _env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **extra}


def _wait_for_holder(lock: Path, proc: subprocess.Popen, timeout: float = 180) -> str:
    """The holder line once the process took the lock (it writes it right after flock)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = lock.read_text().strip() if lock.exists() else ""
        if text:
            return text
        if proc.poll() is not None:
            pytest.fail(f"evaluator exited ({proc.returncode}) before taking the lock: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    pytest.fail(f"{lock}: no holder after {timeout} s")


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


# -- the lock itself -------------------------------------------------------------------------------
def test_second_holder_is_refused_naming_the_first(tmp_path):
    with FolderLock(tmp_path / "out", "evaluation") as first:
        assert first.held and first.stale_holder is None
        holder = (tmp_path / "out" / LOCK).read_text().strip()
        assert holder.startswith(f"pid {os.getpid()} on ") and " since " in holder
        with pytest.raises(TDLMError) as e:  # flock is per open file: the same process is refused too
            FolderLock(tmp_path / "out", "evaluation").acquire()
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "out") in msg and holder in msg and "--output-dir" in msg
    assert (tmp_path / "out" / LOCK).read_text() == ""  # a clean release clears the holder line
    with FolderLock(tmp_path / "out") as again:  # ... so the next holder sees no stale lock
        assert again.stale_holder is None


def test_killed_holder_is_reported_and_taken_over(tmp_path, caplog):
    folder = tmp_path / "out"
    code = textwrap.dedent(f"""
        import os, signal
        from tdlm.data.folder_lock import FolderLock
        FolderLock({str(folder)!r}, "evaluation").acquire()
        print(os.getpid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    dead = proc.stdout.strip()
    with caplog.at_level(logging.WARNING, logger="tdlm.data"), FolderLock(folder, "evaluation") as lock:
        assert lock.stale_holder is not None and lock.stale_holder.startswith(f"pid {dead} on ")
        assert (folder / LOCK).read_text().startswith(f"pid {os.getpid()} on ")
    assert f"stale lock: the evaluation holding it died (pid {dead} on " in caplog.text


def test_a_file_in_place_of_the_folder_is_one_line(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(TDLMError, match="exists and is not a folder"):
        FolderLock(tmp_path / "out").acquire()


# -- the evaluator holds the lock -------------------------------------------------------------------------
def _snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its kind, mtime and bytes: what a refused evaluator must leave as it was."""
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_mtime_ns, None if p.is_dir() else p.read_bytes())
            for p in sorted(root.rglob("*"))}  # fmt: skip


def test_evaluator_refuses_a_folder_another_process_holds_before_writing(tmp_path, capsys):
    """The evaluator's own entry point (``eval/run.py``'s ``main``, in this process: no model is loaded before the
    refusal) on a folder whose lock another process holds: exit status 2, one line naming the folder and the holder,
    and the folder exactly as it was (no run dirs, no run.json, no summary, the holder's line untouched)."""
    from tdlm.evaluation.cli import main

    out = tmp_path / "eval"
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "earlier.txt").write_text("an earlier run's file\n")
    code = textwrap.dedent(f"""
        import sys
        from tdlm.data.folder_lock import FolderLock
        with FolderLock({str(out)!r}, "evaluation"):
            print("held", flush=True)
            sys.stdin.read()  # until the test closes it
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        holder_line = (out / LOCK).read_text().strip()
        assert holder_line.startswith(f"pid {holder.pid} on ")
        before = _snapshot(out)
        capsys.readouterr()
        status = main(["--backbone", "tiny-arith", "--tasks", "arith", "--limit", "2", "--workers", "1",
                       "--threads", "1", "--warmup", "0", "--score-workers", "1", "--output-dir", str(out),
                       "--wandb-mode", "disabled"])  # fmt: skip
        err = capsys.readouterr().err
        assert _snapshot(out) == before, "the refused evaluator wrote into the locked folder"
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1, err
        assert lines[0] == (f"error: {out}: another evaluation is writing this folder ({holder_line}, holding "
                            f"{out / LOCK}); wait for it to end, stop it, or choose another --output-dir")  # fmt: skip
        with pytest.raises(TDLMError, match="another evaluation is writing"):  # the holder still holds it
            FolderLock(out, "evaluation").acquire()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert holder.returncode == 0
    assert (out / LOCK).read_text() == ""  # the holder released it cleanly


# -- real evaluator runs -------------------------------------------------------------------------------
@needs_data
@pytest.mark.slow
def test_second_evaluator_into_one_folder_is_refused_and_the_first_merges(tmp_path):
    out = tmp_path / "eval"
    first = subprocess.Popen([sys.executable, str(RUN), *_args(out)], cwd=REPO, env=_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        holder = _wait_for_holder(out / LOCK, first)
        assert holder.startswith(f"pid {first.pid} on ")
        first.send_signal(signal.SIGSTOP)  # holds the folder for as long as the second run needs
        before = _tree(out)
        # another grid into the same folder: without the lock it would create runs/gsm8k/original/ at once
        second = subprocess.run([sys.executable, str(RUN), *_args(out, "threshold", "original")], cwd=REPO,
                                env=_env(), capture_output=True, text=True, timeout=180)  # fmt: skip
        assert _tree(out) == before  # refused before writing anything
        first.send_signal(signal.SIGCONT)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert lines[0].startswith(f"error: {out}: another evaluation is writing this folder ({holder}")
        assert "choose another --output-dir" in lines[0]
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr[-3000:]
    assert f"{LIMIT} samples decoded, 0 resumed" in stdout
    run_dir = out / "runs" / "gsm8k" / "threshold-tau0.9"
    assert [r["id"] for r in read_records(run_dir / "samples.jsonl")] == IDS
    assert [r["id"] for r in merge(run_dir, IDS)] == IDS  # each sample exactly once in the one shard file
    assert not (out / "runs" / "gsm8k" / "original").exists()
    assert (out / LOCK).read_text() == ""  # released cleanly


@needs_data
@pytest.mark.slow
def test_killed_evaluator_leaves_a_stale_lock_the_next_run_takes_over(tmp_path):
    out = tmp_path / "eval"
    killed = subprocess.run([sys.executable, str(RUN), *_args(out)], cwd=REPO, capture_output=True, text=True,
                            env=_env(TDLM_EVAL_TEST_KILL_AFTER="2"), timeout=300)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]  # killed right after its 2nd record
    stale = (out / LOCK).read_text().strip()
    assert stale.startswith("pid ") and " since " in stale
    shard = shard_path(out / "runs" / "gsm8k" / "threshold-tau0.9", 0, 1)
    assert len(read_records(shard)) == 2
    rerun = subprocess.run([sys.executable, str(RUN), *_args(out)], cwd=REPO, capture_output=True, text=True,
                           env=_env(), timeout=300)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"stale lock: the evaluation holding it died ({stale})" in rerun.stderr
    assert "2 samples decoded, 2 resumed" in rerun.stdout
    run_dir = out / "runs" / "gsm8k" / "threshold-tau0.9"
    assert [r["id"] for r in merge(run_dir, IDS)] == IDS
    assert sorted(r["id"] for r in read_records(shard)) == sorted(IDS)  # no sample decoded twice
    assert [r["id"] for r in read_records(run_dir / "samples.jsonl")] == IDS
    assert (out / LOCK).read_text() == ""


def test_a_lock_that_cannot_write_its_holder_is_one_line_and_not_held(tmp_path):
    """A full disk while the lock writes its holder line: one line ("no space left"), and the folder stays free (a
    job that cannot write must not keep others out)."""
    import errno
    from unittest import mock


    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    with mock.patch("os.pwrite", full), pytest.raises(TDLMError, match="no space left"):
        FolderLock(tmp_path / "run", "evaluation").acquire()
    with FolderLock(tmp_path / "run", "evaluation") as lock:
        assert lock.held

"""Training faults on the run folder's disk (issue 29, "Full disks"): a checkpoint that hits ENOSPC fails the run with
one line, leaves the previous checkpoint verified, ``latest`` and ``train.keep_last`` untouched, and ``--resume`` on a
bigger disk continues from it to the uninterrupted run's result, bit for bit.

The run folder is a small tmpfs in a private mount namespace (``unshare -m --propagation private``) held by a
``sleep`` that this module starts; the launch enters it with ``nsenter``, so only the training sees the small disk.
The test reads the folder through ``/proc/<pid>/root``. "Freeing space" is growing the tmpfs
(``mount -o remount,size=...``). Where mounting is not allowed (not root, no util-linux, no CAP_SYS_ADMIN) the test
skips with the reason.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.log_checks import OUR_TRACEBACK
from tests.test_multinode_training import (
    ARGS,
    ENV,
    SAVE_EVERY,
    STEPS,
    options,
    overrides,
    shared_inputs,
    shared_reference,
)
from tests.test_training import _losses

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PAGE = os.sysconf("SC_PAGE_SIZE")
KEEP_LAST = ["train.keep_last=1"]  # ENOSPC must not make rotation delete the only good checkpoint


def pages(path: Path) -> int:
    """tmpfs charges whole pages per file."""
    return sum(math.ceil(p.stat().st_size / PAGE) for p in path.rglob("*") if p.is_file())


class SmallDisk:
    """A tmpfs over ``mountpoint``, visible only inside a private mount namespace held by a ``sleep``."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint, self.proc = mountpoint, None

    def start(self, size: int) -> SmallDisk:
        if os.geteuid() != 0:
            pytest.skip("the full-disk test mounts a tmpfs: it needs root")
        missing = [t for t in ("unshare", "nsenter", "mount") if shutil.which(t) is None]
        if missing:
            pytest.skip(f"the full-disk test needs {', '.join(missing)} (util-linux)")
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "3600"],
                                     stderr=subprocess.PIPE, text=True)
        ours, deadline = os.readlink("/proc/self/ns/mnt"), time.monotonic() + 30
        while True:  # nsenter before unshare() happened would mount on the host's namespace
            if self.proc.poll() is not None:
                pytest.skip(f"cannot make a private mount namespace: {self.proc.stderr.read().strip()}")
            try:
                if os.readlink(f"/proc/{self.proc.pid}/ns/mnt") != ours:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.05)
        done = self.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.mountpoint)])
        if done.returncode != 0:
            self.stop()
            pytest.skip(f"mounting a tmpfs is not allowed here: {done.stderr.strip()}")
        return self

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        return subprocess.run(["nsenter", "-t", str(self.proc.pid), "-m", "--", *cmd], text=True, **kw)

    def resize(self, size: int) -> None:
        done = self.run(["mount", "-o", f"remount,size={size}", str(self.mountpoint)])
        assert done.returncode == 0, done.stderr

    def path(self, p: Path) -> Path:
        """``p`` as this namespace sees it."""
        return Path(f"/proc/{self.proc.pid}/root") / p.relative_to("/")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _cmd(ds: Path, traj: Path, out: Path, *extra: str) -> list[str]:
    port = str(29000 + os.getpid() % 400)
    return [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", port, str(REPO / "launcher" / "train.py"),
            "--ds", str(ds), "--output-dir", str(out), *options(extra), *ARGS, f"data.trajectories={traj}",
            *KEEP_LAST, *overrides(extra)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    return shared_inputs(tmp_path_factory)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The same run on a roomy disk, never interrupted (keep_last does not change what it computes)."""
    return shared_reference(tmp_path_factory)[2]


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one_and_resume_finishes(tmp_path, files, uninterrupted):
    """The disk holds the run folder and one checkpoint and a half: the step-4 save fits, the step-8 save hits
    ENOSPC. The run ends with one line naming the folder, that the disk is full and that step-4 is intact; step-4
    still verifies, ``latest`` still names it, and train.keep_last=1 deleted nothing (rotation comes only after a
    verified save); no half-written step-8 is left to be taken for the newest. After the disk grows, --resume
    continues from step 4 to the uninterrupted run's losses and adapter, bit for bit."""
    from safetensors.torch import load_file

    from tdlm.training.run_dir import EXIT_NO_SPACE, verify_checksums

    traj, ds = files
    ref_ckpt = uninterrupted / "checkpoints"
    assert SAVE_EVERY == 4 and STEPS >= 12  # the disk fits step-4 and fails at step-8
    tag_pages = pages(ref_ckpt / f"step-{STEPS}")
    # everything but the checkpoint tags (run files, metrics, DeepSpeed's recovery scripts) + room for a tag and a half
    rest = (pages(uninterrupted) - sum(pages(t) for t in ref_ckpt.glob("step-*"))
            - pages(uninterrupted / "adapter"))
    size = (rest + 8 + tag_pages * 3 // 2) * PAGE
    mount = tmp_path / "disk"
    disk = SmallDisk(mount).start(size)
    try:
        out = mount / "run"
        log = tmp_path / "full.log"
        t0 = time.monotonic()
        with open(log, "w") as fh:
            rc = disk.run(_cmd(ds, traj, out), cwd=REPO, env=os.environ | ENV, stdout=fh, stderr=subprocess.STDOUT,
                          capture_output=False, timeout=600).returncode
        failed_s = time.monotonic() - t0
        text = log.read_text()
        assert rc == EXIT_NO_SPACE, text[-3000:]
        lines = [line for line in text.splitlines() if "the disk is full" in line]
        assert len(lines) == 1, text[-3000:]
        assert re.fullmatch(rf"error: {re.escape(str(out / 'checkpoints'))}: the disk is full while saving checkpoint "
                            rf"step-8 \(rank \d: .*\); removed the partial step-8; the previous checkpoint step-4 is "
                            rf"intact \(verified\); free space or move the run folder to a bigger disk, then resume "
                            rf"with --resume", lines[0].strip()), lines[0]
        assert not OUR_TRACEBACK.search(text), text[-3000:]  # no traceback of ours
        seen = disk.path(out)
        assert sorted(p.name for p in (seen / "checkpoints").glob("step-*")) == ["step-4"]
        verify_checksums(seen / "checkpoints" / "step-4")
        assert (seen / "checkpoints" / "latest").read_text() == "step-4"
        assert not (seen / "summary.json").exists()

        disk.resize(size * 4)  # space freed
        t1 = time.monotonic()
        with open(log, "a") as fh:
            rc = disk.run(_cmd(ds, traj, out, "--resume"), cwd=REPO, env=os.environ | ENV, stdout=fh,
                          stderr=subprocess.STDOUT, capture_output=False, timeout=600).returncode
        resume_s = time.monotonic() - t1
        assert rc == 0, log.read_text()[-3000:]
        assert f"resuming from step 4 ({out / 'checkpoints' / 'step-4'})" in log.read_text()
        ref, got = _losses(uninterrupted), _losses(seen)
        assert sorted(got) == list(range(1, STEPS + 1)) and all(got[s] == ref[s] for s in ref), (got, ref)
        a = load_file(uninterrupted / "adapter" / "adapter.safetensors")
        b = load_file(seen / "adapter" / "adapter.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert json.loads((seen / "summary.json").read_text())["resumed_from"] == 4
        print(f"\nENOSPC at step-8 (tmpfs {size // 1024} KiB): failed after {failed_s:.1f} s; 4 updates redone; "
              f"resume to the end {resume_s:.1f} s")
    finally:
        disk.stop()

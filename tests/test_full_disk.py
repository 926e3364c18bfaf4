"""Full disks: a generation or evaluation shard that hits ENOSPC is never recorded as done, the job fails in one
line, and after space is freed the same command completes it exactly once (issue 29, "Full disks").

The output folder is a small tmpfs in a private mount namespace (``unshare -m --propagation private``) held by a
``sleep`` process this module starts; the jobs and the Ray cluster they use run inside it (``nsenter``), so they see
the small disk and nothing else on the machine does. The test reads the folder through ``/proc/<pid>/root``.
"Freeing space" is growing the mounted tmpfs (``mount -o remount,size=...``); its files stay.

tmpfs charges whole pages per file, so the sizes below are counted in pages (``PAGE``) from the files of a
fault-free run of the same job: each step is sized to fail at one chosen write. A lock file holds one page while its
holder line is written (the generation store's pid line, the evaluator's folder lock); ``_lock_reserve`` adds that
page whenever the lock file is empty between runs.

Where mounting is not allowed (not root, no ``unshare`` / ``nsenter``, a container without CAP_SYS_ADMIN) every
test skips with the reason.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tdlm.data.store import LOCK, MANIFEST, atomic_write_json, sha256_of, shard_name
from tdlm.data.trajectories import read_parquet
from tdlm.errors import TDLMError
from tdlm.evaluation import evaluate
from tdlm.evaluation.records import Appender, read_records, shard_path
from tests.test_evaluation import DATA, cfg_for, needs_data
from tests.test_generation import (
    N_PROMPTS,
    RAY_ENV,
    assert_complete,
    build_serial,
    make_cfg,
    prompt_file,  # noqa: F401  (module fixture: the short GSM8K prompts)
)

REPO = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")
ROOMY = 16 * 1024 * 1024  # "space freed": far more than either job writes
pytestmark = pytest.mark.usefixtures("one_thread")


def pages(n_bytes: int) -> int:
    return math.ceil(n_bytes / PAGE)


# The jobs run in one long-lived Python process inside the namespace that calls the command-line entry points
# (tdlm.generation.cli.main = ray_jobs/generate_trajectories.py, tdlm.evaluation.cli.main = eval/run.py) once per
# step, with fd 1 / 2 sent to files: an interpreter start, torch / Ray imports and a local Ray cluster per step cost
# ~60 s each on the loaded 2-core machine. Ray is started once, inside the namespace, and reused by every generation
# step (generate() leaves a caller's Ray alone, as in tests/test_generation.py); evaluation runs its one in-process
# worker, the CPU default. An uncaught exception is printed as Python would print it and gives status 1.
RUNNER = r"""
import json, logging, os, sys, time, traceback
sys.path.insert(0, os.getcwd())
reply = os.fdopen(os.dup(1), "w", buffering=1)
from tdlm.evaluation.cli import main as eval_main
from tdlm.generation.cli import main as gen_main
reply.write("ready\n")
for line in sys.stdin:
    req = json.loads(line)
    if req["kind"] == "ray":
        import ray
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2,
                 _temp_dir=req["temp"], logging_level=logging.WARNING)
        reply.write(json.dumps({"rc": 0}) + "\n")
        continue
    main = gen_main if req["kind"] == "generate" else eval_main
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(req["log"] + ".out", "w") as out, open(req["log"] + ".err", "w") as err:
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        t0 = time.monotonic()
        try:
            rc = main(req["argv"])
        except SystemExit as e:
            rc = e.code
        except BaseException:
            traceback.print_exc()
            rc = 1
        seconds = time.monotonic() - t0
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    for fd in saved:
        os.close(fd)
    reply.write(json.dumps({"rc": rc, "seconds": seconds}) + "\n")
"""


@dataclass
class Step:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class SmallDisks:
    """Small tmpfs mounts visible only inside one private mount namespace, and a job runner inside it."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.holder: subprocess.Popen | None = None
        self.runner: subprocess.Popen | None = None
        self.ray_up = False
        self.steps = 0

    def start(self) -> SmallDisks:
        if os.geteuid() != 0:
            pytest.skip("full-disk tests mount a tmpfs: they need root")
        missing = [t for t in ("unshare", "nsenter", "mount") if shutil.which(t) is None]
        if missing:
            pytest.skip(f"full-disk tests need {', '.join(missing)} (util-linux)")
        self.holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "3600"],
                                       stderr=subprocess.PIPE, text=True)  # fmt: skip
        # nsenter must not run before unshare() has happened: it would mount in this (the host's) namespace.
        ours, deadline = os.readlink("/proc/self/ns/mnt"), time.monotonic() + 30
        while True:
            if self.holder.poll() is not None:
                pytest.skip(f"cannot make a private mount namespace: {self.holder.stderr.read().strip()}")
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{self.holder.pid}/ns/mnt") != ours and \
                        Path(f"/proc/{self.holder.pid}/comm").read_text().strip() == "sleep":  # fmt: skip
                    break
            if time.monotonic() > deadline:
                pytest.skip("unshare did not enter a new mount namespace within 30 s")
            time.sleep(0.02)
        probe = self.scratch / "probe"
        probe.mkdir()
        r = self._enter(["mount", "-t", "tmpfs", "-o", f"size={PAGE}", "tmpfs", str(probe)])
        if r.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not allowed here: {r.stderr.strip()}")
        return self

    def _enter(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["nsenter", "-t", str(self.holder.pid), "-m", f"--wd={REPO}", "--", *cmd],
                              capture_output=True, text=True, timeout=60, **kw)  # fmt: skip

    def mount(self, name: str, size: int) -> Path:
        """A new tmpfs of ``size`` bytes; returns its path (as the jobs see it)."""
        path = self.scratch / name
        path.mkdir()
        r = self._enter(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
        assert r.returncode == 0, r.stderr
        assert self.total(path) == size
        return path

    def resize(self, path: Path, size: int) -> None:
        """Grow (free space) or shrink a mounted tmpfs; its files stay."""
        r = self._enter(["mount", "-o", f"remount,size={size}", str(path)])
        assert r.returncode == 0, r.stderr
        assert self.total(path) == size

    def view(self, path: Path) -> Path:
        """``path`` inside the namespace, as seen from this (host) namespace."""
        return Path(f"/proc/{self.holder.pid}/root") / path.relative_to("/")

    def total(self, path: Path) -> int:
        st = os.statvfs(self.view(path))
        return st.f_blocks * st.f_frsize

    def used(self, path: Path) -> int:
        st = os.statvfs(self.view(path))
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _request(self, req: dict, timeout: float) -> dict:
        if self.runner is None:
            self.runner = subprocess.Popen(
                ["nsenter", "-t", str(self.holder.pid), "-m", f"--wd={REPO}", "--", sys.executable, "-c", RUNNER],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                env={**os.environ, **RAY_ENV, "OMP_NUM_THREADS": "1"})  # fmt: skip
            assert self._reply(180) == "ready"
        self.runner.stdin.write(json.dumps(req) + "\n")
        return json.loads(self._reply(timeout))

    def _reply(self, timeout: float) -> str:
        ready, _, _ = select.select([self.runner.stdout], [], [], timeout)
        assert ready, f"the job runner did not answer within {timeout} s"
        line = self.runner.stdout.readline()
        assert line, f"the job runner died (status {self.runner.poll()})"
        return line.strip()

    def run(self, kind: str, argv: list[str], timeout: float = 300) -> Step:
        """One step: ``kind`` "generate" (ray_jobs/generate_trajectories.py) or "evaluate" (eval/run.py)."""
        if kind == "generate" and not self.ray_up:
            self._request({"kind": "ray", "temp": f"/tmp/ray_tdlm_full_{os.getpid()}"}, 180)
            self.ray_up = True
        self.steps += 1
        log = self.scratch / f"step{self.steps}"
        reply = self._request({"kind": kind, "argv": argv, "log": str(log)}, timeout)
        return Step(reply["rc"], Path(f"{log}.out").read_text(), Path(f"{log}.err").read_text(), reply["seconds"])

    def stop(self) -> None:
        for proc in (self.runner, self.holder):  # the namespace and its mounts go with their last process
            if proc is not None and proc.poll() is None:
                if proc is self.runner:
                    proc.stdin.close()  # the runner ends at EOF (and shuts its Ray down)
                    try:
                        proc.wait(timeout=60)
                        continue
                    except subprocess.TimeoutExpired:
                        pass
                proc.kill()
                proc.wait(timeout=30)
        shutil.rmtree(f"/tmp/ray_tdlm_full_{os.getpid()}", ignore_errors=True)


@pytest.fixture(scope="module")
def disks(tmp_path_factory):
    d = SmallDisks(tmp_path_factory.mktemp("full_disk"))
    try:
        yield d.start()
    finally:
        d.stop()


def _lock_reserve(folder: Path) -> int:
    """One page for the holder line a job writes into an empty (or missing) lock file while it runs."""
    lock = folder / LOCK
    return PAGE if not lock.exists() or lock.stat().st_size == 0 else 0


def _one_line_error(proc: Step) -> str:
    """The job's error: one ``error: ...`` line, no traceback anywhere in its output."""
    assert proc.returncode == 2, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(err) == 1, proc.stderr[-3000:]
    return err[0]


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


# -- fast: a real ENOSPC from /dev/full, no mount (runs where the tmpfs tests skip) ------------------------
needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")


@needs_dev_full
def test_manifest_write_on_a_full_disk_keeps_the_old_manifest(tmp_path):
    """The manifest's temporary name is a symlink to /dev/full (every write fails with ENOSPC)."""
    path = tmp_path / MANIFEST
    path.write_text('{"old": true}\n')
    (tmp_path / f"{MANIFEST}.tmp-{os.getpid()}").symlink_to("/dev/full")
    with pytest.raises(TDLMError) as e:
        atomic_write_json(path, {"new": True}, kept="the old one stays")
    assert str(e.value).startswith(f"{tmp_path}: no space left on the device writing {MANIFEST}")
    assert "the old one stays" in str(e.value) and "\n" not in str(e.value)
    assert _names(tmp_path) == {MANIFEST} and json.loads(path.read_text()) == {"old": True}


@needs_dev_full
def test_shard_append_on_a_full_disk_is_one_line_error(tmp_path):
    """An evaluation shard file that is /dev/full: the append fails at once (no partial line to cut here; the
    tmpfs test below has one) and the error names the run folder; the same error comes out of the worker."""
    run = tmp_path / "run"
    shard = shard_path(run, 0, 1)
    shard.parent.mkdir(parents=True)
    shard.symlink_to("/dev/full")
    with Appender(shard) as out, pytest.raises(TDLMError) as e:
        out.write({"id": "t/0", "generation": "x"})
    assert str(e.value).startswith(f"{run}: no space left on the device appending to shards/{shard.name}")
    assert "sample 't/0' is not recorded" in str(e.value) and "\n" not in str(e.value)


# -- generation -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_generation_full_disk_never_lists_a_partial_shard_and_the_rerun_finishes(disks, prompt_file, tmp_path):  # noqa: F811
    """The generation command three times on one small disk: (1) room for shard 0 but not for the manifest rewrite
    that lists it; (2) one page more: shard 0 is adopted, shard 1 does not fit; (3) space freed: shards 1 and 2
    are computed once, shard 0 is kept, tokens equal a fault-free run."""
    ref = tmp_path / "ref"
    build_serial(make_cfg(ref, prompt_file))  # fault-free, in-process replica code
    s0, manifest = (ref / shard_name(0)).stat().st_size, (ref / MANIFEST).stat().st_size
    assert pages(manifest) == 1 and pages((ref / shard_name(1)).stat().st_size) >= 2, \
        "the sizes below assume a one-page manifest and shards of two pages or more"  # fmt: skip
    lock = PAGE  # the store writes its pid into .lock
    mnt = disks.mount("gen", lock + PAGE * (pages(manifest) + pages(s0)))
    out, view = mnt / "traj", disks.view(mnt) / "traj"
    argv = ["--backbone", "tiny-llada", "--prompts", str(prompt_file), "--prompt-field", "question", "--num-prompts",
            str(N_PROMPTS), "--policy", "threshold", "--gen-length", "16", "--block-size", "8", "--shard-size", "3",
            "--batch-size", "2", "--actors", "1", "--cpus-per-actor", "1", "--log-interval", "1",
            "--output-dir", str(out)]  # fmt: skip

    # (1) the manifest rewrite after shard 0 hits ENOSPC
    first = disks.run("generate", argv)
    err = _one_line_error(first)
    assert err.startswith(f"error: {out}: no space left on the device writing {MANIFEST}"), err
    assert _names(view) == {LOCK, MANIFEST, shard_name(0)}  # no temporary file left to fill the disk
    assert json.loads((view / MANIFEST).read_text())["shards"] == {}  # shard 0 is not listed ...
    assert len(read_parquet(view / shard_name(0))) == 3  # ... but whole (renamed after its last byte)
    mtime0 = (view / shard_name(0)).stat().st_mtime_ns

    # (2) one page more: the rerun adopts shard 0 (the rewrite fits), shard 1 does not
    disks.resize(mnt, disks.used(mnt) + _lock_reserve(view) + PAGE)
    second = disks.run("generate", argv)
    err = _one_line_error(second)
    assert err.startswith(f"error: {out}: no space left on the device writing {shard_name(1)}"), err
    assert "complete shard written just before the last run stopped; verified and adopted" in second.stdout
    for retry in ("retrying", "is gone", "redoing"):  # ENOSPC is not a replica fault: nothing retried
        assert retry not in second.stdout + second.stderr
    listed = json.loads((view / MANIFEST).read_text())["shards"]
    assert list(listed) == [shard_name(0)] and listed[shard_name(0)]["sha256"] == sha256_of(view / shard_name(0))
    assert _names(view) == {LOCK, MANIFEST, shard_name(0)}  # the partial shard 1 is gone, not renamed

    # (3) space freed: the same command finishes, every prompt once, shard 0 untouched
    disks.resize(mnt, ROOMY)
    third = disks.run("generate", argv)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert "1 finished, 2 to do" in third.stdout and "2 shards computed, 1 already finished" in third.stdout
    records = assert_complete(view, make_cfg(view, prompt_file))  # listed == on disk, no tmp, ids once in order
    expected = [r for i in range(3) for r in read_parquet(ref / shard_name(i))]
    assert [(r.source_id, r.prompt_ids, r.response_ids, r.reveal_steps, r.T) for r in records] == \
           [(r.source_id, r.prompt_ids, r.response_ids, r.reveal_steps, r.T) for r in expected]  # fmt: skip
    assert (view / shard_name(0)).stat().st_mtime_ns == mtime0
    m = json.loads((view / MANIFEST).read_text())
    assert m["runs"][-1]["computed_shards"] == [1, 2] and len(m["runs"]) == 1  # the failed runs finished nothing
    print(f"\ngeneration full-disk step seconds: {[round(x.seconds, 1) for x in (first, second, third)]}; "
          f"errors: {[x.stderr.strip().splitlines()[-1:] for x in (first, second)]}")


# -- evaluation -----------------------------------------------------------------------------------------
EVAL_LIMIT = 14  # 14 MBPP records are > 2 pages of shard file, so the first step fails inside the decode


@pytest.fixture(scope="module")
def eval_chain(disks, tmp_path_factory):
    """The evaluation command three times on one small disk: (1) the shard file gets one page and fills up
    mid-line; (2) room for the rest of the shard but not for samples.jsonl; (3) space freed. Returns each step and
    what the folder held after it; the tests below check them."""
    if not (DATA / "gsm8k_test.jsonl").exists():
        pytest.skip(f"benchmarks not in {DATA}")
    ref = evaluate(cfg_for(tmp_path_factory.mktemp("eval_ref") / "ref", limit=EVAL_LIMIT))  # fault-free
    run_ref = Path(ref.runs[0]["run_dir"])
    shard_bytes = shard_path(run_ref, 0, 1).stat().st_size
    samples_bytes = (run_ref / "samples.jsonl").stat().st_size
    run_json = pages((run_ref / "run.json").stat().st_size)
    assert pages(shard_bytes) >= 3 and pages(samples_bytes) >= 3, "the sizes below need 3+ pages of records"
    mnt = disks.mount("eval", PAGE * (1 + run_json + 1))  # the lock line, run.json, one page of shard
    out, view = mnt / "eval", disks.view(mnt) / "eval"
    argv = ["--backbone", "tiny-llada", "--tasks", "mbpp", "--limit", str(EVAL_LIMIT), "--gen-length", "16",
            "--block-size", "8", "--policies", "threshold", "--workers", "1", "--threads", "1", "--warmup", "0",
            "--score-workers", "1", "--wandb-mode", "disabled", "--data-dir", str(DATA), "--output-dir", str(out)]
    rel = Path("runs") / "mbpp" / run_ref.name
    chain: dict = {"ref": ref, "run_dir": out / rel, "view": view, "out": out, "rel": rel}
    shard = shard_path(view / rel, 0, 1)

    chain["first"] = disks.run("evaluate", argv)
    chain["shard_after_first"] = shard.read_bytes() if shard.exists() else b""
    # (2) the rest of the shard (one page of slack for line-length noise: seconds and pids differ per run) plus
    # the lock line; samples.jsonl (3+ pages) then finds at most 2 free pages
    have = pages(len(chain["shard_after_first"]))
    disks.resize(mnt, disks.used(mnt) + _lock_reserve(view) + PAGE * (pages(shard_bytes) - have + 1))
    chain["second"] = disks.run("evaluate", argv)
    chain["names_after_second"] = {str(p.relative_to(view)) for p in view.rglob("*")}
    chain["shard_after_second"] = shard.read_bytes()
    disks.resize(mnt, ROOMY)
    chain["third"] = disks.run("evaluate", argv)
    kept = chain["shard_after_first"].count(b"\n")
    print(f"\nevaluation full-disk step seconds: {[round(chain[k].seconds, 1) for k in ('first', 'second', 'third')]}; "
          f"samples kept by step 1: {kept}; errors: "
          f"{[chain[k].stderr.strip().splitlines()[-1:] for k in ('first', 'second')]}")
    return chain


def _same_samples(a: list[dict], b: list[dict]) -> None:
    key = ("id", "index", "prompt", "generation", "nfe", "tokens")
    assert [tuple(r.get(k) for k in key) for r in a] == [tuple(r.get(k) for k in key) for r in b]


def _ref_shard(chain) -> list[dict]:
    return read_records(shard_path(Path(chain["ref"].runs[0]["run_dir"]), 0, 1))


@needs_data
@pytest.mark.slow
def test_evaluation_shard_append_on_full_disk_keeps_only_whole_samples(eval_chain):
    """(1): the append that crosses the last free block is cut at once (the file ends with a newline), the run fails
    in one line naming the run folder, and the samples before it count as done and equal a fault-free run."""
    err = _one_line_error(eval_chain["first"])
    assert err.startswith(f"error: {eval_chain['run_dir']}: no space left on the device appending to shards/"), err
    data = eval_chain["shard_after_first"]
    assert data and data.endswith(b"\n"), "a cut line was left at the end of the shard file"
    kept = [json.loads(line) for line in data.splitlines()]
    assert 0 < len(kept) < EVAL_LIMIT  # it failed inside the decode
    _same_samples(kept, _ref_shard(eval_chain)[: len(kept)])
    # (2) resumed them: only the rest was decoded, the kept lines are byte for byte the same
    assert eval_chain["shard_after_second"].startswith(data)
    _same_samples(read_records(shard_path(eval_chain["view"] / eval_chain["rel"], 0, 1)), _ref_shard(eval_chain))


@needs_data
@pytest.mark.slow
def test_evaluation_merged_write_on_full_disk_leaves_nothing_to_trust_and_the_rerun_finishes(eval_chain):
    """(2): all samples decoded, then samples.jsonl does not fit: no samples / summary / table file exists that a
    later run or eval/compare.py could read as results. (3): space freed, the same command decodes nothing,
    merges every sample exactly once and equals the fault-free run."""
    second = eval_chain["second"]
    assert second.returncode != 0 and "no space left" in (second.stderr + second.stdout).lower(), second.stderr[-2000:]
    assert "samples decoded" not in second.stdout  # it failed after the decode, not before
    rel = str(eval_chain["rel"])
    names = eval_chain["names_after_second"]
    for trusted in (f"{rel}/samples.jsonl", f"{rel}/summary.json", "summary.json", "table.md"):
        assert trusted not in names, f"{trusted} written on a full disk"
    third = eval_chain["third"]
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"0 samples decoded, {EVAL_LIMIT} resumed" in third.stdout
    view_run = eval_chain["view"] / rel
    ref_samples = read_records(Path(eval_chain["ref"].runs[0]["run_dir"]) / "samples.jsonl")
    got = read_records(view_run / "samples.jsonl")
    assert [s["id"] for s in got] == [s["id"] for s in ref_samples]  # every sample exactly once, in task order
    key = ("id", "generation", "nfe", "correct", "status")
    assert [tuple(s[k] for k in key) for s in got] == [tuple(s[k] for k in key) for s in ref_samples]
    summary = json.loads((eval_chain["view"] / "summary.json").read_text())
    assert summary["runs"][0]["n"] == EVAL_LIMIT
    assert summary["runs"][0]["accuracy"] == eval_chain["ref"].runs[0]["accuracy"]


@needs_data
@pytest.mark.slow
def test_evaluation_merged_write_on_full_disk_fails_in_one_line_and_leaves_no_temporary_file(eval_chain):
    err = _one_line_error(eval_chain["second"])
    assert err.startswith(f"error: {eval_chain['out']}") and "no space left" in err, err
    assert not [n for n in eval_chain["names_after_second"] if ".tmp" in n]

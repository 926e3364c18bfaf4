"""Two training nodes on one host (issue 29): two ``torchrun --nnodes 2`` agents, each its own process tree, meeting
through the c10d rendezvous on 127.0.0.1, and the ``deepspeed --hostfile`` launch over ssh to localhost aliases.

What is checked, against the single-node ``deepspeed --num_gpus 2`` launch of the same run (bit for bit: same ranks,
same gloo collectives, MKL_CBWR): the two-node losses and adapter; a node lost to SIGKILL (its agent and its rank)
ends the other node within 60 s with one line naming the lost rank; ``--resume`` on both nodes then ends with the
uninterrupted run's losses and adapter; a node that stops answering (SIGSTOP) ends the other after
``train.dist_timeout_s``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.log_checks import OUR_TRACEBACK
from tests.test_training import TINY_LLADA, _ds_json, _losses, make_trajectories

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STEPS = 12
SAVE_EVERY = 4
ARGS = ["--config", str(REPO / "configs" / "tiny.yaml"), "--max-steps", str(STEPS), "--",
        f"train.save_every={SAVE_EVERY}",
        *TINY_LLADA, "data.states=4", "train.micro_batch_size=4"]
ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu"}
LOST = re.compile(r"error: rank (\d+): lost rank (\d+) \(host \S+, pid \d+\) during update (\d+) \((.*)\); the newest "
                  r"verified checkpoint is step-(\d+) \((\d+) updates? to redo\); start every node's command again "
                  r"with --resume")
LOST_EARLY = re.compile(r"error: rank (\d+): lost rank (\d+) \(host \S+, pid \d+\) during update (\d+) \((.*)\); no "
                        r"checkpoint yet; start every node's command again \(without --resume\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def options(extra) -> list[str]:
    return [a for a in extra if a.startswith("--")]


def overrides(extra) -> list[str]:  # after "--" with the others: argparse takes one run of positionals
    return [a for a in extra if not a.startswith("--")]


def _shared_base(tmp_path_factory) -> Path:
    """The session's base temp folder: under pytest-xdist each worker's own base is a subfolder of the controller's
    (``popen-gw<N>``), and tests/test_training_faults.py may run on another worker than this file, so the workers
    share the controller's; without xdist, this process's own (never an earlier session's)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "two-rank-reference"


@contextlib.contextmanager
def _shared_lock(base: Path):
    """One builder at a time across the workers: the others wait, then find its result."""
    base.parent.mkdir(parents=True, exist_ok=True)
    with open(base.parent / f"{base.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _shared_inputs(base: Path) -> tuple[Path, Path]:
    traj, ds = base / "traj", base / "test_zero3.json"
    if not (traj / "manifest.json").exists():
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir()
        make_trajectories(traj)
        assert _ds_json(base, "zero3.json", 3) == ds
    return traj, ds


def shared_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """(trajectories, DS JSON), made once per pytest session in its base temp folder (shared with
    tests/test_training_faults.py, on whichever xdist worker it runs)."""
    base = _shared_base(tmp_path_factory)
    with _shared_lock(base):
        return _shared_inputs(base)


def shared_reference(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(trajectories, DS JSON, the uninterrupted single-node ``deepspeed --num_gpus 2`` run), built once per pytest
    session and shared with tests/test_training_faults.py (one launch fewer in the suite, on one xdist worker or
    two: a second worker that asks while the first builds waits for its run rather than launching its own)."""
    base = _shared_base(tmp_path_factory)
    with _shared_lock(base):
        traj, ds = _shared_inputs(base)
        out = base / "run"
        if (out / "summary.json").exists():
            return traj, ds, out
        shutil.rmtree(out, ignore_errors=True)
        cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
               str(REPO / "launcher" / "train.py"), "--ds", str(ds), "--output-dir", str(out), *ARGS,
               f"data.trajectories={traj}"]
        proc = subprocess.run(cmd, cwd=REPO, env=os.environ | ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:]
        return traj, ds, out


@pytest.fixture(scope="module")
def fixture_files(tmp_path_factory) -> tuple[Path, Path]:
    return shared_inputs(tmp_path_factory)


@pytest.fixture(scope="module")
def single_node(tmp_path_factory) -> Path:
    """The reference: one node, ``deepspeed --num_gpus 2``, never interrupted."""
    return shared_reference(tmp_path_factory)[2]


def _agents(out: Path, traj: Path, ds: Path, *extra: str) -> list[subprocess.Popen]:
    """Two torchrun agents ("nodes"), each in its own session, with its own log ``<out>.node<N>.log``."""
    port, rid = free_port(), f"tdlm-{os.getpid()}-{time.monotonic_ns()}"
    agents = []
    for n in range(2):
        cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", rid, str(REPO / "launcher" / "train.py"),
               "--ds", str(ds), "--output-dir", str(out), *options(extra), *ARGS, f"data.trajectories={traj}",
            *overrides(extra)]
        log = open(f"{out}.node{n}.log", "a")  # noqa: SIM115 - the agent's output for the whole launch
        agents.append(subprocess.Popen(cmd, cwd=REPO, env=os.environ | ENV, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True))
    return agents


def _children(pid: int) -> list[int]:
    kids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(p.name))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def _rank(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in env if v.startswith(b"RANK="))[5:])


def _wait_for_step(out: Path, agents, step: int, timeout: float = 300) -> None:
    deadline, path = time.time() + timeout, out / "metrics.jsonl"
    while not path.exists() or path.read_text().count("\n") < step:
        assert all(a.poll() is None for a in agents) and time.time() < deadline, _logs(out)[-3000:]
        time.sleep(0.1)


def _logs(out: Path) -> str:
    return "".join(Path(f"{out}.node{n}.log").read_text() for n in range(2) if Path(f"{out}.node{n}.log").exists())


def _finish(agents, timeout: float = 600) -> list[int]:
    try:
        return [a.wait(timeout=timeout) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)


def _lose_node(out: Path, agents, victim_rank: int, sig: int) -> tuple[int, list[int]]:
    """Signal one whole node (its agent and its rank at once); returns (index of that agent, its pids)."""
    ranks = {n: _children(a.pid) for n, a in enumerate(agents)}
    assert all(len(v) == 1 for v in ranks.values()), ranks
    node = next(n for n, pids in ranks.items() if _rank(pids[0]) == victim_rank)
    pids = [agents[node].pid, *ranks[node]]
    for pid in pids:
        os.kill(pid, sig)
    return node, pids


def _same_adapter(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    x, y = load_file(a / "adapter" / "adapter.safetensors"), load_file(b / "adapter" / "adapter.safetensors")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.slow
def test_two_torchrun_nodes_lose_one_to_sigkill_and_resume_to_the_single_node_result(tmp_path, fixture_files,
                                                                                      single_node):
    """Two nodes train; rank 1's node is killed (SIGKILL to its agent and its rank, as a node dies) after the step-4
    checkpoint; rank 0 ends within 60 s with one line naming rank 1, its last checkpoint and what a resume redoes;
    both nodes resume with --resume and end bit-identical to the single-node run: every loss (updates before the
    loss from the two-node launch, the rest from the resumed one) and the adapter."""
    traj, ds = fixture_files
    out = tmp_path / "run"
    agents = _agents(out, traj, ds)
    try:
        _wait_for_step(out, agents, SAVE_EVERY + 2)
        node, _ = _lose_node(out, agents, victim_rank=1, sig=signal.SIGKILL)
        t0 = time.monotonic()
        survivor = agents[1 - node]
        rc = survivor.wait(timeout=60)  # within 60 s, or TimeoutExpired fails the test
        lost_s = time.monotonic() - t0
        while _children(survivor.pid):
            assert time.monotonic() - t0 < 60, "the survivor's rank outlived its agent"
            time.sleep(0.1)
    finally:
        _finish(agents, timeout=60)
    assert rc != 0
    log = _logs(out)
    lines = [line for line in log.splitlines() if "lost rank" in line]
    assert len(lines) == 1, log[-3000:]
    m = LOST.fullmatch(lines[0].strip())
    assert m, lines[0]
    me, lost, update, _why, ckpt, redo = map(lambda g: int(g) if g.isdigit() else g, m.groups())
    assert (me, lost) == (0, 1) and ckpt % SAVE_EVERY == 0 and ckpt >= SAVE_EVERY and redo == update - 1 - ckpt
    # EXIT_PEER_LOST as torchrun reports it; unless the lost node's agent hosted the c10d store: then the survivor's
    # agent fails on the store first (RendezvousConnectionError) and never reports its rank's status
    assert "exitcode: 76" in log or "RendezvousConnectionError" in log, log[-3000:]
    assert not OUR_TRACEBACK.search(log), log[-3000:]  # no traceback of ours
    assert not (out / "summary.json").exists()
    print(f"\nnode lost at update {update}: survivor ended in {lost_s:.1f} s; resume redoes {redo} updates")

    t1 = time.monotonic()
    assert _finish(_agents(out, traj, ds, "--resume")) == [0, 0], _logs(out)[-3000:]
    resume_s = time.monotonic() - t1
    assert f"resuming from step {ckpt} " in _logs(out)
    ref, got = _losses(single_node), _losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in ref:
        assert got[s] == ref[s], (s, got[s], ref[s])  # bit-identical, two nodes or one
    _same_adapter(single_node, out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["resumed_from"] == ckpt
    print(f"resume on both nodes to the end: {resume_s:.1f} s")


@pytest.mark.slow
def test_a_silent_node_ends_the_other_after_dist_timeout_s(tmp_path, fixture_files):
    """A node that stops answering (SIGSTOP: its connections stay open, so nothing fails at once) holds the other
    one's collective until ``train.dist_timeout_s`` (5 s here; 600 by default, never torch's 30 minutes); the other
    rank then names it in one line and exits, well inside 60 s. Rank 0's node is the silent one here, so the line
    comes from rank 1."""
    traj, ds = fixture_files
    out = tmp_path / "run"
    # When the silent node's torchrun agent hosts the c10d store, the other agent hangs in its store calls after its
    # rank has exited (torch's behaviour; measured > 2 min, read_timeout does not shorten it): what must end here is
    # the rank, with its line; the agents are ended by the test (on a cluster, by the scheduler's node-failure rule).
    agents = _agents(out, traj, ds, "train.dist_timeout_s=5", "train.save_every=0")  # no checkpoint before it
    stopped: list[int] = []
    try:
        _wait_for_step(out, agents, 2)
        node, stopped = _lose_node(out, agents, victim_rank=0, sig=signal.SIGSTOP)
        t0 = time.monotonic()
        rank_pid = _children(agents[1 - node].pid)
        while rank_pid and Path(f"/proc/{rank_pid[0]}").exists() and \
                Path(f"/proc/{rank_pid[0]}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # fmt: skip
            assert time.monotonic() - t0 < 60, "the rank beside a silent node did not end within 60 s"
            time.sleep(0.1)
        ended_s = time.monotonic() - t0
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _finish(agents, timeout=60)
    lines = [line for line in _logs(out).splitlines() if "lost rank" in line]
    assert len(lines) == 1, _logs(out)[-3000:]
    m = LOST_EARLY.fullmatch(lines[0].strip())
    assert m and m.group(1, 2) == ("1", "0") and "Timed out" in m.group(4), lines[0]
    assert "Timed out waiting 5000ms" in m.group(4) and ended_s >= 5, (m.group(4), ended_s)  # the field's timeout
    print(f"\nsilent node: the other rank ended {ended_s:.1f} s after SIGSTOP (dist_timeout_s=5)")


# -- the DeepSpeed hostfile launch over ssh ---------------------------------------------------------------------
SSHD = "/usr/sbin/sshd"
ALIASES = {"node-a": "127.0.0.2", "node-b": "127.0.0.3"}  # two "hosts" on the loopback network, one sshd


def ssh_missing() -> str:
    """Why the hostfile launch cannot run here ("" when it can): checked before any fixture launches anything."""
    missing = [t for t in ("pdsh", "ssh", "ssh-keygen") if shutil.which(t) is None]
    if not Path(SSHD).exists():
        missing.append(SSHD)
    if missing:
        return f"the hostfile launch needs {', '.join(missing)} (Debian: apt-get install -y pdsh openssh-server)"
    if os.geteuid() != 0:
        return "the hostfile launch logs in over ssh as the launching user: this test runs sshd as root"
    return ""


@pytest.fixture
def local_sshd(tmp_path):
    """A test-owned sshd on a free port (its own host key, authorized_keys and pid file in a temp folder), and an
    ``ssh`` on PATH that uses its own config (aliases, key, no host-key prompts): nothing of the machine's ssh setup
    is read or changed. Debian: ``apt-get install -y pdsh openssh-server``."""
    if ssh_missing():
        pytest.skip(ssh_missing())
    d = tmp_path / "ssh"
    (d / "bin").mkdir(parents=True)
    for key in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "id.pub", d / "authorized_keys")
    port = free_port()
    listen = "".join(f"ListenAddress {ip}\n" for ip in ALIASES.values())
    (d / "sshd_config").write_text(
        f"Port {port}\n{listen}HostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        f"PidFile {d / 'sshd.pid'}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        f"KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n")
    hosts = "".join(f"Host {name}\n  HostName {ip}\n" for name, ip in ALIASES.items())
    (d / "ssh_config").write_text(
        f"{hosts}Host *\n  Port {port}\n  User {pwd.getpwuid(os.getuid()).pw_name}\n  IdentityFile {d / 'id'}\n"
        f"  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        f"  BatchMode yes\n")
    # pdsh and DeepSpeed's ssh check both run `ssh` from PATH: this one reads the test's config
    (d / "bin" / "ssh").write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {d / "ssh_config"} "$@"\n')
    (d / "bin" / "ssh").chmod(0o755)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation folder
    sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stdout=subprocess.DEVNULL,
                            stderr=open(d / "sshd.log", "w"))  # noqa: SIM115
    env = os.environ | {"PATH": f"{d / 'bin'}:{os.environ['PATH']}"}
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["ssh", "node-b", "true"], env=env, capture_output=True).returncode != 0:
            if sshd.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"the test's sshd did not accept a login: {(d / 'sshd.log').read_text()[-500:]}")
            time.sleep(0.2)
        yield d, env
    finally:
        sshd.terminate()
        sshd.wait(30)


@pytest.mark.slow
@pytest.mark.skipif(bool(ssh_missing()), reason=ssh_missing() or "-")
def test_deepspeed_hostfile_launch_over_ssh_matches_the_single_node_run(tmp_path, fixture_files, single_node,
                                                                       local_sshd):
    """docs/multi-node.md's ``deepspeed --hostfile`` command, one rank on each of two ssh "hosts" (pdsh starts
    DeepSpeed's per-node launcher through ssh): the same losses and adapter as the single-node launch, bit for bit.
    The ranks' environment reaches the other hosts only through DeepSpeed's exports (DS_ENV_FILE)."""
    d, env = local_sshd
    traj, ds = fixture_files
    (d / "hostfile").write_text("".join(f"{name} slots=1\n" for name in ALIASES))
    (d / "ds_env").write_text("".join(f"{k}={v}\n" for k, v in ENV.items()))
    out = tmp_path / "run"
    cmd = [str(BIN / "deepspeed"), "--hostfile", str(d / "hostfile"), "--master_addr", "127.0.0.1", "--master_port",
           str(free_port()), str(REPO / "launcher" / "train.py"), "--ds", str(ds), "--output-dir", str(out), *ARGS,
           f"data.trajectories={traj}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env | ENV | {"DS_ENV_FILE": str(d / "ds_env")}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "node-a: " in proc.stdout and "node-b: " in proc.stdout  # pdsh's prefixes: one launcher per host
    assert "nnodes=2, num_local_procs=1" in proc.stdout
    ref, got = _losses(single_node), _losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)) and all(got[s] == ref[s] for s in ref), (got, ref)
    _same_adapter(single_node, out)
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2

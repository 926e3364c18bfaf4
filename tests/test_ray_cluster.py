"""Generation and evaluation as Ray jobs on a real three-node cluster that loses nodes (all on this machine).

The cluster is three ``ray start --block`` processes, each with its own raylet: a head with no CPUs (it runs the
job drivers only) and two worker nodes ``a`` and ``b`` with 2 CPUs each and their own custom resource. Generation
(``ray_jobs/generate_trajectories.py``, 2 replicas) and evaluation (``eval/run.py``, 2 workers) are submitted together
as Ray jobs (``JobSubmissionClient``, what ``ray job submit`` calls); their replicas are spread, one of each per
worker node. Then:

* fault-free: the reference tokens and job times;
* SIGKILL of node b's raylet mid-job: both jobs finish on node a (whose CPUs are all taken, so Ray cannot restart the
  lost replicas anywhere: the drivers must move the work), every prompt exactly once in the verified manifest, every
  sample exactly once in the merge, tokens equal to the fault-free run; the evaluation driver moved node b's worker's
  jobs to node a's (that worker is frozen before it decodes anything: ``TDLM_EVAL_TEST_HOLD``);
* SIGKILL of the head's GCS and raylet mid-job: both drivers end with one line naming the lost head (no traceback,
  no hang); the same commands on a fresh cluster resume from the shards on disk and compute only what was missing.

Each fault's cost is printed as ``MEASURED ...`` lines (``pytest -s``): seconds from the kill to the job's end against
the fault-free job, and shards / samples redone. Timings are reported, never asserted (the machine is shared).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tdlm.data.prompts import PromptSource, load_prompts
from tdlm.data.store import sha256_of, shard_name
from tdlm.data.trajectories import read_parquet
from tdlm.evaluation.records import merge, read_records, shard_files
from tdlm.tasks.base import default_data_dir

psutil = pytest.importorskip("psutil")  # a Ray dependency: finds each node's raylet and the job drivers

REPO = Path(__file__).resolve().parents[1]
DATA = default_data_dir()
RAY = str(Path(sys.executable).parent / "ray")
# Multi-node joins need RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 (the other Ray tests set 0: single node on loopback).
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
JOB_ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
N_PROMPTS, SHARD, EVAL_LIMIT = 16, 2, 8  # 8 trajectory shards; 8 GSM8K samples in 2 shard files
# The head-loss jobs are twice as long, so that both are surely mid-way when the later of them reaches the kill point.
HEAD_PROMPTS, HEAD_LIMIT = 32, 16
EVAL_RUN = "runs/gsm8k/threshold-tau0.9"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
PROMPT_IDS: list[str] = []  # source ids of the prompt file, in order (set by the prompts fixture)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists(), reason=f"benchmarks not in {DATA}")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_ports() -> list[str]:
    """Free ports for one node's services: several raylets share this machine; worker ports picked by the OS."""
    flags = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")  # fmt: skip
    return [x for f in flags for x in (f, str(_free_port()))] + ["--min-worker-port", "0", "--max-worker-port", "0"]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not ended, not a zombie); one that ends while it is asked counts as ended."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _tree(pid: int) -> list:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class Cluster:
    """``ray start --block`` processes on 127.0.0.1: one head, worker nodes by name; killed by PID only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}
        self.generation = 0
        self.temps: list[str] = []  # every temp dir a node of this cluster used (removed at shutdown)
        self.orphans: dict[str, list] = {}  # node -> its processes seen before its raylet was killed

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = (self.root / f"{name}-{self.generation}.log").open("w")
        proc = subprocess.Popen([RAY, "start", "--block", "--node-ip-address", "127.0.0.1", *args],
                                env=self.env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        log.close()
        self.procs[name] = proc
        return proc

    def _log(self, name: str) -> str:
        return (self.root / f"{name}-{self.generation}.log").read_text()

    def start(self) -> None:
        self.generation += 1
        # A short temp dir of its own (AF_UNIX paths <= 107 bytes), also for ray_current_cluster.
        self.temp = f"/tmp/ray_tdlm_3n_{os.getpid()}_{self.generation}"
        self.temps.append(self.temp)
        self.env = {**os.environ, **RAY_ENV, "RAY_TMPDIR": self.temp}
        self.gcs_port, dash = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{dash}"
        self._start("head", ["--head", "--port", str(self.gcs_port), "--num-cpus", "0", "--include-dashboard=true",
                             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--ray-client-server-port",
                             str(_free_port()), "--temp-dir", self.temp, *_node_ports()])  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/api/version", timeout=2) as r:
                if r.status == 200:
                    break
            if self.procs["head"].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray head did not come up: {self._log('head')[-3000:]}")
            time.sleep(0.3)
        for name in ("a", "b"):
            self.add_worker(name)

    def add_worker(self, name: str, tries: int = 3) -> None:
        """One node at a time: under load two nodes starting together can outlast Ray's fixed 30 s registration wait."""
        for _ in range(tries):
            # A temp dir per node start: nodes sharing one would unpack each job's working_dir package into the same
            # folder, and one node re-unpacking it deleted the folder under a running driver (getcwd failed); a node
            # started again (after a kill) gets a new one, not the dead node's sockets and unpacked packages.
            temp = f"{self.temp}_{name}{len(self.temps)}"
            self.temps.append(temp)
            proc = self._start(name, ["--address", f"127.0.0.1:{self.gcs_port}", "--num-cpus", "2",
                                      "--resources", json.dumps({f"node_{name}": 1}), "--temp-dir", temp,
                                      *_node_ports()])  # fmt: skip
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and proc.poll() is None and "Ray runtime started" not in self._log(name):
                time.sleep(0.3)
            if "Ray runtime started" in self._log(name) and proc.poll() is None:
                return
            self.kill(name)
        pytest.fail(f"worker node {name} did not start: {self._log(name)[-3000:]}")

    def stopped(self, name: str) -> bool:
        """Whether this test killed node ``name`` (its ``ray start --block`` has exited), whatever the GCS says yet:
        it reports a killed node dead only after its health checks fail, which can outlast a short job."""
        proc = self.procs.get(name)
        return proc is None or proc.poll() is not None

    def node_ids(self) -> dict[str, str]:
        """Live nodes by name (head, a, b) from the dashboard's state API."""
        with urllib.request.urlopen(f"{self.url}/api/v0/nodes?limit=100", timeout=10) as r:
            nodes = json.loads(r.read())["data"]["result"]["result"]
        out = {}
        for n in nodes:
            if n["state"] != "ALIVE":
                continue
            names = [k[5:] for k in n.get("resources_total", {}) if k.startswith("node_") and k != "node_id"]
            names = [k for k in names if k in ("a", "b")]
            out[names[0] if names else "head"] = n["node_id"]
        return out

    def kill_services(self, name: str, services: tuple[str, ...]) -> float:
        """SIGKILL the named Ray processes of one node (``raylet``, ``gcs_server``); returns the time of the kill.
        The node's other processes are remembered first: once their raylet is dead they are orphans, no longer
        under ``ray start``, and :meth:`kill` must still find them (a frozen replica would live on for ever)."""
        tree = _tree(self.procs[name].pid)
        self.orphans.setdefault(name, []).extend(tree[1:])
        procs = [p for p in tree[1:] if p.name() in services]
        assert {p.name() for p in procs} == set(services), [p.name() for p in procs]
        t = time.monotonic()
        for p in procs:
            p.send_signal(signal.SIGKILL)
        return t

    def kill(self, name: str) -> None:
        for p in _tree(self.procs[name].pid) + self.orphans.pop(name, []):
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.procs[name].wait(timeout=30)

    def shutdown(self) -> None:
        for name in list(self.procs)[::-1]:
            self.kill(name)
        self.procs.clear()
        for path in self.temps:
            shutil.rmtree(path, ignore_errors=True)
        self.temps.clear()

    # -- jobs ------------------------------------------------------------------------------------
    def submit(self, entrypoint: list[str], env: dict | None = None) -> Job:
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(self.url)
        runtime_env = {"working_dir": str(REPO), "env_vars": {**JOB_ENV, **(env or {})}}
        t = time.monotonic()
        job_id = client.submit_job(entrypoint=" ".join(entrypoint), runtime_env=runtime_env)
        logs = Path(os.path.realpath(f"{self.temp}/session_latest")) / "logs" / f"job-driver-{job_id}.log"
        job = Job(client, job_id, logs, t)
        # Until its driver runs, a job's working_dir package is being unpacked; a second job with the same package
        # unpacking it at the same time once deleted the folder under the first driver (FileNotFoundError: getcwd).
        deadline = time.monotonic() + 120
        while job.status() == "PENDING" and time.monotonic() < deadline:
            time.sleep(0.1)
        return job


class Job:
    def __init__(self, client, job_id: str, log: Path, submitted: float) -> None:
        self.client, self.id, self.log, self.submitted = client, job_id, log, submitted
        self.ended: float | None = None

    def status(self) -> str:
        return str(self.client.get_job_status(self.id)).rsplit(".", 1)[-1]

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def wait_all(jobs: list[Job], timeout: float = 900) -> None:
    """Poll every 0.25 s until every job ended (its end time recorded); fail with the logs of a failed one. The limit is
    generous: the head-loss rerun (a fresh cluster, 30 of 32 shards) took 175 s at load 15 on 2 cores."""
    deadline = time.monotonic() + timeout
    while any(j.ended is None for j in jobs):
        for j in jobs:
            if j.ended is None and j.status() in TERMINAL:
                j.ended = time.monotonic()
        if time.monotonic() > deadline:
            pytest.fail("jobs did not end: " + " | ".join(f"{j.id}: {j.text()[-1500:]}" for j in jobs))
        time.sleep(0.25)
    for j in jobs:
        assert j.status() == "SUCCEEDED", j.text()[-4000:]


def wait_for(cond, what: str, timeout: float = 240, jobs: tuple[Job, ...] = (), cluster: Cluster | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for j in jobs:
            if j.status() in TERMINAL:
                pytest.fail(f"job ended before {what}: {j.text()[-3000:]}")
        if time.monotonic() > deadline:
            # what is needed to diagnose a stall: each job's driver log and the nodes' states
            nodes = ""
            if cluster is not None:
                with contextlib.suppress(Exception), \
                        urllib.request.urlopen(f"{cluster.url}/api/v0/nodes?limit=100", timeout=10) as r:
                    nodes = str([(n["state"], sorted(k for k in n.get("resources_total", {}) if k.startswith("node_")),
                                  n.get("resources_total", {}).get("CPU")) for n in
                                 json.loads(r.read())["data"]["result"]["result"]])  # fmt: skip
            logs = " | ".join(f"{j.id} {j.status()}: {j.text()[-2000:]}" for j in jobs)
            pytest.fail(f"timed out waiting for {what}; nodes {nodes}; jobs {logs}")
        time.sleep(0.1)


# -- the two jobs --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "questions.jsonl"
    path.write_text("".join(json.dumps({"question": f"Tom has {i} apples and buys {i + 3} more. How many now?"}) + "\n"
                            for i in range(HEAD_PROMPTS)))  # fmt: skip
    PROMPT_IDS[:] = [p.source_id for p in load_prompts(PromptSource(str(path), "question"))]
    return path


def gen_command(out: Path, prompts: Path, n: int = N_PROMPTS) -> list[str]:
    return [sys.executable, "ray_jobs/generate_trajectories.py", "--backbone", "tiny-llada", "--prompts", str(prompts),
            "--num-prompts", str(n), "--policy", "threshold", "--gen-length", "48", "--block-size", "8",
            "--shard-size", str(SHARD), "--batch-size", "1", "--actors", "2", "--output-dir", str(out),
            "--log-interval", "1", "--head-timeout-s", "1"]  # fmt: skip


def eval_command(out: Path, limit: int = EVAL_LIMIT) -> list[str]:
    return [sys.executable, "eval/run.py", "--backbone", "tiny-llada", "--tasks", "gsm8k", "--limit", str(limit),
            "--gen-length", "48", "--block-size", "8", "--policies", "threshold", "--workers", "2", "--threads", "1",
            "--warmup", "0", "--score-workers", "1", "--data-dir", str(DATA), "--output-dir", str(out),
            "--wandb-mode", "disabled", "--head-timeout-s", "1"]  # fmt: skip


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").exists() else {}


def gen_tokens(out: Path, n: int = N_PROMPTS) -> list[tuple]:
    """Every prompt exactly once, in order, in shards whose bytes match the manifest; (id, response, reveal, T)."""
    m = manifest(out)
    assert m["status"] == "complete" and m["counts"]["finished_prompts"] == n
    for name, entry in m["shards"].items():
        assert sha256_of(out / name) == entry["sha256"]
    records = [r for i in range(m["num_shards"]) for r in read_parquet(out / shard_name(i))]
    assert [r.source_id for r in records] == PROMPT_IDS[:n]
    return [(r.source_id, r.response_ids, r.reveal_steps, r.T) for r in records]




def eval_records(out: Path) -> list[dict]:
    return [r for f in shard_files(out / EVAL_RUN) for r in read_records(f)]


def eval_tokens(out: Path, limit: int = EVAL_LIMIT) -> dict[str, list[int]]:
    """Every sample exactly once in the merge and in the shard files; id -> response tokens."""
    ids = [f"gsm8k/{i:04d}" for i in range(limit)]
    merged = merge(out / EVAL_RUN, ids)
    assert sorted(r["id"] for r in eval_records(out)) == ids  # no sample decoded twice
    assert [r["id"] for r in read_records(out / EVAL_RUN / "samples.jsonl")] == ids
    return {r["id"]: r["tokens"] for r in merged}


def driver_pids(out: Path) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        argv = p.info["cmdline"] or []
        cmd = " ".join(argv)
        script = "generate_trajectories.py" in cmd or "eval/run.py" in cmd
        if argv and argv[0] == sys.executable and str(out) in cmd and script:  # not the entrypoint's /bin/sh
            found.append(p.info["pid"])
    return found


def measured(line: str) -> None:
    print(f"MEASURED {line}", flush=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start()
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def fault_free(cluster, prompts, tmp_path_factory) -> dict:
    """Both jobs once without a fault: reference tokens, job seconds, and where the replicas ran."""
    root = tmp_path_factory.mktemp("fault_free")
    gen, ev = cluster.submit(gen_command(root / "traj", prompts)), cluster.submit(eval_command(root / "eval"))
    wait_all([gen, ev])
    nodes = cluster.node_ids()
    replica_nodes = {p["node_id"] for p in manifest(root / "traj")["runs"][-1]["replica_processes"]}
    assert replica_nodes == {nodes["a"], nodes["b"]}  # SPREAD: one replica on each worker node
    assert {nodes["a"][:12], nodes["b"][:12]} <= {line.rsplit("node ", 1)[-1].rstrip(")") for line in
                                                  ev.text().splitlines() if "worker" in line and " up: " in line}
    out = {"gen": gen_tokens(root / "traj"), "eval": eval_tokens(root / "eval"),
           "gen_s": gen.ended - gen.submitted, "eval_s": ev.ended - ev.submitted}  # fmt: skip
    measured(f"fault-free: generation job {out['gen_s']:.1f} s, evaluation job {out['eval_s']:.1f} s "
             f"({N_PROMPTS} trajectories in {N_PROMPTS // SHARD} shards, {EVAL_LIMIT} samples; load "
             f"{os.getloadavg()[0]:.1f})")  # fmt: skip
    return out


def test_worker_node_loss_finishes_on_the_survivor(cluster, fault_free, prompts, tmp_path):
    env = {"TDLM_TEST_SHARD_BARRIER": "2", "TMPDIR": str(tmp_path)}  # both replicas hold a shard before any decodes
    hold = tmp_path / "eval-hold"  # the evaluation driver submits no job while this file exists (HOLD_ENV)
    hold.touch()
    gen = cluster.submit(gen_command(tmp_path / "traj", prompts), env)
    ev = cluster.submit(eval_command(tmp_path / "eval"), {"TDLM_EVAL_TEST_HOLD": str(hold)})

    # Each job's process on node b is frozen (SIGSTOP) before node b dies, so that both have work in flight on b however
    # fast this machine runs them: the generation replica once both replicas hold a shard (the barrier), the evaluation
    # worker once both workers are up, before any job was submitted (the hold, released right after the freeze), so
    # none of its shard is done and the driver must move all of it. Then node b is lost: SIGKILL of its raylet and of
    # every other process of the node (agents, the frozen replicas), as when the machine goes away.
    def eval_file(w: int) -> Path:
        return tmp_path / "eval" / EVAL_RUN / "shards" / f"shard-{w:03d}-of-002.jsonl"

    todo = {"gen": (gen, r"replica (\d+) up: pid (\d+)",  # both replicas hold a shard (the barrier)
                    lambda up: len([p for d in tmp_path.glob("shard-barrier-*") for p in d.iterdir()]) >= 2),
            "eval": (ev, r"worker (\d+) up: pid (\d+)", lambda up: len(up) >= 2)}  # fmt: skip
    frozen: dict[str, list[tuple[int, int]]] = {}  # job -> (slot, pid) of its processes on node b

    def freeze_on_b() -> bool:
        on_b = {p.pid for p in _tree(cluster.procs["b"].pid)}
        for key, (job, pattern, ready) in list(todo.items()):
            up = [(int(w), int(p)) for w, p in re.findall(pattern, job.text())]
            mine = [(w, p) for w, p in up if p in on_b]
            if mine and ready(up):
                for _, pid in mine:
                    with contextlib.suppress(psutil.Error):
                        psutil.Process(pid).send_signal(signal.SIGSTOP)
                frozen[key] = mine
                del todo[key]
                if key == "eval":
                    hold.unlink()
        return not todo

    try:
        wait_for(freeze_on_b, "both jobs with work on both nodes", jobs=(gen, ev), cluster=cluster)
    finally:
        hold.unlink(missing_ok=True)
    gen_done = manifest(tmp_path / "traj").get("counts", {}).get("finished_shards", 0)
    t_kill = cluster.kill_services("b", ("raylet",))
    cluster.kill("b")
    wait_all([gen, ev])
    assert gen_tokens(tmp_path / "traj") == fault_free["gen"]
    assert eval_tokens(tmp_path / "eval") == fault_free["eval"]
    run = manifest(tmp_path / "traj")["runs"][-1]
    assert run["failures"], "the kill hit no shard in flight"  # a shard of node b was redone on node a
    redone = sorted({f["shard"] for f in run["failures"]})
    # node b's evaluation worker decoded nothing (frozen before its first job); the driver moved its jobs to the
    # worker on node a ("worker W is gone (...); worker V takes over its N job(s)"), which decoded them
    [(w_b, pid_b)] = frozen["eval"]
    moves = [(int(w), int(v), int(n)) for w, v, n in
             re.findall(r"worker (\d+) is gone \(.*?\); worker (\d+) takes over its (\d+) job", ev.text())]  # fmt: skip
    assert [(w, n > 0) for w, v, n in moves] == [(w_b, True)] and moves[0][1] != w_b, ev.text()[-3000:]
    assert all(r["worker"]["pid"] != pid_b for r in read_records(eval_file(w_b)))
    sessions = [{r["worker"]["session"] for r in read_records(f)} for f in shard_files(tmp_path / "eval" / EVAL_RUN)]
    assert max(len(x) for x in sessions) <= 2, ev.text()[-3000:]
    measured(f"worker node b lost (raylet, then all its processes SIGKILLed): generation {gen.ended - t_kill:.1f} s "
             f"from kill to job end "
             f"(job {gen.ended - gen.submitted:.1f} s vs fault-free {fault_free['gen_s']:.1f} s: "
             f"{gen.ended - gen.submitted - fault_free['gen_s']:+.1f} s), {gen_done} shards finished at the kill, "
             f"shards redone {redone}; evaluation {ev.ended - t_kill:.1f} s from kill to job end (job "
             f"{ev.ended - ev.submitted:.1f} s vs {fault_free['eval_s']:.1f} s: "
             f"{ev.ended - ev.submitted - fault_free['eval_s']:+.1f} s), samples decoded twice 0 (the driver moved "
             f"{moves[0][2]} job(s) of node b's worker {w_b} to worker {moves[0][1]}); "
             f"load {os.getloadavg()[0]:.1f}")  # fmt: skip


def test_head_loss_fails_in_one_line_and_the_rerun_resumes(cluster, fault_free, prompts, tmp_path):
    if cluster.stopped("b"):  # the previous test took node b down: the job again spans three nodes
        # once the GCS has noticed (until then the dead node still counts as b, and a job placed on it never starts)
        wait_for(lambda: "b" not in cluster.node_ids(), "the killed node b reported dead", timeout=180)
        cluster.add_worker("b")
    traj, ev_out = tmp_path / "traj", tmp_path / "eval"
    gen_cmd, eval_cmd = gen_command(traj, prompts, HEAD_PROMPTS), eval_command(ev_out, HEAD_LIMIT)
    gen, ev = cluster.submit(gen_cmd), cluster.submit(eval_cmd)
    # Each job's replicas are frozen (SIGSTOP) once it has finished work on disk, so that both jobs are mid-way when
    # the head dies however fast this loaded machine runs them; the drivers then meet the lost head, not the end.
    todo = {gen.id: (gen, lambda: manifest(traj).get("shards"), "replica"),
            ev.id: (ev, lambda: eval_records(ev_out), "worker")}

    def freeze_done() -> bool:
        for key, (job, done, word) in list(todo.items()):
            # ">= 2": a replica that Ray restarted logs a second "up" line; every pid listed is frozen
            pids = re.findall(rf"{word} \d+ up: pid (\d+)", job.text())
            if len(pids) >= 2 and done():
                for pid in pids:
                    with contextlib.suppress(psutil.Error):
                        psutil.Process(int(pid)).send_signal(signal.SIGSTOP)
                del todo[key]
        return not todo

    wait_for(freeze_done, "finished work of both jobs", jobs=(gen, ev), cluster=cluster)
    drivers = driver_pids(traj) + driver_pids(ev_out)
    assert len(drivers) == 2, drivers
    at_kill = (len(manifest(traj)["shards"]), len(eval_records(ev_out)))
    t_kill = cluster.kill_services("head", ("gcs_server", "raylet"))
    deadline = time.monotonic() + 90
    t_line = None
    while any(_alive(p) for p in drivers):
        assert time.monotonic() < deadline, "a driver did not end after the head was lost"
        if t_line is None and all("error: lost the Ray head" in j.text() for j in (gen, ev)):
            t_line = time.monotonic()
        time.sleep(0.1)
    t_end = time.monotonic()
    t_line = t_line or t_end
    at_end = (len(manifest(traj)["shards"]), len(eval_records(ev_out)))
    for job in (gen, ev):
        lines = [x for x in job.text().splitlines() if x.strip()]
        assert "Traceback" not in job.text(), job.text()[-3000:]
        # Ray advertises the GCS on the machine's own address even with --node-ip-address 127.0.0.1
        head = rf"error: lost the Ray head at [\d.]+:{cluster.gcs_port} \(no answer for \d+ s\); "
        assert re.match(head, lines[-1]), lines[-3:]
        assert "rerun the same command" in lines[-1]
    cluster.shutdown()  # what is left of the old cluster, including replicas still decoding without a driver
    before_shards = set(manifest(traj)["shards"])
    before_samples = len(eval_records(ev_out))
    n_shards = HEAD_PROMPTS // SHARD
    assert 0 < len(before_shards) < n_shards and 0 < before_samples < HEAD_LIMIT, \
        (at_kill, at_end, t_end - t_kill, ev.text()[-2500:])  # fmt: skip

    cluster.start()  # a fresh cluster; the same two commands
    t_rerun = time.monotonic()
    gen2, ev2 = cluster.submit(gen_cmd), cluster.submit(eval_cmd)
    wait_all([gen2, ev2])
    tokens, samples = gen_tokens(traj, HEAD_PROMPTS), eval_tokens(ev_out, HEAD_LIMIT)
    # the first prompts / problems are the fault-free jobs': same tokens
    assert tokens[:N_PROMPTS] == fault_free["gen"] and {k: samples[k] for k in fault_free["eval"]} == fault_free["eval"]
    run = manifest(traj)["runs"][-1]
    computed = {shard_name(i) for i in run["computed_shards"]}
    assert computed.isdisjoint(before_shards) and len(computed) + len(before_shards) == n_shards - run["adopted_shards"]
    decoded = HEAD_LIMIT - before_samples
    assert f"{decoded} samples decoded, {before_samples} resumed" in ev2.text()
    measured(f"head GCS+raylet SIGKILL: both drivers printed their one line {t_line - t_kill:.1f} s after the kill "
             f"and exited after {t_end - t_kill:.1f} s; "
             f"{len(before_shards)}/{n_shards} shards and {before_samples}/{HEAD_LIMIT} samples kept; "
             f"rerun on a fresh cluster computed {len(computed)} shards ({run['adopted_shards']} adopted) and decoded "
             f"{decoded} samples, none twice; rerun jobs {gen2.ended - t_rerun:.1f} s / {ev2.ended - t_rerun:.1f} s "
             f"(fault-free jobs of half the size {fault_free['gen_s']:.1f} / {fault_free['eval_s']:.1f} s); load "
             f"{os.getloadavg()[0]:.1f}")  # fmt: skip

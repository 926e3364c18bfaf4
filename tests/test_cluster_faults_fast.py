"""Fault paths of the Ray drivers that only the slow three-node test (tests/test_ray_cluster.py) reaches, in seconds
and without Ray: the head watch (:class:`tdlm.data.ray_watch.ClusterWatch`) against a socket this test opens and
closes, and the evaluation driver's worker loss (:func:`tdlm.evaluation.driver.run_on_ray` on the actor pool,
:class:`tdlm.data.ray_pool.ActorPool`) against a fake ``ray`` module whose actors die when the test says.

* the watch fires once the head has been silent for ``timeout_s`` (a port nothing listens on), not before, and a head
  that answers again before then starts the silence over; a dead-node read that never returns (a GCS killed during
  it) does not hold the driver;
* a worker that dies with jobs in flight (``ActorDiedError``), or whose node the GCS reports dead while its jobs
  hang, hands every job it had not finished to the live worker, in the plan's order; every job runs exactly once
  and no finished job runs again; when the last worker's node dies, a new worker finishes the jobs.
"""

from __future__ import annotations

import collections
import socket
import sys
import threading
import time
import types

import pytest

from tdlm.data import ray_watch
from tdlm.data.ray_watch import ClusterWatch, HeadLost, head_lost
from tdlm.decoding.config import DecodeSettings
from tdlm.evaluation import driver
from tdlm.evaluation.config import EvalConfig
from tdlm.evaluation.worker import ShardJob, ShardReport

ray_exceptions = pytest.importorskip("ray.exceptions")  # the real exception classes the driver catches


@pytest.fixture(autouse=True)
def _head_flag(monkeypatch):
    """HeadLost sets a process-wide flag that makes the evaluation CLI leave with os._exit: restored after each test,
    so no later test in this process meets it."""
    monkeypatch.setattr(ray_watch, "_HEAD_LOST", False)


class Clock:
    """``time`` for the watch: the test moves it, so no check depends on how fast this loaded machine runs."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


class Head:
    """A stand-in for the GCS port on 127.0.0.1: bound for the whole test (no other process can take the port), and
    answering a TCP connect only while :meth:`answer` is on."""

    def __init__(self) -> None:
        self.sock = self._bound(0)
        self.port = self.sock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"

    @staticmethod
    def _bound(port: int) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        return s

    def answer(self, on: bool) -> None:
        if on:
            self.sock.listen(64)
        else:  # a bound socket that does not listen: a connect is refused, as on a dead head's port
            self.sock.close()
            self.sock = self._bound(self.port)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2):
                return True
        except OSError:
            return False

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def head():
    h = Head()
    yield h
    h.close()


def test_watch_fires_on_a_silent_head(head, monkeypatch):
    assert not head.answers()  # nothing listens on the port
    clock = Clock()
    monkeypatch.setattr(ray_watch, "time", clock)

    def no_nodes() -> list[dict]:
        raise AssertionError("the GCS is read only while the head answers")

    watch = ClusterWatch(5.0, 1.0, address=head.address, nodes=no_nodes)
    for _ in range(4):  # 1..4 s of silence: not yet
        clock.t += 1.0
        assert watch.check("kept") == set() and not watch.lost
    clock.t += 1.0
    with pytest.raises(HeadLost) as e:  # 5 s: the first probe at the timeout fires
        watch.check("3 sample(s) not submitted")
    msg = str(e.value)
    assert msg == (f"lost the Ray head at {head.address} (no answer for 5 s); 3 sample(s) not submitted: "
                   f"rerun the same command on a running cluster to resume")  # fmt: skip
    assert watch.lost and head_lost()

    # the same on the real clock, with no Ray anywhere: 0.3 s of silence fires within a generous bound
    monkeypatch.setattr(ray_watch, "time", time)
    monkeypatch.setattr(ray_watch, "_HEAD_LOST", False)
    watch = ClusterWatch(0.3, 0.05, address=head.address, nodes=no_nodes)
    t0 = time.monotonic()
    with pytest.raises(HeadLost):
        while time.monotonic() - t0 < 60:
            watch.check("kept")
            time.sleep(0.01)
    assert 0.3 <= time.monotonic() - t0 < 60


def test_watch_a_head_that_answers_again_resets_the_silence(head, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(ray_watch, "time", clock)
    nodes = [{"NodeID": "a", "Alive": True}, {"NodeID": "b", "Alive": False}]
    watch = ClusterWatch(5.0, 1.0, address=head.address, nodes=lambda: nodes)
    head.answer(True)
    clock.t += 1.0
    assert watch.check("kept") == {"b"}  # an answering head: the dead nodes are read from the GCS

    clock.t += 0.5
    head.answer(False)
    assert watch.check("kept") == {"b"}  # within the interval: no probe, the last answer
    for _ in range(4):  # 4 s silent (< 5): the last answer is kept
        clock.t += 1.0
        assert watch.check("kept") == {"b"}
    head.answer(True)  # answers again before the timeout ...
    nodes.append({"NodeID": "c", "Alive": False})
    clock.t += 1.0
    assert watch.check("kept") == {"b", "c"}
    head.answer(False)  # ... so the next silence is counted from that answer, not from the first one
    for _ in range(4):
        clock.t += 1.0
        assert watch.check("kept") == {"b", "c"}, "fired on silence counted from before the head answered again"
    assert not watch.lost and not head_lost()
    clock.t += 1.0
    with pytest.raises(HeadLost, match=r"\(no answer for 5 s\)"):
        watch.check("kept")


def test_watch_never_waits_on_a_node_read_that_does_not_return(head):
    """A GCS that dies during the dead-node read blocks that read until Ray's 60 s reconnect limit, after which Ray
    exits the process from C++ without the one-line error: a check returns at once, starts no second read while the
    first hangs, uses the read's answer once it comes, and a silent head still fires."""
    release = threading.Event()
    reads = []

    def stuck() -> list[dict]:
        reads.append(time.monotonic())
        release.wait(20)
        return [{"NodeID": "x", "Alive": False}]

    head.answer(True)
    watch = ClusterWatch(1.0, 0.05, address=head.address, nodes=stuck)
    try:
        for _ in range(3):
            time.sleep(0.06)
            t0 = time.monotonic()
            got = watch.check("kept")
            blocked = time.monotonic() - t0
            assert blocked < 10, f"a check waited {blocked:.1f} s on a node read that does not return"
            assert got == set()  # nothing known yet; the driver goes on
        assert len(reads) == 1  # one hanging read, not one per check
        release.set()
        deadline = time.monotonic() + 30
        while watch.check("kept") != {"x"}:  # the read's answer is used once it comes
            assert time.monotonic() < deadline
            time.sleep(0.06)
        head.answer(False)
        with pytest.raises(HeadLost):
            while time.monotonic() < deadline:
                watch.check("kept")
                time.sleep(0.01)
    finally:
        release.set()


# -- the evaluation driver's worker loss, on a fake Ray ---------------------------------------------------------
class Ref:
    """One actor call; the fake runs an actor's calls one at a time in the order they were submitted."""

    def __init__(self, actor: FakeActor, method: str, arg: object) -> None:
        self.actor, self.method, self.arg = actor, method, arg


STARTUP_S = 0.3  # an actor's start-up: the driver loops (and checks the dead nodes) while a new actor loads


class FakeActor:
    def __init__(self, ray: FakeRay, name: str, node: str) -> None:
        self.ray, self.name, self.node = ray, name, node
        self.calls: collections.deque[Ref] = collections.deque()  # not finished yet, in order
        self.up_at = time.monotonic() + STARTUP_S  # info() answers once the model is "loaded"
        self.done_jobs = 0
        self.dead = self.killed = False
        self.info = types.SimpleNamespace(remote=lambda: self._call("info", None))
        self.run_shard = types.SimpleNamespace(remote=lambda job: self._call("run_shard", job))

    def _call(self, method: str, arg: object) -> Ref:
        ref = Ref(self, method, arg)
        self.calls.append(ref)
        return ref


class FakeRay(types.ModuleType):
    """What :func:`run_on_ray` calls of ``ray``. ``deaths[i] = (n, how)``: the i-th actor started dies once it has
    finished n jobs, ``"error"``: its unfinished calls raise ActorDiedError; ``"node"``: its node dies, its calls
    hang (Ray waits for a restart that has no room) and the GCS reports the node dead."""

    def __init__(self, gcs_address: str, deaths: dict[int, tuple[int, str]]) -> None:
        super().__init__("ray")
        self.gcs_address, self.deaths = gcs_address, deaths
        self.actors: list[FakeActor] = []
        self.ran: list[tuple[str, str]] = []  # (problem id, actor) of every finished job, in order
        self.dead_nodes: set[str] = set()
        self.in_flight_at_death: dict[str, list[str]] = {}  # actor -> problem ids it had not finished
        self.exceptions = ray_exceptions

    # -- the API the driver uses
    def is_initialized(self) -> bool:
        return True

    def get_runtime_context(self):
        return types.SimpleNamespace(gcs_address=self.gcs_address)

    def nodes(self) -> list[dict]:
        return [{"NodeID": n, "Alive": False} for n in self.dead_nodes] + [{"NodeID": "live", "Alive": True}]

    def cluster_resources(self) -> dict:
        return {"CPU": 4.0}

    def remote(self, cls):
        def launch(spec) -> FakeActor:
            i = len(self.actors)
            actor = FakeActor(self, f"actor{i}", f"node{i}")
            self.actors.append(actor)
            return actor

        return types.SimpleNamespace(options=lambda **kw: types.SimpleNamespace(remote=launch))

    def kill(self, actor: FakeActor, no_restart: bool = True) -> None:
        assert no_restart
        actor.killed = True

    def wait(self, refs: list[Ref], num_returns: int = 1, timeout: float | None = None):
        for ref in refs:  # each actor's oldest unfinished call is the next to end
            a = ref.actor
            if a.dead == "node" or a.killed and not a.dead:
                continue  # hangs: a dead node's calls, or a killed actor's (the driver dropped them)
            if a.dead or a.calls and a.calls[0] is ref and (ref.method != "info" or time.monotonic() >= a.up_at):
                return [ref], [r for r in refs if r is not ref]
        time.sleep(0.01)
        return [], refs

    def get(self, ref: Ref):
        a = ref.actor
        if a.dead:
            a.calls.remove(ref)
            raise ray_exceptions.ActorDiedError()
        assert a.calls.popleft() is ref
        if ref.method == "info":
            return {"node_id": a.node, "pid": 1, "host": "h", "device": "cpu", "device_name": "cpu",
                    "cuda_visible_devices": None}  # fmt: skip
        job: ShardJob = ref.arg
        self.ran += [(pid, a.name) for pid, _, _ in job.problems]
        a.done_jobs += 1
        n, how = self.deaths.get(self.actors.index(a), (None, None))
        if a.done_jobs == n:
            a.dead = how
            self.in_flight_at_death[a.name] = [c.arg.problems[0][0] for c in a.calls if c.method == "run_shard"]
            if how == "node":
                self.dead_nodes.add(a.node)
        return ShardReport(job.run_dir, job.shard, len(job.problems), 0, 0.0)


def _jobs(num_shards: int, per_shard: int) -> list[ShardJob]:
    """The plan's order: round k holds the k-th job of every shard (one problem each, as with batch size 1)."""
    return [ShardJob({}, "/runs/arith/x", w, num_shards, [(f"p{w}-{k}", k, "q")], DecodeSettings(), 0)
            for k in range(per_shard) for w in range(num_shards)]  # fmt: skip


def _run(monkeypatch, tmp_path, head: Head, jobs: list[ShardJob], num_shards: int, deaths,
         fake: FakeRay | None = None) -> FakeRay:  # fmt: skip
    head.answer(True)  # the GCS answers: the watch reads the dead nodes
    fake = fake or FakeRay(head.address, deaths)
    monkeypatch.setitem(sys.modules, "ray", fake)
    cfg = EvalConfig(backbone="tiny-arith", output_dir=str(tmp_path), tasks=["arith"], workers=num_shards,
                     head_timeout_s=60.0)  # fmt: skip
    t0 = time.monotonic()
    driver.run_on_ray(cfg, jobs, num_shards)
    assert time.monotonic() - t0 < 60
    return fake


def _check_exactly_once(fake: FakeRay, jobs: list[ShardJob]) -> None:
    counts = collections.Counter(pid for pid, _ in fake.ran)
    planned = [j.problems[0][0] for j in jobs]
    assert sorted(counts) == sorted(planned), f"jobs never run: {sorted(set(planned) - set(counts))}"
    assert all(n == 1 for n in counts.values()), f"jobs run twice: {[p for p, n in counts.items() if n > 1]}"


@pytest.mark.parametrize("how", ["error", "node"])
def test_a_lost_workers_jobs_move_to_the_live_worker_exactly_once(monkeypatch, tmp_path, head, how):
    jobs = _jobs(2, 6)
    fake = _run(monkeypatch, tmp_path, head, jobs, 2, {1: (2, how)})  # actor1 (shard 1) dies after 2 jobs
    _check_exactly_once(fake, jobs)
    moved = fake.in_flight_at_death["actor1"]
    assert moved, "the death hit no job in flight"
    by = dict(fake.ran)
    assert [p for p, _ in fake.ran if p.startswith("p1-")][:2] == ["p1-0", "p1-1"] and by["p1-0"] == "actor1"
    assert all(by[p] == "actor0" for p in moved), by  # its in-flight jobs ran on the live worker
    assert all(by[f"p1-{k}"] == "actor0" for k in range(2, 6))  # ... and so did the rest of its shard
    assert [p for p, _ in fake.ran if p.startswith("p1-")] == [f"p1-{k}" for k in range(6)]  # in the plan's order
    assert len(fake.actors) == 2 and fake.actors[1].killed  # no new actor while one is live; the lost one killed


def test_the_last_workers_node_dies_and_a_new_worker_finishes(monkeypatch, tmp_path, head):
    jobs = _jobs(1, 5)
    fake = _run(monkeypatch, tmp_path, head, jobs, 1, {0: (2, "node")})
    _check_exactly_once(fake, jobs)
    assert [a for _, a in fake.ran] == ["actor0"] * 2 + ["actor1"] * 3
    assert len(fake.actors) == 2  # one replacement, not one per check of the dead node


def test_the_test_hold_submits_nothing_until_released(monkeypatch, tmp_path, head):
    """The premise of the three-node test's moved-jobs check: with ``TDLM_EVAL_TEST_HOLD`` naming a file that exists,
    the actors start and report but no job is submitted; once the file is gone every job runs, exactly once."""
    hold = tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv(driver.HOLD_ENV, str(hold))
    jobs = _jobs(2, 3)
    fake = FakeRay(head.address, {})
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _run(monkeypatch, tmp_path, head, jobs, 2, {}, fake)
        except BaseException as e:  # reported by the test's thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not (len(fake.actors) == 2 and all(not a.calls for a in fake.actors)):  # both answered info()
            assert time.monotonic() < deadline, "the actors did not report"
            time.sleep(0.05)
        time.sleep(1.0)  # several loops of the driver while held
        assert fake.ran == [] and all(not a.calls for a in fake.actors), "a job was submitted while held"
    finally:
        hold.unlink()
        t.join(60)
    assert not t.is_alive() and not errors, errors
    _check_exactly_once(fake, jobs)

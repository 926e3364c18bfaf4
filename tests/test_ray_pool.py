"""The one Ray actor pool of the generation and evaluation drivers (:class:`tdlm.data.ray_pool.ActorPool`), in seconds
and without a cluster: a fake ``ray`` module whose actors run their calls in order, end or die when the test says,
and a watch that reports dead nodes when the test says (the real :class:`~tdlm.data.ray_watch.ClusterWatch` for the
head-loss test, against a port nothing listens on).

* exactly once: a lost actor's call whose result was already on its way is used, and the moved copy of its job is
  then dropped, whichever copy ends first; a job never reaches ``done`` twice;
* a lost actor's jobs go back in the plan's order: homed jobs into the taker's queue at their plan positions, shared
  jobs into the shared queue before the later ones;
* a lost actor is replaced (``keep_size``, or when no actor is left), once per loss, up to ``max_replacements``;
* a lost head stops the pool in one line naming what is kept, and no Ray call is made after it.
"""

from __future__ import annotations

import collections
import logging
import socket
import sys
import time
import types
from collections.abc import Callable

import pytest

from tdlm.data import ray_watch
from tdlm.data.ray_pool import ActorPool, PoolJob
from tdlm.data.ray_watch import ClusterWatch, HeadLost
from tdlm.errors import TDLMError

ray_exceptions = pytest.importorskip("ray.exceptions")  # the real exception classes the pool catches

log = logging.getLogger("tdlm.test_ray_pool")


@pytest.fixture(autouse=True)
def _head_flag(monkeypatch):
    monkeypatch.setattr(ray_watch, "_HEAD_LOST", False)  # set by HeadLost for the whole process; restored


class Ref:
    def __init__(self, actor: Actor, method: str, arg: object) -> None:
        self.actor, self.method, self.arg = actor, method, arg


class Actor:
    """Runs its calls one at a time in submission order. ``die_after``: dies (its calls raise ActorDiedError) once it
    finished that many jobs; ``late``: jobs whose result was produced before the actor was lost, but arrives only once
    ``gate()`` is true (they succeed even after the kill)."""

    def __init__(self, fake: FakeRay, name: str, node: str) -> None:
        self.fake, self.name, self.node = fake, name, node
        self.calls: collections.deque[Ref] = collections.deque()
        self.finished = 0
        self.dead = self.killed = False
        self.die_after: int | None = None
        self.die_on_job = False  # dies as it takes its first job (that job fails)
        self.slow_start = 0  # its info() answers only after this many more waits of the driver (loading a model)
        self.late: dict[object, Callable[[], bool]] = {}
        self.info = types.SimpleNamespace(remote=lambda: self._call("info", None))
        self.run_shard = types.SimpleNamespace(remote=lambda payload: self._call("run", payload))

    def _call(self, method: str, arg: object) -> Ref:
        assert not self.fake.head_lost, "a Ray call after the head was lost"
        ref = Ref(self, method, arg)
        self.calls.append(ref)
        if method == "run":
            self.fake.submitted.append((arg, self.name))
            self.dead = self.dead or self.die_on_job
        return ref

    def ready(self, ref: Ref) -> bool:
        if ref.arg in self.late:
            return self.late[ref.arg]()
        if self.dead or self.killed:
            return True  # fails at once
        if ref.method == "info" and self.slow_start > 0:
            self.slow_start -= 1
            return False
        return bool(self.calls) and self.calls[0] is ref and not self.fake.hung(self)


class FakeRay(types.ModuleType):
    """What the pool calls of ``ray``. ``plan[i]``: a function that configures the i-th actor started."""

    def __init__(self, plan: dict[int, Callable[[Actor], None]] | None = None) -> None:
        super().__init__("ray")
        self.plan = plan or {}
        self.actors: list[Actor] = []
        self.ran: list[tuple[object, str]] = []  # (payload, actor) of every job that ended with a result
        self.submitted: list[tuple[object, str]] = []
        self.hung_nodes: set[str] = set()
        self.head_lost = False
        self.kills: list[str] = []
        self.after_head_loss: list[str] = []  # Ray calls made after the head was lost (each would block or exit)
        self.exceptions = ray_exceptions

    def hung(self, actor: Actor) -> bool:
        return actor.node in self.hung_nodes

    def launch(self) -> Actor:
        assert not self.head_lost, "an actor started after the head was lost"
        i = len(self.actors)
        actor = Actor(self, f"actor{i}", f"node{i}")
        self.actors.append(actor)
        self.plan.get(i, lambda a: None)(actor)
        return actor

    def kill(self, actor: Actor, no_restart: bool = True) -> None:
        if self.head_lost:  # recorded, not raised: the pool suppresses a failing kill
            self.after_head_loss.append("kill")
        assert no_restart
        actor.killed = True
        self.kills.append(actor.name)

    def wait(self, refs: list[Ref], num_returns: int = 1, timeout: float | None = None):
        if self.head_lost:
            self.after_head_loss.append("wait")
        for ref in refs:
            if ref.actor.ready(ref):
                return [ref], [r for r in refs if r is not ref]
        time.sleep(0.002)
        return [], refs

    def get(self, ref: Ref, timeout: float | None = None):
        a = ref.actor
        if ref in a.calls:
            a.calls.remove(ref)
        if ref.arg not in a.late and (a.dead or a.killed):
            raise ray_exceptions.ActorDiedError()
        if ref.method == "info":
            return {"node_id": a.node, "pid": 1, "host": "h"}
        self.ran.append((ref.arg, a.name))
        a.finished += 1
        if a.finished == a.die_after:
            a.dead = True
        return (ref.arg, a.name)


class Watch:
    """The cluster watch: ``dead()`` says which nodes the GCS reports dead."""

    lost = False

    def __init__(self, dead=lambda: set()) -> None:
        self.dead = dead

    def check(self, where: str) -> set[str]:
        return set(self.dead())


class Pool(ActorPool):
    def __init__(self, fake: FakeRay, slots, watch=None, **kw) -> None:
        kw = {"max_attempts": 3, "max_replacements": 3, "head_timeout_s": 60.0, "poll_s": 0.01, **kw}
        super().__init__(fake.launch, slots, log=log, watch=watch or Watch(), **kw)
        self.delivered_to: list[tuple[object, str]] = []

    def done(self, job: PoolJob, value) -> None:
        self.delivered_to.append(value)


def _use(monkeypatch, fake: FakeRay) -> FakeRay:
    monkeypatch.setitem(sys.modules, "ray", fake)
    return fake


def _shared(n: int) -> list[PoolJob]:
    return [PoolJob(f"j{i}", f"j{i}", i) for i in range(n)]


def _homed(slots: int, rounds: int) -> list[PoolJob]:
    """Round k holds the k-th job of every slot (the evaluator's plan)."""
    return [PoolJob(f"s{w}-{k}", f"s{w}-{k}", k * slots + w, w) for k in range(rounds) for w in range(slots)]


def _once(pool: Pool, jobs: list[PoolJob]) -> None:
    keys = collections.Counter(payload for payload, _ in pool.delivered_to)
    missing = {j.payload for j in jobs} - set(keys)
    assert sorted(keys) == sorted(j.payload for j in jobs), f"never delivered: {missing}"
    assert all(n == 1 for n in keys.values()), f"delivered twice: {[k for k, n in keys.items() if n > 1]}"


# -- exactly once ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("first", ["orphan", "moved"])
def test_a_job_is_delivered_once_when_its_moved_copy_also_completes(monkeypatch, first):
    """actor0's node is reported dead while its job j0 is in flight; j0 moves to actor1 and runs there; actor0's own
    result of j0 was already on its way and arrives too (before or after the moved copy's). Both copies end with a
    result: ``done`` sees j0 once, from the copy that ended first; the other is counted as a duplicate."""
    jobs = _shared(5)

    def gate() -> bool:  # actor0's result arrives while the moved copy runs on actor1 (orphan), or after it (moved)
        on_1 = ("j0", "actor1") in fake.submitted
        ran_1 = ("j0", "actor1") in fake.ran
        return on_1 and not ran_1 if first == "orphan" else ran_1

    fake = _use(monkeypatch, FakeRay({0: lambda actor: actor.late.update(j0=gate)}))
    pool = Pool(fake, [0, 1], Watch(lambda: {"node0"} if ("j0", "actor0") in fake.submitted else set()),
                keep_size=False)  # fmt: skip
    pool.run(jobs)
    _once(pool, jobs)
    assert pool.duplicates == 1
    assert [a for p, a in fake.ran if p == "j0"] == (["actor0", "actor1"] if first == "orphan" else
                                                     ["actor1", "actor0"])  # fmt: skip
    assert dict(pool.delivered_to)["j0"] == ("actor0" if first == "orphan" else "actor1")  # the first copy to end
    assert fake.actors[0].killed and len(fake.actors) == 2  # the lost actor killed; one still live: no new one


def test_a_delivered_jobs_queued_copy_is_not_run(monkeypatch):
    """The lost actor's result arrives while its moved job still waits in the taker's queue: that copy never runs."""
    jobs = _homed(2, 3)

    def a0(actor: Actor) -> None:  # actor0 is slow: its first job ends after the lost actor's result came in
        actor.late["s0-0"] = lambda: ("s1-0", "actor1") in fake.ran

    def a1(actor: Actor) -> None:  # produced before its node was lost, arrives after
        actor.late["s1-0"] = lambda: actor.killed

    fake = _use(monkeypatch, FakeRay({0: a0, 1: a1}))
    pool = Pool(fake, [0, 1], Watch(lambda: {"node1"} if ("s1-0", "actor1") in fake.submitted else set()),
                keep_size=False)  # fmt: skip
    pool.run(jobs)
    _once(pool, jobs)
    assert [a for p, a in fake.submitted if p == "s1-0"] == ["actor1"]  # never submitted again
    assert pool.duplicates == 0 and dict(pool.delivered_to)["s1-0"] == "actor1"


# -- moved jobs keep the plan's order ---------------------------------------------------------------------------
def test_a_lost_actors_homed_jobs_join_the_takers_queue_in_plan_order(monkeypatch):
    """Two actors, six rounds, two jobs in flight each. actor1 dies after its first job, holding s1-1 and s1-2:
    they and its queued s1-3..s1-5 go to actor0 at their places in the plan (s1-1, s1-2, s1-3, s0-4, s1-4, ...), not
    after actor0's own queue (s0-4, s0-5, s1-1, ...)."""
    jobs = _homed(2, 6)

    def a0(actor: Actor) -> None:  # actor0 holds s0-1 until actor1 died, so that its own queue is not empty
        actor.late["s0-1"] = lambda: fake.actors[1].dead

    fake = _use(monkeypatch, FakeRay({0: a0, 1: lambda actor: setattr(actor, "die_after", 1)}))
    pool = Pool(fake, [0, 1], in_flight=2, keep_size=False)
    pool.run(jobs)
    _once(pool, jobs)
    by_0 = [p for p, a in fake.ran if a == "actor0"]
    assert by_0 == ["s0-0", "s0-1", "s0-2", "s0-3", "s1-1", "s1-2", "s1-3", "s0-4", "s1-4", "s0-5", "s1-5"], by_0
    assert [p for p, _ in fake.ran if p.startswith("s1-")] == [f"s1-{k}" for k in range(6)]
    assert len(fake.actors) == 2 and fake.actors[1].killed


def test_a_lost_actors_shared_job_goes_back_before_the_later_ones(monkeypatch):
    """keep_size (generation): actor0 dies with j0; j0 goes back to the front of the shared queue, before j3, and the
    next free actor runs it next."""
    jobs = _shared(6)
    fake = _use(monkeypatch, FakeRay({0: lambda actor: setattr(actor, "die_on_job", True)}))
    pool = Pool(fake, [0, 1, 2], keep_size=True)
    pool.run(jobs)
    _once(pool, jobs)
    assert [p for p, _ in fake.submitted][:4] == ["j0", "j1", "j2", "j0"], fake.submitted
    assert pool.replacements == 1 and dict(pool.delivered_to)["j0"] != "actor0"


# -- a lost actor is replaced -------------------------------------------------------------------------------------
def test_a_lost_actor_is_replaced_in_its_slot_and_runs_the_job(monkeypatch):
    jobs = _shared(3)
    fake = _use(monkeypatch, FakeRay({0: lambda actor: setattr(actor, "die_after", 1)}))
    pool = Pool(fake, [0], keep_size=True)
    pool.run(jobs)
    _once(pool, jobs)
    assert [a for _, a in fake.ran] == ["actor0", "actor1", "actor1"]
    assert pool.replacements == 1 and fake.kills[0] == "actor0" and set(pool.handles) == {0}
    assert [j.attempts for j in jobs] == [1, 2, 1]  # j1 was in flight on actor0 when it died


def test_the_last_actors_node_dies_and_one_new_actor_finishes(monkeypatch):
    """keep_size off (the evaluator): with no live actor left a new one is started, once, not once per check of the
    dead node (the watch keeps reporting it while the new actor loads)."""
    jobs = _homed(1, 4)
    fake = _use(monkeypatch, FakeRay({1: lambda actor: setattr(actor, "slow_start", 5)}))

    def report() -> set[str]:
        if fake.actors[0].finished >= 2:
            fake.hung_nodes.add("node0")
            return {"node0"}
        return set()

    pool = Pool(fake, [0], Watch(report), keep_size=False)
    pool.run(jobs)
    _once(pool, jobs)
    assert [a for _, a in fake.ran] == ["actor0"] * 2 + ["actor1"] * 2
    assert len(fake.actors) == 2 and pool.replacements == 1


def test_actors_that_keep_dying_stop_the_pool_in_one_line(monkeypatch):
    fake = _use(monkeypatch, FakeRay({i: (lambda actor: setattr(actor, "dead", True)) for i in range(10)}))
    pool = Pool(fake, [0], keep_size=True, max_attempts=10, max_replacements=2)
    with pytest.raises(TDLMError, match=r"^actors keep dying \(3 replaced\); last: actor 0 ActorDiedError$"):
        pool.run(_shared(2))
    assert len(fake.actors) == 3


def test_a_job_lost_on_every_attempt_stops_the_pool(monkeypatch):
    fake = _use(monkeypatch, FakeRay({i: (lambda actor: setattr(actor, "die_on_job", True)) for i in range(10)}))
    pool = Pool(fake, [0], keep_size=True, max_attempts=2, max_replacements=10)
    with pytest.raises(TDLMError, match=r"^job j0: actors died on all 2 attempts \(ActorDiedError\)$"):
        pool.run(_shared(1))
    assert [a for p, a in fake.submitted] == ["actor0", "actor1"]


# -- head loss -------------------------------------------------------------------------------------------------------
def test_a_lost_head_stops_the_pool_in_one_line_without_a_ray_call(monkeypatch):
    """The real watch against a port nothing listens on: the run ends with HeadLost (one line, what is kept), and
    neither the loop nor close() calls Ray after it (ray.kill / ray.wait would block on the dead GCS)."""
    fake = _use(monkeypatch, FakeRay())
    fake.hung_nodes = {"node0"}  # nothing ever answers: only the head loss can end the run

    class Watched(ClusterWatch):
        def check(self, where: str) -> set[str]:
            try:
                return super().check(where)
            except HeadLost:
                fake.head_lost = True  # from here on a Ray call fails the test
                raise

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: connects are refused
        address = f"127.0.0.1:{s.getsockname()[1]}"
        pool = Pool(fake, [0], Watched(0.3, 0.05, address=address, nodes=lambda: []), keep_size=True)
        t0 = time.monotonic()
        with pytest.raises(HeadLost) as e:
            pool.run(_shared(3))
        pool.close()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"lost the Ray head at {address} (no answer for ")
    assert msg.endswith("s); 3 job(s) not submitted: rerun the same command on a running cluster to resume"), msg
    assert pool.lost and fake.after_head_loss == [] and time.monotonic() - t0 < 30

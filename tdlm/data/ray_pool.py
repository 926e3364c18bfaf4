"""One Ray actor pool for the generation and evaluation drivers (and the on-policy roll-outs, which run through the
generation driver): connect, start actors where the driver's resources say, hand them jobs, watch the head and the
nodes (:class:`~tdlm.data.ray_watch.ClusterWatch`), replace a lost actor and put its jobs back in the plan's order, and
hand each job's result to the driver exactly once.

A driver subclasses :class:`ActorPool` and keeps only what differs: what a job is (:meth:`ActorPool.submit`), what to
do with a result (:meth:`ActorPool.done`), its progress lines (:meth:`ActorPool.idle`) and the words of its messages.

* **Queues.** Every job has a place in the plan (``position``). A job with a ``home`` waits in that slot's queue (the
  evaluator: actor w runs the jobs of shard w, one writer per shard file); a job without one waits in the shared queue
  that any idle actor takes from (generation). Each queue stays sorted by plan position, so a job that goes back into
  a queue (a lost actor's, a retry) goes back to its place in the plan.
* **A lost actor** (Ray's restarts spent, or its node reported dead) is killed for good. Its unfinished jobs go back:
  shared ones to the shared queue; homed ones to the live actor with the least queued work, or, when none is live, to
  a new actor in the lost slot (it may wait for room on the cluster). ``keep_size`` starts a new actor for every lost
  one (generation's replicas; homed jobs then wait for it). A job lost on each of its ``max_attempts`` stops the run;
  new actors are bounded by ``max_replacements``.
* **Exactly once.** A lost actor's calls are not forgotten: one that had already finished (its result on the way
  when the node was reported dead) is used, and then the moved copy is dropped from its queue, or its result is
  dropped when it also completes. A job's result reaches :meth:`ActorPool.done` once, whichever copy ends first.
* **Head loss.** The watch raises :class:`~tdlm.data.ray_watch.HeadLost` (one line, saying what is kept); after it
  no Ray call is made (:meth:`ActorPool.close` kills nothing: ``ray.kill`` would block on the dead GCS).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from tdlm.data.ray_watch import ClusterWatch
from tdlm.errors import TDLMError

HOLD_POLL_S = 0.2  # how often a held pool looks at its hold file again


def connect_ray(address: str | None, object_store_bytes: int) -> bool:
    """Connect to ``address`` / RAY_ADDRESS or start a fresh local cluster with a small object store (only small
    records travel through Ray: the workers read the weights from disk, and Ray's default store takes 30% of RAM);
    True if this call initialised Ray."""
    import ray

    if ray.is_initialized():  # a caller (a test, a notebook) owns the connection
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address and address.startswith(("http://", "https://")):
        raise TDLMError(
            f"Ray address {address!r} is a Ray Jobs (dashboard) URL: submit the script with "
            f"`ray job submit --address {address} ...`, or pass the cluster address (host:6379 or 'auto')"
        )
    if address:
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise TDLMError(f"cannot connect to the Ray cluster at {address!r}: {e}") from e
    else:  # address="local" always starts a fresh cluster, never attaches to a `ray start` on this machine by accident
        ray.init(address="local", include_dashboard=False, object_store_memory=object_store_bytes,
                 logging_level=logging.WARNING)  # fmt: skip
    return True


class NodeNamed:
    """Mixin for an actor class whose ``info()`` returns a dict: it also names the actor's Ray node, so that the pool
    knows whose jobs to move when the GCS reports that node dead."""

    def info(self) -> dict:
        import ray

        return {**super().info(), "node_id": ray.get_runtime_context().get_node_id()}  # type: ignore[misc]


def actor_launcher(cls: type, spec: object, resources: dict, *, max_restarts: int, max_task_retries: int,
                   **options) -> Callable[[], object]:  # fmt: skip
    """A function that starts one actor of ``cls(spec)`` with the driver's ``resources`` and Ray's own restarts and
    retries. SPREAD: actors on as many nodes as fit, so a lost node takes as few of them as possible with it."""
    import ray

    remote = ray.remote(cls).options(**resources, max_restarts=max_restarts, max_task_retries=max_task_retries,
                                     scheduling_strategy="SPREAD", **options)  # fmt: skip
    return lambda: remote.remote(spec)


@dataclass(eq=False)
class PoolJob:
    """One job: ``key`` names it (its result is delivered once per key), ``payload`` is what the driver submits,
    ``position`` its place in the plan, ``home`` the slot whose queue holds it (None: the shared queue)."""

    key: Hashable
    payload: object
    position: int
    home: int | None = None
    attempts: int = 0  # submissions so far


@dataclass(frozen=True)
class Loss:
    """Why an actor is gone: the Ray error of its call, or (``node`` set) its node was reported dead."""

    error: BaseException
    node: str | None = None

    def __str__(self) -> str:
        return str(self.error) if self.node else type(self.error).__name__


@dataclass(eq=False)
class _Call:
    slot: int
    handle: object
    job: PoolJob | None  # None: the actor's info() (its start-up)


class ActorPool:
    """Actors in ``slots`` started with ``launch()``; :meth:`run` hands them jobs until every job's result was
    delivered to :meth:`done` (see the module docstring). ``in_flight``: jobs submitted ahead per actor; ``poll_s``:
    the longest wait for a result before :meth:`idle` runs; ``hold``: a file that, while it exists, holds every
    submission (a test freezes actors that are up but have started nothing)."""

    noun = "actor"  # the word for one actor in the messages

    def __init__(self, launch: Callable[[], object], slots: Iterable[int], *, log: logging.Logger, max_attempts: int,
                 max_replacements: int, head_timeout_s: float, in_flight: int = 1, keep_size: bool = True,
                 poll_s: float = 1.0, hold: str | None = None, watch: ClusterWatch | None = None) -> None:  # fmt: skip
        self.launch, self.slots, self.log = launch, list(slots), log
        self.max_attempts, self.max_replacements = max_attempts, max_replacements
        self.in_flight, self.keep_size, self.poll_s, self.hold = in_flight, keep_size, poll_s, hold
        self.watch = watch if watch is not None else ClusterWatch(head_timeout_s)
        self.handles: dict[int, object] = {}  # slot -> its current actor
        self.up: set[int] = set()  # slots whose current actor answered info()
        self.node_of: dict[int, str] = {}  # slot -> the Ray node of its current actor
        self.calls: dict[object, _Call] = {}  # ref -> call, also a lost actor's (its result may still come)
        self.queues: dict[int | None, list[PoolJob]] = {None: []}  # slot (None: shared) -> jobs in plan order
        self.delivered: set[Hashable] = set()
        self.replacements = 0  # actors started in place of lost ones
        self.duplicates = 0  # results dropped because their job was delivered already

    @property
    def lost(self) -> bool:
        """Whether the head was lost (then no Ray call may be made)."""
        return self.watch.lost

    # -- what a driver says ----------------------------------------------------------------------
    def submit(self, handle, job: PoolJob):
        """Start ``job`` on the actor ``handle``; returns the call's ref (``job.attempts`` counts this one)."""
        return handle.run_shard.remote(job.payload)

    def ready(self, slot: int, info: dict) -> None:
        """The actor in ``slot`` is up (``info``: what its ``info()`` returned, with ``node_id``)."""
        self.log.info("%s %d up: pid %s on %s (node %s)", self.noun, slot, info.get("pid"), info.get("host"),
                      info["node_id"][:12])  # fmt: skip

    def done(self, job: PoolJob, value) -> None:
        """``job``'s result, delivered once."""

    def idle(self) -> None:
        """No result within ``poll_s``: a driver's progress line."""

    def kept(self) -> str:
        """What the head-loss line says is kept."""
        return f"{sum(len(q) for q in self.queues.values())} job(s) not submitted"

    def task_failed(self, job: PoolJob, slot: int, msg: str, cause: BaseException) -> None:
        """Code inside the actor raised (``msg``, ``cause``): raise to stop the job; return to retry it."""
        raise TDLMError(f"job {job.key}: {msg}")

    def start_failed(self, slot: int, msg: str) -> None:
        raise TDLMError(f"{self.noun} {slot} failed to start: {msg}")

    def gave_up(self, job: PoolJob, slot: int, loss: Loss) -> None:
        """``job`` was on a lost actor on each of its ``max_attempts`` attempts: raise."""
        raise TDLMError(f"job {job.key}: {self.noun}s died on all {job.attempts} attempts ({loss})")

    def job_lost(self, job: PoolJob, slot: int, loss: Loss) -> None:
        """``job`` was unfinished on the lost actor in ``slot``; it goes back to a queue after this."""

    def actor_gone(self, slot: int, loss: Loss, taker: int | None, moved: int) -> None:
        """The actor in ``slot`` is gone; ``taker``: the slot that takes its ``moved`` jobs (None: a new actor)."""
        if taker is None:
            alone = "" if self.keep_size else f" and no {self.noun} is left"
            self.log.warning("%s %d is gone (%s)%s; starting a new one", self.noun, slot, loss, alone)
        else:
            self.log.warning("%s %d is gone (%s); %s %d takes over its %d job(s)", self.noun, slot, loss, self.noun,
                             taker, moved)  # fmt: skip

    def keep_dying(self, slot: int, loss: Loss) -> str:
        return f"{self.noun}s keep dying ({self.replacements} replaced); last: {self.noun} {slot} {loss}"

    # -- state a driver reads ---------------------------------------------------------------------
    def starting(self) -> int:
        """Actors started that have not answered info() yet."""
        return sum(1 for c in self.calls.values() if c.job is None and self.handles.get(c.slot) is c.handle)

    def running(self) -> dict[int, list[PoolJob]]:
        """slot -> the undelivered jobs submitted to its current actor, oldest first."""
        out: dict[int, list[PoolJob]] = {}
        for c in self._live_calls():
            out.setdefault(c.slot, []).append(c.job)  # type: ignore[arg-type]
        return out

    def queued(self) -> list[PoolJob]:
        return [job for q in self.queues.values() for job in q]

    # -- the loop -----------------------------------------------------------------------------------
    def run(self, jobs: Iterable[PoolJob]) -> None:
        """Start the actors and run ``jobs`` until each result was delivered; raises TDLMError (HeadLost included)."""
        import ray

        for job in jobs:
            self._enqueue(job, job.home)
        for slot in self.slots:
            self._start(slot)
        if self.hold:
            self.log.warning("TEST HOLD ACTIVE: no job is submitted while %s exists", self.hold)
        while self.queued() or self._live_calls():
            dead = self.watch.check(self.kept())
            for slot in [s for s in list(self.handles) if self.node_of.get(s) in dead]:
                node = self.node_of[slot]
                self._lose(slot, Loss(RuntimeError(f"node {node[:12]} died"), node))
            if self.hold and os.path.exists(self.hold):
                time.sleep(HOLD_POLL_S)
            else:
                self._dispatch()
            ready, _ = ray.wait(list(self.calls), num_returns=1, timeout=self.poll_s)
            if not ready:
                self.idle()
                continue
            self._finish(ready[0])

    def close(self) -> None:
        """Kill every actor for good, unless the head is lost (``ray.kill`` would block on a dead GCS)."""
        if self.lost:
            return
        import ray

        for handle in self.handles.values():
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)

    # -- internals ----------------------------------------------------------------------------------
    def _live_calls(self) -> list[_Call]:
        """Calls on current actors whose job is not delivered yet (a lost actor's calls are never waited for)."""
        return [c for c in self.calls.values() if c.job is not None and self.handles.get(c.slot) is c.handle
                and c.job.key not in self.delivered]  # fmt: skip

    def _enqueue(self, job: PoolJob, slot: int | None) -> None:
        job.home = slot
        bisect.insort(self.queues.setdefault(slot, []), job, key=lambda j: j.position)

    def _start(self, slot: int) -> None:
        handle = self.launch()
        self.handles[slot] = handle
        self.calls[handle.info.remote()] = _Call(slot, handle, None)  # type: ignore[attr-defined]

    def _dispatch(self) -> None:
        """Top up every live actor to ``in_flight`` jobs: its own queue first, then the shared one."""
        busy = {slot: len(jobs) for slot, jobs in self.running().items()}
        for slot in [s for s in self.handles if s in self.up]:
            while busy.get(slot, 0) < self.in_flight:
                queue = self.queues.get(slot) or self.queues[None]
                if not queue:
                    break
                job = queue.pop(0)
                job.attempts += 1
                handle = self.handles[slot]
                self.calls[self.submit(handle, job)] = _Call(slot, handle, job)
                busy[slot] = busy.get(slot, 0) + 1

    def _finish(self, ref) -> None:
        """One call ended: an actor up, a result, or a failure."""
        import ray
        from ray.exceptions import RayActorError, RayError, RayTaskError

        call = self.calls.pop(ref)
        current = self.handles.get(call.slot) is call.handle
        try:
            value = ray.get(ref)
        except RayTaskError as e:  # raised by code inside the actor
            if not current:
                return  # a lost actor's call: its job went back to a queue already
            cause = getattr(e, "cause", None) or e
            msg = str(cause) if isinstance(cause, TDLMError) else f"{type(cause).__name__}: {cause}"
            if call.job is None:
                self.start_failed(call.slot, msg)
                raise TDLMError(f"{self.noun} {call.slot} failed to start: {msg}") from None
            if call.job.key in self.delivered:
                return
            self.task_failed(call.job, call.slot, msg, cause)  # raises, or returns for a retry
            self._enqueue(call.job, call.job.home)
            return
        except (RayActorError, RayError) as e:  # the actor died and Ray's restarts are spent
            if current:
                self._lose(call.slot, Loss(e), running=call.job)
            return
        if call.job is None:
            if current:
                self.up.add(call.slot)
                self.node_of[call.slot] = value["node_id"]
                self.ready(call.slot, value)
            return
        self._deliver(call.job, value)

    def _deliver(self, job: PoolJob, value) -> None:
        if job.key in self.delivered:  # a moved job's other copy ended first
            self.duplicates += 1
            self.log.info("job %s: a second result (a moved copy) dropped; the first was kept", job.key)
            return
        self.delivered.add(job.key)
        for queue in self.queues.values():  # a moved copy still waiting: not run at all
            queue[:] = [j for j in queue if j.key != job.key]
        self.done(job, value)

    def _lose(self, slot: int, loss: Loss, running: PoolJob | None = None) -> None:
        """The actor in ``slot`` is gone for good: kill it, put its unfinished jobs back in plan order (homed ones to
        the live actor with the least queued work), start a new actor when ``keep_size`` or none is live."""
        import ray

        handle = self.handles.pop(slot)
        self.up.discard(slot)
        self.node_of.pop(slot, None)  # the slot's next actor is known once it answers (else lost again at once)
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)
        mine = [c.job for c in self.calls.values() if c.handle is handle and c.job is not None]
        unfinished = sorted({id(j): j for j in (*mine, *([running] if running else ()))
                             if j.key not in self.delivered}.values(), key=lambda j: j.position)  # fmt: skip
        for job in unfinished:
            if job.attempts >= self.max_attempts:
                self.gave_up(job, slot, loss)
                raise TDLMError(f"job {job.key}: {self.noun}s died on all {job.attempts} attempts ({loss})")
            self.job_lost(job, slot, loss)
        homed = [j for j in unfinished if j.home is not None] + self.queues.pop(slot, [])
        for job in unfinished:
            if job.home is None:
                self._enqueue(job, None)
        live = [s for s in self.handles if s in self.up]
        taker = None if self.keep_size or not live else min(live, key=lambda s: len(self.queues.get(s, ())))
        for job in homed:
            self._enqueue(job, slot if taker is None else taker)
        if taker is None:
            self.replacements += 1
            if self.replacements > self.max_replacements:
                raise TDLMError(self.keep_dying(slot, loss))
        self.actor_gone(slot, loss, taker, len(homed))
        if taker is None:
            self._start(slot)

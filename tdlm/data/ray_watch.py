"""The Ray head and node liveness that the actor pool (:mod:`tdlm.data.ray_pool`) of the generation and evaluation
drivers checks between results.

Why the drivers check themselves: an actor on a node that died may be held by Ray in RESTARTING with its work waiting
for a restart that no node has room for (the survivors' CPUs are held by our other actors), and a driver whose head
(GCS) died learns nothing from Ray: its calls block, or the process exits in Ray's C++ code without a word. The head
is probed with a TCP connect to the GCS port (no Ray call, so it cannot block); only while it answers are the dead
nodes read from the GCS (``ray.nodes()``), in a thread the driver waits for only briefly: a read the GCS dies during
blocks until Ray's 60 s reconnect limit and then exits the process from C++ ("Failed to connect to GCS within 60
seconds"; measured on a Ray job driver whose ``ray.nodes()`` call met the SIGKILL of the GCS: no one-line error), a
window of a few milliseconds per second that the three-node head-loss test (tests/test_ray_cluster.py) can hit. It
lives in the data layer, below both drivers (siblings that may not import each other), beside the folder lock they
share.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

from tdlm.errors import TDLMError


class HeadLost(TDLMError):
    """The Ray head (GCS) stopped answering: the job stops in one line; finished work stays on disk for a rerun."""


_HEAD_LOST = False
READ_WAIT_S = 0.5  # how long a check waits for the dead-node read (it takes milliseconds from a live GCS)


def head_lost() -> bool:
    """True once this process lost its Ray head: its entry point should leave with ``os._exit`` after the error line
    (Ray's teardown then exits from C++ or waits for the dead GCS)."""
    return _HEAD_LOST


class ClusterWatch:
    """Checked by a driver between results: :meth:`check` raises :class:`HeadLost`, else returns the dead nodes.

    ``address`` ("host:port" of the GCS) and ``nodes`` (what ``ray.nodes()`` returns) default to the connected Ray
    cluster's; a test passes its own, so the watch runs without Ray."""

    def __init__(self, timeout_s: float, interval_s: float = 1.0, address: str | None = None,
                 nodes: Callable[[], list[dict]] | None = None) -> None:  # fmt: skip
        if address is None or nodes is None:
            import ray

            address = address or ray.get_runtime_context().gcs_address
            nodes = nodes or ray.nodes
        self.address, self.nodes = address, nodes
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.last_ok = self.last_probe = time.monotonic()
        self.dead_nodes: set[str] = set()
        self.lost = False
        self._reader: threading.Thread | None = None

    def head_answers(self) -> bool:
        host, _, port = self.address.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=min(2.0, self.timeout_s)):
                return True
        except OSError:
            return False

    def check(self, where: str) -> set[str]:
        """Raise :class:`HeadLost` once the head has not answered for ``timeout_s`` (``where`` says what is kept);
        else the ids of the nodes the GCS reports dead."""
        global _HEAD_LOST
        now = time.monotonic()
        if now - self.last_probe < self.interval_s:
            return self.dead_nodes
        self.last_probe = now
        if not self.head_answers():
            if now - self.last_ok >= self.timeout_s:
                self.lost = _HEAD_LOST = True
                raise HeadLost(f"lost the Ray head at {self.address} (no answer for {now - self.last_ok:.0f} s); "
                               f"{where}: rerun the same command on a running cluster to resume")  # fmt: skip
            return self.dead_nodes
        self.last_ok = now
        self._read_dead_nodes()
        return self.dead_nodes

    def _read_dead_nodes(self) -> None:
        """Refresh :attr:`dead_nodes` from the GCS in a daemon thread, waiting at most ``READ_WAIT_S`` for it; a read
        still running (a GCS that died or hangs) is not started again and never waited for again: the TCP probe then
        fails (or the next read answers) and :meth:`check` decides from that."""
        if self._reader is not None and self._reader.is_alive():
            return

        def read() -> None:
            with contextlib.suppress(Exception):  # a GCS that is going away: keep the last answer
                self.dead_nodes = {n["NodeID"] for n in self.nodes() if not n.get("Alive", True)}

        self._reader = threading.Thread(target=read, name="tdlm-cluster-watch", daemon=True)
        self._reader.start()
        self._reader.join(READ_WAIT_S)

"""The Ray head and node liveness that the generation and evaluation drivers check between results.

Why the drivers check themselves: an actor on a node that died may be held by Ray in RESTARTING with its work waiting
for a restart that no node has room for (the survivors' CPUs are held by our other actors), and a driver whose head
(GCS) died learns nothing from Ray: its calls block, or the process exits in Ray's C++ code without a word. The head
is probed with a TCP connect to the GCS port (no Ray call, so it cannot block); only while it answers are the dead
nodes read from the GCS (``ray.nodes()``). It lives in the data layer, below both drivers (siblings that may not
import each other), beside the folder lock they share.
"""

from __future__ import annotations

import contextlib
import socket
import time

from tdlm.errors import TDLMError


class HeadLost(TDLMError):
    """The Ray head (GCS) stopped answering: the job stops in one line; finished work stays on disk for a rerun."""


_HEAD_LOST = False


def head_lost() -> bool:
    """True once this process lost its Ray head: its entry point should leave with ``os._exit`` after the error line
    (Ray's teardown then exits from C++ or waits for the dead GCS)."""
    return _HEAD_LOST


class ClusterWatch:
    """Checked by a driver between results: :meth:`check` raises :class:`HeadLost`, else returns the dead nodes."""

    def __init__(self, timeout_s: float, interval_s: float = 1.0) -> None:
        import ray

        self.address = ray.get_runtime_context().gcs_address  # "host:port" of the GCS
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.last_ok = self.last_probe = time.monotonic()
        self.dead_nodes: set[str] = set()
        self.lost = False

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
        import ray

        with contextlib.suppress(Exception):  # a GCS that is going away: keep the last answer
            self.dead_nodes = {n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)}
        return self.dead_nodes

"""What holds inside the sandbox, checked there (issue: "a backend trusted by name").

The guarantees a run reports are never taken from a backend's name or from what the launcher asked for: a ``bwrap``
that isolates nothing would be reported as full isolation. Instead the sample's own process - after the launcher and
the backend built the namespaces, the new root, the rlimits, the uid drop, ``no_new_privs`` and the seccomp filter,
right before the candidate's code - runs :func:`sandbox_facts` (inside :data:`.sample.DRIVER`, no extra process)
and writes what it found as one ``repr`` line on a pipe of its own, which it closes before the candidate runs (the
candidate cannot write or rewrite that line). Both sides then apply :func:`guarantees_held` to those facts and the
evaluator's :func:`expectations`: the sample's process refuses to run the candidate when a required guarantee does
not hold, and the evaluator derives every per-run flag (and so ``isolation_support``) from the same facts.

What is compared (each guarantee not shown is not held):

- ``network`` / ``ipc`` / ``pid``: ``/proc/self/ns/{net,ipc,pid}`` differ from the evaluator's (same nsfs device,
  another inode); ``pid`` also needs ``/proc/self`` to name this process (a ``/proc`` of its own PID namespace);
- ``filesystem``: another mount namespace, ``/`` read-only, and a host path the evaluator created for this run (a
  marker file under its own temp directory) not visible;
- ``seccomp``: ``Seccomp: 2`` (a filter) and ``NoNewPrivs: 1`` in ``/proc/self/status``, and a call on no list
  of the allowlist (``getpriority``) refused with EPERM: a filter that is there but allows it is not ours;
- ``privileges``: uid and euid not 0, no effective, permitted, inheritable or ambient capability, and an empty
  bounding set (or ``no_new_privs``, which keeps a non-empty one from granting anything through exec);
- ``limits``: the rlimits at most the evaluator's (``RLIMIT_MEMLOCK`` and ``RLIMIT_MSGQUEUE`` 0 among them); the
  per-sample cgroup in ``/proc/self/cgroup`` (its path, or the root of a cgroup namespace of its own: bwrap's
  ``--unshare-cgroup-try``), else (no cgroup) the filter seen refusing ``fork``, ``pipe2`` and ``memfd_create``
  with EPERM (each called with arguments the kernel itself rejects, so nothing is created either way): one process
  whose kernel objects are each counted by an rlimit (:data:`.host.CGROUP_ONLY_SYSCALLS` says which calls the
  no-cgroup filter leaves out and why); the sample's ``/tmp`` and ``/dev/shm`` inode-limited (statvfs) unless a
  cgroup charging kernel memory bounds their files; TCP / UDP buffers bounded (a cgroup v2 charges them; under
  bwrap, whose loopback is up, the filter refuses AF_INET; in-house, a network namespace of its own has it down).

The two functions below are plain Python with their imports inside: :data:`SOURCE` is their text, which the driver
runs as is, so the evaluator and the sample's process apply the same rule.
"""

from __future__ import annotations

import inspect
import os
import subprocess
from functools import lru_cache
from typing import Any

NAMESPACES = ("net", "pid", "mnt", "ipc", "uts", "user", "cgroup")
CAPS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
RLIMITS = ("AS", "CPU", "FSIZE", "NOFILE", "NPROC", "MEMLOCK", "MSGQUEUE", "SIGPENDING")


def sandbox_facts(expect: dict) -> dict:
    """What this process sees of its own isolation (run in the sample's process, before the candidate's code)."""
    import os
    import resource

    facts: dict = {"uid": (os.getuid(), os.geteuid()), "ns": {}, "status": {}, "rlimits": {}, "cgroup": None,
                   "inodes": [], "root_ro": False, "proc_own": False, "marker": "error"}  # fmt: skip
    for name in expect["ns"]:
        try:
            st = os.stat("/proc/self/ns/" + name)
            facts["ns"][name] = (st.st_dev, st.st_ino)
        except OSError:
            facts["ns"][name] = None
    try:
        facts["proc_own"] = os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Seccomp", "NoNewPrivs") or key.startswith("Cap"):
                    facts["status"][key] = int(value.strip(), 16 if key.startswith("Cap") else 10)
    except (OSError, ValueError):
        facts["status"] = {}
    for name in ("AS", "CPU", "FSIZE", "NOFILE", "NPROC", "MEMLOCK", "MSGQUEUE", "SIGPENDING"):
        soft = resource.getrlimit(getattr(resource, "RLIMIT_" + name))[0]
        facts["rlimits"][name] = None if soft == resource.RLIM_INFINITY or soft < 0 else soft
    try:
        groups = {}
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                for c in ctrls.split(",") if ctrls else [""]:
                    groups[c] = path
        facts["cgroup"] = groups
    except (OSError, ValueError):
        pass
    for path in ("/tmp", "/dev/shm"):
        try:
            facts["inodes"].append(os.statvfs(path).f_files)
        except OSError:
            facts["inodes"].append(None)
    try:
        facts["root_ro"] = bool(os.statvfs("/").f_flag & os.ST_RDONLY)
    except OSError:
        pass
    try:  # a call on no list of the allowlist (harmless where it goes through): only a filter of ours refuses it
        os.getpriority(os.PRIO_PROCESS, 0)
        facts["offlist"] = 0
    except OSError as e:
        facts["offlist"] = e.errno
    if expect["cgroup"] is None:
        # no cgroup: the sample must stay one process that holds nothing outside its address space, so the filter
        # must refuse processes, pipes and memfds. Each call gets arguments the kernel rejects (EINVAL) before it
        # creates anything, so only a filter answers EPERM; fork, if it goes through, ends its child at once.
        seen = {}
        for call, args in ((os.pipe2, (0o1,)), (os.memfd_create, ("x", 0x100))):
            try:
                call(*args)
                seen[call.__name__] = 0
            except OSError as e:
                seen[call.__name__] = e.errno
        try:
            pid = os.fork()
        except OSError as e:
            seen["fork"] = e.errno
        else:
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            seen["fork"] = 0
        facts["one_process"] = seen
    try:
        os.lstat(expect["marker"])
        facts["marker"] = "visible"
    except (FileNotFoundError, NotADirectoryError):
        facts["marker"] = "absent"
    except OSError:  # e.g. EACCES on a directory on the way: the host's tree is there
        facts["marker"] = "error"
    return facts


def guarantees_held(facts: dict, expect: dict) -> dict:
    """Each guarantee -> whether ``facts`` (from :func:`sandbox_facts`) show it held, against ``expect``."""
    host_ns = expect["ns"]
    ns = facts.get("ns") or {}

    def new(name):  # a namespace of its own: the same nsfs, another inode (never "unreadable" or "missing")
        mine, theirs = ns.get(name), host_ns.get(name)
        return bool(mine) and bool(theirs) and mine[0] == theirs[0] and mine[1] != theirs[1]

    status = facts.get("status") or {}
    seccomp = status.get("Seccomp") == 2 and status.get("NoNewPrivs") == 1 and facts.get("offlist") == 1
    uid = facts.get("uid") or (0, 0)
    caps_clear = all(status.get(k) == 0 for k in ("CapInh", "CapPrm", "CapEff", "CapAmb"))
    bounded = status.get("CapBnd") == 0 or status.get("NoNewPrivs") == 1
    network = new("net")
    rl = facts.get("rlimits") or {}
    rlimits = all(rl.get(k) is not None and (bound < 0 or rl[k] <= bound) for k, bound in expect["rlimits"].items())
    cgroup = expect["cgroup"]
    if cgroup is None:  # no cgroup: one process whose filter refuses what no rlimit counts (seen failing: EPERM)
        one = facts.get("one_process") or {}
        tasks = seccomp and sorted(one) == ["fork", "memfd_create", "pipe2"] and all(v == 1 for v in one.values())
    else:
        seen = facts.get("cgroup") or {}
        tasks = all(seen.get(c) == p or (seen.get(c) == "/" and new("cgroup")) for c, p in cgroup.items())
    limit = expect["inodes"]
    inodes = limit is None or (bool(facts.get("inodes")) and all(
        n is not None and 0 < n <= limit for n in facts["inodes"]))  # fmt: skip
    inet = expect["inet"] == "charged" or (seccomp if expect["inet"] == "filtered" else network)
    return {
        "filesystem": new("mnt") and facts.get("root_ro") is True and facts.get("marker") == "absent",
        "network": network,
        "pid": new("pid") and facts.get("proc_own") is True,
        "ipc": new("ipc"),
        "limits": rlimits and tasks and inodes and inet,
        "seccomp": seccomp,
        "privileges": 0 not in uid and caps_clear and bounded,
    }


# the text the driver runs; both functions import what they need themselves
SOURCE = inspect.getsource(sandbox_facts) + "\n\n" + inspect.getsource(guarantees_held)


_host_ns: dict[int, dict[str, tuple[int, int] | None]] = {}


def host_namespaces() -> dict[str, tuple[int, int] | None]:
    """The evaluator's own namespace ids ((nsfs device, inode) each), once per process."""
    pid = os.getpid()
    if pid not in _host_ns:
        ids: dict[str, tuple[int, int] | None] = {}
        for name in NAMESPACES:
            try:
                st = os.stat(f"/proc/self/ns/{name}")
                ids[name] = (st.st_dev, st.st_ino)
            except OSError:  # unknown: nothing inside can be shown to differ from it, so nothing is held
                ids[name] = None
        _host_ns[pid] = ids
    return _host_ns[pid]


def expectations(*, backend: str, marker: str, rlimits: dict[str, int], cgroup: dict[str, str] | None,
                 cgroup_kind: str | None, kmem: bool, tmpfs_inodes: int, require: list[str]) -> dict[str, Any]:
    """What the evaluator knows of one run (its namespaces, the marker, the limits it set, the cgroup it made), for
    :func:`guarantees_held`; ``require``: the guarantees the sample's process must see held before it runs the
    candidate (empty for a probe). ``rlimits`` values: the most allowed, or -1 for any finite one."""
    return {
        "ns": host_namespaces(), "marker": marker, "rlimits": rlimits, "cgroup": cgroup,
        "inodes": None if kmem else tmpfs_inodes,
        "inet": "charged" if cgroup_kind == "cgroup-v2" else ("filtered" if backend == "bwrap" else "netns"),
        "require": list(require),
    }  # fmt: skip


def parse_facts(text: str) -> dict | None:
    """The first line of the verification pipe as a facts dict, or None (nothing reported: nothing holds)."""
    import ast

    line = text.split("\n", 1)[0]
    try:
        facts = ast.literal_eval(line)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return facts if isinstance(facts, dict) else None


@lru_cache(maxsize=8)
def bwrap_version(path: str) -> str:
    """``bubblewrap 0.8.0`` (what ``path --version`` prints), for the level line."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"version unknown ({type(e).__name__})"
    return (out.stdout.strip().splitlines() or ["version unknown"])[0][:80]

"""The code sandbox for model-written MBPP solutions (issue 22): a verdict the sample cannot touch, nothing to
read, aggregate limits, fail closed.

Per run (:func:`run_python`), on a machine that grants everything (``isolation_support()["level"] == "full"``):

1. **Verdict outside the sample** (:mod:`.verdict`). The trusted process parses each assert with :mod:`ast`; the
   sample's process only evaluates the calls into the candidate's code and writes their values back through a
   strict serialiser of builtins (numbers, str, bytes, bool, None, list/tuple/dict/set/frozenset; anything else
   fails; never unpickled). The trusted process evaluates each assert with those values, real builtins and the
   ``test_imports`` modules. No completion token: exiting early only loses values.
2. **Nothing to read.** A new root (bubblewrap, or the in-house mount namespace + ``pivot_root``) holding only the
   interpreter's binary, loader, shared libraries and stdlib, read-only (:func:`.host.interpreter_files`); a
   size-capped tmpfs ``/tmp`` (cwd, HOME) and ``/dev/shm``; ``/dev/{null,zero,full,random,urandom}``; a ``/proc``
   of its own PID namespace. New network (no interface but a down loopback, no abstract sockets of the host), IPC
   and UTS namespaces. Environment: :data:`.core.SAMPLE_ENV` only. stdout / stderr go to capped files; results get
   :func:`.verdict.excerpt` (one escaped line) only.
3. **Aggregate limits** (:class:`.host.Cgroups`): a cgroup per sample (v2 delegated subtree, else v1 memory + pids
   + cpuacct) bounds memory (tmpfs, memfd and shm pages included), tasks, and CPU time (polled, the whole tree
   killed past ``cpu_s``). Without a cgroup: RLIMIT_NPROC of the sample's uid (nobody as root), and seccomp
   refuses ``fork`` / ``vfork`` / non-thread ``clone`` and ``memfd_create``, so per-process rlimits are the
   aggregate. :attr:`SandboxResult.mechanism` records which applied.
4. **Fail closed.** :func:`require_sandbox` raises one line (what the kernel refused, how to get it) when any of
   :data:`GUARANTEES` is missing, unless ``allow_weak``; then every result's ``weakened`` names what is missing.
5. **A maintained tool first**: ``bwrap`` (bubblewrap) when on PATH and working (as root the launcher drops to
   nobody first, so bwrap runs unprivileged in its own user namespace, ``--disable-userns``, ``--cap-drop ALL``);
   the in-house namespaces (:mod:`.launcher`) otherwise, with the same guarantees. Seccomp (``pyseccomp`` builds
   the BPF; bwrap ``--seccomp`` or the launcher's ``prctl`` installs it) denies ``ptrace``, ``keyctl``, ``setns``,
   ``mount``, ``unshare`` and relatives (:data:`.host.DENIED_SYSCALLS`).

Threat model. In scope: anything a sample can do from Python or ctypes in its own process tree: reward hacking
of the checks, reading files, exfiltration through results, resource exhaustion, state between samples, escaping
through namespaces or other processes. Out of scope: kernel exploits through the syscalls the filter allows, and
side channels (timing of the evaluator).
"""

from .core import (
    GUARANTEES,
    NOBODY,
    SAMPLE_ENV,
    SandboxLimits,
    SandboxResult,
    backend_unavailable,
    default_python,
    isolation_support,
    require_sandbox,
    run_python,
)
from .verdict import excerpt, split_asserts

__all__ = [
    "GUARANTEES",
    "NOBODY",
    "SAMPLE_ENV",
    "SandboxLimits",
    "SandboxResult",
    "backend_unavailable",
    "default_python",
    "excerpt",
    "isolation_support",
    "require_sandbox",
    "run_python",
    "split_asserts",
]

"""The code sandbox for model-written MBPP solutions (issues 22 and 28): a verdict the sample cannot touch or
stall, nothing to read, nothing reachable past the namespaces, aggregate limits, fail closed.

Per run (:func:`run_python`), on a machine that grants everything (``isolation_support()["level"] == "full"``):

1. **Verdict outside the sample** (:mod:`.verdict`, :mod:`.trusted`). The evaluator splits each assert with the
   grammar of :func:`tdlm.tasks.mbpp.plan_assert`: the sample evaluates only the sub-expressions rooted at a name the
   candidate defines (from the task's reference solution, bound at any depth; looked up in the program's globals only,
   so a missing one is a NameError and a builtin never answers for it): ``name(.attr)*`` and at most one call, with
   argument values the evaluator computed. Everything else - the comparison, the expected side, lambdas, methods of
   the returned values, ``test_imports`` modules - is evaluated on the trusted side, on decoded builtin values. A
   shape the grammar cannot split (``is`` between the candidate's values, arguments that use names bound in the assert
   or mix the candidate's values into other code, a name that is neither a builtin, imported nor the reference's; more
   than one value sent back, or one from a position Python may skip or repeat - after ``and`` / ``or``, in a
   conditional branch, a later link of a chained comparison, a lambda or comprehension body; an assert that sends
   nothing to the sample; without a reference, a bare name used as a value) is refused by :func:`split_asserts`,
   before anything is decoded. The values come back through a strict serialiser of builtins (never unpickled); a
   returned iterator is consumed within a list's budgets and rebuilt as an iterator (an item changed after it was
   yielded fails in one line), and ``Fraction``, ``Decimal``, dict views, ``range``, ``deque``, ``Counter``,
   ``OrderedDict``, namedtuples, dates, Enum members and dataclass instances arrive as themselves. No completion
   token: exiting early only loses values.
2. **A bounded trusted side.** The evaluator's process never parses the sample's bytes: a trusted child
   (``python -I -S -B trusted.py``, one of a small reused pool, no candidate code) decodes them and evaluates the
   asserts under budgets: nesting 64, 200,000 elements, 4,096 hex digits per int, 1 CPU-s per sample
   (``ITIMER_PROF`` with its default action: the process ends even inside one long C call, and a fresh one
   replaces it), RLIMIT_AS 1 GiB, a wall clock. Any failure there fails that sample with one line
   (``Score.detail``); nothing raises into ``score_many``. Worst case measured by ``bench/sandbox_throughput.py``:
   4 MiB of hash-colliding ints cost the evaluator 1.09 CPU-s.
3. **Nothing to read.** A new root (bubblewrap, or the in-house mount namespace + ``pivot_root``) holding only the
   interpreter's binary, loader, shared libraries and stdlib, read-only (:func:`.host.interpreter_files`); a
   size-capped tmpfs ``/tmp`` (cwd, HOME) and ``/dev/shm``; ``/dev/{null,zero,full,random,urandom}`` and nothing
   else there (no ``/dev/pts``, ``/dev/ptmx`` or ``/dev/tty``: no pty from the host-wide pool), read-only; a
   ``/proc`` of its own PID namespace. New network (no interface but a down loopback, no abstract sockets of the
   host), IPC and UTS namespaces. Environment: :data:`.core.SAMPLE_ENV` only. stdout / stderr go to capped files;
   results get :func:`.verdict.excerpt` (one escaped line) only.
4. **Nothing past the namespaces.** Seccomp (``pyseccomp`` builds the BPF; bwrap ``--seccomp`` or the launcher's
   ``prctl`` installs it) is an allowlist (:data:`.host.SYSCALL_GROUPS`: the calls the interpreter, the driver and
   the 257 canonical MBPP solutions made under strace, plus threads, clocks, files in its own ``/tmp``, signals to
   itself, each group with its reason); every other call fails with EPERM, whatever the kernel adds next.
   ``clone`` never with a ``CLONE_NEW*`` flag (no nested user namespace with its capabilities, on either backend),
   ``clone3`` ENOSYS (glibc falls back to ``clone``), ``ioctl`` / ``fcntl`` / ``prlimit64`` only with the
   requests, commands and pid (0) listed, and ``socket`` / ``socketpair`` of no family but AF_UNIX, AF_INET and
   AF_INET6 (no netlink, packet or vsock sockets: vsock shares the host's port space); under bubblewrap, whose
   ``--unshare-net`` brings the loopback up, AF_INET / AF_INET6 neither (EAFNOSUPPORT: no cgroup v1 charges TCP /
   UDP buffers to the sample). bwrap adds ``--disable-userns`` and ``--cap-drop ALL``; the in-house launcher
   empties the capability bounding set while still privileged, then drops the uid and the other sets, and checks
   that none is left (else the sample does not run).
5. **Aggregate limits** (:class:`.host.Cgroups`): a cgroup per sample (v2 delegated subtree, else v1 memory + pids +
   cpuacct) bounds memory (tmpfs, memfd and shm pages included), tasks, and CPU time (polled, the whole tree killed
   past ``cpu_s``). Without a cgroup the sample is one process, and each kernel object it can make is counted by
   an rlimit: memory and page tables by RLIMIT_AS, fds (files, sockets) by RLIMIT_NOFILE, threads by RLIMIT_NPROC
   of its uid (nobody as root), files by the inode- and size-limited tmpfs; seccomp refuses ``fork`` / ``vfork`` /
   non-thread ``clone``, ``memfd_create``, System V shm / msg / sem, pipes and AF_UNIX sockets
   (:data:`.host.CGROUP_ONLY_SYSCALLS`, :data:`.host.NOCGROUP_FAMILIES`: memory no address-space limit counts), and
   the sample's own process must see ``fork``, ``pipe2`` and ``memfd_create`` refused, else ``limits`` is not held
   (:mod:`.verify`). Every setting: RLIMIT_MSGQUEUE 0, RLIMIT_MEMLOCK 0 (both checked inside), RLIMIT_SIGPENDING
   256; AIO, io_uring, ``memfd_secret``, inotify and fanotify are on no list. The files of the
   tmpfs (kernel memory, no tmpfs bytes) are bounded by a cgroup that charges kernel memory (v2, or v1 with kmem
   accounting), else by an inode limit: the in-house root's tmpfs has one, and under bubblewrap (whose ``--tmpfs`` has
   none) the launcher mounts inode-limited ones for bwrap to bind; where neither holds, ``limits`` is missing.
   :attr:`SandboxResult.mechanism` records which applied.
6. **Fail closed, for every caller.** :func:`run_python` itself calls :func:`require_sandbox` (probed once per
   limits), which raises one line (what the kernel refused, how to get it) when any of :data:`GUARANTEES` is
   missing, and nothing runs - unless ``allow_weak`` is passed explicitly; then every result's ``weakened`` names
   what is missing. So ``Scorer``, ``score``, ``score_code`` and the harness task all refuse alike. A run that
   gets less than the probe found (its new root or an inode-limited tmpfs cannot be built) never runs the sample:
   the launcher stops first, and the result is an ``error`` with a one-line ``detail``, never a pass.
7. **Verified from inside, never trusted by name** (:mod:`.verify`). Every flag above - ``isolation_support``'s
   guarantees and level, each result's ``*_isolated`` / ``seccomp`` / ``weakened`` - comes from what the sample's
   own process saw right before the candidate's code (the driver, in the process that then runs it): namespace
   ids that differ from the evaluator's, the run's host marker file absent and ``/`` read-only, ``Seccomp: 2`` and
   ``NoNewPrivs: 1``, a non-zero uid without capabilities, the rlimits, cgroup and inode-limited tmpfs. It sends
   that as one line on its own pipe and closes it before the candidate starts; a required guarantee not held there
   stops the run before the candidate (an ``error``), and a guarantee not shown is not held. The level line names
   the program that built the sandbox (``bwrap <path> (<version>)`` or the in-house launcher).
8. **A maintained tool first**: ``bwrap`` (bubblewrap) when installed in a system directory
   (:data:`.core.BWRAP_PATHS`, never looked up on PATH) and working (as root the launcher drops to
   nobody first, so bwrap runs unprivileged in its own user namespace); the in-house namespaces (:mod:`.launcher`)
   otherwise, with the same guarantees. An explicit backend that is not installed is refused in one line
   (:func:`backend_unavailable`), never replaced.

Threat model. In scope: anything a sample can do from Python or ctypes in its own process tree: reward hacking of
the checks (values crafted for the trusted side's comparison or to stall or crash it, forged lines on the values
channel, redefined builtins, objects with their own ``__eq__``), reading files, exfiltration through results,
resource exhaustion (kernel memory of files included), state between samples, escaping through namespaces, the
kernel's socket families or other processes. The dataset (asserts, ``test_imports``, reference solutions) is
trusted. Out of scope: kernel exploits through the syscalls and socket families the allowlist keeps, and side
channels (timing of the evaluator).
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

"""The launcher: a small, dependency-free Python program that prepares one sample's process and ``exec``s it.

It runs as ``python -I -S -B -c LAUNCHER <hex of marshal(cfg)>`` (single-threaded, so the process it builds
inherits no locks; ``marshal`` because importing ``json`` costs more than the rest of the launcher) and reports
what it achieved as ``repr`` lines of dicts (read with ``ast.literal_eval``) on an inherited close-on-exec pipe
(EOF without an ``exec_failed`` line means the final ``exec`` succeeded). ``ctypes`` is imported only by the
in-house backend. Order: join the per-sample cgroups -> rlimits (``RLIMIT_MSGQUEUE`` 0, ``RLIMIT_MEMLOCK`` 0 and
a small ``RLIMIT_SIGPENDING`` among them) -> then one of

- ``bwrap`` backend: unless a cgroup that charges kernel memory bounds the files, mount the sample's ``/tmp`` and
  ``/dev/shm`` as size- and inode-limited tmpfs in a private mount namespace (a user namespace of its own first
  when not root; bubblewrap's ``--tmpfs`` has no inode limit), as root drop to ``nobody`` (bubblewrap then runs
  unprivileged, in a user namespace of its own, and the sample is ``nobody`` on the host too), then ``exec`` the
  prepared ``bwrap`` command line, which binds them (if the probe had that inode limit and this run cannot mount
  it, the launcher stops: the sample never runs);
- ``inhouse`` backend (the fallback with the same guarantees): a user namespace when not root; new network, IPC,
  UTS and mount namespaces; a new root on a tmpfs holding only the interpreter's files (read-only bind mounts),
  ``/dev/{null,zero,full,random,urandom}``, size-capped tmpfs ``/tmp`` and ``/dev/shm`` and a ``/proc`` mounted by
  the PID namespace's init; ``pivot_root`` and detach the old root; ``/`` read-only; a PID namespace whose init
  (PID 1, ``PR_SET_PDEATHSIG``) runs the sample as PID 2. Then in the sample: every namespace and the new root
  the probe had (``cfg["require"]``) must be there, else the launcher stops with ``exec_failed weakened after the
  probe: ...`` and the sample never runs; empty the capability bounding set while still privileged (root, or
  the owner of the user namespace: ``PR_CAPBSET_DROP`` needs ``CAP_SETPCAP``), drop to ``nobody`` (root), clear
  the other capability sets (capset), then verify - no effective, permitted, inheritable or ambient capability
  and an empty bounding set, else stop (a uid 0 without ``nobody`` mapped keeps no power); set ``no_new_privs``,
  install the seccomp filter, ``exec``;
- ``none`` (only with ``allow_weak_sandbox``): rlimits, ``no_new_privs`` and the seccomp filter, nothing else.

What the launcher reports is not what the run's guarantees are taken from: the sample's own process checks what
holds after the exec (:mod:`.verify`), whatever bwrap or this launcher claimed.
"""

LAUNCHER = r"""
import marshal, os, resource, signal, sys
cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
fd = cfg["status_fd"]
R = resource
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH, PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 2, 1, 24, 38, 22
PR_CAPBSET_READ, PR_CAP_AMBIENT, PR_CAP_AMBIENT_IS_SET = 23, 47, 1
SECCOMP_MODE_FILTER = 2
ARCH = os.uname().machine
SYS_PIVOT_ROOT, SYS_CAPGET, SYS_CAPSET = {"x86_64": (155, 125, 126), "aarch64": (41, 90, 91)}.get(ARCH, (None,) * 3)

def say(obj):
    os.write(fd, (repr(obj) + "\n").encode())

def die(why):
    os.write(fd, ("exec_failed " + why + "\n").encode())
    os._exit(125)

def failed(what):
    e = ctypes.get_errno()  # noqa: F821 - ctypes is imported below, before the first call
    return f"{what}: {os.strerror(e)} (errno {e})"

def setlim(kind, soft, hard=None):
    hard = soft if hard is None else hard
    _, old_hard = R.getrlimit(kind)
    if old_hard != R.RLIM_INFINITY:
        soft, hard = min(soft, old_hard), min(hard, old_hard)
    R.setrlimit(kind, (soft, hard))

def count_tasks(uid):
    n = 0
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat("/proc/" + p).st_uid == uid:
                    n += len(os.listdir("/proc/" + p + "/task"))
            except OSError:
                pass
    return n

report = {}
for path in cfg["cgroup_procs"]:  # first: every process of the sample is created inside its cgroups
    try:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        die(f"cgroup {path}: {e}")
drop = cfg["drop_to"] is not None and os.geteuid() == 0
run_uid = cfg["drop_to"] if drop else os.getuid()
# RLIMIT_NPROC counts every task of the uid; root ignores it, so count only when it binds
base = count_tasks(run_uid) if run_uid != 0 else 0
setlim(R.RLIMIT_NPROC, base + cfg["max_tasks"])
setlim(R.RLIMIT_AS, cfg["memory_bytes"])
setlim(R.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1)  # soft -> SIGXCPU, hard -> SIGKILL
setlim(R.RLIMIT_FSIZE, cfg["file_size_bytes"])
setlim(R.RLIMIT_NOFILE, cfg["max_open_files"])
setlim(R.RLIMIT_CORE, 0)
# kernel memory no address-space limit sees, counted per uid: POSIX message queues (none), and the queued signals
# that POSIX timers hold (the default lets every uid keep ~100,000 of them, ~30 MiB)
setlim(R.RLIMIT_MSGQUEUE, 0)
setlim(R.RLIMIT_MEMLOCK, 0)  # no locked pages (mlock, SHM_LOCK): MBPP needs none, and they cannot be reclaimed
setlim(R.RLIMIT_SIGPENDING, cfg["max_sigpending"])
keep = cfg["keep_fds"]

def drop_uid():
    os.setgroups([])
    os.setgid(cfg["drop_to"])
    os.setuid(cfg["drop_to"])

def bwrap_tmpfs():
    # bubblewrap's --tmpfs takes a size but no inode limit, and without a cgroup nothing else bounds the kernel
    # memory of millions of empty files: mount the sample's /tmp and /dev/shm here (a private mount namespace, in a
    # user namespace of our own when not root), size- and inode-limited, and let bwrap bind them.
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    def err(what):
        e = ctypes.get_errno()
        return f"{what}: {os.strerror(e)} (errno {e})"
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
            return err("unshare(CLONE_NEWUSER|CLONE_NEWNS) for the inode-limited tmpfs")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
    elif libc.unshare(CLONE_NEWNS) != 0:
        return err("unshare(CLONE_NEWNS) for the inode-limited tmpfs")
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return err("mount --make-rprivate /")
    opts = f"size={cfg['tmpfs_bytes']},nr_inodes={cfg['tmpfs_inodes']},mode=1777".encode()
    for d in cfg["bwrap_tmpfs"]:
        os.makedirs(d, exist_ok=True)
        if libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
            return err("mount tmpfs on " + d)
    return ""

if cfg["backend"] == "bwrap":
    why = "not needed: the cgroup charges kernel memory"
    if cfg["bwrap_tmpfs"]:
        try:
            why = bwrap_tmpfs()
        except OSError as e:
            why = f"inode-limited tmpfs: {e}"
    if why and cfg["bwrap_tmpfs"] and "limits" in cfg["require"]:  # the probe had them: never run without
        die("weakened after the probe: limits (no inode-limited tmpfs for bwrap: " + why + ")")
    if drop:
        try:
            drop_uid()
        except OSError as e:
            die(f"drop to {cfg['drop_to']}: {e}")
    notes = {"inodes": why} if why and cfg["bwrap_tmpfs"] else {}
    say({"backend": "bwrap", "dropped": drop, "inodes": not why, "notes": notes})
    for n in keep:
        os.set_inheritable(n, True)
    os.set_inheritable(fd, False)
    argv = cfg["bwrap_argv"] if not why else cfg["bwrap_argv_plain"]
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        die(f"exec bwrap: {e}")

import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.syscall.restype = ctypes.c_long
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
notes = {}
userns = False
if cfg["backend"] == "inhouse" and os.geteuid() != 0:
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER) == 0:
        try:
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"{uid} {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
            userns = True
        except OSError as e:
            notes["userns"] = f"uid_map: {e}"
    else:
        notes["userns"] = failed("unshare(CLONE_NEWUSER)")

def unshare(flag, name):
    if cfg["backend"] != "inhouse":
        return False
    if libc.unshare(flag) == 0:
        return True
    notes[name] = failed(f"unshare({name})")
    return False

net = unshare(CLONE_NEWNET, "CLONE_NEWNET")
ipc = unshare(CLONE_NEWIPC, "CLONE_NEWIPC")
uts = unshare(CLONE_NEWUTS, "CLONE_NEWUTS")
if uts:
    libc.sethostname(b"sandbox", 7)

def locked_flags(path):  # flags a user namespace may not clear on a bind remount
    f = os.statvfs(path).f_flag
    out = 0
    for st, ms in ((2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME)):
        if f & st:
            out |= ms
    return out

def ro_bind(src, dst):
    if libc.mount(src.encode(), dst.encode(), None, MS_BIND | MS_REC, None) != 0:
        raise OSError(failed(f"bind {src}"))
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | locked_flags(src)
    if libc.mount(None, dst.encode(), None, flags, None) != 0:
        raise OSError(failed(f"remount {dst} read-only"))

def new_root(with_proc):
    # The new root: a small tmpfs holding only what `ops` names, then pivot_root onto it.
    stage = cfg["stage"]
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # no mount event reaches the host
        raise OSError(failed("mount --make-rprivate /"))
    if libc.mount(b"tmpfs", stage.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=4m,nr_inodes=4096,mode=0755") != 0:
        raise OSError(failed("mount tmpfs (new root)"))
    for op in cfg["ops"]:
        kind, path = op[0], stage + op[-1]
        if kind == "symlink":
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.symlink(op[1], path)
        elif kind == "bind":
            if os.path.isdir(op[-1]):
                os.makedirs(path, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "w").close()
            ro_bind(op[-1], path)
    os.makedirs(stage + "/dev", exist_ok=True)
    for dev in cfg["devices"]:  # no pty, no tty: nothing else in /dev
        open(stage + "/dev/" + dev, "w").close()
        if libc.mount(("/dev/" + dev).encode(), (stage + "/dev/" + dev).encode(), None, MS_BIND, None) != 0:
            raise OSError(failed("bind /dev/" + dev))
    opts = f"size={cfg['tmpfs_bytes']},nr_inodes={cfg['tmpfs_inodes']},mode=1777".encode()
    for d in ("/tmp", "/dev/shm"):
        os.makedirs(stage + d, exist_ok=True)
        if libc.mount(b"tmpfs", (stage + d).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
            raise OSError(failed("mount tmpfs on " + d))
    os.makedirs(stage + "/proc", exist_ok=True)
    if with_proc and libc.mount(b"proc", (stage + "/proc").encode(), b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                                None) != 0:  # fmt: skip
        raise OSError(failed("mount /proc"))
    os.chdir(stage)
    if SYS_PIVOT_ROOT is None or libc.syscall(SYS_PIVOT_ROOT, b".", b".") != 0:  # old root stacks under the new
        raise OSError(failed("pivot_root"))
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(failed("detach the old root"))
    os.chdir("/")
    if libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None) != 0:
        raise OSError(failed("remount / read-only"))
    os.chdir("/tmp")

mntns = False
if cfg["backend"] == "inhouse":
    mntns = libc.unshare(CLONE_NEWNS) == 0
    if not mntns:
        notes["filesystem"] = failed("unshare(CLONE_NEWNS)")
pid = unshare(CLONE_NEWPID, "CLONE_NEWPID")
rooted = False

def enter_root(with_proc):
    # Built by the PID namespace's init when there is one: /proc of the new PID namespace must be mounted while
    # the old root's /proc is still visible (a user namespace may mount proc only then).
    global rooted
    if mntns:
        try:
            new_root(with_proc)
            rooted = True
        except OSError as e:  # the mount namespace is ours alone: nothing of a half-built root is visible outside
            notes["filesystem"] = str(e)
    if not rooted:
        os.chdir(cfg["workdir"])

CAP_SETPCAP = 8

def capabilities():
    # (effective, permitted, inheritable) of this process, each as a 64-bit mask (capget, no /proc needed)
    hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    if SYS_CAPGET is None or libc.syscall(SYS_CAPGET, hdr, data) != 0:
        raise OSError(failed("capget"))
    return tuple(data[i] | (data[i + 3] << 32) for i in range(3))

def bounding_set():
    # the capabilities still in the bounding set (PR_CAPBSET_READ until EINVAL: past the last one)
    held = []
    for cap in range(64):
        r = libc.prctl(PR_CAPBSET_READ, cap, 0, 0, 0)
        if r < 0:
            if ctypes.get_errno() == 22:
                break
            raise OSError(failed(f"read capability {cap} of the bounding set"))
        if r:
            held.append(cap)
    return held

def drop_bounding_set():
    # While still privileged (before the uid drop): PR_CAPBSET_DROP needs CAP_SETPCAP, which nobody lacks.
    # A process that never had it (unprivileged, no user namespace: weak mode only) cannot drop it, and
    # no_new_privs keeps it from gaining anything through exec.
    if not capabilities()[0] >> CAP_SETPCAP & 1:
        return False
    for cap in bounding_set():
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(failed(f"drop capability {cap} from the bounding set"))
    return True

def drop_caps(bounded):
    if SYS_CAPSET is not None:
        hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ctypes.c_uint32 * 6)()
        if libc.syscall(SYS_CAPSET, hdr, data) != 0:
            raise OSError(failed("capset"))
    # verify, fail closed: no capability left in any set, and an empty bounding set where it could be dropped
    eff, prm, inh = capabilities()
    amb = [c for c in range(64) if libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_IS_SET, c, 0, 0) == 1]
    left = bounding_set() if bounded else []
    if eff or prm or inh or amb or left:
        raise OSError(f"capabilities left: effective {eff:#x}, permitted {prm:#x}, inheritable {inh:#x}, "
                      f"ambient {amb}, bounding set {left}")

def check_required():
    # Fail closed: a guarantee the probe had (cfg["require"]) that this run did not get means the sample never runs
    got = {"network": net, "ipc": ipc, "pid": pid, "filesystem": rooted}
    lost = [k for k in cfg["require"] if k in got and not got[k]]
    if lost:
        why = "; ".join(str(notes[k]) for k in notes) or "no note"
        die("weakened after the probe: " + ", ".join(lost) + " (" + why.replace("\n", " ")[:300] + ")")

def seal():
    # In the sample's own process, right before exec: the bounding set (still privileged), uid, the other
    # capability sets (verified), no_new_privs, seccomp.
    bounded = drop_bounding_set()
    if drop:
        drop_uid()
    drop_caps(bounded)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(failed("no_new_privs"))
    if cfg["seccomp_fd"] is not None:
        os.lseek(cfg["seccomp_fd"], 0, 0)
        prog = b""
        while True:
            c = os.read(cfg["seccomp_fd"], 65536)
            if not c:
                break
            prog += c
        os.close(cfg["seccomp_fd"])
        buf = ctypes.create_string_buffer(prog, len(prog))
        class Fprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        fp = Fprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
        if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fp), 0, 0) != 0:
            raise OSError(failed("seccomp"))

def exec_sample():
    check_required()
    try:
        seal()
    except OSError as e:
        die(f"seal: {e}")
    argv = cfg["argv"]
    try:
        os.execve(argv[0], argv, cfg["env"])
    except BaseException as e:
        die("exec " + repr(e))

for n in keep:
    os.set_inheritable(n, True)
os.set_inheritable(fd, False)  # close-on-exec: EOF right after a successful exec
if not pid:
    enter_root(False)
say({"backend": cfg["backend"], "net": net, "ipc": ipc, "uts": uts, "pid": pid, "userns": userns, "fs": rooted,
     "dropped": drop, "notes": dict(notes)})
if not pid:
    exec_sample()

def mirror(status):
    if os.WIFSIGNALED(status):  # die the same way, so returncode == -sig on both paths
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # (their disposition cannot be set: EINVAL)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))

# PID namespace: the first child is PID 1 there, a minimal init that runs the sample as PID 2 and reaps orphans.
# The sample must not be PID 1 itself: the kernel drops default-action signals to a namespace init, so SIGXCPU /
# SIGXFSZ from the rlimits would be ignored. When init exits, the kernel kills the whole namespace.
life_r, life_w = os.pipe()  # getppid() is 0 inside the namespace, so EOF here says the launcher died
st_r, st_w = os.pipe()  # init -> launcher: the sample's raw wait status
init = os.fork()
if init == 0:
    os.close(life_w)
    os.close(st_r)
    enter_root(True)
    say({"fs": rooted, "fs_note": notes.get("filesystem")})
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    import select
    if select.select([life_r], [], [], 0)[0]:  # the launcher died before prctl took effect
        os._exit(125)
    sample = os.fork()
    if sample == 0:
        os.close(st_w)
        os.close(life_r)
        exec_sample()
    for n in keep:
        os.close(n)
    os.close(fd)
    while True:
        pid_done, status = os.wait()
        if pid_done == sample:
            break
    os.write(st_w, str(status).encode())
    os._exit(0)
os.close(life_r)
os.close(st_w)
for n in keep:
    os.close(n)
os.close(fd)
_, init_status = os.waitpid(init, 0)
data = os.read(st_r, 64)
mirror(int(data) if data else init_status)
"""

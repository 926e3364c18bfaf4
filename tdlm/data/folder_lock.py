"""One writer per output folder: an ``flock`` on ``<folder>/.lock`` that names its holder.

Two jobs writing one folder interleave their files (two evaluations once appended the same samples to one shard,
and the merge refused the duplicates after 73 minutes), so every writer takes the folder's lock first and a second
one fails at once, in one line that names the folder, the holder and the ways out.

Why ``flock`` and not a lock file whose existence is the lock: the kernel releases an ``flock`` when its holder dies,
even on SIGKILL or OOM kill, so a dead holder can never keep a folder locked. The holder line ("pid P on HOST since
T") is written into the file while it is held and cleared on a clean release; a non-empty file whose lock could be
taken therefore means the last holder died without releasing it. That *stale* lock is reported as a warning naming
the dead holder (its partial output is what the new holder resumes from) and taken over.

Limits: ``flock`` is per open file description, so a second lock on the same folder in the same process is refused
as well (one writer, whichever process). On NFS, Linux maps ``flock`` to byte-range locks through the lock manager,
so holders on different nodes exclude each other there too; on a file system without lock support the open fails
and the error names the folder.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import logging
import os
import socket
from pathlib import Path

from tdlm.errors import TDLMError

log = logging.getLogger("tdlm.data")

LOCK = ".lock"


def holder_line() -> str:
    """The text a holder writes into the lock file: who holds it, for the refusal message of a second writer."""
    since = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    return f"pid {os.getpid()} on {socket.gethostname()} since {since}"


class FolderLock:
    """Exclusive lock on a folder for the life of this object (``with FolderLock(dir, "evaluation"):``).

    ``what`` names the kind of job in the messages ("evaluation"), ``flag`` the option that picks another folder.
    ``stale_holder`` is the holder line of a dead previous holder that this lock took over, else None.
    """

    def __init__(self, folder: str | os.PathLike, what: str = "run", flag: str = "--output-dir") -> None:
        self.folder = Path(folder).expanduser()
        self.path = self.folder / LOCK
        self.what, self.flag = what, flag
        self.stale_holder: str | None = None
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        if self._fd is not None:
            return self
        if self.folder.exists() and not self.folder.is_dir():
            raise TDLMError(f"{self.flag} {self.folder} exists and is not a folder")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            from tdlm.data.trajectories import is_disk_full, write_error

            if is_disk_full(e):
                raise write_error(self.path, e, "nothing was written") from None
            raise TDLMError(f"{self.folder}: cannot create the lock file {LOCK} ({e.strerror}); "
                            f"choose a writable {self.flag}") from None  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd) or "a process that has not written its name yet"
            os.close(fd)
            raise TDLMError(
                f"{self.folder}: another {self.what} is writing this folder ({holder}, holding {self.path}); "
                f"wait for it to end, stop it, or choose another {self.flag}"
            ) from None
        except OSError as e:  # ENOLCK: a file system without lock support
            os.close(fd)
            raise TDLMError(f"{self.path}: cannot lock ({e.strerror}); put {self.flag} on a file system with "
                            f"file locks") from None  # fmt: skip
        previous = _read(fd)
        if previous:
            # The lock was free but the file names a holder: it died without releasing (a clean release clears it).
            self.stale_holder = previous
            log.warning("%s: stale lock: the %s holding it died (%s); taking it over and resuming from its output",
                        self.folder, self.what, previous)  # fmt: skip
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (holder_line() + "\n").encode(), 0)
            os.fsync(fd)
        except OSError as e:  # a full disk: one line, and the lock is not held by a job that cannot write
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            from tdlm.data.trajectories import write_error

            raise write_error(self.path, e, "nothing was written") from None
        self._fd = fd
        return self

    def release(self) -> None:
        """Clear the holder line, then unlock (a later holder that finds the line knows this one died)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""

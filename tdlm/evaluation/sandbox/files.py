"""The runner's file plumbing on the trusted side: capped reads of what a sample wrote, an unnamed fd for what it is
given, and removal of a scratch tree whose modes the sample may have changed."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile


def read_capped(path: str, cap: int) -> tuple[bytes, int]:
    with open(path, "rb") as f:
        return f.read(cap + 1), os.fstat(f.fileno()).st_size


def read_text(path: str, cap: int) -> str:
    data, total = read_capped(path, cap)
    text = data[:cap].decode("utf-8", errors="replace")
    if total > cap:
        text += f"\n[... truncated: {total} bytes total, {cap} kept]"
    return text


def rmtree(path: str) -> None:
    def fix(func, p, _exc):  # sample code may chmod its own files to 000 (weak mode only: no private /tmp)
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)


def fd_with(data: bytes) -> int:
    """An fd holding ``data`` with no name anywhere (memfd, else an unlinked temp file), offset 0."""
    try:
        fd = os.memfd_create("tdlm-sandbox")
    except (AttributeError, OSError):
        f = tempfile.TemporaryFile()
        fd = os.dup(f.fileno())
        f.close()
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def read_nonblocking(fd: int, cap: int = 65536) -> bytes:
    os.set_blocking(fd, False)
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(cap) or b""
        except BlockingIOError:
            return b""

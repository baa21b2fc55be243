"""Path rows: files on the serving machine, read only under the root the operator named.

A client names a path; the server reads it only when it resolves (symlinks followed) to a
regular file inside :attr:`serving.limits.ServeLimits.path_root` of at most
``max_file_bytes``. Devices, FIFOs, sockets, directories, ``/proc`` files and anything
outside the root are refused, and so is a file that does not exist, with one and the same
answer, so the answer tells nothing about the machine's files. The file is opened
non-blocking and without following a final symlink, and what was opened is checked again
(``fstat``, its ``/proc/self/fd`` path), so a swap between the check and the open is
caught.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from core.errors import RunError

REFUSED = ("path: not a readable file under the serving root (paths are relative to it; "
           "or send the image's bytes in 'image')")
OFF = "path: path rows are off on this server; send the image's bytes in 'image'"
SYSTEM = ("/proc", "/sys", "/dev", "/run")


class PathRefused(ValueError):
    """A path row that is not read; the message is the same for every reason."""


class PathRoot:
    """Reads files under ``root`` ("" : path rows are off)."""

    def __init__(self, root: str, max_file_bytes: int) -> None:
        self.root = check_root(root) if root else None
        self.max_file_bytes = max_file_bytes

    def read(self, name: object, budget: int) -> bytes:
        """The bytes of the file ``name`` names (relative to the root, or absolute inside
        it), at most ``min(max_file_bytes, budget)`` of them; PathRefused otherwise."""
        if self.root is None:
            raise PathRefused(OFF)
        limit = min(self.max_file_bytes, budget)
        try:
            target = os.path.realpath(os.path.join(self.root, str(name)))
            if not _inside(target, self.root):
                raise PathRefused(REFUSED)
            fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (OSError, ValueError, TypeError):  # missing, NUL byte, loop, permissions
            raise PathRefused(REFUSED) from None
        try:
            info = os.fstat(fd)
            opened = os.readlink(f"/proc/self/fd/{fd}")
            if not stat.S_ISREG(info.st_mode) or not _inside(opened, self.root) \
                    or info.st_size > limit:
                raise PathRefused(REFUSED)
            data = b""
            while len(data) <= limit and (chunk := os.read(fd, limit + 1 - len(data))):
                data += chunk
        except OSError:
            raise PathRefused(REFUSED) from None
        finally:
            os.close(fd)
        if len(data) > limit:  # grew after fstat
            raise PathRefused(REFUSED)
        return data


def check_root(root: str) -> str:
    """The resolved root; RunError naming it when it is not a directory or is the file
    system's root or a system tree (``/proc``, ``/sys``, ``/dev``, ``/run``)."""
    resolved = os.path.realpath(root)
    if not os.path.isdir(resolved):
        raise RunError(f"--path-root {root}: not a directory")
    if resolved == "/" or any(_inside(resolved, s) for s in SYSTEM):
        raise RunError(f"--path-root {root}: resolves to {resolved}, a system tree; name "
                       "the directory that holds the images")
    return resolved


def _inside(path: str, root: str) -> bool:
    return path == root or Path(path).is_relative_to(root)

"""Faults a user can fix. Raised with one line that names the file, key or URI at fault
and what to do; the entry points print that line (no traceback) and exit with status 1."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NO_SPACE_MESSAGES = ("database or disk is full", "No space left on device", "Disk quota exceeded")


class RunError(RuntimeError):
    """A fault found at run time (after configuration checks), worded for the user."""


def first_line(err: BaseException | str, limit: int = 200) -> str:
    """A short cause for a one-line report: the first line of ``err``'s message cut to
    ``limit`` characters, or the error's type name when it has no message."""
    lines = str(err).strip().splitlines()
    if not lines:
        return type(err).__name__ if isinstance(err, BaseException) else ""
    return lines[0][:limit]


def error_chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, then the errors it was raised from or while handling (``__cause__``, else
    ``__context__``), each once."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def disk_full(err: BaseException) -> bool:
    """Whether ``err``, or an error it was raised from, says a disk or quota is full: an
    ``OSError`` with ENOSPC or EDQUOT, or SQLite's "database or disk is full" (which
    SQLAlchemy and MLflow wrap in their own exception types)."""
    return any((isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS)
               or any(message in str(e) for message in NO_SPACE_MESSAGES)
               for e in error_chain(err))


def free_space(path: os.PathLike | str) -> str:
    """``"<N> MiB free"`` on the file system holding ``path`` (or its nearest existing
    parent; ``sqlite:///`` and ``file://`` URIs name local paths too), for messages;
    ``""`` for other URIs or when it cannot be read."""
    text = str(path)
    for scheme in ("sqlite:///", "file://"):
        text = text.removeprefix(scheme)
    if "://" in text:
        return ""
    probe = os.path.abspath(text)
    while True:  # asked, not checked first: another rank may remove a partial write meanwhile
        try:
            return f"{shutil.disk_usage(probe).free / 2**20:.1f} MiB free"
        except FileNotFoundError:
            if os.path.dirname(probe) == probe:
                return ""
            probe = os.path.dirname(probe)
        except OSError:
            return ""


def no_space(what: str, path: os.PathLike | str, key: str, then: str) -> RunError:
    """The one-line fault for a full disk while writing ``what`` at ``path``: names the
    option ``key`` that places it and what ``then`` holds for the work done so far."""
    free = free_space(path)
    return RunError(f"no space left on device writing {what} {path}"
                    f"{f' ({free})' if free else ''}: free space there or set {key} to "
                    f"another disk; {then}")


@contextmanager
def full_disk_stops(what: str, path: os.PathLike | str, key: str, then: str) -> Iterator[None]:
    """A full disk met inside raises :func:`no_space` (``what``, ``path``, ``key``,
    ``then``) instead of the library's own exception; other errors pass unchanged."""
    try:
        yield
    except Exception as err:
        if disk_full(err) and not isinstance(err, RunError):
            raise no_space(what, path, key, then) from None
        raise

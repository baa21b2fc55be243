"""One run per directory: rank 0 holds ``<run_dir>/run.lock`` while it trains.

The lock is a file created with ``O_EXCL`` (atomic on local file systems and NFS v3+)
holding the holder's host, pid and start time; a thread refreshes its modification time
every ``HEARTBEAT_S`` seconds. A second start fails at once naming the directory and the
holder. A lock whose holder is gone is taken over, so torchrun restarts and slurm requeues
resume: on the same host, when its pid is no longer alive; on any host, when its heartbeat
is older than ``STALE_AFTER_S`` (a crashed or lost node stops refreshing it).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from core.errors import RunError

log = logging.getLogger(__name__)

LOCK = "run.lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class RunLock:
    """Rank 0's lock on a run directory (a context manager)."""

    def __init__(self, run_dir: Path, stale_after_s: float = STALE_AFTER_S,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        self.path = run_dir / LOCK
        self.stale_after_s, self.heartbeat_s = stale_after_s, heartbeat_s
        self.token = uuid.uuid4().hex
        self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                       "started": datetime.now(UTC).isoformat(timespec="seconds"),
                       "token": self.token}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunError` naming the directory and the holder."""
        for _ in range(3):  # a holder that leaves between our two looks: look again
            try:
                with open(self.path, "x") as f:
                    json.dump(self.record, f)
                break
            except FileExistsError:
                holder = self.holder()
                if holder is None:
                    continue
                reason = self.gone(holder)
                if reason is None:
                    raise RunError(self.describe(holder)) from None
                if self.take_over():
                    log.warning("%s: took over the lock of pid %s on %s (%s)", self.path.parent,
                                holder.get("pid"), holder.get("host"), reason)
                    break
        else:
            raise RunError(f"{self.path}: could not take the lock (another start is taking "
                           "it at the same time)")
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def holder(self) -> dict | None:
        """The holder's record with its heartbeat age (``age_s``); None when no lock."""
        try:
            text = self.path.read_text()
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        try:
            record = json.loads(text)
        except json.JSONDecodeError:  # a holder that crashed while writing it
            record = {}
        return {**record, "age_s": age}

    def gone(self, holder: dict) -> str | None:
        """Why the holder is gone, or None while it may still run."""
        if holder["age_s"] > self.stale_after_s:
            return f"no heartbeat for {holder['age_s']:.0f} s"
        if not holder.get("pid"):  # unreadable: being written, or its writer crashed
            return "an unreadable lock" if holder["age_s"] > 2 else None
        if holder.get("host") == self.record["host"] and not pid_alive(int(holder["pid"])):
            return f"pid {holder['pid']} is no longer running"
        return None

    def describe(self, holder: dict) -> str:
        return (f"{self.path.parent} is in use by pid {holder.get('pid')} on "
                f"{holder.get('host')} since {holder.get('started')} (heartbeat "
                f"{holder['age_s']:.0f} s ago): wait for that run to end, or choose another "
                "name or output_dir (a lock without a heartbeat for "
                f"{self.stale_after_s:.0f} s is taken over)")

    def take_over(self) -> bool:
        """Replace a gone holder's lock with ours; True if ours is the one in place."""
        temporary = self.path.with_name(f".{LOCK}.{self.token}")
        temporary.write_text(json.dumps(self.record))
        os.replace(temporary, self.path)
        time.sleep(0.05)  # another taker replacing it at the same time wins or loses here
        return (self.holder() or {}).get("token") == self.token

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if (self.holder() or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)

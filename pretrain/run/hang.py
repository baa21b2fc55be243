"""A rank that stops making progress ends like a crash: found, named, killed, restarted.

Two of torch's own timeouts, in this order, both following the run's step time
``E = max(train.hang.floor_s, train.hang.factor x the median step)``:

1. **The collective timeout** (``dist.set_timeout`` on the default group): a rank waiting
   in a collective for a peer that stopped fails after ``E``. Waiting, it alone can tell
   who stopped: every rank beats a heartbeat into the job's store (its step, and whether
   it waits for its data), so the waiting rank names the ranks whose heartbeat stood
   still (a frozen process) or that wait for their data, in one line, and writes it under
   ``<run>/hangs/`` for the restarted run to log again and to tag on its MLflow run. Then
   it exits, and torchrun restarts the group as for a crash.
2. **The step timer** (torch's ``FileTimerClient``, served on each node by
   :mod:`pretrain.run.step_timer`): a rank whose steps stop for
   ``E + NAMING_S + train.hang.kill_after_s`` (the waiting rank has named it by then) is
   killed with its process group by SIGKILL, which stops even a frozen process: its
   agent needs no 30 s of SIGTERM first.
3. **The rendezvous** (torchrun's): the restarted group waits for its nodes; a node whose
   agent is frozen too misses its heartbeats and is left out.

Known long phases follow their own time: a checkpoint write and the kNN monitor
(:meth:`HangWatch.long_phase`, by name) wait ``max(floor, factor x that phase's median in
this process)``. What has not been timed yet keeps ``engine.collective_timeout`` and no
step timer: each phase's first run in a process (the run's end and a preemption's
checkpoint run once); a fresh run's first ``train.hang.warmup_steps`` steps; a restarted
run's first ``RESTART_STEPS`` steps (the loader's start, the caption store's first read,
``train.compile``), after which it follows the larger of the step time rank 0 recorded
under ``<run>/hangs/`` and its own steps', until it has ``warmup_steps`` of its own.
A straggler that pauses for less than ``E`` changes nothing. Limits: the line needs gloo
(an NCCL timeout aborts the process; never run on a GPU), and DeepSpeed's and a 2-D
FSDP2 mesh's own groups keep ``engine.collective_timeout``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from core.config import InvalidValue
from core.errors import RunError

log = logging.getLogger(__name__)

TIMER_FILE = "TORCHELASTIC_TIMER_FILE"  # the node's step-timer server's pipe (torchrun passes it)
BEAT_S = 1.0  # seconds between heartbeats
READ_S = 5.0  # the longest wait for the store's answer to one reading of the heartbeats
NAMING_S = 3 * BEAT_S + 2 * READ_S  # the longest naming: two readings, 3 beats apart
STEP_TIME = "step_time.json"  # under <run>/hangs/: the run's median step and its world
RESTART_STEPS = 2  # a restart's steps on the long timeout: the loader's start, compile


@dataclass
class HangConfig:
    """``train.hang.*``: when a rank that makes no progress is a hang."""

    enabled: bool = True  # heartbeats, the collective timeout and the step timer follow the run
    floor_s: float = 15.0  # the least wait for a peer: above the pauses of a healthy job
    factor: float = 10.0  # a wait of this many median steps is a hang
    kill_after_s: float = 10.0  # after the waiting ranks' timeout and naming, the kill
    warmup_steps: int = 10  # a fresh run's steps on the long timeout, measuring its step

    def validate(self) -> None:
        for key in ("floor_s", "factor", "kill_after_s"):
            if getattr(self, key) <= 0:
                raise InvalidValue(key, f"must be > 0, got {getattr(self, key)}")
        if self.warmup_steps < 1:
            raise InvalidValue("warmup_steps", f"must be >= 1, got {self.warmup_steps}")


class Hang(RunError):
    """A collective timed out waiting for a rank that stopped: the process ends in one
    line (exit 1), and torchrun restarts the group as for a crash."""


def is_collective_timeout(err: BaseException) -> bool:
    """A gloo collective that waited out its timeout (``Timed out waiting 15000ms for
    send operation to complete``)."""
    return isinstance(err, RuntimeError) and re.search(r"Timed out waiting \d+ms",
                                                       str(err)) is not None


class Heartbeat:
    """This rank's heartbeat in the job's store, from a thread of its own (a frozen process
    beats no more; one waiting in a collective still does): ``count step phase host pid``."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store, rank
        self.step, self.phase, self.count = 0, "data", 0
        self.host, self.stopped = socket.gethostname(), threading.Event()
        self.beat()  # every rank's key exists before the first step
        self.thread = threading.Thread(target=self._beat, daemon=True, name="heartbeat")
        self.thread.start()

    def beat(self) -> None:
        self.count += 1
        self.store.set(f"hang/beat/{self.rank}",
                       f"{self.count} {self.step} {self.phase} {self.host} {os.getpid()}")

    def _beat(self) -> None:
        while not self.stopped.wait(BEAT_S):
            with contextlib.suppress(Exception):  # a store that stopped answering: the
                self.beat()  # waiting ranks tell

    def close(self) -> None:
        self.stopped.set()


def read_beats(store: dist.Store, world: int, wait_s: float = READ_S,
               ) -> dict[int, list[str]] | None:
    """Every rank's last heartbeat; None when the store does not answer within ``wait_s``
    (a client's own timeout does not end a read from a server that froze: a thread
    reads)."""
    keys = [f"hang/beat/{rank}" for rank in range(world)]
    values: list[list[bytes]] = []
    reader = threading.Thread(target=lambda: values.append(store.multi_get(keys)),
                              daemon=True, name="heartbeat-reader")
    reader.start()
    reader.join(wait_s)
    if not values:  # an error in the reader, or no answer: the store is the finding
        return None
    return {rank: value.decode().split() for rank, value in enumerate(values[0])}


def who_stopped(store: dist.Store, world: int, rank: int, step: int, timeout_s: float,
                ) -> str:
    """One line: the ranks that stopped making progress, from two readings of the
    heartbeats ``3 x BEAT_S`` apart (a count that did not move: a frozen process; a phase
    of ``data``: a rank waiting for its batch)."""
    first = read_beats(store, world)
    time.sleep(3 * BEAT_S)
    second = read_beats(store, world) if first is not None else None
    if first is None or second is None:
        return (f"hang at step {step}: rank {rank} waited {timeout_s:.0f} s in a collective "
                "and the job's store (served on rank 0's node) does not answer: rank 0 or "
                "its node stopped")
    frozen = [r for r in range(world) if r != rank and second[r][0] == first[r][0]]
    waiting = [r for r in range(world) if r != rank and r not in frozen
               and second[r][2] == "data"]
    named = [f"rank {r} on {second[r][3]} (pid {second[r][4]}, {what})"
             for found, what in ((frozen, "no heartbeat"), (waiting, "waiting for its data"))
             for r in found]
    nobody = ("a rank that went on again (every heartbeat moved: a pause about as long as "
              "the timeout, or the network)")
    return (f"hang at step {step}: rank {rank} waited {timeout_s:.0f} s in a collective for "
            f"{', '.join(named) or nobody} and exits: the group restarts from the newest "
            "checkpoint")


class HangWatch:
    """This rank's part: its heartbeat, its step timer and the collective timeout, moved
    by :meth:`progress` after every step and lifted for :meth:`long_phase`."""

    def __init__(self, cfg: HangConfig, rank: int, world: int, long_s: float,
                 run_dir: Path, store: dist.Store | None) -> None:
        self.cfg, self.rank, self.world, self.long_s = cfg, rank, world, long_s
        self.run_dir, self.store = run_dir, store
        self.steps: deque[float] = deque(maxlen=50)  # the newest step times
        self.counted = 0  # steps since this start
        self.phases: dict[str, deque[float]] = {}  # each long phase's durations
        self.recorded_s = recorded_step_s(run_dir, world)
        self.last = time.monotonic()
        self.timeout_s, self.in_phases = long_s, []  # the expiries of the phases under way
        self.heartbeat = Heartbeat(store, rank) if store is not None else None
        self.timer = None
        if os.environ.get(TIMER_FILE):
            from torch.distributed.elastic.timer import FileTimerClient

            self.timer = FileTimerClient(os.environ[TIMER_FILE])
        if rank == 0 and world > 1:
            log.info("hang watch: %s", f"step timer served at {os.environ[TIMER_FILE]}"
                     if self.timer else "no step timer (launch/torchrun.sh and "
                     "launch/slurm.sbatch start one): a frozen process ends by torchrun's "
                     "SIGTERM and, 30 s on, SIGKILL")
        self._arm(long_s)

    @property
    def step_s(self) -> float | None:
        """The run's step time: the median of this start's steps once it has
        ``warmup_steps`` of them; before that, from a restart's ``RESTART_STEPS``-th step
        on, the larger of the one recorded before it and the median of its own steps but
        the first (a run resumed with a slower configuration); None while not known."""
        if self.counted >= self.cfg.warmup_steps:
            return statistics.median(self.steps)
        if self.recorded_s is not None and self.counted >= RESTART_STEPS:
            return max(self.recorded_s, statistics.median(list(self.steps)[1:]))
        return None

    @property
    def expiry_s(self) -> float:
        """How long a collective waits for a peer now: the long timeout while the run's
        step time is not known and in long phases, else ``max(floor, factor x step)``."""
        if self.in_phases:
            return max(self.in_phases)
        return self.following(self.step_s)

    def following(self, seconds: float | None) -> float:
        """``max(floor, factor x seconds)``, at most the long timeout; the long timeout
        while ``seconds`` is not known."""
        if seconds is None:
            return self.long_s
        return min(self.long_s, max(self.cfg.floor_s, self.cfg.factor * seconds))

    def phase_s(self, name: str) -> float | None:
        """The median of phase ``name``'s durations in this process; None before it has
        run once here (a cold start: its loader, its compilation)."""
        return statistics.median(self.phases[name]) if self.phases.get(name) else None

    def progress(self, step: int) -> None:
        """``step`` is done: its time counts, the timeouts follow, the heartbeat moves on."""
        now = time.monotonic()
        self.steps.append(now - self.last)
        self.last, self.counted = now, self.counted + 1
        if self.heartbeat is not None:
            self.heartbeat.step, self.heartbeat.phase = step, "data"
        if self.rank == 0 and self.counted % self.cfg.warmup_steps == 0:
            record_step_s(self.run_dir, statistics.median(self.steps), self.world)
        self._arm(self.expiry_s)

    def batch_arrived(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.phase = "step"

    @contextlib.contextmanager
    def long_phase(self, name: str) -> Iterator[None]:
        """A checkpoint write, an evaluation: while it lasts, the timeouts follow that
        phase's own median (the long timeout on its first run, and in a phase inside a
        longer one); its duration counts for the next."""
        self.in_phases.append(self.following(self.phase_s(name)))
        self._arm(self.expiry_s)
        start = time.monotonic()
        try:
            yield
            self.phases.setdefault(name, deque(maxlen=20)).append(time.monotonic() - start)
        finally:
            self.in_phases.pop()
            self.last += time.monotonic() - start  # the phase is not part of its step
            self._arm(self.expiry_s)

    def _arm(self, expiry_s: float) -> None:
        """The collective timeout to ``expiry_s`` (when it moved by more than a tenth), and
        the step timer to it plus the naming's longest (:data:`NAMING_S`: the kill comes
        after the waiting rank has named this one) plus ``kill_after_s`` (at least two
        median steps: a waiting rank's collective began up to a step after its timer was
        armed); no step timer while the timeout is the long one (warmup, long phases)."""
        if abs(expiry_s - self.timeout_s) > 0.1 * self.timeout_s:
            if self.world > 1 and dist.is_initialized():
                dist.set_timeout(timedelta(seconds=expiry_s))
            self.timeout_s = expiry_s
        if self.timer is not None:
            margin = NAMING_S + max(self.cfg.kill_after_s, 2 * (self.step_s or 0.0))
            try:
                if expiry_s >= self.long_s:  # a long phase is bounded by its collectives
                    self.timer.release(self.scope)
                else:
                    self.timer.acquire(self.scope, time.time() + expiry_s + margin)
            except OSError:  # the node's server is gone: a second of retries a step
                log.warning("hang: no step-timer server at %s; rank %d runs without its "
                            "step timer", os.environ.get(TIMER_FILE), self.rank)
                self.timer = None

    @property
    def scope(self) -> str:
        """The step timer's name on the node's server (one timer per rank, moved on)."""
        return f"rank {self.rank}"

    def timed_out(self, step: int) -> str:
        """A collective of ``step`` timed out here: the line naming who stopped, logged at
        once (the process ends on it, :class:`Hang`, but its unwinding may outlast the
        stopped rank's step timer, whose kill restarts the group and so ends this process
        before its exit line) and written under ``<run>/hangs/``; this rank's step timer is
        released (it exits now)."""
        if self.timer is not None:
            with contextlib.suppress(OSError):
                self.timer.release(self.scope)
        line = (who_stopped(self.store, self.world, self.rank, step, self.timeout_s)
                if self.store is not None else f"hang at step {step}: rank {self.rank} "
                f"waited {self.timeout_s:.0f} s in a collective")
        log.error("%s", line)
        folder = self.run_dir / "hangs"
        folder.mkdir(parents=True, exist_ok=True)
        record = {"step": step, "rank": self.rank, "line": line, "time": time.time()}
        (folder / f"{int(time.time() * 1000)}-rank{self.rank}.json").write_text(
            json.dumps(record) + "\n")
        return line

    def close(self) -> None:
        """The run's steps are over: the long timeouts again, no heartbeat, no timer."""
        self.in_phases.append(self.long_s)
        self._arm(self.long_s)
        if self.heartbeat is not None:
            self.heartbeat.close()
        if self.timer is not None:
            with contextlib.suppress(OSError):
                self.timer.release(self.scope)


def record_step_s(run_dir: Path, step_s: float, world: int) -> None:
    """Rank 0's median step time and its world, for the run's next start (a disk that
    refuses it costs the next start its record, nothing more)."""
    folder = run_dir / "hangs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"{STEP_TIME}.partial"
        partial.write_text(json.dumps({"step_s": step_s, "world": world}) + "\n")
        partial.replace(folder / STEP_TIME)
    except OSError as err:
        log.warning("hang: could not record the step time under %s: %s", folder, err)


def recorded_step_s(run_dir: Path, world: int) -> float | None:
    """The step time recorded before this start, scaled to this world when it shrank (a
    rank's share of a kept global batch grows; never scaled down: with a batch per rank
    the step does not shorten); None on a fresh run or a record that is not a positive,
    finite time and world."""
    try:
        record = json.loads((run_dir / "hangs" / STEP_TIME).read_text())
        step_s, recorded_world = float(record["step_s"]), float(record["world"])
    except Exception:  # noqa: BLE001 - any unreadable record is no record
        return None
    if not (math.isfinite(step_s) and math.isfinite(recorded_world) and step_s > 0
            and recorded_world >= 1):
        return None
    return step_s * max(1.0, recorded_world / world)


def report_hangs(run_dir: Path, tracker: Any) -> int:
    """The restarted run's rank 0: each hang the waiting ranks wrote, once (several ranks
    may have named the same), logged and, with MLflow, tagged ``hang.<n>`` and counted in
    the metric ``hangs``; the records are moved to ``hangs/reported/``."""
    folder = run_dir / "hangs"
    records = sorted(folder.glob("*-rank*.json")) if folder.is_dir() else []
    if not records:
        return 0
    reported = folder / "reported"
    reported.mkdir(exist_ok=True)
    earlier = len(list(reported.glob("hang-*.json")))
    seen: dict[int, dict[str, Any]] = {}
    for path in records:
        record = json.loads(path.read_text())
        seen.setdefault(record["step"], record)
        path.unlink()
    for n, (step, record) in enumerate(sorted(seen.items()), start=earlier + 1):
        log.warning("restarted after a %s", record["line"])
        (reported / f"hang-{n:04d}.json").write_text(json.dumps(record) + "\n")
        if tracker is not None:
            tracker.set_tag(f"hang.{n}", record["line"][:5000])
            tracker.log_metrics(step, {"hangs": float(n)})
    return len(seen)

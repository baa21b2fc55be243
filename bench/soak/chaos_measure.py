"""The chaos soak's measurements (``bench/soak/chaos.py``), read from rank 0's training log: each
fault's recovery, the steps it made train again and a pause's restarts; the loss curve;
the distance between two runs' final weights."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from pretrain.run.checkpoint import list_checkpoints, model_state_of

STEP = re.compile(r"^(\S+ \S+) rank0 pretrain\.loop\.trainer INFO: step (\d+) (.*=.*)$")
WORLD = re.compile(r"^(\S+ \S+) rank0 pretrain INFO: (\d+) ranks on ")
RESUMED = re.compile(r"^(\S+ \S+) rank0 .*resumed from \S+ at step (\d+)")


KINDS = ("agent", "worker", "freeze", "freeze_agent", "straggler")
BACK_S, PAUSE_S = (5, 20), (2, 8)  # a node's absence; a straggler's pause (under 15 s)
PAUSES = {"straggler": PAUSE_S, "freeze_agent": BACK_S}  # the faults that end by SIGCONT


@dataclass
class Kill:
    at: float  # time.time() of the fault
    kind: str  # one of KINDS
    agent: int
    last_step: int  # the newest step logged before it
    recovery_s: float | None = None  # to the next step logged by a group formed after it
    redone: int | None = None  # steps trained again after it
    world_after: int | None = None
    restarts: int | None = None  # a pause's: the groups formed while or soon after it
    pause_s: float | None = None  # how long it stood stopped (straggler, freeze_agent)


def weights_distance(a: Path, b: Path) -> float:
    """The relative L2 distance of run ``b``'s final weights (every floating tensor of the
    model state, batch-norm statistics included) from run ``a``'s."""
    first, second = (model_state_of(list_checkpoints(run)[0])[1] for run in (a, b))
    keys = [k for k, v in first.items() if v.is_floating_point()]
    difference = sum(float((first[k].double() - second[k].double()).square().sum())
                     for k in keys)
    norm = sum(float(first[k].double().square().sum()) for k in keys)
    return (difference / norm) ** 0.5


def stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def log_events(run_log: Path) -> list[tuple[float, str, int, dict[str, float]]]:
    """(time, "step" | "world" | "resumed", number, metrics) of rank 0's log, in order."""
    events = []
    if not run_log.exists():
        return events
    for line in run_log.read_text().splitlines():
        for kind, pattern in (("step", STEP), ("world", WORLD), ("resumed", RESUMED)):
            found = pattern.match(line)
            if found:
                metrics = ({k: float(v) for k, v in (item.split("=") for item in
                                                    found.group(3).split())}
                           if kind == "step" else {})
                events.append((stamp(found.group(1)), kind, int(found.group(2)), metrics))
    return events


def log_span(run_log: Path) -> float:
    """Seconds from the first to the last line rank 0 logged with a time."""
    stamps = [stamp(" ".join(line.split()[:2])) for line in run_log.read_text().splitlines()
              if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ rank0 ", line)]
    return stamps[-1] - stamps[0]


def last_logged_step(run_log: Path) -> int:
    steps = [number for _, kind, number, _ in log_events(run_log) if kind == "step"]
    return steps[-1] if steps else 0


def measure_kills(kills: list[Kill], events: list) -> None:
    """Each kill's recovery (to the first step logged after a new world formed after it)
    and the steps trained again (the newest step logged before that world less the step
    its resume took up; a resume that follows two kills counts once). A pause restarted the
    group when one formed while it lasted or within 30 s (before the next fault)."""
    counted: set[float] = set()
    for kill, following in zip(kills, [*kills[1:], None], strict=True):
        after = [e for e in events if e[0] > kill.at]
        if kill.kind in PAUSES and kill.pause_s is not None:
            until = min(kill.at + kill.pause_s + 30, following.at if following else np.inf)
            kill.restarts = sum(1 for e in after if e[1] == "world" and e[0] < until)
            if not kill.restarts:
                continue  # stopped for less than the timeout: a straggler, healed
        world = next((e for e in after if e[1] == "world"), None)
        if world is None:
            continue
        step = next((e for e in after if e[1] == "step" and e[0] > world[0]), None)
        resumed = next((e for e in after if e[1] == "resumed" and e[0] > world[0]), None)
        if step is not None:
            kill.recovery_s = step[0] - kill.at
        kill.world_after = world[2]
        reached = max([e[2] for e in events if e[1] == "step" and e[0] < world[0]], default=0)
        resumed_at = resumed[2] if resumed is not None else 0
        kill.redone = 0 if resumed and resumed[0] in counted else max(0, reached - resumed_at)
        if resumed is not None:
            counted.add(resumed[0])


def healed(kill: Kill) -> bool:
    """A step followed the fault's restart, or it caused none (a pause)."""
    return kill.recovery_s is not None or (kill.kind in PAUSES and kill.restarts == 0)


def loss_by_samples(events: list) -> tuple[np.ndarray, np.ndarray]:
    """Loss against samples, the last time each step was trained."""
    rows = {int(m["samples"]): m["loss"] for _, kind, _, m in events if kind == "step"}
    samples = np.array(sorted(rows))
    return samples, np.array([rows[s] for s in samples])

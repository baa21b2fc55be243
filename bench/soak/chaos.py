"""A chaos soak of the elastic launch: three agents of ``launch/torchrun.sh``
(``NNODES=1:3``, one process each) train while a seeded schedule draws a fault 30-90 s
after the group has healed from the last one (every agent back in a group that has trained
5 steps since; each kind once in every five, in a drawn order): SIGKILL of a whole agent and every
process under it (``agent``: a node lost, started again 5-20 s later) or of one training
process (``worker``); SIGSTOP of one
training process and its loader worker (``freeze``: a hang, left frozen for the hang
watch to find) or of a whole agent tree (``freeze_agent``: a node that stops answering,
SIGCONT 5-20 s later); a pause of 2-8 s, under the hang watch's 15 s floor (``straggler``:
SIGSTOP, then SIGCONT).

    python -m bench.soak.chaos                   # 12 faults over 180 epochs, then the references
    python -m bench.soak.chaos --kills 15 --epochs 80 --gap 15 30 --seed 1 --record  # the docs
    python -m bench.soak.chaos --analyse-only        # measure the soak in --workdir again

The rendezvous store runs in a process of its own, as on a cluster whose endpoint is a head
node no fault reaches; every agent joins it as a client. The run: InfoNCE on 1,600
cluttered digits (``cluttered_digits``), the small CNN at 32 px, 16 instances a rank on the
3 ranks it begins with (a global batch of 48, kept through every change of world),
``train.epochs`` epochs, a checkpoint every 4 steps, the ledger kept, the encoder registered
at the end. Then the same configuration uninterrupted on 3 processes, and on 1 (float32:
the distance between those two is what the order of floating-point sums alone gives, the
batches being the same on any world).

Reported: per kind, faults and those survived, seconds from the fault to the next step
trained by a group formed after it (median, max), and the restarts a straggler caused;
per fault, that time and the steps trained again; the ledger of every epoch (read once,
twice, unread: nothing may be unread beyond the last partial global batch); the final
checkpoint loaded into the configured model and the registered version; the loss against
samples beside the uninterrupted run's (``chaos.png``); the final weights' relative L2
distance to the uninterrupted run's, beside the 1-rank run's. Writes
``bench/results/chaos.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import yaml

from bench.common import machine, write_json
from bench.records import invocation, provenance, write_and_show
from bench.soak.chaos_measure import (
    BACK_S,
    KINDS,
    PAUSES,
    Kill,
    last_logged_step,
    log_events,
    log_span,
)
from bench.soak.chaos_report import report
from bench.soak.chaos_tables import NAME, RENDERER
from core.runtime import free_port

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
SAMPLES, BATCH, NODES = 1600, 16, 3
SETTLED_STEPS = 5  # steps of the newest group before the next fault is drawn


def overrides(workdir: Path, name: str, epochs: int) -> list[str]:
    return [f"output_dir={workdir}", f"name={name}", f"data.shards={workdir / 'shards'}",
            f"data.batch_size={BATCH}", f"data.global_batch_size={BATCH * NODES}",
            "data.workers=1", "data.resolution=32",
            "data.ledger=true", "model.backbone=small_cnn", "model.width=16",
            "objective.name=infonce", "objective.temperature=0.1", "optim.name=adamw",
            "optim.lr=0.002", "optim.warmup_steps=10", f"train.epochs={epochs}",
            "train.log_every=1", "train.progress=false", "checkpoint.every=4",
            "checkpoint.keep=2", "tracking.log_model=true"]


def make_shards(workdir: Path) -> None:
    if (workdir / "shards" / "manifest.json").exists():
        return
    subprocess.run([sys.executable, "-m", "app.make_shards", "shards.source=cluttered_digits",
                    f"shards.output={workdir / 'shards'}", f"shards.samples={SAMPLES}",
                    "shards.shard_size=200", "shards.split=train"], cwd=REPO, check=True)


def job_file(workdir: Path) -> Path:
    job = workdir / "job.yaml"
    job.write_text("name: chaos\n")
    return job


def environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MAX_RESTARTS": "1000", **extra}


def uninterrupted(workdir: Path, epochs: int, log, name: str = "reference",
                  nproc: int = NODES) -> float:
    """The soak's configuration, uninterrupted on ``nproc`` processes: its seconds."""
    start = time.monotonic()
    subprocess.run(["bash", "launch/torchrun.sh", str(job_file(workdir)),
                    *overrides(workdir, name, epochs)], cwd=REPO,
                   env=environment(NPROC=str(nproc)), stdout=log, stderr=subprocess.STDOUT,
                   check=True)
    return time.monotonic() - start


def finished(run_dir: Path, epochs: int) -> bool:
    """The run ended (its encoder registered) after ``epochs`` epochs."""
    log, config = run_dir / "train.log", run_dir / "config.yaml"
    return (log.exists() and "registered model" in log.read_text()
            and yaml.safe_load(config.read_text())["train"]["epochs"] == epochs)


class Soak:
    """The store, the agents, and the kill schedule."""

    def __init__(self, workdir: Path, epochs: int, seed: int, kills: int,
                 gap: tuple[float, float], log, kinds: tuple[str, ...] = KINDS) -> None:
        self.workdir, self.log, self.kills_wanted, self.gap = workdir, log, kills, gap
        self.kinds = kinds
        self.rng = random.Random(seed)
        self.port = free_port()
        self.args = [str(job_file(workdir)), *overrides(workdir, "soak", epochs)]
        self.store = subprocess.Popen(
            [sys.executable, "-c", "import time; from torch.distributed import TCPStore; "
             f"s = TCPStore('127.0.0.1', {self.port}, is_master=True, "
             "wait_for_workers=False); time.sleep(10**6)"], stdout=log, stderr=log)
        self.agents: list[subprocess.Popen | None] = [None] * NODES
        self.kills: list[Kill] = []
        self.frozen: list[tuple[list[psutil.Process], float]] = []  # (tree, SIGCONT at)
        self.cycle: list[str] = []  # the kinds still to draw in this round

    def start(self, index: int) -> None:
        env = environment(NNODES=f"1:{NODES}", RDZV_ENDPOINT=f"127.0.0.1:{self.port}",
                          RDZV_ID="chaos", NPROC="1",
                          RDZV_CONF="is_host=0,last_call_timeout=2,keep_alive_interval=1")
        self.agents[index] = subprocess.Popen(["bash", "launch/torchrun.sh", *self.args],
                                              cwd=REPO, env=env, stdout=self.log,
                                              stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> list[int]:
        return [i for i, a in enumerate(self.agents) if a is not None and a.poll() is None]

    def finished(self) -> bool:
        return any(a is not None and a.poll() == 0 for a in self.agents)

    def kill(self, last_step: int, kinds: tuple[str, ...]) -> Kill | None:
        """The drawn fault on a drawn agent (a node-wide one only while another node
        lives); None when it had no training process (the group between two rounds)."""
        alive = self.alive()
        if not self.cycle:  # each kind once in every len(kinds) faults, in a drawn order
            self.cycle = self.rng.sample(kinds, len(kinds))
        kind = next((k for k in self.cycle if len(alive) > 1 or "agent" not in k), "worker")
        if kind in self.cycle:
            self.cycle.remove(kind)
        index = self.rng.choice(alive)
        agent = psutil.Process(self.agents[index].pid)
        workers = [c for c in agent.children() if "app.pretrain" in " ".join(c.cmdline())]
        if "agent" not in kind and not workers:
            return None
        tree = ([agent, *agent.children(recursive=True)] if "agent" in kind
                else [workers[0], *workers[0].children(recursive=True)])
        fault = Kill(time.time(), kind, index, last_step)
        if kind in PAUSES:
            fault.pause_s = self.rng.uniform(*PAUSES[kind])
        signal_of = signal.SIGKILL if kind in ("agent", "worker") else signal.SIGSTOP
        for process in tree if kind != "worker" else tree[:1]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal_of)
        if kind == "agent":
            self.agents[index].wait()
        elif kind in ("freeze_agent", "straggler"):
            self.frozen.append((tree, time.monotonic() + fault.pause_s))
        self.kills.append(fault)
        print(f"fault {len(self.kills)}: {kind} of agent {index} after step {last_step}",
              flush=True)
        return fault

    def settled(self, run_log: Path, back: dict[int, float]) -> bool:
        """Every fault healed: no tree stopped, no node away, every agent alive in a
        group formed after the last fault (but a straggler's), which has trained
        ``SETTLED_STEPS`` steps since (past the hang watch's restart steps,
        ``pretrain/run/hang.py``)."""
        if self.frozen or back:
            return False
        events = log_events(run_log)
        world = next((e for e in reversed(events) if e[1] == "world"), None)
        if world is None or world[2] != len(self.alive()):
            return False
        since, last = world[0], self.kills[-1] if self.kills else None
        if last is not None and last.kind not in PAUSES and world[0] < last.at:
            return False
        if last is not None:
            since = max(since, last.at + (last.pause_s or 0.0))
        return sum(1 for e in events if e[1] == "step" and e[0] > since) >= SETTLED_STEPS

    def thaw(self) -> None:
        """SIGCONT the frozen trees whose time has come."""
        for tree, when in list(self.frozen):
            if time.monotonic() >= when:
                for process in tree:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.send_signal(signal.SIGCONT)
                self.frozen.remove((tree, when))

    def run(self, run_log: Path) -> float:
        start = time.monotonic()
        for index in range(NODES):
            self.start(index)
            time.sleep(0.5)
        next_kill = time.monotonic() + self.rng.uniform(*self.gap)
        back: dict[int, float] = {}  # agent -> when it starts again
        checked = 0.0  # when the group was last seen settled or not
        while not self.finished():
            now = time.monotonic()
            if not self.alive() and not back:
                raise RuntimeError(f"every agent ended without finishing: {self.log.name}")
            for index, when in list(back.items()):
                if now >= when:
                    self.start(index)
                    del back[index]
            self.thaw()
            due = len(self.kills) < self.kills_wanted
            if due and now >= checked + 1.0:  # the gap runs from a settled group
                checked = now
                if not self.settled(run_log, back):
                    next_kill = max(next_kill, now + self.gap[0])
            if due and now >= next_kill:
                kill = self.kill(last_logged_step(run_log), self.kinds)
                if kill is not None and kill.kind == "agent":
                    back[kill.agent] = now + self.rng.uniform(*BACK_S)
                next_kill = now + self.rng.uniform(*self.gap)
            time.sleep(0.2)
        for tree, _ in self.frozen:  # the run is done: nothing stays stopped
            for process in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal.SIGCONT)
        for agent in self.agents:  # a node back after the last round waits for no one
            if agent is not None and agent.poll() is None:
                try:
                    agent.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(agent.pid, signal.SIGKILL)
                    agent.wait()
        self.store.kill()
        return time.monotonic() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/chaos"))
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=180)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gap", type=float, nargs=2, default=(30.0, 90.0),
                        help="seconds between kills, drawn uniformly")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                        help="the faults drawn from")
    parser.add_argument("--output", type=Path, default=RESULTS / "chaos.json")
    parser.add_argument("--keep-reference", action="store_true",
                        help="keep the uninterrupted runs in --workdir that finished")
    parser.add_argument("--analyse-only", action="store_true",
                        help="measure the soak already in --workdir again, from the kills "
                             "--output recorded")
    parser.add_argument("--record", action="store_true",
                        help=f"also write bench/records/{NAME}.json (with --analyse-only: "
                             "the soak's own command, commit and date)")
    args = parser.parse_args(argv)
    if args.analyse_only:
        recorded = json.loads(args.output.read_text())
        kills = [Kill(**kill) for kill in recorded["kills"]]
        args.epochs, args.seed = recorded["summary"]["epochs_asked"], recorded["seed"]
        soak_seen = recorded.get("provenance")  # absent from a soak older than provenance
        if args.record and soak_seen is None:
            raise SystemExit(f"{args.output}: no provenance (the soak predates it): its "
                             "record cannot name the commit that ran it")
        written = report(args, kills, recorded["summary"]["soak_s"],
                         recorded["summary"]["uninterrupted_s"]
                         or log_span(args.workdir / "reference" / "train.log"), SAMPLES,
                         BATCH * NODES, soak_seen)
        if args.record:
            keep(soak_seen, written)
        return
    seen = provenance(invocation())  # the tree the soak starts from
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    references = {"reference": NODES, "reference-1": 1}
    kept = [name for name in references
            if args.keep_reference and finished(args.workdir / name, args.epochs)]
    for name in ["soak", *(name for name in references if name not in kept)]:
        subprocess.run(["rm", "-rf", str(args.workdir / name)], check=True)
    make_shards(args.workdir)
    with open(args.workdir / "agents.log", "w") as log:
        soak = Soak(args.workdir, args.epochs, args.seed, args.kills, tuple(args.gap), log,
                    tuple(args.kinds))
        soak_s = soak.run(args.workdir / "soak" / "train.log")
        if len(soak.kills) < args.kills:
            print(f"{len(soak.kills)} of the {args.kills} faults asked: the run ended first "
                  "(more --epochs, or a shorter --gap)", flush=True)
        write_json(args.output, {"machine": machine(), "seed": args.seed,  # the soak kept
                                 "summary": {"soak_s": soak_s, "epochs_asked": args.epochs,
                                             "uninterrupted_s": None},
                                 "kills": [asdict(k) for k in soak.kills]}, seen)
        for name, nproc in references.items():
            if name not in kept:
                uninterrupted(args.workdir, args.epochs, log, name, nproc=nproc)
    written = report(args, soak.kills, soak_s,
                     log_span(args.workdir / "reference" / "train.log"), SAMPLES,
                     BATCH * NODES, seen)
    if args.record:
        keep(seen, written)


def keep(seen: dict, written: dict) -> None:
    """The soak's record: its seed, summary and faults, with the provenance ``seen``."""
    write_and_show(NAME, seen, RENDERER, {key: written[key] for key in
                                          ("seed", "summary", "kills")}, "faults")


if __name__ == "__main__":
    main()

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

    python -m bench.chaos                       # 12 faults over 180 epochs, then the references
    python -m bench.chaos --kills 10 --epochs 50 --gap 25 45 --seed 1  # docs/benchmarks.md's
    python -m bench.chaos --analyse-only        # measure the soak in --workdir again

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
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import yaml

from bench.chaos_measure import (
    BACK_S,
    KINDS,
    PAUSES,
    Kill,
    healed,
    last_logged_step,
    log_events,
    log_span,
    loss_by_samples,
    measure_kills,
    weights_distance,
)
from bench.common import machine, print_table, write_json
from core.runtime import free_port
from pretrain.run.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[1]
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


def ledger(run_dir: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "data_pipeline.loader.ledger", str(run_dir),
                           "--json"], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["epochs"]


def final_checkpoint(run_dir: Path) -> dict[str, Any]:
    """The newest checkpoint loaded into a model built from the run's own config."""
    import torch

    from app.run_config import parse_run
    from data_pipeline.shards import ShardSet
    from pretrain.model.encoder import build_model
    from pretrain.run.checkpoint import model_state_of

    config, _ = parse_run("pretrain", "", ["--config", str(run_dir / "config.yaml")])
    shared, state = model_state_of(list_checkpoints(run_dir)[0])
    classes = len(ShardSet.open(config.data.shards).class_names)
    model = build_model(config.model, config.objective, torch.device("cpu"), classes)
    model.load_state_dict(state)
    return {"step": int(shared["step"]), "samples": int(shared["samples"]),
            "world": int(shared["world"]), "global_batch": int(shared["global_batch"])}


def plot(path: Path, soak: tuple, reference: tuple, kills: list[Kill], events: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smoothed(curve: tuple[np.ndarray, np.ndarray], window: int = 25) -> tuple:
        kernel = np.ones(window) / window
        return curve[0][window - 1:], np.convolve(curve[1], kernel, mode="valid")

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    left.plot(*smoothed(reference), label="uninterrupted, 3 ranks", lw=1)
    left.plot(*smoothed(soak), label=f"soak, {len(kills)} faults", lw=1, alpha=0.8)
    left.set(xlabel="samples", ylabel="loss (mean of 25 steps)",
             title="loss against samples")
    left.legend()
    start = events[0][0]
    worlds = [(e[0] - start, e[2]) for e in events if e[1] == "world"]
    worlds.append((events[-1][0] - start, worlds[-1][1]))  # to the last step
    right.step([t for t, _ in worlds], [w for _, w in worlds], where="post", label="world")
    colours = dict(zip(KINDS, ["red", "orange", "blue", "purple", "green"], strict=True))
    for kind in KINDS:
        for n, kill in enumerate(k for k in kills if k.kind == kind):
            right.axvline(kill.at - start, color=colours[kind], lw=0.8, ls="--",
                          label=kind if n == 0 else None)
    right.set(xlabel="seconds", ylabel="ranks", title="world, and the faults",
              yticks=[1, 2, 3])
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(args: argparse.Namespace, kills: list[Kill], soak_s: float,
           reference_s: float) -> None:
    """Measure the kills, read the ledger, load the final checkpoint, plot, and write."""
    events = log_events(args.workdir / "soak" / "train.log")
    for kill in kills:
        kill.recovery_s = kill.redone = kill.world_after = kill.restarts = None
    measure_kills(kills, events)
    epochs = ledger(args.workdir / "soak")
    per_epoch = SAMPLES // (BATCH * NODES) * BATCH * NODES
    recoveries = [k.recovery_s for k in kills if k.recovery_s is not None]
    per_kind = {}
    for kind in KINDS:
        found = [k for k in kills if k.kind == kind]
        times = [k.recovery_s for k in found if k.recovery_s is not None]
        per_kind[kind] = {"faults": len(found),
                          "survived": sum(healed(k) for k in found),
                          "recovery_median_s": float(np.median(times)) if times else None,
                          "recovery_max_s": max(times, default=None),
                          **({"restarts": sum(k.restarts or 0 for k in found)}
                             if kind in PAUSES else {})}
    registered = re.findall(r"registered model (\S+) version (\d+)",
                            (args.workdir / "soak" / "train.log").read_text())
    summary = {
        "kills": len(kills), "per_kind": per_kind,
        "survived": sum(healed(k) for k in kills),
        "recovery_median_s": float(np.median(recoveries)) if recoveries else None,
        "recovery_max_s": max(recoveries, default=None),
        "steps_redone": sum(k.redone or 0 for k in kills),
        "epochs": len(epochs), "epochs_asked": args.epochs,
        "samples_twice": sum(e["more_than_once"] for e in epochs.values()),
        "unread_beyond_last_batch": sum(max(0, e["unread"] - (SAMPLES - per_epoch))
                                        for e in epochs.values()),
        "final": final_checkpoint(args.workdir / "soak"),
        "registered": registered[-1] if registered else None,
        "soak_s": soak_s, "uninterrupted_s": reference_s,
    }
    soak_curve = loss_by_samples(events)
    reference_curve = loss_by_samples(log_events(args.workdir / "reference" / "train.log"))
    summary["final_loss"] = float(np.mean(soak_curve[1][-25:]))
    summary["uninterrupted_final_loss"] = float(np.mean(reference_curve[1][-25:]))
    summary["weights_distance"] = weights_distance(args.workdir / "reference",
                                                   args.workdir / "soak")
    summary["one_rank_weights_distance"] = weights_distance(args.workdir / "reference",
                                                            args.workdir / "reference-1")
    plot(args.output.with_suffix(".png"), soak_curve, reference_curve, kills, events)
    print_table([asdict(k) for k in kills],
                ["kind", "agent", "last_step", "world_after", "recovery_s", "redone", "pause_s",
                 "restarts"])
    print_table([{"kind": kind, **row} for kind, row in per_kind.items()],
                ["kind", "faults", "survived", "recovery_median_s", "recovery_max_s",
                 "restarts"])
    print(json.dumps(summary, indent=2))
    write_json(args.output, {"machine": machine(), "seed": args.seed, "summary": summary,
                             "kills": [asdict(k) for k in kills]})


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
    args = parser.parse_args(argv)
    if args.analyse_only:
        recorded = json.loads(args.output.read_text())
        kills = [Kill(**kill) for kill in recorded["kills"]]
        args.epochs = recorded["summary"]["epochs_asked"]
        report(args, kills, recorded["summary"]["soak_s"],
               recorded["summary"]["uninterrupted_s"]
               or log_span(args.workdir / "reference" / "train.log"))
        return
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
                                 "kills": [asdict(k) for k in soak.kills]})
        for name, nproc in references.items():
            if name not in kept:
                uninterrupted(args.workdir, args.epochs, log, name, nproc=nproc)
    report(args, soak.kills, soak_s, log_span(args.workdir / "reference" / "train.log"))


if __name__ == "__main__":
    main()

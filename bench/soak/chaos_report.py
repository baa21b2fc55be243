"""The chaos soak's report (``bench/soak/chaos.py``): each fault measured, the epochs' ledger,
the final checkpoint loaded, the loss and the world plotted, the summary written."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import machine, print_table, write_json
from bench.soak.chaos_measure import (
    KINDS,
    PAUSES,
    Kill,
    healed,
    log_events,
    loss_by_samples,
    measure_kills,
    weights_distance,
)
from pretrain.run.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[2]


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


def report(args: argparse.Namespace, kills: list[Kill], soak_s: float, reference_s: float,
           samples: int, global_batch: int, seen: dict[str, Any] | None
           ) -> dict[str, Any]:
    """Measure the kills, read the ledger, load the final checkpoint, plot, and write (with
    ``seen``, the soak's provenance; None: now's); the run read ``samples`` an epoch in
    global batches of ``global_batch``. Returns what it wrote."""
    events = log_events(args.workdir / "soak" / "train.log")
    for kill in kills:
        kill.recovery_s = kill.redone = kill.world_after = kill.restarts = None
    measure_kills(kills, events)
    epochs = ledger(args.workdir / "soak")
    per_epoch = samples // global_batch * global_batch
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
        "unread_beyond_last_batch": sum(max(0, e["unread"] - (samples - per_epoch))
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
    written = {"machine": machine(), "seed": args.seed, "summary": summary,
               "kills": [asdict(k) for k in kills]}
    write_json(args.output, written, seen)
    return written

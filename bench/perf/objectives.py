"""Forward + backward time and peak memory of every objective against lightly's NTXentLoss,
pytorch-metric-learning's SupConLoss and open_clip's SigLipLoss, side by side in one
process.

    python -m bench.perf.objectives                  # N in 1024 4096 8192, D = 128
    python -m bench.perf.objectives --sizes 1024     # the smallest case

The cases come from the table of objectives: each entry at its defaults and under each of
its ``examples``. N counts all embeddings: N/2 images x 2 views (lightly gets the two views
as out0/out1; clip gets N/2 images and N/2 texts). 100 classes; captions are 384-d
(all-MiniLM-L6-v2).

Targets, each objective at its defaults: within 1.3x of the fastest peer at N = 8192;
xclr within 1.1x of infonce (checked for the class-graph and the caption path
separately); siglip within 1.3x of open_clip's SigLipLoss on the same N/2 image-text
pairs. Writes
bench/results/objectives.json and prints a table; with ``--record``, also
``bench/records/perf/objectives.json``, whose view ``table`` is the table docs/benchmarks.md
shows. The peers are the ``bench`` extra (``bash launch/setup.sh dev,bench``).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Collection
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bench.common import (
    keep_freed_memory,
    machine,
    peak_memory_bytes,
    print_table,
    time_interleaved,
    write_json,
)
from bench.records import invocation, provenance, source_line, write_record
from pretrain.contrast.parameters import ParameterShape, initial_values
from pretrain.objectives import OBJECTIVES, ObjectiveSpec, batch_loss

CAPTION_DIM = 384  # all-MiniLM-L6-v2
NUM_CLASSES = 100
TARGET_N = 8192
PEERS = ("lightly", "pytorch-metric-learning", "open_clip_torch")
NAME = "perf/objectives"
RENDERER = "bench.perf.objectives"  # this module, by the name a record imports it
# the docs' rows: words -> the cases they show, side by side
GROUPS = {
    "lightly NTXentLoss (peer)": ["lightly NTXentLoss"],
    "pml SupConLoss (peer)": ["pml SupConLoss"],
    "open_clip SigLipLoss (peer)": ["open_clip SigLipLoss"],
    "infonce / supcon": ["infonce", "supcon"],
    "sincere / eps_supinfonce": ["sincere", "eps_supinfonce"],
    "flatnce / holder_flatnce": ["flatnce", "holder_flatnce"],
    "xclr captions / class graph": ["xclr[captions]", "xclr[class_graph]"],
    "projnce centroid / kernel / median / learned": [
        "projnce", "projnce[projection=kernel, bandwidth=2.0]", "projnce[projection=median]",
        "projnce[projection=learned]"],
    "clip / siglip": ["clip", "siglip"],
}


def objective_of(case: str) -> str:
    """The objective a case label names: ``xclr[captions, top_k=5]`` -> ``xclr``."""
    return case.split("[")[0]


def unshown(measured: Collection[str], shown: Collection[str]) -> list[str]:
    """The cases at their defaults (no ``=`` in the label) of each measured objective that
    no case in ``shown`` names: a new entry of the table, which a docs table shows with no
    edit of its rows."""
    named = {objective_of(case) for case in shown}
    return [case for case in measured if objective_of(case) not in named and "=" not in case]


def shown_groups(measured: Collection[str]) -> dict[str, list[str]]:
    """The docs' rows: :data:`GROUPS`, then a row of its own for each :func:`unshown` case."""
    grouped = [case for cases in GROUPS.values() for case in cases]
    return {**GROUPS, **{case: [case] for case in unshown(measured, grouped)}}


def objective_cases(z: Tensor, ids: Tensor, labels: Tensor, captions: Tensor, graph: Tensor,
                    text: Tensor, table: Tensor, tile_size: int | None = None
                    ) -> dict[str, Callable[[], Tensor]]:
    """One case per entry of the table of objectives at its defaults and under each of its
    ``examples``; an objective with soft targets runs from captions and from the class
    graph. A case hands the objective what its entry declares, as a run does: labels with
    the number of classes, captions or the graph, the texts of N/2 image-text pairs (N
    counts both views for the others), its loss parameters in place of the keys they
    start from (shaped [C, D] as ``table``, leaves that require a gradient)."""
    cases = {}
    for name, spec in OBJECTIVES.items():
        defaults = spec.defaults()
        sources = ("captions", "class_graph") if spec.soft_targets else ("",)
        for example, source in itertools.product(spec.settings(), sources):
            words = [source, *(f"{k}={v}" for k, v in example.items())]
            label = f"{name}[{', '.join(filter(None, words))}]" if any(words) else name
            cases[label] = _case(name, spec, defaults | dict(example), source,
                                 (z, ids, labels, captions, graph, text, table), tile_size)
    return cases


def _case(name: str, spec: ObjectiveSpec, keys: dict, source: str, inputs: tuple,
          tile_size: int | None) -> Callable[[], Tensor]:
    z, ids, labels, captions, graph, text, table = inputs
    shape = ParameterShape(table.shape[0], table.shape[1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        parameters = {k: v.to(z).requires_grad_()
                      for k, v in initial_values(spec.parameters, keys, shape).items()}
    rows = len(z) // 2 if spec.text_tower else len(z)
    given = {"labels": labels[:rows] if spec.labels or source == "class_graph" else None,
             "num_classes": table.shape[0] if spec.labels else None,
             "captions": captions if source == "captions" else None,
             "class_graph": graph if source == "class_graph" else None,
             "text": text[:rows] if spec.text_tower else None}
    return lambda: batch_loss(name, z[:rows], ids[:rows], temperature=0.1, tile_size=tile_size,
                              **given, **(keys | parameters))[0]


def peer_cases(z, labels, text):
    from lightly.loss import NTXentLoss
    from open_clip.loss import SigLipLoss
    from pytorch_metric_learning.losses import SupConLoss

    ntxent, supcon, siglip = NTXentLoss(temperature=0.1), SupConLoss(temperature=0.1), SigLipLoss()
    half = z.shape[0] // 2
    normalize = torch.nn.functional.normalize
    return {
        "lightly NTXentLoss": lambda: ntxent(z[:half], z[half:]),
        "pml SupConLoss": lambda: supcon(z, labels),
        # the same N/2 images and texts as siglip; open_clip's model normalises the features
        "open_clip SigLipLoss": lambda: siglip(normalize(z[:half], dim=1),
                                               normalize(text[:half], dim=1), 10.0, -10.0),
    }


def run_size(n: int, dim: int, repeats: int, device: torch.device) -> list[dict]:
    gen = torch.Generator().manual_seed(n)
    images = n // 2
    z = torch.randn(n, dim, generator=gen).to(device).requires_grad_()
    ids = torch.arange(images).repeat(2).to(device)  # view 1 rows, then view 2 rows
    labels = (ids % NUM_CLASSES).to(device)
    captions = torch.randn(images, CAPTION_DIM, generator=gen).half().to(device)[ids]
    names = torch.randn(NUM_CLASSES, CAPTION_DIM, generator=gen)
    names = torch.nn.functional.normalize(names, dim=1)
    graph = (names @ names.T).to(device)
    text = torch.randn(n, dim, generator=gen).to(device).requires_grad_()
    table = torch.randn(NUM_CLASSES, dim, generator=gen).to(device).requires_grad_()

    def step(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            z.grad = None
            loss_fn().backward()
        return run

    cases = {**peer_cases(z, labels, text), **objective_cases(z, ids, labels, captions, graph,
                                                        text, table)}
    cases = {name: step(fn) for name, fn in cases.items()}
    seconds = time_interleaved(cases, rounds=repeats)
    rows = []
    for name, fn in cases.items():
        peak = peak_memory_bytes(fn, device)
        rows.append({"N": n, "loss": name, "fwd_bwd_ms": seconds[name] * 1e3,
                     "peak_mib": peak / 2**20,
                     "peer": name.startswith(("lightly", "pml", "open_clip"))})
        print(f"  N={n} {name}: {seconds[name] * 1e3:.1f} ms", flush=True)
    # the softmax peers run on all N rows; open_clip's SigLipLoss is siglip's own peer
    fastest_peer = min(r["fwd_bwd_ms"] for r in rows
                       if r["peer"] and not r["loss"].startswith("open_clip"))
    ms = {r["loss"]: r["fwd_bwd_ms"] for r in rows}
    for row in rows:
        row["vs_fastest_peer"] = row["fwd_bwd_ms"] / fastest_peer
        if row["loss"] in ("xclr[captions]", "xclr[class_graph]"):
            row["vs_infonce"] = row["fwd_bwd_ms"] / ms["infonce"]
        if row["loss"] == "siglip":
            row["vs_open_clip"] = row["fwd_bwd_ms"] / ms["open_clip SigLipLoss"]
    return rows


def _side_by_side(values: list[float | None], digits: int) -> str:
    """``a / b`` for up to two figures, ``low-high`` for more, one figure when all agree."""
    shown = [f"{v:,.{digits}f}" for v in values if v is not None]
    if not shown:
        return ""
    if len(set(shown)) == 1:
        return shown[0]
    if len(shown) > 2:
        low, high = min(v for v in values if v is not None), max(v for v in values
                                                                 if v is not None)
        return f"{low:,.{digits}f}-{high:,.{digits}f}"
    return " / ".join(shown)


def render_table(record: dict[str, Any]) -> list[str]:
    """``table``: the source, then each of :func:`shown_groups` at N = 8,192 (ms, peak MiB, and the
    ratios the targets read), then the targets."""
    rows = {r["loss"]: r for r in record["figures"]["rows"] if r["N"] == TARGET_N}
    peers = ", ".join(f"{k} {v}" for k, v in record["figures"]["peers"].items())
    lines = [f"{source_line(record)} Peers: {peers}.", "",
             "| loss | ms | peak MiB | vs fastest peer | vs infonce | vs open_clip |",
             "| --- | --- | --- | --- | --- | --- |"]
    for words, names in shown_groups(rows).items():
        group = [rows[name] for name in names]
        ms = " / ".join(f"{r['fwd_bwd_ms']:,.0f}" for r in group)
        versus_peer = [None if r["loss"] == "open_clip SigLipLoss" else r["vs_fastest_peer"]
                       for r in group]  # siglip's own peer, not a softmax's
        columns = [_side_by_side([r["peak_mib"] for r in group], 0),
                   _side_by_side(versus_peer, 2),
                   _side_by_side([r.get("vs_infonce") for r in group], 2),
                   _side_by_side([r.get("vs_open_clip") for r in group], 2)]
        lines.append(f"| {words} | {ms} | {' | '.join(columns)} |")
    lines += ["", "Targets at N = 8,192, each objective at its defaults: " + "; ".join(
        f"{name.replace(f' at N={TARGET_N}', '')}: **{'met' if ok else 'not met'}**"
        for name, ok in record["figures"]["targets"].items()) + "."]
    return lines


VIEWS = {"table": render_table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("bench/results/objectives.json"))
    parser.add_argument("--record", action="store_true",
                        help=f"also write bench/records/{NAME}.json (the docs' table)")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    device = torch.device(args.device)
    allocator_tuned = device.type == "cpu" and keep_freed_memory()
    rows = [row for n in args.sizes for row in run_size(n, args.dim, args.repeats, device)]
    # the targets hold each objective at its defaults (a name without key=value)
    at_target = [r for r in rows if r["N"] == TARGET_N and not r["peer"] and "=" not in r["loss"]]
    checks = {}
    if at_target:
        checks[f"every objective <= 1.3x fastest peer at N={TARGET_N}"] = all(
            r["vs_fastest_peer"] <= 1.3 for r in at_target)
        for row in at_target:
            if "vs_infonce" in row:
                checks[f"{row['loss']} <= 1.1x infonce at N={TARGET_N}"] = row["vs_infonce"] <= 1.1
            if "vs_open_clip" in row:
                checks[f"siglip <= 1.3x open_clip's SigLipLoss at N={TARGET_N}"] = (
                    row["vs_open_clip"] <= 1.3)
    write_json(args.out, {"machine": machine(), "dim": args.dim, "rows": rows,
                          "targets": checks, "cpu_allocator_keeps_freed_memory": allocator_tuned})
    if args.record:
        figures = {"dim": args.dim, "rows": rows, "targets": checks,
                   "peers": {name: version(name) for name in PEERS}}
        print(f"record: {write_record(NAME, seen, RENDERER, figures)}")
    print_table(rows, ["N", "loss", "fwd_bwd_ms", "peak_mib", "vs_fastest_peer", "vs_infonce",
                       "vs_open_clip"])
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if not checks:
        print(f"targets are defined at N={TARGET_N}; add it to --sizes to check them")


if __name__ == "__main__":
    main()

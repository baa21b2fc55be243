"""One data set through the four stages at rising size: ``make-shards``, ``graph-precompute``,
``pretrain`` and ``evaluate``, each through its real command, so that a cost growing faster
than the data set shows where the stages meet, not only in each stage measured alone
(``python -m bench.scale``).

    python -m bench.scale.rehearsal                                 # 125k, 250k, 500k, 1M
    python -m bench.scale.rehearsal --sizes 20000 40000 --workdir /tmp/r
    python -m bench.scale.rehearsal --sizes 125000 --merge          # one size again, the rest kept
    python -m bench.scale.rehearsal --stages graph --merge          # one stage again at every size

The data set: a CC-style caption table of ``size`` rows (captions of ~100 characters, 80%
distinct, a class label 0-9), pointing at a pool of 256 tiny 16 px JPEGs whose class is
their label; a fixed 10,000-row test table beside it. Per size:

- ``make_shards``: the caption table to shards of 10,000 (2 workers).
- ``graph``: ``graph-precompute`` of the shards in parts of 2,500 rows: every part
  collected, the distinct captions streamed into the encoder's chunks and merged into the
  caption store, then the caption-neighbour graph (``graph.task=neighbours``, the inverted
  file at every size: ``auto`` searches exactly, in quadratic time, up to 200,000). Part 0's
  chunks are embedded by the real all-MiniLM-L6-v2 and timed; the other parts' chunks are
  stand-ins clustered as caption embeddings are (the real model embeds ~75 captions/s on
  2 cores: 800,000 distinct captions would take hours). ``real_encode_s`` carries part 0's
  measured rate to every distinct caption.
- ``pretrain``: one epoch of X-CLR on the caption store's targets, a 16-wide small CNN at
  16 px, 2 ranks (torchrun, gloo), 1,024 images per rank, views without augmentation (the
  evaluation view: the rehearsal measures the path, not the recipe), ``data.ledger=true``.
- ``ledger``: ``python -m data_pipeline.loader.ledger RUN --json`` over the run: every
  sample once, fewer unread than one global batch (the epoch's last, partial batch).
- ``evaluate``: kNN (and one probe epoch) over the whole bank on 2 ranks.

Each stage records wall seconds, the peak resident memory of its command and of its
largest child (rank or worker), and the bytes it wrote. Exponents are fitted per stage
over the sizes (``bench.scale.fit.exponent``). Writes ``bench/results/rehearsal.json``,
``rehearsal.png`` beside it, and prints a table; with ``--record``, once every size is
measured, also the record ``scale/rehearsal`` (``bench/scale/rehearsal_tables.py`` renders
it). A record holds one run: ``--record`` refuses ``--merge``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import machine, print_table, write_json
from bench.processes import run_command
from bench.records import invocation, provenance, write_record
from bench.scale.fit import exponent
from bench.scale.ingest import WORDS, stand_in_chunks
from bench.scale.tables import IMAGES, tiny_jpegs
from data_pipeline.graph.config import GraphConfig

SIZES = [125_000, 250_000, 500_000, 1_000_000]
TEST_ROWS = 10_000
SHARD = 10_000
PART = 2_500  # graph-precompute rows per part
CLASSES = 10
DISTINCT = 0.8  # share of distinct captions
PER_RANK = 1024
RESULTS = Path(__file__).resolve().parents[1] / "results"
RECORD = "scale/rehearsal"
RENDERER = "bench.scale.rehearsal_tables"
# per stage and size: wall seconds; peak resident memory of the command and of its largest
# child, MiB (VmHWM: file pages it mapped count too); their largest anonymous memory
# sampled (RssAnon: what the process itself allocated); bytes written, MiB
MEASURES = ("seconds", "rss_mib", "child_rss_mib", "anon_mib", "child_anon_mib", "disk_mib")


def caption_table(root: Path, rows: int, seed: int) -> Path:
    """``rows`` rows of caption, image path, label; row i's caption is caption
    i % distinct (DISTINCT of them distinct)."""
    table = root / f"table-{rows}-{seed}.tsv"
    if table.is_file():
        return table
    images = tiny_jpegs(root / "images", CLASSES)
    distinct = int(rows * DISTINCT)
    words = np.random.default_rng(seed).integers(0, len(WORDS), (distinct, 18))
    gen = np.random.default_rng(seed + 1)
    pool = gen.integers(0, IMAGES, rows)
    with open(table.with_suffix(".part"), "w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t")
        for i in range(rows):
            j = i % distinct
            caption = " ".join(WORDS[w] for w in words[j]) + f" {seed}-{j}"
            writer.writerow([caption, images[pool[i]], int(pool[i]) % CLASSES])
    table.with_suffix(".part").rename(table)
    return table


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measured(module: str, args: list[str], nproc: int = 1) -> dict[str, Any]:
    result = run_command(module, args, nproc)
    return {"seconds": round(result["seconds"], 1),
            "rss_mib": round(result["command_rss_mib"]),
            "child_rss_mib": round(result["worker_rss_mib"]),
            "anon_mib": round(result["command_anon_mib"]),
            "child_anon_mib": round(result["worker_anon_mib"]), "printed": result["printed"]}


def make_shards(table: Path, out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    names = table.parent / "classes.txt"
    names.write_text("".join(f"class {c}\n" for c in range(CLASSES)))
    result = measured("app.make_shards", [f"shards.class_names={names}",
        "shards.source=captions", f"shards.input={table}", "shards.caption_column=0",
        "shards.image_column=1", "shards.label_column=2", "shards.has_header=false",
        f"shards.output={out}", f"shards.shard_size={SHARD}", "shards.workers=2"])
    return {**result, "disk_mib": round(folder_bytes(out) / 2**20, 1)}


def graph_child(rows: int, workdir: Path) -> dict[str, Any]:
    """Child process: collect every part, stand-in chunks beside part 0's real ones (timed),
    merge."""
    from data_pipeline.graph.job import collect, encode_part, merge

    cfg = graph_config(rows, workdir)
    parts = rows // PART
    start = time.perf_counter()
    for part in range(parts):
        collect(cfg, part, parts)
    collected = time.perf_counter()
    stand_in_chunks(cfg, int(rows * DISTINCT), skip_part=0)
    written = time.perf_counter()
    encode_part(cfg, 0, parts)
    encoded = time.perf_counter()
    merge(cfg, parts)
    return {"collect_s": collected - start, "stand_in_s": written - collected,
            "part0_encode_s": encoded - written, "merge_s": time.perf_counter() - encoded}


def graph_config(rows: int, workdir: Path) -> GraphConfig:
    return GraphConfig(shards=str(workdir / f"shards-{rows}"),
                       output=str(workdir / f"store-{rows}"), num_parts=rows // PART)


def graph(rows: int, workdir: Path) -> dict[str, Any]:
    store = workdir / f"store-{rows}"
    shutil.rmtree(store, ignore_errors=True)
    captions = measured("bench.scale.rehearsal", ["--child", str(rows), "--workdir", str(workdir)])
    phases = json.loads(captions.pop("printed").splitlines()[-1])
    neighbours = measured("app.graph_precompute", ["graph.task=neighbours", "graph.index=ivf",
                                                   f"graph.output={store}"])
    distinct = int(rows * DISTINCT)
    part0 = -(-distinct // (rows // PART))  # about: chunk c goes to part c % parts
    rate = part0 / phases["part0_encode_s"]
    return {"seconds": round(captions["seconds"] + neighbours["seconds"], 1),
            "rss_mib": max(captions["rss_mib"], neighbours["rss_mib"]),
            "anon_mib": max(captions["anon_mib"], neighbours["anon_mib"]),
            "captions_rss_mib": captions["rss_mib"], "captions_anon_mib": captions["anon_mib"],
            "neighbours_rss_mib": neighbours["rss_mib"],
            "neighbours_anon_mib": neighbours["anon_mib"],
            "child_rss_mib": 0, "child_anon_mib": 0,
            "disk_mib": round(folder_bytes(store) / 2**20, 1),
            "neighbours_s": neighbours["seconds"], "encoder_captions_per_s": round(rate, 1),
            "real_encode_s": round(distinct / rate), **{k: round(v, 1) for k, v in phases.items()}}


def pretrain(rows: int, workdir: Path) -> dict[str, Any]:
    runs = workdir / f"runs-{rows}"
    shutil.rmtree(runs, ignore_errors=True)
    result = measured("app.pretrain", [
        f"output_dir={runs}", "name=rehearsal", f"data.shards={workdir / f'shards-{rows}'}",
        f"data.caption_store={workdir / f'store-{rows}'}", "objective.name=xclr",
        "model.backbone=small_cnn", "model.width=16", "model.projector_hidden=64",
        "model.projector_dim=32", "data.resolution=16", f"data.batch_size={PER_RANK}",
        "data.augment=none", "data.workers=1", "data.ledger=true", "train.epochs=1",
        "train.progress=false", "train.log_every=50", "checkpoint.every=100000",
        "tracking.enabled=false"], nproc=2)
    result.pop("printed")
    return {**result, "disk_mib": round(folder_bytes(runs) / 2**20, 1)}


def ledger(rows: int, workdir: Path) -> dict[str, Any]:
    run = workdir / f"runs-{rows}" / "rehearsal"
    result = measured("data_pipeline.loader.ledger", [str(run), "--json"])
    (epoch,) = json.loads(result.pop("printed"))["epochs"].values()
    exact = (epoch["more_than_once"] == 0 and epoch["skipped"] == 0
             and epoch["once"] + epoch["unread"] == rows and epoch["unread"] < 2 * PER_RANK)
    return {**result, "disk_mib": round(folder_bytes(run / "ledger") / 2**20, 1),
            "once": epoch["once"], "more_than_once": epoch["more_than_once"],
            "unread": epoch["unread"], "exact": exact}


def evaluate(rows: int, workdir: Path) -> dict[str, Any]:
    runs = workdir / f"runs-{rows}"
    before = folder_bytes(runs)
    result = measured("app.evaluate", [
        f"output_dir={runs}", "name=rehearsal", "model.backbone=small_cnn", "model.width=16",
        "model.projector_hidden=64", "model.projector_dim=32", "data.resolution=16",
        "data.workers=1", f"data.shards={workdir / f'shards-{rows}'}",
        f"eval.train_shards={workdir / f'shards-{rows}'}",
        f"eval.test_shards={workdir / 'test-shards'}", "eval.probe_epochs=1",
        "tracking.enabled=false"], nproc=2)
    knn = [line for line in result.pop("printed").splitlines() if "knn" in line.lower()]
    return {**result, "disk_mib": round((folder_bytes(runs) - before) / 2**20, 1),
            "knn": knn[-1][:120] if knn else ""}


def shards(rows: int, workdir: Path) -> dict[str, Any]:
    return make_shards(caption_table(workdir, rows, seed=1), workdir / f"shards-{rows}")


STAGES = {"make_shards": shards, "graph": graph, "pretrain": pretrain, "ledger": ledger,
          "evaluate": evaluate}


def rehearse(rows: int, workdir: Path, stages: list[str]) -> dict[str, dict[str, Any]]:
    """The ``stages`` (in the table's order) at ``rows`` samples; a later stage reads what
    an earlier one left in ``workdir``."""
    found = {}
    for name in (name for name in STAGES if name in stages):
        found[name] = STAGES[name](rows, workdir)
        print(f"rehearsal {rows:,}: {name} {found[name]['seconds']} s", flush=True)
    return found


def fitted(results: dict[int, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """The exponent of every measure over the sizes, per stage (measures a size lacks, as
    one of an earlier run merged in may, are left out)."""
    sizes = sorted(results)
    exponents: dict[str, dict[str, float]] = {}
    for stage in results[sizes[0]]:
        exponents[stage] = {}
        for measure in MEASURES:
            values = [results[s][stage].get(measure) for s in sizes]
            if None not in values:
                fit = exponent(sizes, [max(v, 1e-3) for v in values])
                exponents[stage][measure] = round(fit, 3)
    return exponents


def plot(results: dict[int, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(results)
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for stage in results[sizes[0]]:
        rows = [results[s][stage] for s in sizes]
        axes[0].plot(sizes, [r["seconds"] for r in rows], "o-", label=stage)
        axes[1].plot(sizes, [max(r["rss_mib"], r["child_rss_mib"]) for r in rows], "o-",
                     label=stage)
        anon = [(s, max(r["anon_mib"], r["child_anon_mib"])) for s, r in zip(sizes, rows,
                                                                         strict=True)
                if "anon_mib" in r]  # a size merged from an earlier run may lack it
        axes[2].plot([s for s, _ in anon], [a for _, a in anon], "o-", label=stage)
    titles = ("wall seconds", "peak resident memory of a process, MiB",
              "peak anonymous memory of a process, MiB")
    for axis, title in zip(axes, titles, strict=True):
        axis.set(xscale="log", yscale="log", xlabel="samples", title=title)
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def earlier(out: Path) -> dict[int, dict[str, dict[str, Any]]]:
    """The sizes a previous run wrote to ``out`` (none if there is no such file)."""
    if not out.is_file():
        return {}
    return {int(size): stages for size, stages in json.loads(out.read_text())["results"].items()}


def report(results: dict[int, dict[str, dict[str, Any]]], out: Path, complete: bool,
           seen: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    """Writes the JSON and the plot of the sizes measured so far; returns the exponents."""
    exponents = fitted(results) if len(results) > 1 else {}
    write_json(out, {"machine": machine(), "sizes": sorted(results), "complete": complete,
                     "results": results, "exponents": exponents}, seen)
    plot(results, out.with_suffix(".png"))
    return exponents


def figures(results: dict[int, dict[str, dict[str, Any]]],
            exponents: dict[str, dict[str, float]]) -> dict[str, Any]:
    """What the record keeps: every size's measures (its strings left out), the exponents
    and pretrain's global batch (2 ranks)."""
    return {"sizes": sorted(results), "exponents": exponents, "global_batch": 2 * PER_RANK,
            "results": {str(size): {stage: {k: v for k, v in measures.items()
                                            if not isinstance(v, str)}
                                    for stage, measures in stages.items()}
                        for size, stages in sorted(results.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/rehearsal"))
    parser.add_argument("--out", type=Path, default=RESULTS / "rehearsal.json")
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES),
                        help="measure only these (the others' files must be in --workdir)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other sizes and stages already in --out")
    parser.add_argument("--record", action="store_true",
                        help=f"once every size is measured, also write the record {RECORD}")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record and args.merge:
        parser.error("--record keeps one run's figures: leave out --merge")
    if args.record and len(set(args.sizes)) < 2:
        parser.error("--record fits exponents over the sizes: give at least two --sizes")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.child:
        print(json.dumps(graph_child(args.child, args.workdir)))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    seen = provenance(invocation())  # the tree the run starts from
    test = args.workdir / "test-shards"
    if not (test / "manifest.json").is_file():
        make_shards(caption_table(args.workdir, TEST_ROWS, seed=2), test)
    results = earlier(args.out) if args.merge else {}
    for rows in args.sizes:  # written after every size, so a stopped run keeps what it measured
        results[rows] = {**results.get(rows, {}), **rehearse(rows, args.workdir, args.stages)}
        exponents = report(results, args.out, rows == args.sizes[-1],
                           None if args.merge else seen)
    rows = [{"samples": size, "stage": stage, **{k: v for k, v in measures.items()
                                                 if not isinstance(v, str)}}
            for size, stages in sorted(results.items()) for stage, measures in stages.items()]
    print_table(rows, ["samples", "stage", *MEASURES])
    print("exponents:", json.dumps(exponents))
    if args.record:
        print(f"record: {write_record(RECORD, seen, RENDERER, figures(results, exponents))}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Costs that grow with the data set, measured at rising cardinalities with tiny payloads
(16 px JPEGs), each fitted to a power law and extrapolated to CC12M (~12M samples in
~1,200 shards of 10,000).

    python -m bench.scale                               # every part, default sizes
    python -m bench.scale --part captions --rows 100000 1000000

Parts:

- ``captions``: ``make-shards`` of a CC-style caption table (``shards.workers=2``, shards of
  10,000), time and peak resident memory of the parent and of the largest worker, beside
  the memory that the whole table takes as Python rows (how the source read it before it
  streamed: once per process).
- ``index``: ``make-shards shards.source=img2dataset`` indexing tars in place (one read per
  tar for count and checksum), 1 against 2 workers.
- ``counts``: opening a remote shard list without a manifest (a real ``http.server`` on
  127.0.0.1): requests per open, first and later.
- ``epochs``: the training stream's epoch plan at simulated worlds of 8, 64 and 512 ranks:
  CC12M's samples delivered once each, and batch class mixing on ImageNet listed class by
  class (``bench/scale_loader.py``).
- ``resume``: time from a loader resumed at 10% and at 90% of an epoch to its first batch,
  local and HTTP shards.
- ``tree``: ``make-shards`` of an ImageNet-style tree listed class by class (1,000
  folders, up to ImageNet's 1.28M images, 2 workers), beside the memory of the tree listed
  as ``Path`` objects (how the source held it before its listing went to files).
- ``graph``: ``graph-precompute`` of a caption set in parts of 10,000 (one shard each):
  collect and encode of part 0 and the merge through the real command, beside the memory
  of every caption held as Python strings (how encode and merge held them before they
  streamed). Part 0's chunks are encoded by the real model; the others' are stand-in unit
  vectors (the real model embeds ~75 captions/s on 2 cores: 1M captions would take ~3.7 h).
- ``evaluation``: kNN, SINCERE's margin, one epoch of the linear probe and the diagnostics
  over a bank of synthetic 512-d features of 1,000 classes (up to ImageNet's 1,281,167
  rows) and 50,000 queries, each stage in its own process: time and peak memory beside the
  features' size (``bench/scale_eval.py``).
- ``evaluate_run``: the real ``evaluate`` on 2 ranks over up to 300,000 real 16 px
  JPEGs of 1,000 classes, twice into one run: the largest rank's peak memory against the
  bank's size and the run folder's growth by the second evaluation (``bench/scale_eval.py``).
- ``ledger``: ``python -m data_pipeline.loader.ledger`` over a 2-rank epoch of tars of
  10,000 samples (img2dataset's layout and stats), every key read from the tars' headers
  and judged against the ledger's reads: time and peak memory.
- ``neighbours``: the caption-neighbour graph (inverted file of lists of <= 256 rows, 16
  probed, k = 10) over a memory-mapped store of
  clustered float16 384-d embeddings (all-MiniLM-L6-v2's width): time, peak resident
  memory (VmHWM, and the anonymous memory the process holds itself) beside the store's
  size, and the recall against exact search; with the probes and the result in memory and
  memory-mapped in a scratch folder (as graph-precompute runs it).

Each size runs in a fresh process so that peak memory is its own. Writes JSON and prints a
table; ``docs/benchmarks.md`` records the numbers.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench.common import machine, peak_rss_bytes, print_table, write_json
from bench.processes import run_command
from bench.scale_eval import STAGES, run_evaluate, run_stage
from bench.scale_ingest import (
    all_captions,
    collect_rest,
    make_shards_measured,
    other_chunks,
    run_graph,
    run_neighbours,
    run_tree,
    run_tree_listing,
)
from bench.scale_ledger import run_ledger
from bench.scale_loader import class_mixing, epoch_coverage, resume_latency

CC12M_ROWS, CC12M_SHARDS = 12_000_000, 1_200
SHARD = 10_000
IMAGES = 256  # distinct image files the table's rows point at


def tiny_jpegs(folder: Path, classes: int = 0) -> list[str]:
    """``IMAGES`` 16 px JPEGs of random pixels; with ``classes``, tinted by class i % classes."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(0)
    names = []
    for i in range(IMAGES):
        path = folder / f"{i:04d}.jpg"
        if not path.is_file():
            pixels = (gen.integers(0, 256, (16, 16, 3), dtype=np.uint8) if not classes else
                      gen.integers(0, 40, (16, 16, 3), dtype=np.uint8) + 25 * (i % classes))
            Image.fromarray(pixels.astype(np.uint8)).save(path, quality=90)
        names.append(f"images/{path.name}")
    return names


def caption_table(root: Path, rows: int) -> Path:
    """A CC3M-style TSV (caption, image path) of ``rows`` rows: captions of about CC12M's
    length (~100 characters), images from a pool of tiny JPEGs."""
    table = root / f"captions-{rows}.tsv"
    if table.is_file():
        return table
    images = tiny_jpegs(root / "images")
    gen = np.random.default_rng(rows)
    words = ["a", "photo", "of", "the", "dog", "cat", "on", "red", "blue", "street", "with",
             "in", "person", "holding", "sunset", "over", "beach", "and", "two", "old"]
    with open(table, "w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t")
        for i in range(rows):
            caption = " ".join(words[j] for j in gen.integers(0, len(words), 18))
            writer.writerow([f"{caption} {i}", images[i % IMAGES]])
    return table


def run_captions(rows: int, workdir: Path) -> dict[str, Any]:
    """make-shards of a table of ``rows`` rows."""
    table = caption_table(workdir, rows)
    result = make_shards_measured([
        "shards.source=captions", f"shards.input={table}", "shards.caption_column=0",
        "shards.image_column=1", "shards.has_header=false"], workdir / f"shards-{rows}", rows)
    return {"rows": rows, **result, "rows_per_s": rows / result["seconds"],
            "table_mib": table.stat().st_size / 2**20}


def run_whole_table(rows: int, workdir: Path) -> dict[str, Any]:
    """Child process: the table read whole into Python rows (the earlier source's way)."""
    table = caption_table(workdir, rows)
    before = peak_rss_bytes()
    with open(table, newline="", encoding="utf-8") as handle:
        loaded = list(csv.reader(handle, delimiter="\t"))
    return {"rows": len(loaded), "whole_table_rss_mib": (peak_rss_bytes() - before) / 2**20}


def img2dataset_tars(folder: Path, tars: int, per_tar: int) -> None:
    from webdataset import TarWriter

    folder.mkdir(parents=True, exist_ok=True)
    payload = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 30, 200)).save(payload, format="JPEG")
    for t in range(tars):
        path = folder / f"{t:05d}.tar"
        if path.is_file():
            continue
        with TarWriter(str(path)) as writer:
            for i in range(per_tar):
                writer.write({"__key__": f"{t:05d}{i:05d}", "jpg": payload.getvalue(),
                              "txt": f"caption {i}", "json": {"key": i}})


def run_index(tars: int, workers: int, workdir: Path) -> dict[str, Any]:
    folder = workdir / f"img2dataset-{tars}"
    img2dataset_tars(folder, tars, SHARD)
    result = run_command("app.make_shards", ["shards.source=img2dataset", f"shards.input={folder}",
                              f"shards.output={workdir / f'index-{tars}-{workers}'}",
                              f"shards.workers={workers}"])
    assert f"{tars * SHARD} samples" in result.pop("printed")
    return {"tars": tars, "workers": workers, **result, "tars_per_s": tars / result["seconds"]}


def run_counts(shards: int, workdir: Path) -> dict[str, Any]:
    """Requests a remote list without a manifest costs, first open and later ones."""
    import os

    from data_pipeline.shards import ShardSet
    from tests.data_pipeline.remote import ShardServer

    folder = workdir / f"remote-{shards}"
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        (folder / f"{s:05d}_stats.json").write_text(json.dumps({"successes": SHARD}))
    os.environ["XDG_CACHE_HOME"] = str(workdir / f"cache-{shards}")
    server = ShardServer(folder).start()
    try:
        url = f"{server.url}/{{00000..{shards - 1:05d}}}.tar"
        asked = []
        for _ in range(3):
            before = len(server.requests())
            start = time.perf_counter()
            assert ShardSet.open(url).total == shards * SHARD
            asked.append((len(server.requests()) - before, time.perf_counter() - start))
    finally:
        server.stop()
    return {"shards": shards, "first_open_requests": asked[0][0],
            "first_open_s": asked[0][1], "later_open_requests": asked[1][0],
            "later_open_s": asked[1][1]}


def loader_epochs(worlds: list[tuple[int, int]]) -> dict[str, Any]:
    coverage = [epoch_coverage(CC12M_ROWS, world, workers, 256) for world, workers in worlds]
    print("epoch coverage, CC12M (12M samples, 1,200 shards), a chunk of 256 a rank:")
    print_table(coverage, ["world", "samples", "delivered", "twice", "left", "global_batch",
                           "batches_per_rank", "max_shard_ranges_per_lane", "seconds",
                           "ms_per_rank"])
    mixing = [class_mixing(world, workers, 128, shuffled)
              for world, workers in worlds for shuffled in (True, False)]
    print("distinct classes per batch of 128, ImageNet listed class by class:")
    print_table(mixing, ["world", "shards", "distinct_classes", "iid", "ratio", "batches"])
    return {"coverage": coverage, "mixing": mixing}


def child(part: str, size: int, workers: int, workdir: Path,
          stage: str = "") -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.scale", "--child", part, "--size", str(size),
               "--workers", str(workers), "--workdir", str(workdir), "--stage", stage]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{part} at {size}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def exponent(sizes: list[float], costs: list[float]) -> float:
    """The slope of log(cost) against log(size): 1 is linear, 0 constant."""
    return float(np.polyfit(np.log(sizes), np.log(costs), 1)[0])


def extrapolate(size: float, cost: float, slope: float, target: float, time: bool) -> float:
    """``cost`` at ``size`` carried to ``target`` along the fitted power law; a time is
    carried at least linearly (a fit below 1 reflects start-up costs being amortised, not
    per-item work getting cheaper)."""
    return cost * (target / size) ** (max(slope, 1.0) if time else slope)


def sized(results: dict[str, Any], name: str, rows: list[dict[str, Any]], size: str,
          fitted: list[str], target: int, title: str, columns: list[str]) -> None:
    """Fit each of ``fitted`` against ``size`` over ``rows``, carry the largest to ``target``
    (times end in ``_s`` or are ``seconds``), store under ``name`` and print."""
    sizes = [r[size] for r in rows]
    fit = {key: exponent(sizes, [r[key] for r in rows]) for key in fitted}
    results[name] = {"rows": rows, "exponent": fit, "target": target, "at_target": {
        key: extrapolate(sizes[-1], rows[-1][key], fit[key], target,
                         key == "seconds" or key.endswith("_s")) for key in fitted}}
    print(title)
    print_table(rows, columns)
    print("exponent:", {k: round(v, 2) for k, v in fit.items()})
    print(f"at {target:,}:", {k: round(v, 1) for k, v in results[name]["at_target"].items()})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["all", "captions", "index", "counts", "epochs",
                                           "resume", "tree", "graph", "neighbours",
                                           "evaluation", "evaluate_run", "ledger"],
                        default="all")
    parser.add_argument("--worlds", nargs="+", default=["8x8", "64x8", "512x8"])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 300_000, 1_000_000])
    parser.add_argument("--tars", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--shards", type=int, nargs="+", default=[120, 1_200])
    parser.add_argument("--ledger-tars", type=int, nargs="+", default=[13, 50, 100])
    parser.add_argument("--captions", type=int, nargs="+", default=[100_000, 300_000, 1_000_000])
    parser.add_argument("--images", type=int, nargs="+", default=[128_000, 400_000, 1_281_167])
    parser.add_argument("--graph-rows", type=int, nargs="+",
                        default=[100_000, 300_000, 1_000_000])
    parser.add_argument("--bank", type=int, nargs="+", default=[128_000, 400_000, 1_281_167])
    parser.add_argument("--eval-images", type=int, nargs="+", default=[100_000, 300_000])
    parser.add_argument("--eval-stages", nargs="+", choices=STAGES, default=list(STAGES),
                        help="the stages of --part evaluation (default: all)")
    parser.add_argument("--probe-epochs", type=int, default=10)
    parser.add_argument("--workdir", type=Path, default=Path("bench/results/scale"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/scale.json"))
    parser.add_argument("--child", choices=["whole_table", "counts", "neighbours",
                                            "tree_listing", "collect_rest", "other_chunks",
                                            "all_captions", "evaluation"])
    parser.add_argument("--stage", default="")
    parser.add_argument("--size", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.child:
        run = {"whole_table": lambda: run_whole_table(args.size, args.workdir),
               "counts": lambda: run_counts(args.size, args.workdir),
               "neighbours": lambda: run_neighbours(args.size, args.workdir, args.stage),
               "tree_listing": lambda: run_tree_listing(args.size, args.workdir),
               "collect_rest": lambda: collect_rest(args.size, args.workdir),
               "other_chunks": lambda: other_chunks(args.size, args.workdir),
               "all_captions": lambda: all_captions(args.size, args.workdir),
               "evaluation": lambda: run_stage(args.stage, args.size)}[args.child]
        print(json.dumps(run()))
        return
    results: dict[str, Any] = {"machine": machine()}
    if args.part in ("all", "captions"):
        rows = []
        for n in args.rows:
            row = run_captions(n, args.workdir) | child("whole_table", n, 1, args.workdir)
            rows.append(row)
        fit = {key: exponent(args.rows, [r[key] for r in rows])
               for key in ("seconds", "command_rss_mib", "worker_rss_mib", "whole_table_rss_mib")}
        last = rows[-1]
        results["captions"] = {"rows": rows, "exponent": fit, "cc12m": {
            key: extrapolate(last["rows"], last[key], fit[key], CC12M_ROWS, key == "seconds")
            for key in fit}}
        print("make-shards of a caption table (2 workers, shards of 10,000):")
        print_table(rows, ["rows", "seconds", "rows_per_s", "command_rss_mib",
                           "worker_rss_mib", "whole_table_rss_mib", "table_mib"])
        print("exponent:", {k: round(v, 2) for k, v in fit.items()})
        print("at CC12M:", {k: round(v, 1) for k, v in results["captions"]["cc12m"].items()})
    if args.part in ("all", "index"):
        rows = [run_index(t, w, args.workdir) for t in args.tars for w in (1, 2)]
        two = [r for r in rows if r["workers"] == 2]
        slope = exponent([r["tars"] for r in two], [r["seconds"] for r in two])
        results["index"] = {"rows": rows, "exponent": slope, "cc12m_seconds": extrapolate(
            two[-1]["tars"], two[-1]["seconds"], slope, CC12M_SHARDS, True)}
        print("img2dataset indexing (tars of 10,000 samples):")
        print_table(rows, ["tars", "workers", "seconds", "tars_per_s", "command_rss_mib",
                           "worker_rss_mib"])
        print(f"exponent {slope:.2f}; at CC12M ({CC12M_SHARDS} tars, 2 workers): "
              f"{results['index']['cc12m_seconds'] / 60:.1f} min")
    if args.part in ("all", "ledger"):
        rows = [run_ledger(t, args.workdir) for t in args.ledger_tars]
        sized(results, "ledger", rows, "samples", ["seconds", "command_rss_mib"], CC12M_ROWS,
              "the ledger command over one epoch (keys from the tars' headers, 2 ranks):",
              ["samples", "tars", "seconds", "keys_per_s", "command_rss_mib", "once",
               "unread"])
    if args.part in ("all", "counts"):
        rows = [child("counts", s, 1, args.workdir) for s in args.shards]
        results["counts"] = {"rows": rows}
        print("remote shard list without a manifest, requests per open:")
        print_table(rows, ["shards", "first_open_requests", "first_open_s",
                           "later_open_requests", "later_open_s"])
    if args.part in ("all", "epochs"):
        results["epochs"] = loader_epochs([tuple(map(int, w.split("x")))
                                           for w in args.worlds])
    if args.part in ("all", "resume"):
        rows = resume_latency(args.workdir)
        seconds = {(r["source"], r["fraction"]): r["seconds"] for r in rows}
        ratios = {where: seconds[where, 0.9] / seconds[where, 0.1] for where in ("local", "http")}
        results["resume"] = {"rows": rows, "ratio_90_to_10": ratios}
        print("resume latency (first batch after building the loader, median of 3):")
        print_table(rows, ["source", "fraction", "seconds", "samples", "world"])
        print("90% / 10%:", {k: round(v, 2) for k, v in ratios.items()})
    if args.part in ("all", "tree"):
        rows = [run_tree(n, args.workdir) | child("tree_listing", n, 1, args.workdir)
                for n in args.images]
        sized(results, "tree", rows, "images",
              ["seconds", "command_rss_mib", "worker_rss_mib", "listing_rss_mib"], 1_281_167,
              "make-shards of a class-sorted tree (1,000 classes, 2 workers, shards of 10,000):",
              ["images", "seconds", "images_per_s", "command_rss_mib", "worker_rss_mib",
               "listing_rss_mib"])
    if args.part in ("all", "graph"):
        rows = [run_graph(n, args.workdir, lambda name, size: child(name, size, 1, args.workdir))
                | child("all_captions", n, 1, args.workdir) for n in args.graph_rows]
        sized(results, "graph", rows, "rows",
              ["collect_rss_mib", "encode_rss_mib", "merge_s", "merge_rss_mib",
               "merge_center_s", "merge_center_rss_mib", "all_captions_rss_mib"], CC12M_ROWS,
              "graph-precompute in parts of 10,000 captions (part 0 and the merge measured):",
              ["rows", "parts", "collect_s", "collect_rss_mib", "encode_s", "encode_rss_mib",
               "merge_s", "merge_rss_mib", "merge_center_s", "merge_center_rss_mib",
               "all_captions_rss_mib", "store_mib"])
    if args.part in ("all", "neighbours"):
        both = [child("neighbours", n, 1, args.workdir, where)
                for n in args.captions for where in ("memory", "scratch")]
        rows = [r for r in both if r["where"] == "scratch"]  # what graph-precompute runs
        fit = {key: exponent(args.captions, [r[key] for r in rows])
               for key in ("seconds", "rss_mib", "anon_mib")}
        results["neighbours"] = {"rows": both, "exponent": fit, "cc12m": {
            key: extrapolate(rows[-1]["rows"], rows[-1][key], fit[key], CC12M_ROWS,
                             key == "seconds") for key in fit}}
        print("caption-neighbour graph (inverted file, lists <= 256, 16 probed, k = 10, 384-d):")
        print_table(both, ["rows", "where", "lists", "seconds", "recall", "rss_mib", "anon_mib",
                           "store_mib"])
        print("exponent:", {k: round(v, 2) for k, v in fit.items()})
        print("at CC12M:", {k: round(v, 1) for k, v in results["neighbours"]["cc12m"].items()})
    if args.part in ("all", "evaluation"):
        rows = [child("evaluation", n, 1, args.workdir, stage)
                for n in args.bank for stage in args.eval_stages]
        fit = {stage: {key: exponent(args.bank, [r[key] for r in rows if r["stage"] == stage])
                       for key in ("seconds", "stage_added_mib")} for stage in args.eval_stages}
        results["evaluation"] = {"rows": rows, "exponent": fit}
        print("evaluation over a bank of 512-d features, 1,000 classes, 50,000 queries:")
        print_table(rows, ["stage", "rows", "seconds", "peak_rss_mib", "features_mib",
                           "stage_added_mib", "value"])
        print("exponent:", {s: {k: round(v, 2) for k, v in f.items()} for s, f in fit.items()})
    if args.part in ("all", "evaluate_run"):
        rows = [run_evaluate(n, args.workdir, args.probe_epochs) for n in args.eval_images]
        results["evaluate_run"] = {"rows": rows, "probe_epochs": args.probe_epochs}
        print("evaluate on 2 ranks, twice into one run (small CNN, 16 px, 1,000 classes):")
        print_table(rows, ["images", "bank_mib", "first_s", "first_rss_mib", "second_s",
                           "second_rss_mib", "run_mib_after_first", "second_adds_mib",
                           "growth"])
    write_json(args.out, results)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()

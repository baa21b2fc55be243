"""Costs that grow with the data set, measured at rising cardinalities with tiny payloads
(16 px JPEGs), each fitted to a power law and extrapolated to CC12M (~12M samples in
~1,200 shards of 10,000).

    python -m bench.scale                               # every part, default sizes
    python -m bench.scale --part captions --rows 100000 1000000
    python -m bench.scale --part tree graph --record ingest   # also bench/records/scale/ingest.json

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
  class (``bench/scale/loader.py``).
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
  features' size (``bench/scale/evaluation.py``).
- ``evaluate_run``: the real ``evaluate`` on 2 ranks over up to 300,000 real 16 px
  JPEGs of 1,000 classes, twice into one run: the largest rank's peak memory against the
  bank's size and the run folder's growth by the second evaluation (``bench/scale/evaluation.py``).
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
table; with ``--record NAME`` also the record ``scale/NAME`` that ``docs/benchmarks.md``
cites (``bench/scale/scale_tables.py`` renders it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import machine, print_table, write_json
from bench.records import invocation, provenance, write_record
from bench.scale.evaluation import STAGES, run_evaluate, run_stage
from bench.scale.fit import exponent, extrapolate
from bench.scale.ingest import (
    all_captions,
    collect_rest,
    other_chunks,
    run_graph,
    run_neighbours,
    run_tree,
    run_tree_listing,
)
from bench.scale.ledger import run_ledger
from bench.scale.loader import class_mixing, epoch_coverage, resume_latency
from bench.scale.tables import (
    CC12M_ROWS,
    CC12M_SHARDS,
    run_captions,
    run_counts,
    run_index,
    run_whole_table,
)

PARTS = ("captions", "index", "ledger", "counts", "epochs", "resume", "tree", "graph",
         "neighbours", "evaluation", "evaluate_run")
RENDERER = "bench.scale.scale_tables"


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
    parser.add_argument("--part", nargs="+", choices=["all", *PARTS], default=["all"])
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
    parser.add_argument("--record", metavar="NAME",
                        help="also write the figures as bench/records/scale/NAME.json")
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
    seen = provenance(invocation())  # the tree the run starts from
    parts = set(PARTS) if "all" in args.part else set(args.part)
    results: dict[str, Any] = {"machine": machine()}
    if "captions" in parts:
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
    if "index" in parts:
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
    if "ledger" in parts:
        rows = [run_ledger(t, args.workdir) for t in args.ledger_tars]
        sized(results, "ledger", rows, "samples", ["seconds", "command_rss_mib"], CC12M_ROWS,
              "the ledger command over one epoch (keys from the tars' headers, 2 ranks):",
              ["samples", "tars", "seconds", "keys_per_s", "command_rss_mib", "once",
               "unread"])
    if "counts" in parts:
        rows = [child("counts", s, 1, args.workdir) for s in args.shards]
        results["counts"] = {"rows": rows}
        print("remote shard list without a manifest, requests per open:")
        print_table(rows, ["shards", "first_open_requests", "first_open_s",
                           "later_open_requests", "later_open_s"])
    if "epochs" in parts:
        results["epochs"] = loader_epochs([tuple(map(int, w.split("x")))
                                           for w in args.worlds])
    if "resume" in parts:
        rows = resume_latency(args.workdir)
        seconds = {(r["source"], r["fraction"]): r["seconds"] for r in rows}
        ratios = {where: seconds[where, 0.9] / seconds[where, 0.1] for where in ("local", "http")}
        results["resume"] = {"rows": rows, "ratio_90_to_10": ratios}
        print("resume latency (first batch after building the loader, median of 3):")
        print_table(rows, ["source", "fraction", "seconds", "samples", "world"])
        print("90% / 10%:", {k: round(v, 2) for k, v in ratios.items()})
    if "tree" in parts:
        rows = [run_tree(n, args.workdir) | child("tree_listing", n, 1, args.workdir)
                for n in args.images]
        sized(results, "tree", rows, "images",
              ["seconds", "command_rss_mib", "worker_rss_mib", "listing_rss_mib"], 1_281_167,
              "make-shards of a class-sorted tree (1,000 classes, 2 workers, shards of 10,000):",
              ["images", "seconds", "images_per_s", "command_rss_mib", "worker_rss_mib",
               "listing_rss_mib"])
    if "graph" in parts:
        rows = [run_graph(n, args.workdir, lambda name, size: child(name, size, 1, args.workdir))
                | child("all_captions", n, 1, args.workdir) for n in args.graph_rows]
        sized(results, "graph", rows, "rows",
              ["collect_rss_mib", "encode_rss_mib", "merge_s", "merge_rss_mib",
               "merge_center_s", "merge_center_rss_mib", "all_captions_rss_mib"], CC12M_ROWS,
              "graph-precompute in parts of 10,000 captions (part 0 and the merge measured):",
              ["rows", "parts", "collect_s", "collect_rss_mib", "encode_s", "encode_rss_mib",
               "merge_s", "merge_rss_mib", "merge_center_s", "merge_center_rss_mib",
               "all_captions_rss_mib", "store_mib"])
    if "neighbours" in parts:
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
    if "evaluation" in parts:
        rows = [child("evaluation", n, 1, args.workdir, stage)
                for n in args.bank for stage in args.eval_stages]
        fit = {stage: {key: exponent(args.bank, [r[key] for r in rows if r["stage"] == stage])
                       for key in ("seconds", "stage_added_mib")} for stage in args.eval_stages}
        results["evaluation"] = {"rows": rows, "exponent": fit}
        print("evaluation over a bank of 512-d features, 1,000 classes, 50,000 queries:")
        print_table(rows, ["stage", "rows", "seconds", "peak_rss_mib", "features_mib",
                           "stage_added_mib", "value"])
        print("exponent:", {s: {k: round(v, 2) for k, v in f.items()} for s, f in fit.items()})
    if "evaluate_run" in parts:
        rows = [run_evaluate(n, args.workdir, args.probe_epochs) for n in args.eval_images]
        results["evaluate_run"] = {"rows": rows, "probe_epochs": args.probe_epochs}
        print("evaluate on 2 ranks, twice into one run (small CNN, 16 px, 1,000 classes):")
        print_table(rows, ["images", "bank_mib", "first_s", "first_rss_mib", "second_s",
                           "second_rss_mib", "run_mib_after_first", "second_adds_mib",
                           "growth"])
    write_json(args.out, results, seen)
    print(f"written: {args.out}")
    if args.record:
        figures = {key: value for key, value in results.items() if key != "machine"}
        print(f"record: {write_record(f'scale/{args.record}', seen, RENDERER, figures)}")


if __name__ == "__main__":
    main()

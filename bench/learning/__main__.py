"""The learning benchmark: does training learn, and do the papers' claims reproduce?

    python -m bench.learning                      # everything: ~6 h on 2 CPU cores
    python -m bench.learning --part main --seeds 0 --only infonce supcon
    python -m bench.learning --part sweep         # the sweeps behind the recipes
    python -m bench.learning --report-only        # the report from the finished runs
    python -m bench.learning --part main --keep       # over several sittings: commit the kept runs
    python -m bench.learning --part main --report-only --keep --record   # the record learning/main

Trains every configuration (``bench/learning/configs.py``) on the cluttered digits with
the real ``pretrain`` command (2 DDP processes), evaluates the encoder and the untrained
encoder it started from, and checks the claims (``bench/learning/claims.py``). Finished
runs are kept (``<out>/runs/<name>/result.json``) and skipped when run again, so an
interrupted benchmark continues. Writes ``learning.json``, ``learning.md`` and PNG plots
to ``--out``, and prints the claims; ``--record`` also writes the record ``learning/PART``
of every finished run and the claims (``bench/learning/benchmark_tables.py`` renders it).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.common import machine, write_json
from bench.learning import benchmark_tables, configs, finished, report
from bench.learning.ceiling import train_cross_entropy
from bench.learning.claims import Results, check, verdict
from bench.learning.data import DataSet, cluttered, digits
from bench.learning.runs import Configuration, run
from bench.records import invocation, provenance, write_record
from data_pipeline.graph.class_graph import load_class_graph

RENDERER = "bench.learning.benchmark_tables"  # the module that renders its records
MAIN_ORDER = [*configs.OBJECTIVES, *configs.SMALL_BATCH, *configs.NEGATIVES, *configs.BACKBONES,
              *configs.BACKBONE_REFERENCES]


class DataSets(Mapping[str, DataSet]):
    """The benchmark's data sets, each made (shards and caption stores) when first read:
    the main and digits parts make no alt-text set (every part reads the cluttered set:
    its report plots from it)."""

    def __init__(self, makers: dict[str, Callable[[], DataSet]]) -> None:
        self._makers, self._made = makers, {}

    def __getitem__(self, name: str) -> DataSet:
        if name not in self._made:
            self._made[name] = self._makers[name]()
        return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


def run_all(confs: list[Configuration], datasets: Mapping[str, DataSet], root: Path,
            report_only: bool = False, kept: bool = False) -> Results:
    """One result per finished configuration; ``report_only`` trains nothing and leaves
    out the configurations that have no result yet (their claims say "not run");
    ``kept`` restores the runs kept in the repository and keeps each one finished here."""
    results: Results = defaultdict(list)
    for conf in tqdm(confs, desc="learning benchmark", unit="run"):
        group = conf.tags["group"]
        if kept:
            finished.restore(conf, root)
        if report_only and not finished.result_path(conf, root).is_file():
            continue
        data = datasets[conf.data]
        if group.startswith("cross_entropy"):
            result = train_cross_entropy(conf, data, root)
        else:
            result = run(conf, data, root, floor=group.startswith("untrained"))
        if kept:
            finished.keep(conf, root)
        key = f"{conf.name.split(group)[0]}{group}"  # keeps the digits_ prefix
        results[key].append(result)
    return results


def write(results: Results, sweep: Results, datasets: Mapping[str, DataSet], out: Path,
          seeds: list[int], part: str) -> list[dict[str, Any]]:
    claims = check(results, ("main", "alt_text") if part == "all" else (part,))
    cluttered_set = datasets["cluttered"]
    write_json(out / "learning.json", {"machine": machine(), "seeds": seeds, "claims": claims,
                                       "results": results, "sweep": sweep})
    report.plot_knn_curves(results, [*configs.OBJECTIVES, "cross_entropy", "untrained"],
                           out / "knn_vs_k.png")
    report.plot_negatives(results, out / "negatives.png")
    pairs = [("xclr_captions", "caption_graph",
              load_class_graph(cluttered_set.caption_graph)[0]),
             ("xclr_class_graph", "class_graph", load_class_graph(cluttered_set.class_graph)[0]),
             ("infonce", "caption_graph", load_class_graph(cluttered_set.caption_graph)[0])]
    report.plot_similarity(results, pairs, out / "similarity.png")
    lines = ["# Learning benchmark", "",
             f"Machine: {', '.join(f'{k} {v}' for k, v in machine().items())}. "
             f"Seeds: {seeds}. Command: `python -m bench.learning`.", ""]
    main_names = [n for n in ["untrained", *MAIN_ORDER, "cross_entropy"] if n in results]
    if main_names:
        lines += ["## Cluttered digits", "", *report.results_table(results, main_names), ""]
    captions = report.caption_table(results)
    if captions:
        lines += ["Caption evaluation (retrieval among the test canvases' distinct captions, "
                  "zero-shot from the digit names):", "", *captions, ""]
    alt_names = [n for n in configs.ALT_TEXT if n in results]
    if alt_names:
        lines += ["## Alt-text captions", "",
                  "Class signal of each caption set (all-MiniLM-L6-v2 embeddings of the "
                  "training captions: mean cosine of two captions of one class and of two "
                  "classes):", "", *report.caption_signal_table(datasets), "",
                  *report.results_table(results, ["untrained", *alt_names]), ""]
    lines += ["## Claims", "", *report.claims_section(claims)]
    digit_names = [n for n in results if n.startswith("digits_")]
    if digit_names:
        lines += ["## Plain digits (reference)", "", *report.results_table(results, digit_names),
                  ""]
    if sweep:
        lines += ["## Recipe sweeps", "", *report.results_table(sweep, list(sweep)),
                  ""]
    lines += ["Plots: `knn_vs_k.png`, `negatives.png`, `similarity.png`."]
    (out / "learning.md").write_text("\n".join(lines) + "\n")
    return claims


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.learning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/learning"))
    parser.add_argument("--part", choices=["all", "main", "alt_text", "digits", "sweep"],
                        default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="+", help="configurations to run (names, main or sweep)")
    parser.add_argument("--sweep-seeds", type=int, nargs="+", default=[0],
                        help="seeds of the sweep entries (one seed unless an entry's "
                             "difference needs more)")
    parser.add_argument("--train-samples", type=int, default=6000)
    parser.add_argument("--test-samples", type=int, default=1000)
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: write the report from the finished runs")
    parser.add_argument("--no-ceiling", action="store_true",
                        help="leave out the cross-entropy ceiling (the untrained floor of "
                             "every seed still runs: each gain is measured against it)")
    parser.add_argument("--set", nargs="+", default=[], metavar="key=value",
                        help="overrides for every configuration (e.g. train.max_steps=5 for "
                             "a smoke run; use another --out)")
    parser.add_argument("--record", action="store_true",
                        help="also write the record learning/PART of the finished runs")
    parser.add_argument("--keep", action="store_true",
                        help="restore the runs kept in bench/learning/finished_runs and keep each "
                             "run finished here there (commit them: a benchmark of several "
                             "sittings continues from any checkout)")
    args = parser.parse_args()
    for flag in ("record", "keep"):
        if getattr(args, flag) and (args.set or any(
                getattr(args, n) != parser.get_default(n) for n in ("train_samples",
                                                                    "test_samples"))):
            parser.error(f"--{flag} keeps the recipes' runs: leave out --set and the sample "
                         "counts")
    seen = provenance(invocation())  # the tree the benchmark starts from
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sizes = (out / "data", args.train_samples, args.test_samples)
    datasets = DataSets({"cluttered": lambda: cluttered(*sizes),
                         "alt_text": lambda: cluttered(*sizes, "alt_text"),
                         "alt_text_centred": lambda: cluttered(*sizes, "alt_text", center=True),
                         "digits": lambda: digits(out / "data")})
    only = set(args.only) if args.only else None
    confs: list[Configuration] = []
    if args.part in ("all", "main"):
        floor, ceiling = configs.floor_and_ceiling("cluttered", args.seeds)
        confs += floor + configs.main(args.seeds, only) + ([] if args.no_ceiling else ceiling)
    if args.part in ("all", "alt_text"):
        if args.part == "alt_text":
            confs += configs.floor_and_ceiling("cluttered", args.seeds)[0]
        confs += configs.alt_text(args.seeds, only)
    if args.part in ("all", "digits"):
        floor, ceiling = configs.floor_and_ceiling("digits", args.seeds[:1], "digits_")
        confs += floor + configs.digits(args.seeds[:1]) + ceiling
    sweep_confs = (configs.sweep(args.sweep_seeds, only) if args.part in ("all", "sweep")
                   else [])
    confs = [dataclasses.replace(c, overrides=(*c.overrides, *args.set)) for c in confs]
    sweep_confs = [dataclasses.replace(c, overrides=(*c.overrides, *args.set))
                   for c in sweep_confs]
    results = run_all(confs, datasets, out, args.report_only, args.keep)
    sweep = run_all(sweep_confs, datasets, out, args.report_only, args.keep)
    claims = write(results, sweep, datasets, out, args.seeds, args.part)
    if args.record:  # with the untrained floor of each seed, which every gain is against
        seeds = sorted({*args.seeds, *args.sweep_seeds})
        floor = run_all(configs.floor_and_ceiling("cluttered", seeds)[0], datasets, out,
                        report_only=True, kept=args.keep)
        found: Results = defaultdict(list)  # a seed in two of them is kept once
        for part in (floor, results, sweep):
            for name, runs in part.items():
                found[name] += runs
        record = write_record(f"learning/{args.part}", seen, RENDERER,
                              benchmark_tables.figures(found, claims))
        print(f"record: {record}")
    for claim in claims:
        print(f"({claim['claim']}) {verdict(claim)}: {claim['title']}")
    print(f"report: {out / 'learning.md'}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()

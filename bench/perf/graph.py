"""Captions/s of the graph-precompute job against calling ``SentenceTransformer.encode``
directly on the same captions, plus the gain from encoding each distinct caption once
.

    python -m bench.perf.graph                      # 2,000 distinct captions, then 50% duplicates

Captions are real text: ImageNet class names in varied sentence templates. The model is
loaded once beforehand for both sides; the job's time includes reading the shards,
deduplication, chunk files and the merge. Target: at least 0.9x without deduplication.
With ``--record``, also writes ``bench/records/perf/graph.json``, whose view ``summary`` is
the paragraph docs/benchmarks.md shows.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import machine, print_table, write_json
from bench.records import invocation, provenance, source_line, write_record
from data_pipeline.formats import Sample
from data_pipeline.graph.config import GraphConfig
from data_pipeline.graph.encoder import load_encoder
from data_pipeline.graph.job import run_captions
from data_pipeline.image_tree import read_class_names
from data_pipeline.manifest import Manifest, ShardInfo, file_sha256
from data_pipeline.tario import write_shard

TEMPLATES = ["a photo of a {}.", "a blurry photo of the {} in the park.",
             "my {} sitting next to a window on a sunny afternoon.",
             "close-up of a {} with a white background, studio lighting."]
MIN_VS_DIRECT = 0.9
NAME = "perf/graph"
RENDERER = "bench.perf.graph"  # this module, by the name a record imports it


def render_summary(record: dict[str, Any]) -> list[str]:
    """``summary``: the source, the job's rate against direct encoding with and without
    duplicates, the target, and CC12M's hours at the job's rate."""
    figures = record["figures"]
    rate = {r["case"]: r for r in figures["rows"]}
    job, direct = rate["job, distinct captions"], rate["SentenceTransformer.encode, distinct"]
    dedup = rate["job, 50% duplicates (dedup)"]
    direct_dup = rate["SentenceTransformer.encode, 50% duplicates"]
    met = job["vs_direct"] >= MIN_VS_DIRECT
    return [f"{source_line(record)} {figures['captions']:,} captions, MiniLM on the CPU, "
            f"median of 3: the job (read, deduplicated, chunked, merged) "
            f"{job['captions_per_s']:.0f} captions/s against `SentenceTransformer.encode`'s "
            f"{direct['captions_per_s']:.0f}, **{job['vs_direct']:.3f}x** (target >= "
            f"{MIN_VS_DIRECT}x, {'met' if met else 'not met'}); with 50% duplicates "
            f"{dedup['captions_per_s']:.0f} against {direct_dup['captions_per_s']:.0f}. "
            f"CC12M's 12 M captions: {figures['projection']['cc12m_hours_this_cpu']:.0f} h "
            f"on one part here; parts scale out."]


def captions(count: int) -> list[str]:
    names = read_class_names("imagenet1k")
    return [TEMPLATES[i % len(TEMPLATES)].format(names[(i * 7) % len(names)]) + f" #{i}"
            for i in range(count)]


def write_caption_shards(directory: Path, texts: list[str], per_shard: int = 500) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    infos = []
    for index, start in enumerate(range(0, len(texts), per_shard)):
        path = directory / f"shard-{index:06d}.tar"
        samples = [Sample(f"s{i:07d}", b"\xff", "jpg", None, texts[i])
                   for i in range(start, min(len(texts), start + per_shard))]
        count = write_shard(path, samples)
        infos.append(ShardInfo(path.name, count, path.stat().st_size, file_sha256(path)))
    Manifest("bench", infos).write(directory)


def time_job(shards: Path, out: Path, batch: int) -> float:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    run_captions(GraphConfig(shards=str(shards), output=str(out), batch_size=batch))
    return time.perf_counter() - start


def time_direct(model, texts: list[str], batch: int) -> float:
    start = time.perf_counter()
    model.encode(texts, batch_size=batch, convert_to_numpy=True, normalize_embeddings=True)
    return time.perf_counter() - start


VIEWS = {"summary": render_summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--captions", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workdir", type=Path, default=Path("bench/results/graph"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/graph.json"))
    parser.add_argument("--record", action="store_true",
                        help=f"also write bench/records/{NAME}.json (the docs' paragraph)")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    model = load_encoder("bundled")
    distinct = captions(args.captions)
    repeated = distinct[: args.captions // 2] * 2  # same count, 50% duplicates
    write_caption_shards(args.workdir / "distinct", distinct)
    write_caption_shards(args.workdir / "repeated", repeated)
    rounds: dict[str, list[float]] = {"job": [], "direct": [], "job_dedup": [], "direct_dup": []}
    for _ in range(3):
        rounds["job"].append(time_job(args.workdir / "distinct", args.workdir / "s1", args.batch))
        rounds["direct"].append(time_direct(model, distinct, args.batch))
        rounds["job_dedup"].append(time_job(args.workdir / "repeated", args.workdir / "s2",
                                            args.batch))
        rounds["direct_dup"].append(time_direct(model, repeated, args.batch))
    med = {k: float(np.median(v)) for k, v in rounds.items()}
    n = args.captions
    rows = [
        {"case": "job, distinct captions", "captions_per_s": n / med["job"],
         "vs_direct": med["direct"] / med["job"]},
        {"case": "SentenceTransformer.encode, distinct", "captions_per_s": n / med["direct"],
         "vs_direct": 1.0},
        {"case": "job, 50% duplicates (dedup)", "captions_per_s": n / med["job_dedup"],
         "vs_direct": med["direct_dup"] / med["job_dedup"]},
        {"case": "SentenceTransformer.encode, 50% duplicates", "captions_per_s":
         n / med["direct_dup"], "vs_direct": 1.0},
    ]
    rate = n / med["job"]
    projection = {"cc3m_hours_this_cpu": 3.3e6 / rate / 3600,
                  "cc12m_hours_this_cpu": 12e6 / rate / 3600}
    ok = med["direct"] / med["job"] >= MIN_VS_DIRECT
    write_json(args.out, {"machine": machine(), "captions": n, "batch": args.batch,
                          "rows": rows, "rounds": rounds, "projection": projection,
                          "target_at_least_0.9x": ok})
    if args.record:
        figures = {"captions": n, "batch": args.batch, "rows": rows, "projection": projection}
        print(f"record: {write_record(NAME, seen, RENDERER, figures)}")
    print_table(rows, ["case", "captions_per_s", "vs_direct"])
    print(f"projected on this CPU: CC3M {projection['cc3m_hours_this_cpu']:.1f} h, "
          f"CC12M {projection['cc12m_hours_this_cpu']:.1f} h (no GPU in this run)")
    print(f"{'PASS' if ok else 'FAIL'}  job >= 0.9x direct encode (distinct captions)")


if __name__ == "__main__":
    main()

"""Memory and time of the objectives against many negatives: dense [n, N] logits against
column tiles (``objective.tile_size``, docs/negatives.md).

    python -m bench.perf.negatives                         # N = 8192 ... 131072, D = 128
    python -m bench.perf.negatives --sizes 8192 16384      # a quick run
    python -m bench.perf.negatives --part peaks            # peak memory at N = 131072

One process holds all N embeddings as anchors and candidates (N/2 images x 2 views, 100
classes). Each (path, N) runs forward + backward of infonce in a fresh child process with
glibc's default allocator, which reports its wall time and peak resident memory above the
process before the loss; dense runs only while its
[N, N] float32 logits and their softmax fit in ``--dense-limit-gib``. In this process,
every objective's tiled time is timed against its dense time at N = 8192 (interleaved).

Peaks: forward + backward of infonce and of xclr (caption targets, 384-dim captions) at
N = 131,072, tiles of 256 and 4,096, each in a fresh child process: peak resident memory
less the idle process's against the figure recorded in ``RECORDED_ABOVE_IDLE_GIB``.

A training step with cached-gradient chunks (``train.chunk_size``): 4,096 views per
process (2,048 images x 2), the small CNN at 32 px, infonce, at chunk sizes 4,096 (one
chunk, plus the chunked path's extra no-gradient forward), 512 and 128 against the plain
step, each in a fresh child process: time per step and peak resident memory.

Targets: tiled peak memory grows linearly in N (doubling N at most 2.3x the memory above
the idle process); every objective's tiled time at N = 8192 within 1.3x of its dense
time; what every peak
adds to its idle process at most 1.2x its recorded figure. Writes
bench/results/negatives.json and prints tables; ``--record`` also writes each part's record,
``bench/records/perf/{tiles,peaks,chunks}.json``, whose views (tiles: ``ratios``, tiled
against dense time, and ``memory``, time and peak memory against N; ``peaks``; ``chunks``)
are the tables docs/benchmarks.md shows (rendered by ``bench/perf/negatives_tables.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import (
    keep_freed_memory,
    machine,
    peak_rss_bytes,
    print_table,
    time_interleaved,
    write_json,
)
from bench.perf.objectives import objective_cases
from bench.records import invocation, provenance, write_record
from pretrain.contrast.batch import AUTO_TILE_SIZE, DENSE_MAX_CANDIDATES
from pretrain.objectives import BatchOptions, BatchRows, local_batch, objective_function

NUM_CLASSES = 100
RATIO_N = 8192
MAX_TILED_VS_DENSE = 1.3  # every objective's tiled pass against its dense one at RATIO_N
CAPTION_DIM = 384  # all-MiniLM-L6-v2's embeddings
PEAK_N = 131072
# the memory (GiB) forward + backward at N = PEAK_N added to their idle process (peak
# resident memory less the idle process's) when first measured, per (objective, tile
# size): the budget a run is held to. A run more than PEAK_TOLERANCE times above it fails
# its check (the tiles' memory grew); the record perf/peaks keeps what a run measured.
# The idle process itself (torch, its inputs) moves with the torch build and the machine,
# which the loss does not control: its figure is printed.
RECORDED_ABOVE_IDLE_GIB = {("infonce", 256): 0.25, ("infonce", 4096): 0.26,
                           ("xclr", 256): 0.25, ("xclr", 4096): 0.26}
PEAK_TOLERANCE = 1.2
RECORDS = {"tiles": "perf/tiles", "peaks": "perf/peaks", "chunks": "perf/chunks"}  # per part
RENDERER = "bench.perf.negatives_tables"  # the module that renders its records
def embeddings(n: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    z = torch.randn(n, dim, generator=gen).requires_grad_()
    ids = torch.arange(n // 2).repeat(2)
    return z, ids, ids % NUM_CLASSES


def image_captions(n: int) -> torch.Tensor:
    """[n, CAPTION_DIM] unit caption embeddings, the two views of an image (rows i and
    i + n/2, as ``embeddings``' ids) sharing one, made in place: the idle process holds
    the captions and no freed copy."""
    captions = torch.empty(n, CAPTION_DIM)
    first = captions[:n // 2]
    torch.randn(first.shape, generator=torch.Generator().manual_seed(n + 1), out=first)
    first.div_(torch.linalg.vector_norm(first, dim=1, keepdim=True))
    captions[n // 2:] = first
    return captions


def child(n: int, dim: int, tile_size: int | None, repeats: int,
          objective: str = "infonce") -> dict:
    """Forward + backward of ``objective`` (infonce, or xclr on caption embeddings) in this
    (fresh) process: seconds and peak RSS, with the default allocator (keep_freed_memory
    would hold on to every freed tile)."""
    z, ids, labels = embeddings(n, dim)
    captions = None if objective != "xclr" else image_captions(n)
    idle = peak_rss_bytes()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        z.grad = None
        batch = local_batch(BatchRows(z, ids, labels, captions=captions),
                            BatchOptions(tile_size=tile_size))
        if tile_size is None:  # dense even above the automatic choice's limit
            batch = dataclasses.replace(batch, tile_size=None)
        objective_function(objective)(batch, 0.1).loss.backward()
        times.append(time.perf_counter() - start)
    peak = peak_rss_bytes()
    return {"seconds": min(times), "peak_gib": peak / 2**30, "idle_gib": idle / 2**30}


def run_child(n: int, dim: int, tile_size: int | None, repeats: int,
              objective: str = "infonce") -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.perf.negatives", "--child", str(n), str(tile_size or 0),
         "--dim", str(dim), "--repeats", str(repeats), "--objective", objective],
        check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def dense_gib(n: int) -> float:
    """Approximate peak of the dense path: logits, softmax and a masked copy, float32."""
    return 3 * n * n * 4 / 2**30


def scaling_rows(sizes: list[int], dim: int, tile_size: int, dense_limit: float) -> list[dict]:
    rows = []
    for n in sizes:
        repeats = 3 if n <= 16384 else 1
        for path in ("dense", "tiled"):
            if path == "dense" and dense_gib(n) > dense_limit:
                rows.append({"N": n, "path": path, "fits": False})
                continue
            result = run_child(n, dim, tile_size if path == "tiled" else None, repeats)
            rows.append({"N": n, "path": path, "fits": True, **result,
                         "above_idle_gib": result["peak_gib"] - result["idle_gib"]})
            print(f"  N={n} {path}: {result['seconds']:.2f} s, "
                  f"peak {result['peak_gib']:.2f} GiB", flush=True)
    return rows


def objective_ratios(dim: int, tile_size: int, repeats: int) -> list[dict]:
    """Every objective at N = RATIO_N: tiled time over dense time, in this process."""
    keep_freed_memory()
    z, ids, labels = embeddings(RATIO_N, dim)
    gen = torch.Generator().manual_seed(1)
    captions = torch.randn(RATIO_N // 2, 384, generator=gen)[ids]
    names = torch.nn.functional.normalize(torch.randn(NUM_CLASSES, 384, generator=gen), dim=1)
    inputs = (z, ids, labels, captions, names @ names.T,
              torch.randn(RATIO_N, dim, generator=gen).requires_grad_(),
              torch.randn(NUM_CLASSES, dim, generator=gen).requires_grad_())
    dense = objective_cases(*inputs)  # the automatic choice is dense at RATIO_N
    tiled = objective_cases(*inputs, tile_size=tile_size)
    rows = []
    for name in dense:
        def step(fn):
            def run() -> None:
                z.grad = None
                fn().backward()
            return run
        seconds = time_interleaved({"dense": step(dense[name]), "tiled": step(tiled[name])},
                                   repeats)
        rows.append({"objective": name, "dense_ms": seconds["dense"] * 1e3,
                     "tiled_ms": seconds["tiled"] * 1e3,
                     "tiled_vs_dense": seconds["tiled"] / seconds["dense"]})
        print(f"  {name}: {rows[-1]['tiled_vs_dense']:.2f}x", flush=True)
    return rows


def linear_growth(rows: list[dict]) -> dict[str, float]:
    """Memory above the idle process at 2N over that at N, per doubling of tiled N."""
    tiled = sorted((r for r in rows if r["path"] == "tiled"), key=lambda r: r["N"])
    return {f"{a['N']}->{b['N']}": b["above_idle_gib"] / a["above_idle_gib"]
            for a, b in zip(tiled, tiled[1:], strict=False) if b["N"] == 2 * a["N"]}


def chunk_child(rows: int, chunk_size: int, repeats: int) -> dict:
    """Training steps (forward, backward, SGD update) in this fresh process; chunk 0 is the
    plain step."""
    from pretrain.distributed.engine import EngineConfig, build_engine
    from pretrain.loop.step import Objective
    from pretrain.loop.trainer import chunked_loss, forward_loss
    from pretrain.model.encoder import ModelConfig, build_model
    from pretrain.objectives import ObjectiveConfig

    torch.manual_seed(0)
    cfg = ObjectiveConfig(name="infonce", temperature=0.2)
    model = build_model(ModelConfig(), cfg, torch.device("cpu"))
    engine = build_engine(model, torch.optim.SGD(model.parameters(), lr=0.01), EngineConfig(),
                          torch.device("cpu"), micro_batch=rows)
    batch = {"images": torch.randn(rows, 3, 32, 32), "ids": torch.arange(rows // 2).repeat(2)}
    objective = Objective(cfg)
    idle = peak_rss_bytes()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if chunk_size:
            _, backward = chunked_loss(engine, batch, objective, 0, chunk_size)
            backward()
        else:
            engine.backward(forward_loss(engine, batch, objective, 0).loss)
        engine.step()
        times.append(time.perf_counter() - start)
    peak = peak_rss_bytes()
    return {"seconds": min(times), "peak_gib": peak / 2**30,
            "above_idle_gib": (peak - idle) / 2**30}


def chunk_rows(rows: int, chunk_sizes: list[int], repeats: int) -> list[dict]:
    results = []
    for chunk in [0, *chunk_sizes]:
        out = subprocess.run(
            [sys.executable, "-m", "bench.perf.negatives", "--chunk-child", str(rows), str(chunk),
             "--repeats", str(repeats)], check=True, capture_output=True, text=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        results.append({"views": rows, "chunk_size": chunk or "off", **result})
        print(f"  chunk {chunk or 'off'}: {result['seconds']:.2f} s, "
              f"peak {result['peak_gib']:.2f} GiB", flush=True)
    plain = results[0]
    for row in results:
        row["time_vs_plain"] = row["seconds"] / plain["seconds"]
        row["memory_vs_plain"] = row["above_idle_gib"] / plain["above_idle_gib"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+",
                        default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tile-size", type=int, default=AUTO_TILE_SIZE)
    parser.add_argument("--dense-limit-gib", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=5, help="timing rounds")
    parser.add_argument("--part", choices=["tiles", "peaks", "chunks", "all"], default="all")
    parser.add_argument("--objective", choices=["infonce", "xclr"], default="infonce",
                        help=argparse.SUPPRESS)
    parser.add_argument("--chunk-views", type=int, default=4096)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[4096, 512, 128])
    parser.add_argument("--child", type=int, nargs=2, metavar=("N", "TILE"), help=argparse.SUPPRESS)
    parser.add_argument("--chunk-child", type=int, nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("bench/results/negatives.json"))
    parser.add_argument("--record", action="store_true",
                        help="also write each part's record, bench/records/perf/<part>.json")
    args = parser.parse_args()
    if args.child:
        n, tile = args.child
        print(json.dumps(child(n, args.dim, tile or None, args.repeats, args.objective)))
        return
    if args.chunk_child:
        print(json.dumps(chunk_child(*args.chunk_child, args.repeats)))
        return
    seen = provenance(invocation())  # the tree the run starts from
    payload = {"machine": machine()}
    if args.part in ("tiles", "all"):
        payload.update(tiles_part(args))
    if args.part in ("peaks", "all"):
        peaks = peaks_part(args.dim)
        payload["peaks"] = peaks["rows"]
        payload.setdefault("targets", {}).update(peaks["targets"])
    if args.part in ("chunks", "all"):
        print(f"training step, {args.chunk_views} views, chunked:")
        chunks = chunk_rows(args.chunk_views, args.chunk_sizes, min(args.repeats, 2))
        payload["chunks"] = chunks
        print_table(chunks, ["views", "chunk_size", "seconds", "peak_gib", "above_idle_gib",
                             "time_vs_plain", "memory_vs_plain"])
    write_json(args.out, payload)
    figures = {"tiles": {"tile_size": args.tile_size, "objectives": payload.get("objectives"),
                         "scaling": payload.get("scaling")},
               "peaks": {"rows": payload.get("peaks")},
               "chunks": {"views": args.chunk_views, "rows": payload.get("chunks")}}
    for part in RECORDS if args.record else ():
        if args.part in (part, "all"):
            print(f"record: {write_record(RECORDS[part], seen, RENDERER, figures[part])}")
    if not all(payload.get("targets", {}).values()):
        raise SystemExit("bench.perf.negatives: a check failed (above)")


def tiles_part(args: argparse.Namespace) -> dict:
    print("forward + backward of infonce, one process per row:")
    scaling = scaling_rows(args.sizes, args.dim, args.tile_size, args.dense_limit_gib)
    assert RATIO_N <= DENSE_MAX_CANDIDATES  # the automatic choice is dense there
    print(f"every objective at N = {RATIO_N}, tiled against dense:")
    ratios = objective_ratios(args.dim, args.tile_size, args.repeats)
    growth = linear_growth(scaling)
    checks = {f"tiled {row['objective']} <= {MAX_TILED_VS_DENSE}x dense at N = {RATIO_N} (got "
              f"{row['tiled_vs_dense']:.2f}x)": row["tiled_vs_dense"] <= MAX_TILED_VS_DENSE
              for row in ratios}
    if growth:  # --sizes without a doubling of N leave nothing to check
        checks["tiled memory grows linearly (<= 2.3x per doubling of N)"] = all(
            g <= 2.3 for g in growth.values())
    print_table(scaling, ["N", "path", "fits", "seconds", "peak_gib", "above_idle_gib"])
    print_table(ratios, ["objective", "dense_ms", "tiled_ms", "tiled_vs_dense"])
    print("memory growth per doubling of N:", {k: round(v, 2) for k, v in growth.items()})
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return {"dim": args.dim, "tile_size": args.tile_size, "scaling": scaling,
            "memory_growth_per_doubling": growth, "objectives": ratios, "targets": checks}



def peaks_part(dim: int) -> dict:
    """Peak resident memory at N = PEAK_N of every recorded (objective, tile size), each in
    a fresh child process: what it adds to the idle process, against the recorded figure."""
    print(f"peak memory at N = {PEAK_N}, one process per row:")
    rows, checks = [], {}
    for (objective, tile_size), recorded in RECORDED_ABOVE_IDLE_GIB.items():
        result = run_child(PEAK_N, dim, tile_size, 1, objective)
        above = result["peak_gib"] - result["idle_gib"]
        rows.append({"objective": objective, "tile_size": tile_size, **result,
                     "above_idle_gib": above, "recorded_above_idle_gib": recorded})
        print(f"  {objective} T={tile_size}: {result['seconds']:.0f} s, "
              f"peak {result['peak_gib']:.2f} GiB, {above:.2f} above idle", flush=True)
        checks[f"{objective} at N = {PEAK_N}, T = {tile_size}: above idle <= {PEAK_TOLERANCE}"
               f" x the recorded {recorded} GiB (got {above:.2f})"] = \
            above <= PEAK_TOLERANCE * recorded
    print_table(rows, ["objective", "tile_size", "seconds", "peak_gib", "idle_gib",
                       "above_idle_gib", "recorded_above_idle_gib"])
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return {"rows": rows, "targets": checks}


if __name__ == "__main__":
    main()

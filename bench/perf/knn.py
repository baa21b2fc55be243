"""Exact kNN against the machine's own matrix-multiply throughput.

    python -m bench.perf.knn                          # 10,000 queries x 100,000 x 512 bank, k = 200
    python -m bench.perf.knn --queries 2000 --bank 20000

Measured in one process on the same random data: torch.mm of the queries against the bank
in blocks into one reused output buffer (the floor every exact search pays; fresh output
buffers would page-fault and cost ~30%), our exact search (``evaluation.knn.ExactIndex``: the
bank in blocks, each searched by matmul + top-k or by faiss's brute-force ``knn``, the best
merged; then the weighted vote), and scikit-learn's
``KNeighborsClassifier`` (brute force, cosine). Target: exact kNN at >= 70% of the matmul
throughput (medians of interleaved rounds: this machine's speed drifts by tens of percent
between minutes). Also projects the ImageNet kNN evaluation (50,000 x 1,281,167, 2048-d ResNet-50
features) from the measured rate here, and for one H100 from an assumed sustained
matmul rate (no GPU in this task; stated in the table). Writes bench/results/knn.json;
with ``--record``, also ``bench/records/perf/knn.json``, whose view ``table`` is the table
docs/benchmarks.md shows.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import machine, print_table, time_interleaved, write_json
from bench.records import invocation, provenance, source_line, write_record
from evaluation.knn import BLOCK_BYTES, build_index, knn_accuracy

RESULTS = Path("bench/results/knn.json")
H100_TFLOPS_ASSUMED = 50.0  # sustained fp32 (TF32 off) GEMM; an assumption, not measured
MIN_VS_MATMUL = 0.7  # the target: exact kNN at >= 70% of the matmul rate
NAME = "perf/knn"
RENDERER = "bench.perf.knn"  # this module, by the name a record imports it
SHOWN = {"torch.mm (floor)": "torch.mm into one reused buffer (the floor)",
         "exact index (mm + topk + vote)": "exact torch search (mm + top-k per block, merge, "
                                           "vote)",
         "faiss knn per bank block + vote": "faiss `knn` per block, merge, vote (default)",
         "sklearn KNeighborsClassifier": "scikit-learn `KNeighborsClassifier` (brute, cosine)"}
EXACT = ("exact index (mm + topk + vote)", "faiss knn per bank block + vote")


def render_table(record: dict[str, Any]) -> list[str]:
    """``table``: the source and shape, each method's seconds and its rate against the
    matmul floor, and the target."""
    shape, rows = record["figures"]["shape"], record["figures"]["rows"]
    by_method = {r["method"]: r for r in rows}
    met = all(by_method[m]["vs_matmul"] >= MIN_VS_MATMUL for m in EXACT)
    return [f"{source_line(record)} {shape['queries']:,} queries x {shape['bank']:,} x "
            f"{shape['dim']} bank, k = {shape['k']}, median of {shape['rounds']} rounds:", "",
            "| method | s | vs torch.mm |", "| --- | --- | --- |",
            *(f"| {SHOWN[r['method']]} | {r['seconds']:.2f} | {r['vs_matmul']:.2f} |"
              for r in rows),
            "", f"Target, exact kNN at >= {MIN_VS_MATMUL:.0%} of the matmul rate: "
            f"**{'met' if met else 'not met'}** by "
            + " and ".join(f"{by_method[m]['vs_matmul']:.2f}" for m in EXACT) + "."]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_only(queries: torch.Tensor, bank: torch.Tensor) -> None:
    rows = max(1, BLOCK_BYTES // (bank.shape[0] * bank.element_size()))
    out = queries.new_empty(rows, bank.shape[0])
    for start in range(0, len(queries), rows):
        chunk = queries[start:start + rows]
        torch.mm(chunk, bank.T, out=out[: len(chunk)])


VIEWS = {"table": render_table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--bank", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--k", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved; medians reported")
    parser.add_argument("--skip-sklearn", action="store_true")
    parser.add_argument("--record", action="store_true",
                        help=f"also write bench/records/{NAME}.json (the docs' table)")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    gen = torch.Generator().manual_seed(0)
    bank = F.normalize(torch.randn(args.bank, args.dim, generator=gen), dim=1)
    queries = F.normalize(torch.randn(args.queries, args.dim, generator=gen), dim=1)
    bank_labels = torch.randint(0, 1000, (args.bank,), generator=gen)
    labels = torch.randint(0, 1000, (args.queries,), generator=gen)
    flops = 2.0 * args.queries * args.bank * args.dim
    rows = []

    def add(name: str, seconds: float, mm_seconds: float) -> None:
        rows.append({"method": name, "seconds": seconds, "gflops": flops / seconds / 1e9,
                     "vs_matmul": mm_seconds / seconds})

    exact, flat = build_index(bank, "exact"), build_index(bank, "faiss_flat")
    times = time_interleaved({
        "torch.mm (floor)": lambda: matmul_only(queries, bank),
        "exact index (mm + topk + vote)": lambda: knn_accuracy(
            exact, bank_labels, queries, labels, [args.k], 0.07, 1000),
        "faiss knn per bank block + vote": lambda: knn_accuracy(
            flat, bank_labels, queries, labels, [args.k], 0.07, 1000)}, args.rounds)
    mm = times["torch.mm (floor)"]
    for name, seconds in times.items():
        add(name, seconds, mm)
    if not args.skip_sklearn:
        from sklearn.neighbors import KNeighborsClassifier

        clf = KNeighborsClassifier(args.k, algorithm="brute", metric="cosine", n_jobs=-1)
        x, y, xq = bank.numpy(), bank_labels.numpy(), queries.numpy()
        add("sklearn KNeighborsClassifier", timed(lambda: clf.fit(x, y).predict(xq)), mm)
    print_table(rows, ["method", "seconds", "gflops", "vs_matmul"])
    imagenet_flops = 2.0 * 50_000 * 1_281_167 * 2048
    rate = max(rows[1]["gflops"], rows[2]["gflops"]) * 1e9  # the default index's path
    projection = {"imagenet_flops": imagenet_flops,
                  "this_cpu_hours": imagenet_flops / rate / 3600,
                  "h100_seconds_assumed": imagenet_flops / (H100_TFLOPS_ASSUMED * 1e12),
                  "h100_assumption_tflops": H100_TFLOPS_ASSUMED}
    print(f"ImageNet kNN (50,000 x 1,281,167 x 2048): {projection['this_cpu_hours']:.2f} h on "
          f"this CPU at the measured rate; ~{projection['h100_seconds_assumed']:.0f} s on one "
          f"H100 at an assumed {H100_TFLOPS_ASSUMED:.0f} TFLOP/s (not measured here)")
    write_json(RESULTS, {"machine": machine(), "shape": vars(args), "rows": rows,
                         "imagenet_projection": projection})
    if args.record:
        figures = {"shape": vars(args), "rows": rows}
        print(f"record: {write_record(NAME, seen, RENDERER, figures)}")


if __name__ == "__main__":
    main()

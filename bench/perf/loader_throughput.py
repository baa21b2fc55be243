"""The training loader's throughput and memory at simulated worlds, against another
checkout's loader (the baseline: an older commit, unpacked with ``git archive``).

    python -m bench.perf.loader_throughput --baseline /tmp/base       # 1x2, 2x2, 16x4
    python -m bench.perf.loader_throughput --worlds 1x2 --rounds 1    # this checkout alone

Rank 0 of a world of W ranks with K loader workers (the other ranks are simulated: each
reads its own part of every global batch alike) reads real tars of 16 px JPEGs (SimCLR
views at 16 px, 64 instances a chunk, a global batch of 64 x W): images a second over 80
batches after 4 to warm up, the CPU time its process and workers spent an image, and the
peak resident memory of its process and workers together (RSS summed, sampled every
20 ms: pages a forked worker shares with its parent count twice, alike for both
checkouts). Each measurement runs in a fresh process, the
checkouts alternating round by round; the median of the rounds is reported, and each
round's rate ratio (sorted). Writes
``bench/results/loader_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
WORLDS = ["1x2", "2x2", "16x4"]


def measure(shards: str, world: int, workers: int, warm: int = 4, batches: int = 80) -> dict:
    """Rank 0's loader of ``world`` ranks, ``workers`` workers (run in a fresh process:
    the data pipeline imported is whichever is first on the path)."""
    import psutil

    from data_pipeline.config import DataConfig
    from data_pipeline.loader import TrainLoader

    cfg = DataConfig(shards=shards, batch_size=64, workers=workers, resolution=16,
                     persistent_workers=False, shuffle_buffer=512)
    peak, done = [0], threading.Event()

    def sample() -> None:
        me = psutil.Process()
        while not done.is_set():
            try:
                rss = me.memory_info().rss + sum(c.memory_info().rss
                                                 for c in me.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
            peak[0] = max(peak[0], rss)
            time.sleep(0.02)

    def cpu_seconds() -> float:  # this process and its workers, user and system
        processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
        return sum(sum(p.cpu_times()[:2]) for p in processes)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    loader = TrainLoader(cfg, 0, world, global_batch=64 * world)
    images, start, cpu, seconds = 0, 0.0, 0.0, 0.0
    for index, batch in enumerate(loader.epoch()):
        if index == warm:
            start, cpu = time.perf_counter(), cpu_seconds()
        elif index > warm:
            images += len(batch["keys"])
        if index == warm + batches:  # before the loop ends the workers
            seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            break
    loader.close()
    done.set()
    watcher.join()
    return {"batches_per_s": batches / seconds, "images_per_s": images / seconds,
            "cpu_ms_per_image": 1e3 * cpu / images, "peak_rss_mib": peak[0] / 2**20}


def run(checkout: Path, shards: str, world: int, workers: int) -> dict:
    """:func:`measure` in a fresh process importing ``checkout``'s data pipeline."""
    code = ("import importlib.util, json, sys; "
            f"sys.path.insert(0, {str(checkout)!r}); "
            f"spec = importlib.util.spec_from_file_location('bench_loader', {__file__!r}); "
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            f"print(json.dumps(module.measure({shards!r}, {world}, {workers})))")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    from bench.scale.loader import tiny_shards

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another checkout's root")
    parser.add_argument("--worlds", nargs="+", default=WORLDS, help="RANKSxWORKERS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "loader")
    parser.add_argument("--output", type=Path, default=RESULTS / "loader_throughput.json")
    args = parser.parse_args(argv)
    folder = args.workdir / "shards"
    tiny_shards(folder, shards=40, per_shard=2_500)
    checkouts = {"this": REPO, **({"baseline": args.baseline} if args.baseline else {})}
    rows = []
    for spec in args.worlds:
        world, workers = (int(x) for x in spec.split("x"))
        runs: dict[str, list[dict]] = {name: [] for name in checkouts}
        for _ in range(args.rounds):
            for name, checkout in checkouts.items():
                runs[name].append(run(checkout, str(folder), world, workers))
        row = {"world": spec}
        for name in checkouts:
            for key in ("images_per_s", "cpu_ms_per_image", "peak_rss_mib"):
                row[f"{name}_{key}"] = statistics.median(r[key] for r in runs[name])
        if args.baseline:  # each round's pair too: their spread is the machine's drift
            paired = sorted(a["images_per_s"] / b["images_per_s"]
                            for a, b in zip(runs["this"], runs["baseline"], strict=True))
            row["speed_ratio_rounds"] = [round(r, 3) for r in paired]
            row["speed_ratio"] = row["this_images_per_s"] / row["baseline_images_per_s"]
            row["cpu_ratio"] = row["this_cpu_ms_per_image"] / row["baseline_cpu_ms_per_image"]
            row["memory_ratio"] = row["this_peak_rss_mib"] / row["baseline_peak_rss_mib"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    from bench.common import machine, write_json
    write_json(args.output, {"machine": machine(), "rounds": args.rounds,
                             "baseline": str(args.baseline or ""), "rows": rows})


if __name__ == "__main__":
    main()

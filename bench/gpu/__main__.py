"""Run the GPU kit's parts one after another and write their figures.

    python -m bench.gpu OUT_DIR [--dry-run [--jobs N]] [--parts tests,sync,...] [--budget S]

Each part runs in a process of its own (forked from a server that imported the kit once)
with its share of ``--budget`` (time a part leaves unused passes to the next); a part that
fails or runs out of time is recorded as such, its whole process tree killed (pytest,
torchrun and loader processes included), and the others go on. The default budget leaves
60 s of a 600 s command for start-up and the report. The dry run may run
``--jobs`` parts at a time, each with the whole budget as its limit (it measures nothing; on
a GPU each part runs alone, so that its timings are its own). Writes ``OUT_DIR/gpu.json``
(the machine, every part's rows, status and log tail), ``OUT_DIR/gpu.md`` (a table per part,
also printed) and ``OUT_DIR/logs/``; both are rewritten as each part ends, so a command cut
short keeps what its finished parts measured.
Exits 1 if any part failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch

from bench.gpu import part
from bench.gpu.kit_tables import part_status, table
from bench.gpu.part import PARTS, write_atomically
from bench.gpu.tree import kill_tree
from bench.records import invocation, provenance, tree_digest

MARGIN = 0.85  # of its time limit, a part plans its own work to end within
BUDGET_S = 540.0  # the default budget: 60 s of a 600 s command left for start-up and report
# Each part is forked from a server that imported torch and the kit once (a fresh
# interpreter would pay ~3 s of imports and its teardown per part); the server never
# touches CUDA, so each part initialises it afresh. Started at the first part, after
# ``main`` has set the environment the parts inherit.
FORKS = mp.get_context("forkserver")
FORKS.set_forkserver_preload(["bench.gpu.part"])


def machine() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "gpu_memory_gib": (torch.cuda.get_device_properties(0).total_memory / 2**30
                               if cuda else None),
            "cpu_cores": os.cpu_count(), "cpu": platform.processor() or platform.machine()}


def run_part(name: str, out: Path, seconds: float, dry_run: bool) -> dict[str, Any]:
    log = out / "logs" / f"{name}.log"
    argv = [name, str(out / "parts"), "--seconds", f"{seconds * MARGIN:.0f}",
            *(["--dry-run"] if dry_run else [])]
    start = time.perf_counter()
    process = FORKS.Process(target=part.logged, args=(argv, str(log)), name=name)
    process.start()
    process.join(seconds)
    if process.exitcode is None:
        kill_tree(process.pid)
        process.join()
        status = f"out of time ({seconds:.0f} s)"
    else:
        status = "ok" if process.exitcode == 0 else f"failed (exit {process.exitcode})"
    result_file = out / "parts" / f"{name}.json"
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if status == "ok" and not result.get("ok", False):
        status = "failed (its check)"
    return {"status": status, "seconds": time.perf_counter() - start, **result,
            "title": PARTS[name].title, "columns": list(PARTS[name].columns),
            "log_tail": log.read_text()[-4000:]}


def reported(name: str, out: Path, seconds: float, dry_run: bool) -> dict[str, Any]:
    """:func:`run_part`, its start and end printed."""
    print(f"gpu kit: {name} (up to {seconds:.0f} s)", flush=True)
    result = run_part(name, out, seconds, dry_run)
    print(f"gpu kit: {name} {result['status']} in {result['seconds']:.0f} s: "
          f"{result.get('summary', '')}", flush=True)
    return result


def write_report(report: dict[str, Any], out: Path) -> str:
    """``gpu.json`` and ``gpu.md`` of the parts finished so far; the tables, for printing."""
    write_atomically(out / "gpu.json", json.dumps(report, indent=2))
    m = report["machine"]
    commit = report["provenance"]["commit"] or "no git checkout"
    header = (f"# GPU kit, {m['date']}: {m['gpu'] or 'CPU dry run'}, torch {m['torch']} "
              f"(CUDA {m['cuda']}), Python {m['python']}, {m['cpu_cores']} CPU cores, "
              f"commit {commit}\n\n")
    tables = ["\n".join(table(r["title"], part_status(r), r.get("rows", []), r["columns"]))
              + "\n" for r in report["parts"].values()]
    write_atomically(out / "gpu.md", header + "\n".join(tables))
    return header + "\n".join(tables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (the suite)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, in order")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all parts")
    parser.add_argument("--jobs", type=int, default=1, help="parts at a time (dry run only)")
    args = parser.parse_args()
    names = args.parts.split(",")
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)} (choose from {', '.join(PARTS)})")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("torch sees no CUDA device: run on a GPU node, or pass --dry-run")
    if args.jobs != 1 and not args.dry_run:
        parser.error("--jobs: parts share a GPU only in the dry run (timings would mix)")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    (args.out / "parts").mkdir(exist_ok=True)
    report = {"machine": machine(), "provenance": provenance(invocation()),
              "tree_sha256": tree_digest(),  # the record's check where the node has no git
              "dry_run": args.dry_run, "budget_s": args.budget, "parts": {}}
    if args.jobs > 1:
        # each part's torch threads its share of the cores: more, and their spin-waits take
        # each other's cores (the dry run's sync part took 63 s beside another part, 8 s so)
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.jobs))
        with ThreadPoolExecutor(args.jobs) as pool:
            started = {pool.submit(reported, n, args.out, args.budget, args.dry_run): n
                       for n in names}
            for done in as_completed(started):
                report["parts"][started[done]] = done.result()
                write_report(report, args.out)
        report["parts"] = {n: report["parts"][n] for n in names}  # in the asked order
    else:
        shares = sum(PARTS[n].share for n in names)
        spare = 0.0
        for name in names:
            allowed = args.budget * PARTS[name].share / shares + spare
            report["parts"][name] = reported(name, args.out, allowed, args.dry_run)
            spare = max(0.0, allowed - report["parts"][name]["seconds"])
            write_report(report, args.out)
    print("\n" + write_report(report, args.out))
    sys.exit(0 if all(r["status"] == "ok" for r in report["parts"].values()) else 1)


if __name__ == "__main__":
    main()

"""The kit's parts that run whole commands or the data path:

- ``tests``: the CUDA-gated tests and the CUDA dry-run tests, with the GPU present;
- ``demo``: the demo pipeline, one process under torchrun, DDP over NCCL in bf16 (on CPU:
  gloo, fp32), without MLflow: make-shards, pretrain, evaluate from the checkpoint;
- ``fsdp2``: the same under ``engine.name=fsdp2`` (bf16 gathers, fp32 reductions), for the
  small CNN and for a hybrid-stem ViT sharded per block with activation checkpointing,
  each then resumed under DDP from its FSDP2 checkpoint and evaluated.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

from bench.gpu.sizes import Sizes
from bench.gpu.tree import kill_tree

REPO = Path(__file__).resolve().parents[2]
CUDA_TESTS = ["tests/pretrain/loop/test_cuda_dry_run.py", "tests/pretrain/loop/test_host_reads.py",
              "tests/evaluation/test_cuda_dry_run.py",
              "tests/data_pipeline/test_loader.py::test_loader_options_prefetch_and_pin_only_for_a_gpu",
              "tests/data_pipeline/dali"]
# the dry run: a few cases of each file, on CPU
DRY_RUN_SELECTION = ("(infonce and dense and not eps) or extract_on_cuda or catches_a_reduction "
                     "or pin_only")


def run_until(command: list[str], deadline: float, **kwargs: Any
              ) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, **kwargs)``, killed with
    every process below it (a torchrun agent with its ranks, pytest with its workers) if it
    is still running at ``deadline`` (``time.monotonic()``): then :class:`TimeoutError`, so
    the part stops within its own time."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, **kwargs)
    try:
        out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        out, err = process.communicate(timeout=60)
        print(out[-2000:], err[-2000:], flush=True)
        raise TimeoutError(f"{' '.join(command[1:4])} ran past the part's deadline") from None
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def junit_counts(report: Path) -> dict[str, Any]:
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {"tests": int(suite.get("tests", 0)), "failed": failed,
            "skipped": int(suite.get("skipped", 0))}


def tests(sizes: Sizes, device: torch.device, work: Path, deadline: float,
          dry_run: bool = False, **_: Any) -> dict[str, Any]:
    paths, notes = list(CUDA_TESTS), []
    if importlib.util.find_spec("nvidia.dali") is None:  # the rest of the folder runs
        notes.append("DALI not installed: its cases skipped")
    report = work / "tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
               "addopts=", f"--junitxml={report}", *paths]
    if dry_run:
        command += ["-k", DRY_RUN_SELECTION]
    elif importlib.util.find_spec("xdist") is not None:  # pytest-xdist, where the node has it
        command += ["-n", str(min(8, os.cpu_count() or 1))]
    start = time.perf_counter()
    result = run_until(command, deadline, cwd=REPO)
    print(result.stdout[-3000:], result.stderr[-2000:], flush=True)
    counts = junit_counts(report)
    row = {"tests": counts["tests"], "failed": len(counts["failed"]),
           "skipped": counts["skipped"], "seconds": time.perf_counter() - start,
           "cuda": torch.cuda.is_available(), "failures": "; ".join(counts["failed"][:20])}
    return {"rows": [row], "ok": result.returncode == 0,
            "summary": "; ".join([f"pytest exit {result.returncode}", *notes])}


def stage(args: list[str], log: Path, module: str, deadline: float,
          launcher: list[str] | None = None) -> str:
    # 4 torch threads a rank, or the part's share of the cores (``python -m bench.gpu --jobs``)
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    command = [*(launcher or [sys.executable]), "-m", module, *args]
    result = run_until(command, deadline, cwd=log.parent, env=env)
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}\n")
    if result.returncode:
        raise RuntimeError(f"{module} exited {result.returncode}: {result.stderr[-1500:]}")
    return result.stderr


def demo_shards(root: Path, sizes: Sizes) -> None:
    """The demo's training and test shards under ``root``, by the make-shards command's own
    ``main`` in this process (an interpreter for each split only adds its start-up)."""
    from app.make_shards import main as make_shards

    for split, samples in (("train", sizes.demo_samples), ("test", sizes.demo_samples // 4)):
        make_shards(["--config", str(REPO / "launch/configs/demo.yaml"), f"shards.split={split}",
                     f"shards.samples={samples}",
                     f"shards.output={root / 'data' / 'shards' / f'cluttered-{split}'}"])


def demo(sizes: Sizes, device: torch.device, work: Path, deadline: float, **_: Any
         ) -> dict[str, Any]:
    """The demo recipe without the class graph (the sentence model that builds it is too
    large to carry): SupCon on the cluttered digits, NCCL on a GPU."""
    root = work / "demo"
    root.mkdir(exist_ok=True)
    log = root / "demo.log"
    config = ["--config", str(REPO / "launch/configs/demo.yaml")]
    common = [*config, "tracking.enabled=false", "objective.name=supcon",
              "objective.xclr.class_graph="]
    demo_shards(root, sizes)
    start = time.perf_counter()
    train_log = stage([*common, f"train.max_steps={sizes.demo_steps}", "train.progress=false",
                       "engine.process_group=true",
                       f"train.log_every={max(1, sizes.demo_steps // 4)}"], log, "app.pretrain",
                      deadline, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node", "1"])
    train_s = time.perf_counter() - start
    stage([*common, "eval.index=exact", "eval.probe_epochs=10", "eval.compare_untrained=false",
           "eval.save_index=false"], log, "app.evaluate", deadline)
    results = json.loads(next((root / "runs").rglob("results.json")).read_text())
    setup = re.search(r"(\d+) ranks on (\S+), (\S+); backend (\S+)", train_log)
    rates = [float(r) for r in re.findall(r"images_per_s=([\d.]+)", train_log)]
    row = {"ranks": setup and int(setup[1]), "device": setup and setup[2],
           "precision": setup and setup[3], "backend": setup and setup[4],
           "steps": sizes.demo_steps, "train_s": train_s,
           "images_s": rates[-1] if rates else None,
           "knn_top1": knn_top1(results)}
    return {"rows": [row], "ok": setup is not None,
            "summary": f"train {train_s:.0f} s on {row['backend']}, kNN top-1 {row['knn_top1']}"}


FSDP2_MODELS = {"small_cnn": [],
                "vit_hybrid": ["model.backbone=timm:vit_tiny_patch16_224", "model.image_size=32",
                               "model.patch_size=4", "model.vit_stem=hybrid",
                               "model.activation_checkpointing=2"]}


def fsdp2(sizes: Sizes, device: torch.device, work: Path, deadline: float, rows: list,
          **_: Any) -> dict[str, Any]:
    """``engine.name=fsdp2`` on one process under torchrun (NCCL, bf16 on a GPU), then the
    run resumed under DDP for half as many steps again, and kNN from its checkpoint."""
    root = work / "fsdp2"
    root.mkdir(exist_ok=True)
    log = root / "fsdp2.log"
    config = ["--config", str(REPO / "launch/configs/demo.yaml")]
    common = [*config, "tracking.enabled=false", "objective.name=supcon",
              "objective.xclr.class_graph=", "train.progress=false", "engine.process_group=true",
              f"train.log_every={max(1, sizes.demo_steps // 4)}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "1"]
    demo_shards(root, sizes)
    for name in sizes.fsdp2_models:
        run = [*common, *FSDP2_MODELS[name], f"name={name}"]
        start = time.perf_counter()
        sharded = stage([*run, "engine.name=fsdp2", f"train.max_steps={sizes.demo_steps}"],
                        log, "app.pretrain", deadline, torchrun)
        train_s = time.perf_counter() - start
        resumed = stage([*run, "engine.name=ddp",
                         f"train.max_steps={sizes.demo_steps * 3 // 2}"], log,
                        "app.pretrain", deadline, torchrun)
        stage([*run, "eval.index=exact", "eval.probe_epochs=10",
               "eval.compare_untrained=false", "eval.save_index=false",
               f"eval.output=runs/{name}/eval"], log, "app.evaluate", deadline)
        results = json.loads((root / "runs" / name / "eval" / "results.json").read_text())
        setup = re.search(r"(\d+) ranks on (\S+), (\S+); backend (\S+)", sharded)
        losses = [float(v) for v in re.findall(r" loss=([\d.e+-]+)", sharded + resumed)]
        rows.append({"model": name, "precision": setup and setup[3],
                     "backend": setup and setup[4], "steps": sizes.demo_steps,
                     "train_s": train_s,
                     "resumed": f"at step {sizes.demo_steps}" in resumed,
                     "first_loss": losses[0] if losses else None,
                     "last_loss": losses[-1] if losses else None,
                     "knn_top1": knn_top1(results)})
    ok = all(row["resumed"] and row["knn_top1"] is not None for row in rows)
    return {"rows": rows, "ok": ok,
            "summary": "; ".join(f"{r['model']}: kNN {r['knn_top1']}" for r in rows)}


def knn_top1(results: dict[str, Any]) -> float | None:
    """The backbone's best weighted-kNN top-1 in an ``evaluate`` results.json."""
    found = [value for key, value in _flat(results) if "knn" in key and key.endswith("top1")]
    return max(found) if found else None


def _flat(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _flat(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), value)] if isinstance(value, int | float) else []

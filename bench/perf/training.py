"""Training throughput and the cost of X-CLR's soft targets.

    python -m bench.perf.training                      # both parts
    python -m bench.perf.training --part step          # X-CLR vs SimCLR step time only

Part ``throughput``: the real ``pretrain`` command on the digits shards (32 px, 64 images
per rank, SimCLR) for 1 process and for 2 processes (torchrun, DDP over gloo), with the
small CNN, ResNet-18 and a timm ViT-Tiny at patch 4 (64 tokens); images/s (augmented
views through the encoder, all ranks) from the run's own monitor, first window dropped as
warm-up.

Part ``step``: one whole training step (forward, global batch, objective, backward, LARS
update) timed interleaved in this process for SimCLR (infonce), X-CLR with a class graph
and X-CLR with 384-d caption embeddings, on the same model and batch. Target: X-CLR at
most 2% slower than SimCLR (the paper: 0.3%).

Part ``text``: CLIP's text tower (forward, and backward into its projection) on a batch
of 2B views whose views share their captions (B distinct captions, as training sees it:
the loader says so and the tower encodes each once) against 2B distinct captions, the work
a tower that encodes every view's caption does.

Part ``compile``: one training step (forward, global batch, infonce, backward) of the small
CNN and of timm's ``test_vit`` at patch 4, eager against the encoder compiled by
``torch.compile`` (``train.compile``): the first step's seconds (the compilation) and the
median steady-state step, each model built afresh from the same seed.

Part ``ledger``: the cost of ``data.ledger=true``: one training step of the small CNN
(SimCLR, the ``step`` part's batch) timed interleaved against the same step that also
records its batch's sample keys in an epoch ledger and appends them to its file at once
(the ledger buffers lines to every report; a flush per step is its most expensive setting).
Target: at most 1.02x.

Writes bench/results/training.json and prints tables; ``--record`` also writes
``bench/records/perf/training.json``, whose views (one per part) docs/benchmarks.md shows.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, print_table, time_interleaved, write_json
from bench.records import invocation, provenance, source_line, write_record
from pretrain.distributed.engine import DDPEngine, EngineConfig
from pretrain.loop.optim import OptimConfig, build_optimizer
from pretrain.loop.step import Objective, model_inputs
from pretrain.loop.trainer import forward_loss
from pretrain.model.encoder import ModelConfig, build_model
from pretrain.objectives import ObjectiveConfig

RESULTS = Path("bench/results/training.json")
NAME = "perf/training"
RENDERER = "bench.perf.training"  # this module, by the name a record imports it
MAX_XCLR_VS_SIMCLR = 1.02  # the targets: X-CLR's step against SimCLR's,
MAX_LEDGER_RATIO = 1.02  # and a step that keeps the ledger against one that does not
WORDS = {"small_cnn": "small CNN", "resnet18": "ResNet-18", "vit_tiny_p4": "ViT-Tiny/4",
         "timm:test_vit": "timm `test_vit`"}
REPO = Path(__file__).resolve().parents[2]


def make_shards(directory: Path) -> Path:
    shards = directory / "digits"
    subprocess.run([sys.executable, "-m", "app.make_shards", "shards.source=digits",
                    f"shards.output={shards}", "shards.shard_size=300"], check=True, cwd=REPO,
                   capture_output=True)
    return shards


# the rows of the throughput part: a label -> model overrides
BACKBONES = {
    "small_cnn": ["model.backbone=small_cnn"],
    "resnet18": ["model.backbone=resnet18"],
    "vit_tiny_p4": ["model.backbone=timm:vit_tiny_patch16_224", "model.patch_size=4"],
}


def run_throughput(shards: Path, out: Path, backbone: str, nproc: int, steps: int) -> float:
    overrides = [f"output_dir={out}", f"name={backbone}-{nproc}", f"data.shards={shards}",
                 "data.batch_size=64", "data.resolution=32", f"data.workers={2 // nproc}",
                 *BACKBONES[backbone], "objective.name=infonce",
                 f"train.max_steps={steps}", f"train.log_every={steps // 4}",
                 "train.progress=false", "tracking.enabled=false", "checkpoint.every=0"]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", str(nproc), "-m", "app.pretrain"] if nproc > 1 else
                [sys.executable, "-m", "app.pretrain"])
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, os.cpu_count() // nproc))}
    result = subprocess.run([*launcher, *overrides], cwd=REPO, env=env, capture_output=True,
                            text=True)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    rates = [float(m) for m in re.findall(r"images_per_s=([\d.]+)", result.stderr)]
    return sum(rates[1:]) / len(rates[1:])


def throughput(steps: int, backbones: list[str]) -> list[dict]:
    """Images/s of each backbone on 1 and 2 processes; ``vs_small_cnn`` against the small
    CNN's single process in the same invocation (when it is among ``backbones``)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shards = make_shards(Path(tmp))
        for backbone in backbones:
            n = steps if backbone == "small_cnn" else max(8, steps // 4)
            single = run_throughput(shards, Path(tmp) / "runs", backbone, 1, n)
            double = run_throughput(shards, Path(tmp) / "runs", backbone, 2, n)
            rows.append({"backbone": backbone, "steps": n, "images_s_1proc": single,
                         "images_s_2proc": double, "ratio_2_over_1": double / single})
    base = next((r["images_s_1proc"] for r in rows if r["backbone"] == "small_cnn"), None)
    for row in rows:
        row["vs_small_cnn"] = row["images_s_1proc"] / base if base else float("nan")
    return rows


def step_cases(batch_images: int, backbone: str) -> dict:
    torch.manual_seed(0)
    views = 2 * batch_images
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 100, (batch_images,), generator=gen).repeat(2)
    batch = {"images": torch.randn(views, 3, 32, 32, generator=gen),
             "ids": torch.arange(batch_images).repeat(2), "labels": labels,
             "caption_embeddings": torch.randn(batch_images, 384, generator=gen).repeat(2, 1)}
    graph = torch.nn.functional.normalize(torch.randn(100, 64, generator=gen), dim=1)
    graph = graph @ graph.T
    cases = {}
    for label, name, class_graph, captions in (
            ("simclr", "infonce", None, False), ("xclr_class_graph", "xclr", graph, False),
            ("xclr_captions", "xclr", None, True)):
        cfg = ObjectiveConfig(name=name)
        model = build_model(ModelConfig(backbone=backbone), cfg, torch.device("cpu"))
        engine = DDPEngine(model, build_optimizer(model, OptimConfig(), views), EngineConfig(),
                           torch.device("cpu"))
        objective = Objective(cfg, class_graph)
        inputs = dict(batch) if captions else {k: v for k, v in batch.items()
                                               if k != "caption_embeddings"}

        def step(engine=engine, objective=objective, inputs=inputs):
            out = forward_loss(engine, inputs, objective, 0)
            engine.backward(out.loss)
            engine.step()

        cases[label] = step
    return cases


def step_times(batch_images: int, rounds: int) -> list[dict]:
    rows = []
    for backbone in ("small_cnn", "resnet18"):
        times = time_interleaved(step_cases(batch_images, backbone), rounds)
        for label, seconds in times.items():
            rows.append({"backbone": backbone, "objective": label, "batch": batch_images,
                         "step_s": seconds, "vs_simclr": seconds / times["simclr"]})
    return rows


def ledger_times(batch_images: int, rounds: int) -> list[dict]:
    from data_pipeline.loader.ledger import LedgerWriter

    step = step_cases(batch_images, "small_cnn")["simclr"]
    keys = [f"cc12m_train_{i:08d}" for i in range(batch_images)]  # CC12M-sized names
    applied = torch.tensor(True)
    with tempfile.TemporaryDirectory() as run_dir:
        ledger = LedgerWriter(Path(run_dir), "bench", 0, 1)
        ledger.start(0)

        steps = itertools.count(1)

        def with_ledger() -> None:
            step()
            ledger.record(0, next(steps), {"keys": keys}, applied)
            ledger.flush()

        times = time_interleaved({"step": step, "step_with_ledger": with_ledger}, rounds)
        ledger.close()
    return [{"batch": batch_images, "step_s": times["step"],
             "with_ledger_s": times["step_with_ledger"],
             "ratio": times["step_with_ledger"] / times["step"]}]


def text_tower_times(batch_images: int, rounds: int) -> list[dict]:
    from data_pipeline.text import load_tokenizer, tokenize
    from pretrain.model.text_tower import TextTower, TextTowerConfig

    torch.manual_seed(0)
    tower = TextTower(TextTowerConfig(), 128)
    tokenizer = load_tokenizer("bundled")
    captions = [f"a small red digit {i} on a blue background, top left"
                for i in range(2 * batch_images)]
    shared = {**tokenize(tokenizer, captions[:batch_images] * 2, 32),
              "text_repeated": True}  # the views share captions, as the loader marks it
    batches = {"shared_by_views": shared, "one_per_view": tokenize(tokenizer, captions, 32)}

    def case(tokens: dict) -> Callable[[], None]:
        def run() -> None:  # the step's own choice of rows (model_inputs), then the tower
            _, ids, mask, repeats = model_inputs({"images": torch.empty(0), **tokens})
            tower(ids, mask).repeat(repeats, 1).sum().backward()
        return run

    times = time_interleaved({k: case(v) for k, v in batches.items()}, rounds)
    return [{"rows": 2 * batch_images, "captions": label, "step_s": seconds,
             "vs_one_per_view": seconds / times["one_per_view"]}
            for label, seconds in times.items()]


COMPILE_BACKBONES = {"small_cnn": {"width": 32},
                     "timm:test_vit": {"backbone": "timm:test_vit", "patch_size": 4}}


def compile_times(batch_images: int, rounds: int) -> list[dict]:
    cfg = ObjectiveConfig(name="infonce", temperature=0.2)
    gen = torch.Generator().manual_seed(1)
    batch = {"images": torch.randn(2 * batch_images, 3, 32, 32, generator=gen),
             "ids": torch.arange(batch_images).repeat(2)}
    objective = Objective(cfg)
    rows = []
    for name, model_keys in COMPILE_BACKBONES.items():
        eager = None
        for compiled in (False, True):
            torch.manual_seed(0)
            model = build_model(ModelConfig(**model_keys), cfg, torch.device("cpu"))
            if compiled:
                model.encoder.compile()

            def run(model=model) -> None:
                model.zero_grad(set_to_none=True)
                forward_loss(model, batch, objective, 0).loss.backward()

            start = time.perf_counter()
            run()
            first = time.perf_counter() - start
            steady = time_interleaved({"step": run}, rounds)["step"]
            eager = steady if not compiled else eager
            rows.append({"backbone": name, "compiled": compiled, "first_step_s": first,
                         "step_s": steady, "vs_eager": steady / eager})
            print(f"  {name} compiled={compiled}: first {first:.1f} s, step {steady:.3f} s",
                  flush=True)
    return rows


def render_parts(record: dict[str, Any]) -> list[str]:
    """The source, then each part the record holds: the step table and its target, the
    throughput, compile, text tower and ledger bullets."""
    got = record["figures"]
    lines = [source_line(record), ""]
    if "step" in got:
        lines += [*_step_lines(got["step"], got["rounds"]), ""]
    for part, bullet in (("throughput", _throughput_line), ("compile", _compile_line),
                         ("text", _text_line), ("ledger", _ledger_line)):
        if part in got:
            lines.append(bullet(got[part]))
    return lines[:-1] if lines[-1] == "" else lines


def _step_lines(rows: list[dict], rounds: int) -> list[str]:
    by = {(r["backbone"], r["objective"]): r for r in rows}
    backbones = list(dict.fromkeys(r["backbone"] for r in rows))
    worst = {b: max(by[b, "xclr_class_graph"]["vs_simclr"], by[b, "xclr_captions"]["vs_simclr"])
             for b in backbones}
    verdicts = [f"**{'met' if w <= MAX_XCLR_VS_SIMCLR else 'not met'}** with {WORDS[b]}"
                for b, w in worst.items()]
    return [f"One training step (forward, global batch, objective, backward, LARS), "
            f"{rows[0]['batch']} images x 2 views, median of {rounds} interleaved rounds:", "",
            "| backbone | SimCLR step s | X-CLR class graph / SimCLR | X-CLR 384-d captions / "
            "SimCLR |", "| --- | --- | --- | --- |",
            *(f"| {WORDS[b]} | {by[b, 'simclr']['step_s']:.3f} | "
              f"{by[b, 'xclr_class_graph']['vs_simclr']:.3f} | "
              f"{by[b, 'xclr_captions']['vs_simclr']:.3f} |" for b in backbones),
            "", f"Target, X-CLR at most {MAX_XCLR_VS_SIMCLR}x SimCLR's step: "
            f"{', '.join(verdicts)}."]


def _throughput_line(rows: list[dict]) -> str:
    return ("- Throughput of the real `pretrain` command (digits, 32 px, 64 images a rank): "
            + "; ".join(f"{WORDS[r['backbone']]} {r['images_s_1proc']:.1f} views/s on 1 "
                        f"process, {r['images_s_2proc']:.1f} on 2 ({r['ratio_2_over_1']:.2f}x)"
                        for r in rows)
            + ". On 2 cores a second process adds no compute: this measures the distributed "
              "path's overhead.")


def _compile_line(rows: list[dict]) -> str:
    return "- `train.compile`: " + ", ".join(
        f"{WORDS[r['backbone']]} step {r['vs_eager']:.2f}x eager after "
        f"{r['first_step_s']:.0f} s of compilation" for r in rows if r["compiled"]) + \
        " (off by default)."


def _text_line(rows: list[dict]) -> str:
    by = {r["captions"]: r for r in rows}
    n = by["shared_by_views"]["rows"]
    return (f"- CLIP's text tower: {n} rows whose two views share {n // 2} captions take "
            f"{by['shared_by_views']['vs_one_per_view']:.3f}x the time of {n} distinct "
            "captions: each distinct caption is encoded once.")


def _ledger_line(rows: list[dict]) -> str:
    row = rows[0]
    met = row["ratio"] <= MAX_LEDGER_RATIO
    return (f"- `data.ledger`: a step that also appends its {row['batch']} keys at once takes "
            f"**{row['ratio']:.3f}x** (target <= {MAX_LEDGER_RATIO}x, "
            f"{'met' if met else 'not met'}).")


VIEWS = {"parts": render_parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "throughput", "step", "text", "compile",
                                           "ledger"],
                        default="all")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=256, help="images per step (x2 views)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--backbones", default=",".join(BACKBONES),
                        help=f"throughput rows, of {', '.join(BACKBONES)}")
    parser.add_argument("--record", action="store_true",
                        help=f"also write bench/records/{NAME}.json")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    payload = {"machine": machine()}
    if args.part in ("all", "throughput"):
        payload["throughput"] = throughput(args.steps, args.backbones.split(","))
        print_table(payload["throughput"], ["backbone", "steps", "images_s_1proc",
                                            "images_s_2proc", "ratio_2_over_1",
                                            "vs_small_cnn"])
    if args.part in ("all", "step"):
        payload["step"] = step_times(args.batch, args.rounds)
        print_table(payload["step"], ["backbone", "objective", "batch", "step_s", "vs_simclr"])
    if args.part in ("all", "text"):
        payload["text"] = text_tower_times(args.batch, args.rounds)
        print_table(payload["text"], ["rows", "captions", "step_s", "vs_one_per_view"])
    if args.part in ("all", "compile"):
        payload["compile"] = compile_times(args.batch, args.rounds)
        print_table(payload["compile"], ["backbone", "compiled", "first_step_s", "step_s",
                                         "vs_eager"])
    if args.part in ("all", "ledger"):
        payload["ledger"] = ledger_times(args.batch, args.rounds)
        print_table(payload["ledger"], ["batch", "step_s", "with_ledger_s", "ratio"])
    write_json(RESULTS, payload)
    if args.record:
        figures = {k: v for k, v in payload.items() if k != "machine"} | {"rounds": args.rounds}
        print(f"record: {write_record(NAME, seen, RENDERER, figures)}")


if __name__ == "__main__":
    main()

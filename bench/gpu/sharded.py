"""The kit's part ``sharded``: the project's training step under ``engine.name=fsdp2`` in a
one-process group (NCCL on a GPU, gloo on CPU):

- every objective case, dense, under ``torch.cuda.set_sync_debug_mode`` (as the ``sync``
  part does for DDP): each synchronising CUDA call of an FSDP2 step, by project line;
- the ViT-L recipes' model, objective, optimiser, engine and precision
  (``launch/configs/*_vitl.yaml``) at their per-GPU batch of 224 px images, with and
  without activation checkpointing: images/s and the peak GPU memory of a step.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.gpu.sizes import Sizes
from bench.gpu.steps import (
    CLASSES,
    OBJECTIVE_CASES,
    case_name,
    counted_synchronisations,
    past,
    project_trainer,
    synthetic_batch,
    timed,
)
from core.config import load_config
from pretrain.distributed.engine import EngineConfig
from pretrain.model.encoder import ModelConfig
from pretrain.model.text_tower import TextTowerConfig, random_text_model
from pretrain.objectives import ObjectiveConfig, objective_spec

REPO = Path(__file__).resolve().parents[2]
FSDP2 = EngineConfig(name="fsdp2")


def one_process_group(device: torch.device) -> None:
    """The group FSDP2 shards over: this process alone."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)


def sync_rows(sizes: Sizes, device: torch.device, work: Path, text_dir: str,
              recorded: list, deadline: float) -> list[dict]:
    graph = torch.rand(CLASSES, CLASSES, device=device)
    rows = []
    for name, keys, with_graph in OBJECTIVE_CASES:
        if past(deadline):
            break
        spec = objective_spec(name)
        objective = ObjectiveConfig.of(name, learnable_temperature=spec.text_tower, **keys)
        model_cfg = ModelConfig(width=16, projector_hidden=64, projector_dim=32,
                                text=TextTowerConfig(model=text_dir))
        with tempfile.TemporaryDirectory(dir=work) as run_dir:
            trainer = project_trainer(model_cfg, objective, sizes.sync_images, device,
                                      Path(run_dir), graph if with_graph else None,
                                      engine_cfg=FSDP2)
            found = counted_synchronisations(trainer, sizes, spec, with_graph, device)
        rows.append({"case": case_name(name, keys, with_graph), "checkpointing": "",
                     "synchronisations": len(found), "where": "; ".join(sorted(set(found)))})
        recorded.append(rows[-1])
        print(f"  fsdp2 {rows[-1]['case']}: {len(found)} synchronisations", flush=True)
    return rows


def recipe_rows(sizes: Sizes, device: torch.device, work: Path, text_dir: str,
                recorded: list, deadline: float) -> list[dict]:
    from app.run_config import RunConfig

    rows = []
    for recipe in sizes.sharded_recipes:
        if past(deadline):
            break
        cfg = load_config(RunConfig, REPO / "launch" / "configs" / f"{recipe}.yaml")
        spec = objective_spec(cfg.objective.name)
        objective = dataclasses.replace(cfg.objective, xclr=dataclasses.replace(
            cfg.objective.xclr, class_graph=""))  # the graph is handed over below
        graph = torch.rand(CLASSES, CLASSES, device=device) if cfg.objective.xclr.class_graph \
            else None
        images = sizes.sharded_images or cfg.data.batch_size
        settings = [("none", False), (cfg.model.activation_checkpointing, False)]
        if sizes.sharded_compile and recipe == sizes.sharded_recipes[0]:
            settings.append((cfg.model.activation_checkpointing, True))  # train.compile
        for checkpointing, compiled in settings:
            model_cfg = dataclasses.replace(
                cfg.model, activation_checkpointing=checkpointing,
                text=dataclasses.replace(cfg.model.text, model=text_dir),
                **sizes.sharded_model)
            batch = synthetic_batch(images, model_cfg.image_size, device, text=spec.text_tower)
            with tempfile.TemporaryDirectory(dir=work) as run_dir:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                trainer = project_trainer(model_cfg, objective, images, device, Path(run_dir),
                                          graph, engine_cfg=cfg.engine, optim_cfg=cfg.optim,
                                          precision=cfg.train.precision,
                                          compile_encoder=compiled)
                first, seconds, failure = timed_or_failure(trainer, batch, sizes.step_steps,
                                                           device)
                peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
                del trainer
            rows.append({"case": recipe + (" compiled" if compiled else ""),
                         "checkpointing": checkpointing, "views": 2 * images,
                         "images_s": seconds and 2 * images / seconds, "step_s": seconds,
                         "first_step_s": first, "peak_gib": peak / 2**30,
                         "where": failure})
            recorded.append(rows[-1])
            print(f"  {rows[-1]['case']} checkpointing={checkpointing}: "
                  f"{rows[-1]['images_s']} views/s, peak {peak / 2**30:.1f} GiB {failure}",
                  flush=True)
    return rows


def timed_or_failure(trainer: Any, batch: dict[str, Any], steps: int, device: torch.device
                     ) -> tuple[float | None, float | None, str]:
    """(first step s, median step s, "") of ``trainer`` on ``batch``, or (None, None, the
    failure's first line): out of memory, or a compilation that fails."""
    try:
        first, seconds = timed(functools.partial(trainer.train_step, batch), steps, device)
    except Exception as err:  # reported in the table, not raised: the next rows still run
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        return None, None, f"{type(err).__name__}: {' '.join(lines[:3])[:300]}"
    return first, seconds, ""


def sharded(sizes: Sizes, device: torch.device, work: Path, deadline: float, rows: list,
            **_: Any) -> dict[str, Any]:
    one_process_group(device)
    text_dir = random_text_model(work / "random-text-model")
    syncs = sync_rows(sizes, device, work, text_dir, rows, deadline)
    recipe_rows(sizes, device, work, text_dir, rows, deadline)
    ours = sum(r["where"].count(".py:") for r in syncs)
    return {"rows": rows, "ok": ours == 0,
            "summary": f"{sum(r['synchronisations'] for r in syncs)} synchronising calls in "
                       f"{len(syncs)} FSDP2 steps' cases, {ours} at a line of the project"
                       + ("" if device.type == "cuda" else " (CPU: not checked)")}

"""The kit's parts that drive the project's own training step (``Trainer.train_step``) on
synthetic batches already on the device:

- ``sync``: every objective case, dense, tiled and in cached-gradient chunks, under
  ``torch.cuda.set_sync_debug_mode``: each synchronising CUDA call the step makes is
  named by the line of the project that made it (0 is the target);
- ``step``: images/s of the project's step against a plain torch loop of the same model
  (forward, InfoNCE, backward, optimiser step), and the TFLOP/s each achieves;
- ``compile``: the step with the encoder compiled (``train.compile``) against eager.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from bench.gpu.sizes import Sizes
from core.runtime import Runtime, resolve_precision
from pretrain.distributed.engine import EngineConfig, build_engine, engine_spec
from pretrain.loop.optim import OptimConfig, build_optimizer, warmup_cosine_in_samples
from pretrain.loop.step import Objective
from pretrain.loop.trainer import RunLength, TrainConfig, Trainer
from pretrain.loop.utilisation import device_peak_tflops
from pretrain.model.encoder import ModelConfig, build_model
from pretrain.model.flops import Flops
from pretrain.model.text_tower import TextTowerConfig, random_text_model
from pretrain.objectives import OBJECTIVES, ObjectiveConfig, objective_spec
from pretrain.run.checkpoint import CheckpointConfig, Checkpointer

REPO = Path(__file__).resolve().parents[2]
CLASSES = 10
CAPTION_DIM = 32
TEXT_TOKENS = 8
# (objective name, objective.* keys, a class graph) of every case the sync part runs
# (every entry of the table under each of its examples; soft targets from both sources)
OBJECTIVE_CASES: list[tuple[str, dict[str, Any], bool]] = [
    (name, dict(example), graph) for name, spec in OBJECTIVES.items()
    for example in spec.examples
    for graph in ((True, False) if spec.soft_targets else (False,))]


def case_name(name: str, keys: dict[str, Any], graph: bool) -> str:
    extra = ["class_graph"] if graph else [f"{v}" for v in keys.values()]
    if name == "xclr" and not graph:
        extra = ["captions"]
    return f"{name}[{','.join(extra)}]" if extra else name


def synthetic_batch(images: int, resolution: int, device: torch.device, captions: bool = False,
                    text: bool = False) -> dict[str, Any]:
    """Two views of ``images`` images with labels, and (``captions``) caption embeddings
    and (``text``) caption tokens shared by both views, as the loader hands them over, on
    ``device``."""
    gen = torch.Generator().manual_seed(images)
    rows = 2 * images
    labels = torch.randint(0, CLASSES, (images,), generator=gen).repeat(2)
    batch = {"images": torch.randn(rows, 3, resolution, resolution, generator=gen),
             "ids": torch.arange(images).repeat(2), "labels": labels}
    if captions:
        batch["caption_embeddings"] = torch.randn(images, CAPTION_DIM, generator=gen
                                                  ).repeat(2, 1)
    if text:
        batch["input_ids"] = torch.randint(1, 128, (images, TEXT_TOKENS), generator=gen
                                           ).repeat(2, 1)
        batch["attention_mask"] = torch.ones(rows, TEXT_TOKENS, dtype=torch.long)
        batch["text_repeated"] = True
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def project_trainer(model_cfg: ModelConfig, objective: ObjectiveConfig, images: int,
                    device: torch.device, run_dir: Path, graph: torch.Tensor | None = None,
                    chunk_size: int = 0, engine_cfg: EngineConfig | None = None,
                    optim_cfg: OptimConfig | None = None, precision: str = "auto",
                    compile_encoder: bool = False) -> Trainer:
    """The trainer a one-process run builds (``app.pretrain.build_trainer``), with no
    loader, checkpoints, tracking or periodic report inside the steps it is handed (an
    engine that shards, FSDP2, needs the process group its caller made)."""
    torch.manual_seed(0)
    engine_cfg = engine_cfg or EngineConfig()
    precision = resolve_precision(precision, device)
    model = build_model(model_cfg, objective, device, CLASSES)
    if compile_encoder:  # as app.pretrain does (train.compile): before the engine's changes
        model.encoder.compile()
    engine_spec(engine_cfg.name).prepare(model, engine_cfg, precision)
    optimizer = build_optimizer(model, optim_cfg or OptimConfig(), images)
    engine = build_engine(model, optimizer, engine_cfg, device, 2 * images)
    train = TrainConfig(log_every=10**6, progress=False, chunk_size=chunk_size)
    return Trainer(train, engine=engine,
                   objective=Objective(objective, graph, CLASSES, 2 * images), loader=None,
                   checkpointer=Checkpointer(run_dir, CheckpointConfig(every=0), 0, 1, device,
                                             images),
                   schedule=warmup_cosine_in_samples(10**6 * images, images, 10),
                   length=RunLength(images, 10**6 * images, max_steps=10**6),
                   runtime=Runtime(0, 1, 0, device), precision=precision)


def past(deadline: float) -> bool:
    """Whether the part's deadline has come (said in its log): its loop stops there, and
    the rows so far are its result."""
    if time.monotonic() < deadline:
        return False
    print("  the part's deadline has come: stopping with the rows so far", flush=True)
    return True


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def project_line() -> str:
    """``file:line`` of the innermost frame of the project's package code on the stack."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if REPO in path.parents and "bench" not in path.relative_to(REPO).parts[:1] \
                and "site-packages" not in path.parts:
            return f"{path.relative_to(REPO)}:{frame.lineno} ({frame.name})"
    return "outside the project"


@contextlib.contextmanager
def synchronisations(device: torch.device) -> Iterator[list[str]]:
    """Lists, by the project line that made it, each CUDA call in the body that makes the
    host wait for the device. ``set_sync_debug_mode("warn")`` rather than ``"error"``, so
    that every one is named, not only the first; a no-op on CPU."""
    found: list[str] = []
    if device.type != "cuda":
        yield found
        return
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None) -> None:
            if "synchroniz" in str(message):
                found.append(project_line())
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown


def counted_synchronisations(trainer: Trainer, sizes: Sizes, spec: Any, with_graph: bool,
                             device: torch.device) -> list[str]:
    """The synchronising calls of ``sizes.sync_steps`` steps of ``trainer`` on a batch the
    objective ``spec`` takes, after two uncounted ones."""
    batch = synthetic_batch(sizes.sync_images, sizes.sync_resolution, device,
                            captions=spec.soft_targets and not with_graph, text=spec.text_tower)
    for _ in range(2):
        trainer.train_step(batch)
    synchronize(device)
    with synchronisations(device) as found:
        for _ in range(sizes.sync_steps):
            trainer.train_step(batch)
        synchronize(device)  # outside the steps: not one of theirs
    return found


def sync_variants(sizes: Sizes) -> dict[str, dict[str, Any]]:
    rows = 2 * sizes.sync_images
    return {"dense": {}, "tiled": {"tile_size": max(2, rows // 4)},
            "chunked": {"chunk_size": max(2, rows // 4)}}


def sync(sizes: Sizes, device: torch.device, work: Path, deadline: float, rows: list,
         **_: Any) -> dict[str, Any]:
    """Every objective case and variant: two steps uncounted, then ``sync_steps`` steps
    whose synchronising calls are listed."""
    text_dir = random_text_model(work / "random-text-model")
    graph = torch.rand(CLASSES, CLASSES, device=device)
    for name, keys, with_graph in OBJECTIVE_CASES:
        spec = objective_spec(name)
        if past(deadline):
            break
        for variant, options in sync_variants(sizes).items():
            objective = ObjectiveConfig.of(name, learnable_temperature=spec.text_tower,
                                           tile_size=options.get("tile_size"), **keys)
            model_cfg = ModelConfig(width=16, projector_hidden=64, projector_dim=32,
                                    text=TextTowerConfig(model=text_dir))
            with tempfile.TemporaryDirectory(dir=work) as run_dir:
                trainer = project_trainer(model_cfg, objective, sizes.sync_images, device,
                                          Path(run_dir), graph if with_graph else None,
                                          options.get("chunk_size", 0))
                found = counted_synchronisations(trainer, sizes, spec, with_graph, device)
            rows.append({"objective": case_name(name, keys, with_graph), "variant": variant,
                         "steps": sizes.sync_steps, "synchronisations": len(found),
                         "where": "; ".join(sorted(set(found)))})
            print(f"  {rows[-1]['objective']} {variant}: {len(found)} synchronisations",
                  flush=True)
    total = sum(r["synchronisations"] for r in rows)
    ours = sum(r["where"].count(".py:") for r in rows)  # distinct project lines per case
    return {"rows": rows, "ok": ours == 0,
            "summary": f"{total} synchronising calls in {len(rows)} cases, "
                       f"{ours} at a line of the project"
                       + ("" if device.type == "cuda" else " (CPU: not checked)")}


def plain_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               precision: str) -> Callable[[torch.Tensor], None]:
    """A plain torch training step of the same encoder: forward under autocast, InfoNCE
    on the two views written out, backward, optimiser step."""
    def step(images: torch.Tensor) -> None:
        with torch.autocast(images.device.type, torch.bfloat16, enabled=precision == "bf16"):
            _, z = model.encoder(images)
        z = F.normalize(z.float(), dim=1)
        n = z.shape[0]
        logits = (z @ z.T / 0.1).fill_diagonal_(float("-inf"))
        targets = torch.arange(n, device=z.device).roll(n // 2)
        F.cross_entropy(logits, targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def timed(step: Callable[[], None], steps: int, device: torch.device) -> tuple[float, float]:
    """(first call's seconds, median seconds of ``steps`` more after two uncounted)."""
    start = time.perf_counter()
    step()
    synchronize(device)
    first = time.perf_counter() - start
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def step_flops(model: torch.nn.Module, images: torch.Tensor, precision: str) -> Flops:
    """Floating-point operations of one forward and backward of the encoder on ``images``
    (torch's flop counter: matrix products and convolutions), all views together."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.autocast(images.device.type, torch.bfloat16,
                                 enabled=precision == "bf16"):
        _, z = model.encoder(images)
        z.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return Flops.counted(counter, views=1)


def step(sizes: Sizes, device: torch.device, work: Path, deadline: float, rows: list,
         **_: Any) -> dict[str, Any]:
    """Each backbone at ``step_resolution``: the project's step and the plain loop."""
    for backbone in sizes.step_backbones:
        if past(deadline):
            break
        model_cfg = ModelConfig(backbone=backbone, small_stem=False,
                                image_size=sizes.step_resolution)
        objective = ObjectiveConfig(name="infonce")
        batch = synthetic_batch(sizes.step_images, sizes.step_resolution, device)
        views = 2 * sizes.step_images
        with tempfile.TemporaryDirectory(dir=work) as run_dir:
            trainer = project_trainer(model_cfg, objective, sizes.step_images, device,
                                      Path(run_dir))
            _, ours = timed(functools.partial(trainer.train_step, batch), sizes.step_steps,
                            device)
            precision = trainer.precision
            flops = step_flops(trainer.model, batch["images"], precision)
            del trainer
        torch.manual_seed(0)
        model = build_model(model_cfg, objective, device, CLASSES)
        optimizer = build_optimizer(model, OptimConfig(), sizes.step_images)
        plain = plain_loop(model, optimizer, precision)
        _, theirs = timed(functools.partial(plain, batch["images"]), sizes.step_steps, device)
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
        peak = device_peak_tflops(device, precision, flops)
        rows.append({"backbone": backbone, "precision": precision, "views": views,
                     "images_s": views / ours, "plain_images_s": views / theirs,
                     "vs_plain": theirs / ours, "tflops": flops.total / ours / 1e12,
                     "plain_tflops": flops.total / theirs / 1e12,
                     "mfu": flops.total / ours / 1e12 / peak if peak else None})
        print(f"  {backbone}: {views / ours:.0f} views/s, plain {views / theirs:.0f}",
              flush=True)
    return {"rows": rows, "ok": True,
            "summary": "views/s of the project's step and a plain loop (images_s counts "
                       "views); TFLOP/s of the encoder's matrix products and convolutions, "
                       "and MFU against the device's dense peak (pretrain/loop/utilisation.py)"}


def compiled(sizes: Sizes, device: torch.device, work: Path, deadline: float, rows: list,
             **_: Any) -> dict[str, Any]:
    """``train.compile``: the step with the encoder compiled in place, against eager."""
    eager = None
    backbone = sizes.compile_backbone
    model_cfg = ModelConfig(backbone=backbone, small_stem=False, image_size=sizes.step_resolution)
    batch = synthetic_batch(sizes.step_images, sizes.step_resolution, device)
    for compile_encoder in (False, True):
        if past(deadline):
            break
        with tempfile.TemporaryDirectory(dir=work) as run_dir:
            trainer = project_trainer(model_cfg, ObjectiveConfig(name="infonce"),
                                      sizes.step_images, device, Path(run_dir))
            if compile_encoder:
                trainer.model.encoder.compile(backend=sizes.compile_backend)
            first, median = timed(functools.partial(trainer.train_step, batch),
                                  sizes.step_steps, device)
            del trainer
        eager = median if eager is None else eager
        rows.append({"backbone": backbone, "compiled": compile_encoder,
                     "backend": sizes.compile_backend if compile_encoder else "eager",
                     "first_step_s": first, "step_s": median, "vs_eager": median / eager})
        print(f"  {backbone} compiled={compile_encoder}: first {first:.1f} s, "
              f"step {median * 1e3:.1f} ms", flush=True)
    if len(rows) < 2:
        return {"rows": rows, "ok": False, "summary": "the deadline came before the compiled "
                                                      "step"}
    return {"rows": rows, "ok": True,
            "summary": f"speedup {rows[0]['step_s'] / rows[1]['step_s']:.2f}x after "
                       f"{rows[1]['first_step_s']:.0f} s of compilation"}

"""Per-rank memory of one training step under each engine: parameters, gradients,
optimiser state and activations of a timm ViT, measured on 2 CPU ranks (gloo) under DDP,
DeepSpeed ZeRO-2 and ZeRO-3, FSDP2 and FSDP2 with full activation checkpointing; beside it the
figure each engine's layout gives at 8, 64 and 512 ranks for ViT-B/16, ViT-L/16 and a
1B and a 2.5B ViT (counted on the meta device: no weights).

    python -m bench.perf.memory                                      # ViT-B/16 and ViT-L/16
    python -m bench.perf.memory --models vit_base_patch16_224 --batch 1

Each setting is a fresh ``torchrun --nproc_per_node 2`` of this module (``worker``): three
steps (InfoNCE, AdamW, fp32, ``--batch`` images x 2 views per rank, 224 px), the third
measured on rank 0 from its resident memory, with glibc mapping every allocation above
64 KiB on its own so that a freed tensor leaves the resident set (torch's CPU allocator
keeps no cache). The first two steps build the optimiser state and DDP's rebuilt gradient
buckets. Measured: the state (resident after the backward: weights, gradients, the
engine's buffers, optimiser state), the activations (what the forward adds) and the peak,
each above the resident memory before the model was built; the weights' and the
optimiser's own bytes (moments, ZeRO's fp32 master partition) counted from their tensors,
the rest of the state is gradients and the engines' buffers. Writes
``bench/results/memory.json`` and prints two tables; ``--record`` also writes
``bench/records/perf/memory.json``, whose view ``table`` docs/benchmarks.md shows.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, peak_rss_bytes, print_table, rss_bytes, write_json
from bench.records import invocation, provenance, source_line, write_record

MODELS = ("vit_base_patch16_224", "vit_large_patch16_224")
# engine setting -> (engine.*, model.activation_checkpointing)
SETTINGS: dict[str, tuple[dict[str, Any], str]] = {
    "ddp": ({"name": "ddp"}, "none"),
    "zero2": ({"name": "deepspeed", "deepspeed_config": "launch/deepspeed/zero2.json"},
              "none"),
    "zero3": ({"name": "deepspeed", "deepspeed_config": "launch/deepspeed/zero3.json"},
              "none"),
    "fsdp2": ({"name": "fsdp2"}, "none"),
    "fsdp2+checkpointing": ({"name": "fsdp2"}, "full"),
}
# the ViTs counted on the meta device: timm's own, and two sized as the examples
COUNTED = {"vit_base_patch16_224": {}, "vit_large_patch16_224": {},
           "vit_1b (giant/14)": {"model": "vit_giant_patch14_224"},
           "vit_2.5b (2560 wide, 32 deep)": {"model": "vit_base_patch16_224",
                                              "embed_dim": 2560, "depth": 32,
                                              "num_heads": 32}}
WORLDS = (2, 8, 64, 512)
MiB = 2**20
MMAP_THRESHOLD = 65536  # glibc: larger allocations are mappings of their own
NAME = "perf/memory"
RENDERER = "bench.perf.memory"  # this module, by the name a record imports it
MAX_FSDP2_STATE_VS_DDP = 0.6  # the targets: FSDP2's per-rank state against DDP's,
MIN_CHECKPOINTING_CUT = 3.0  # and how many times fewer activations checkpointing keeps
# the table's rows: words -> the settings shown in it, joined by " / "
SHOWN = {"ddp": ("ddp",), "deepspeed ZeRO-2 / ZeRO-3": ("zero2", "zero3"),
         "fsdp2": ("fsdp2",), "fsdp2 + checkpointing": ("fsdp2+checkpointing",)}
MODEL_WORDS = {"vit_base_patch16_224": "ViT-B/16", "vit_large_patch16_224": "ViT-L/16"}


# --- one rank's measurement (run under torchrun) -------------------------------------------

def resident_now() -> int:
    """This process's resident memory after a garbage collection. The worker runs with
    ``MALLOC_MMAP_THRESHOLD_`` at 64 KiB, so every tensor above it is its own mapping,
    returned to the system when freed: the resident memory follows the live tensors."""
    gc.collect()
    return rss_bytes()


def one_step(model_name: str, setting: str, batch: int) -> dict[str, int]:
    """Build the model and engine of ``setting``, run one step; this rank's live tensor
    bytes after each phase (and the peak)."""
    from pretrain.distributed.engine import EngineConfig, build_engine, engine_spec
    from pretrain.loop.optim import OptimConfig, build_optimizer
    from pretrain.loop.step import Objective
    from pretrain.loop.trainer import forward_loss
    from pretrain.model.encoder import ModelConfig, build_model
    from pretrain.objectives import ObjectiveConfig

    engine_keys, checkpointing = SETTINGS[setting]
    rows = 2 * batch
    data = {"images": torch.randn(rows, 3, 224, 224),
            "ids": torch.arange(batch).repeat(2), "labels": torch.arange(batch).repeat(2)}
    objective_cfg = ObjectiveConfig.of("infonce")
    start = resident_now()
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone=f"timm:{model_name}", image_size=224,
                                    activation_checkpointing=checkpointing),
                        objective_cfg, torch.device("cpu")).train()
    engine_cfg = EngineConfig(**engine_keys)
    engine_spec(engine_cfg.name).prepare(model, engine_cfg, "fp32")
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=1e-4), rows)
    engine = build_engine(model, optimizer, engine_cfg, torch.device("cpu"), rows)
    objective = Objective(objective_cfg, rows_per_rank=rows)
    for step in range(3):  # the first two build the optimiser state and DDP's buckets
        if step == 2:
            after_step = resident_now()
            Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts here
        out = forward_loss(engine, data, objective, step, measure_rank=False)
        forward = resident_now()
        engine.backward(out.loss)
        del out
        backward = resident_now()
        engine.step()
    return {"state": backward - start, "activations": forward - after_step,
            "peak": peak_rss_bytes() - start,
            "parameters": sum(local_bytes(p) for p in model.parameters()),
            "parameter_count": sum(getattr(p, "ds_numel", p.numel())  # ZeRO-3: whole
                                   for p in model.parameters()),
            "optimizer": optimizer_bytes(engine.optimizer)}


def local_bytes(tensor: torch.Tensor) -> int:
    """The bytes this rank stores of ``tensor`` (its shard, for an FSDP2 DTensor; its
    partition, for a ZeRO-3 parameter)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    local = getattr(tensor, "ds_tensor", local)
    return local.numel() * local.element_size()


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The optimiser's state on this rank: its moments, and under ZeRO the fp32 master
    weights of this rank's partition."""
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's wraps the torch one
    moments = [v for state in inner.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
    masters = getattr(optimizer, "fp32_partitioned_groups_flat", masters or [])  # ZeRO-3
    return sum(local_bytes(t) for t in [*moments, *masters])


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != str(MMAP_THRESHOLD):
        raise SystemExit("bench.perf.memory worker: run by bench.perf.memory "
                         "(MALLOC_MMAP_THRESHOLD_)")
    dist.init_process_group("gloo")
    live = one_step(args.model, args.setting, args.batch)
    if dist.get_rank() == 0:
        write_json(args.out, live)
    dist.destroy_process_group()


# --- the measured table --------------------------------------------------------------------

def measure(model_name: str, setting: str, batch: int) -> dict[str, Any]:
    """One setting on 2 fresh CPU ranks: rank 0's memory by phase, MiB."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "live.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "2", "-m", "bench.perf.memory", "worker", "--model",
                   model_name, "--setting", setting, "--batch", str(batch), "--out", str(out)]
        env = os.environ | {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
                            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2)),
                            "HF_HUB_OFFLINE": "1"}
        subprocess.run(command, check=True, env=env)
        live = json.loads(out.read_text())
    other = live["state"] - live["parameters"] - live["optimizer"]
    return {"model": model_name, "engine": setting,
            "parameters MiB": live["parameters"] / MiB, "optimizer MiB": live["optimizer"] / MiB,
            "gradients+buffers MiB": other / MiB, "state MiB": live["state"] / MiB,
            "activations MiB": live["activations"] / MiB, "peak MiB": live["peak"] / MiB,
            "layout at 2 MiB": LAYOUTS[setting.split("+")[0]].per_rank(
                live["parameter_count"], 2) / MiB}


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's state and activations against DDP's for the same model."""
    ddp = {r["model"]: r for r in rows if r["engine"] == "ddp"}
    for row in rows:
        base = ddp[row["model"]]
        row["state / ddp"] = row["state MiB"] / base["state MiB"]
        row["activations / ddp"] = row["activations MiB"] / base["activations MiB"]
    return rows


# --- the computed table --------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Bytes per parameter of fp32 AdamW training on each rank of ``world``: a replicated
    part and a part divided among the ranks."""

    replicated: float
    sharded: float

    def per_rank(self, parameters: int, world: int) -> float:
        return parameters * (self.replicated + self.sharded / world)


# DDP: weights, gradients, the reducer's gradient buckets (a copy of every gradient),
# AdamW's two moments. ZeRO-2: weights on every rank; the fp32 master weights, the reduced
# gradients and the moments sharded (plus its reduction buckets, bounded by
# reduce_bucket_size, not counted). ZeRO-3: the weights partitioned too, beside the fp32
# master partition (a copy even in fp32), gradients and moments. FSDP2: weights, gradients
# and moments all sharded. The measured table sets each beside its 2-rank figure.
LAYOUTS = {"ddp": Layout(4 + 4 + 4 + 8, 0), "zero2": Layout(4, 4 + 4 + 8),
           "zero3": Layout(0, 4 + 4 + 4 + 8), "fsdp2": Layout(0, 4 + 4 + 8)}


def parameter_count(keys: dict[str, Any], name: str) -> int:
    import timm

    keys = dict(keys)
    model_name = keys.pop("model", name)
    with torch.device("meta"):
        model = timm.create_model(model_name, pretrained=False, num_classes=0, **keys)
    return sum(p.numel() for p in model.parameters())


def computed_rows() -> list[dict[str, Any]]:
    rows = []
    for name, keys in COUNTED.items():
        count = parameter_count(keys, name)
        for engine, layout in LAYOUTS.items():
            rows.append({"model": name, "parameters M": count / 1e6, "engine": engine,
                         **{f"{w} ranks GiB": layout.per_rank(count, w) / 2**30
                            for w in WORLDS}})
    return rows


def render_table(record: dict[str, Any]) -> list[str]:
    """The source, each model's per-rank state and activations by engine against DDP's,
    and the targets."""
    got = record["figures"]
    rows = {(r["model"], r["engine"]): r for r in got["measured"]}
    models = list(dict.fromkeys(r["model"] for r in got["measured"]))

    def cells(model: str, settings: tuple[str, ...]) -> str:
        found = [rows[model, s] for s in settings]
        return " | ".join(" / ".join(fmt.format(r[key]) for r in found) for key, fmt in (
            ("state MiB", "{:,.0f}"), ("state / ddp", "{:.2f}"),
            ("activations / ddp", "{:.2f}")))
    fsdp2 = [rows[m, "fsdp2"]["state / ddp"] for m in models]
    cuts = [rows[m, "fsdp2"]["activations MiB"] / rows[m, "fsdp2+checkpointing"]["activations MiB"]
            for m in models]
    return [f"{source_line(record)} {got['ranks']} ranks, {got['batch']} images a rank:", "",
            "| model | engine | state MiB | state / ddp | activations / ddp |",
            "| --- | --- | --- | --- | --- |",
            *(f"| {MODEL_WORDS.get(m, m)} | {words} | {cells(m, settings)} |"
              for m in models for words, settings in SHOWN.items()
              if all((m, s) in rows for s in settings)),
            "", f"Targets: FSDP2 at most {MAX_FSDP2_STATE_VS_DDP}x DDP's per-rank state, **"
            f"{'met' if max(fsdp2) <= MAX_FSDP2_STATE_VS_DDP else 'not met'}** "
            f"({', '.join(f'{x:.2f}x' for x in fsdp2)}); checkpointing cuts FSDP2's "
            f"activations at least {MIN_CHECKPOINTING_CUT:.0f}x, **"
            f"{'met' if min(cuts) >= MIN_CHECKPOINTING_CUT else 'not met'}** "
            f"({', '.join(f'{x:.1f}x' for x in cuts)})."]


VIEWS = {"table": render_table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("worker", help="one rank of one setting (run by torchrun)")
    one.add_argument("--model", required=True)
    one.add_argument("--setting", choices=list(SETTINGS), required=True)
    one.add_argument("--batch", type=int, required=True)
    one.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--batch", type=int, default=2, help="images per rank (2 views each)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/memory.json"))
    parser.add_argument("--record", action="store_true",
                        help=f"also write bench/records/{NAME}.json")
    args = parser.parse_args()
    if args.command == "worker":
        worker(args)
        return
    seen = provenance(invocation())  # the tree the run starts from
    measured = with_ratios([measure(m, s, args.batch) for m in args.models
                            for s in args.settings])
    computed = computed_rows()
    write_json(args.out, {"machine": machine(), "batch": args.batch, "ranks": 2,
                          "measured": measured, "computed": computed})
    print_table(measured, list(measured[0]))
    print()
    print_table(computed, list(computed[0]))
    if args.record:
        figures = {"batch": args.batch, "ranks": 2, "measured": measured}
        print(f"record: {write_record(NAME, seen, RENDERER, figures)}")


if __name__ == "__main__":
    main()

"""``engine.name=fsdp2`` on 2 real gloo ranks against DDP and one process, in float64.

The one-step equality of every objective (and with cached-gradient chunks) is in
``test_engine.py`` and ``test_chunked.py``. Here: the sharding itself (every declared
block and the root hold 1/2 of each parameter), several optimiser steps of a
checkpointed hybrid ViT under LARS with gradient clipping and a skipped step (LARS's
per-layer norms and the clipping norm are reductions over shards), and checkpoints that
move between DDP and FSDP2 and between 2 ranks and 1. Float64 throughout: the shards'
partial sums change the summation order only, so 1e-9 bounds the difference with room
(a wrong shard, an unreduced norm or a lost optimiser state is O(1e-2) or more).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from core.config import ConfigError, load_config
from core.errors import RunError
from pretrain.distributed.engine import EngineConfig, build_engine, engine_spec
from pretrain.loop.optim import OptimConfig, build_optimizer
from pretrain.loop.step import Objective
from pretrain.loop.trainer import forward_loss
from pretrain.model.encoder import ModelConfig, build_model
from tests.pretrain.distributed import engine_tasks

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

VIT = ModelConfig(backbone="timm:vit_tiny_patch16_224", image_size=16, patch_size=8,
                  vit_stem="hybrid", width=8, timm_kwargs={"depth": 3, "embed_dim": 32,
                                                           "num_heads": 2},
                  norm="group", projector_hidden=32, projector_dim=16,
                  projector_bn_out=False, activation_checkpointing=2)
CPU = torch.device("cpu")
TOLERANCE = 1e-9


def build(engine_name: str, state: dict[str, Any] | None = None, replicate: int = 1,
          channels_last: bool = False):
    torch.manual_seed(0)
    cfg = engine_tasks.objective_config("infonce", {})
    model = build_model(VIT, cfg, CPU, engine_tasks.NUM_CLASSES).double()
    if channels_last:  # as build_model leaves the encoder on a GPU (model.channels_last)
        model.encoder = model.encoder.to(memory_format=torch.channels_last)
        assert not all(p.is_contiguous() for p in model.parameters())
    engine_cfg = EngineConfig(name=engine_name, gradient_clipping=0.5, replicate=replicate)
    engine_spec(engine_name).prepare(model, engine_cfg, "fp32")
    optimizer = build_optimizer(model, OptimConfig(name="lars", lr=2.0, weight_decay=1e-3,
                                                   warmup_steps=0), 19)
    engine = build_engine(model, optimizer, engine_cfg, CPU, micro_batch=19)
    if state is not None:
        engine.load_state_dict(state)
    return engine, Objective(cfg, rows_per_rank=engine_tasks.ROWS_PER_RANK)


def train(engine_name: str, steps: range, state: dict[str, Any] | None = None,
          skip_at: int = 1, replicate: int = 1, sharded_from: str = "",
          sharded_to: str = "") -> dict[str, Any]:
    """``steps`` optimiser steps (the one at ``skip_at`` skipped on the device, as after a
    non-finite loss) from ``state`` or from the sharded checkpoint state in directory
    ``sharded_from``; the engine's full state after them (``sharded_to``: also written
    there as a sharded checkpoint state)."""
    engine, objective = build(engine_name, state, replicate)
    if sharded_from:
        engine.load_sharded(Path(sharded_from))
    batch = engine_tasks.training_batch()
    if dist.is_initialized():
        rows = engine_tasks.rank_rows(dist.get_rank(), dist.get_world_size())
        batch = {k: v[rows] for k, v in batch.items()}
    for step in steps:
        moved = {**batch, "images": batch["images"] + 0.3 * step}
        out = forward_loss(engine, moved, objective, step)
        engine.backward(out.loss)
        engine.step(skip=torch.tensor(step == skip_at))
    if sharded_to:
        engine.save_sharded(Path(sharded_to))
    return engine.state_dict()


def assert_same_state(state: dict[str, Any], reference: dict[str, Any]) -> None:
    assert state["model"].keys() == reference["model"].keys()
    for key, value in reference["model"].items():
        torch.testing.assert_close(state["model"][key], value, rtol=0, atol=TOLERANCE, msg=key)
    ours, theirs = state["optimizer"], reference["optimizer"]
    assert [g["params"] for g in ours["param_groups"]] == \
        [g["params"] for g in theirs["param_groups"]]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        for name, value in entry.items():
            torch.testing.assert_close(ours["state"][index][name], value, rtol=0,
                                       atol=TOLERANCE, msg=f"optimizer {index} {name}")


def shard_sizes() -> dict[str, Any]:
    """The sharded model of :func:`build`, its convolutions channels-last first (as
    ``model.channels_last`` leaves them on a GPU; FSDP2 takes contiguous parameters only)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    engine, _ = build("fsdp2", channels_last=True)
    model = engine.module
    sharded = [isinstance(block, FSDPModule) for block in model.blocks()]
    local = {name: (p.to_local().numel(), tuple(p.shape)) for name, p in
             model.named_parameters() if isinstance(p, DTensor)}
    every = {name for name, _ in model.named_parameters()}
    return {"blocks": sharded, "root": isinstance(model, FSDPModule), "local": local,
            "every": every}


def test_every_declared_block_and_the_root_hold_half_of_each_parameter(gloo2):
    ranks = gloo2.run(shard_sizes)
    for rank in ranks:
        assert rank["blocks"] == [True] * 3 and rank["root"]
        assert set(rank["local"]) == rank["every"]  # every parameter is a DTensor
    for name, (local, shape) in ranks[0]["local"].items():  # split on dim 0, rank 0 first
        rest = torch.Size(shape[1:]).numel()
        assert local + ranks[1]["local"][name][0] == shape[0] * rest, name
        assert local == -(-shape[0] // 2) * rest, name


def test_fsdp2_steps_equal_ddp_and_one_process(gloo2):
    """3 LARS steps with clipping, the second skipped on the device."""
    whole = train("ddp", range(3))
    for engine in ("ddp", "fsdp2"):
        assert_same_state(gloo2.run(train, engine, range(3))[0], whole)
    moved = whole["model"]["encoder.projector.3.weight"] - build("ddp")[0].state_dict()[
        "model"]["encoder.projector.3.weight"]
    assert moved.abs().max() > 1e4 * TOLERANCE  # the steps trained, far beyond the tolerance


def test_hsdp_replicas_of_one_rank_equal_ddp(gloo2):
    """engine.replicate=2 on 2 ranks: two replica groups of one shard each (the all-reduce
    across groups alone; sharding inside a group: the 4-rank tests below)."""
    assert_same_state(gloo2.run(train, "fsdp2", range(3), None, 1, 2)[0],
                      train("ddp", range(3)))


def hsdp_layout() -> dict[str, Any]:
    """This rank's HSDP layout under ``engine.replicate=2`` on 4 ranks: the mesh's groups
    and each parameter's local rows against its whole rows."""
    from torch.distributed.tensor import DTensor

    engine, _ = build("fsdp2", replicate=2)
    params = dict(engine.module.named_parameters())
    mesh = next(p for p in params.values() if isinstance(p, DTensor)).device_mesh
    return {"mesh": mesh.mesh.tolist(), "names": mesh.mesh_dim_names,
            "rows": {name: (p.to_local().shape[0] if p.dim() else 1,
                            p.shape[0] if p.dim() else 1) for name, p in params.items()}}


def test_hsdp_shards_inside_each_replica_group(gloo4):
    """engine.replicate=2 on 4 ranks: 2 replica groups of 2 ranks; each parameter is cut in
    two within a group (ranks 0 and 2 hold the first half, 1 and 3 the second)."""
    ranks = gloo4.run(hsdp_layout)
    assert all(r["mesh"] == [[0, 1], [2, 3]] for r in ranks)
    assert ranks[0]["names"] == ("replicate", "shard")
    for name, (local, whole) in ranks[0]["rows"].items():
        assert local == -(-whole // 2), name
        assert ranks[2]["rows"][name][0] == local, name  # the same shard in the other group
        assert local + ranks[1]["rows"][name][0] == whole, name


def test_hsdp_with_sharding_in_each_group_equals_ddp_and_its_checkpoint_moves(gloo4, gloo3,
                                                                            tmp_path):
    """3 LARS steps with clipping (the second skipped) on 4 ranks as 2 groups of 2 equal one
    DDP process; a sharded checkpoint HSDP writes after 2 steps is read by one DDP process
    and by FSDP2 on 3 ranks, and both continue to the uninterrupted run's state."""
    whole = train("ddp", range(3))
    assert_same_state(gloo4.run(train, "fsdp2", range(3), None, 1, 2)[0], whole)
    longer = train("ddp", range(4))
    written = str(tmp_path / "hsdp")
    gloo4.run(train, "fsdp2", range(2), None, 1, 2, "", written)
    assert len(list(Path(written).glob("*.distcp"))) == 4  # a file per rank
    assert_same_state(train("ddp", range(2, 4), sharded_from=written), longer)
    assert_same_state(gloo3.run(train, "fsdp2", range(2, 4), None, 1, 1, written)[0], longer)


def test_a_checkpoint_moves_between_ddp_and_fsdp2_and_world_sizes(gloo2):
    """FSDP2 on 2 ranks -> DDP in one process, and one process -> FSDP2 on 2 ranks, each
    equal to the uninterrupted run."""
    whole = train("ddp", range(4))
    fsdp2_half = gloo2.run(train, "fsdp2", range(2))[0]
    assert_same_state(train("ddp", range(2, 4), fsdp2_half), whole)
    ddp_half = train("ddp", range(2))
    assert_same_state(gloo2.run(train, "fsdp2", range(2, 4), ddp_half)[0], whole)


def test_a_sharded_checkpoint_moves_between_ddp_and_fsdp2_and_world_sizes(gloo2, tmp_path):
    """checkpoint.format=sharded (DCP): FSDP2 on 2 ranks writes its shards, one DDP
    process reads them whole; one DDP process writes, FSDP2 on 2 ranks reads each its
    shard. Both equal the uninterrupted run."""
    whole = train("ddp", range(4))
    fsdp2_state = str(tmp_path / "fsdp2")
    gloo2.run(train, "fsdp2", range(2), None, 1, 1, "", fsdp2_state)
    assert len(list(Path(fsdp2_state).glob("*.distcp"))) == 2  # a file per rank
    assert_same_state(train("ddp", range(2, 4), sharded_from=fsdp2_state), whole)
    ddp_state = str(tmp_path / "ddp")
    train("ddp", range(2), sharded_to=ddp_state)
    assert_same_state(gloo2.run(train, "fsdp2", range(2, 4), None, 1, 1, ddp_state)[0], whole)


def test_replicate_must_divide_the_ranks_and_be_positive(gloo2):
    assert gloo2.run(refusal_of_replicate, 3) == ["engine.replicate=3 must divide the 2 ranks"] * 2
    with pytest.raises(ConfigError, match="replicate.*must be >= 1, got 0"):
        load_config(EngineConfig, overrides=["replicate=0"])


def refusal_of_replicate(replicate: int) -> str:
    model = build_model(VIT, engine_tasks.objective_config("infonce", {}), CPU, 6)
    try:
        engine_spec("fsdp2").prepare(model, EngineConfig(name="fsdp2", replicate=replicate),
                                     "fp32")
    except RunError as err:
        return str(err)
    return "accepted"


def test_loaded_moments_take_their_parameters_channels_last_layout():
    """FSDP2 writes contiguous moments; a DDP run with channels-last convolutions (on a GPU)
    loads them in its parameters' layout, as torch's fused CUDA optimisers require."""
    from pretrain.distributed.engine_base import match_parameter_layouts

    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(conv.parameters(), lr=0.1)
    conv(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    for entry in state["state"].values():
        entry.update({k: v.contiguous() for k, v in entry.items() if v.ndim == 4})
    optimizer.load_state_dict(state)
    assert optimizer.state[conv.weight]["exp_avg"].stride() != conv.weight.stride()
    before = optimizer.state[conv.weight]["exp_avg"].clone()
    match_parameter_layouts(optimizer)
    moment = optimizer.state[conv.weight]["exp_avg"]
    assert moment.stride() == conv.weight.stride() and torch.equal(moment, before)


VIT_L_RECIPES = ("cc12m_clip_vitl", "imagenet_xclr_vitl")


class ConfigOnlyWeights:
    """``AutoModel`` for a model built on the meta device: the text tower from its
    checkpoint's config, no weights (``from_pretrained`` refuses the meta device)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def from_pretrained(self, path: str) -> torch.nn.Module:
        from transformers import AutoConfig

        return self.real.from_config(AutoConfig.from_pretrained(path))


def recipe_units(recipe: str) -> dict[str, Any]:
    """The recipe's model built on the meta device (its 304M weights never allocated) and
    sharded as its engine would: each block's unit, checkpointing and shard."""
    import transformers
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    from app.run_config import RunConfig

    cfg = load_config(RunConfig, f"launch/configs/{recipe}.yaml")
    real = transformers.AutoModel
    transformers.AutoModel = ConfigOnlyWeights(real)
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, cfg.objective, torch.device("meta"))
    finally:
        transformers.AutoModel = real
    engine_spec(cfg.engine.name).prepare(model, cfg.engine, cfg.train.precision)
    blocks = model.encoder.backbone.blocks
    return {"image blocks": len(blocks),
            "units": [isinstance(b, FSDPModule) for b in model.blocks()],
            "checkpointed": all(isinstance(b, CheckpointWrapper) for b in blocks),
            "text layers": len(model.text.layers()) if model.text is not None else 0,
            "qkv": next(tuple(p.to_local().shape) for name, p in blocks[0].named_parameters()
                        if name.endswith("attn.qkv.weight"))}


@pytest.mark.parametrize("recipe", VIT_L_RECIPES)
def test_the_vit_l_recipes_shard_every_block_under_fsdp2(gloo2, recipe):
    """Both ViT-L recipes build their model for FSDP2 with activation checkpointing: each
    of ViT-L's 24 blocks (and CLIP's text layers) a unit, each rank holding half of it."""
    ranks = gloo2.run(recipe_units, recipe)
    for rank in ranks:
        assert rank["image blocks"] == 24 and rank["checkpointed"]
        assert rank["units"] == [True] * (24 + rank["text layers"])
        assert rank["qkv"] == (3 * 1024 // 2, 1024)  # ViT-L's 3072 x 1024 split in two
    assert ranks[0]["text layers"] == (6 if recipe.startswith("cc12m_clip") else 0)

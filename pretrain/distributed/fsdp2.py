"""``engine.name=fsdp2``: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each rank holds 1/N of every parameter, gradient and optimiser state (N ranks sharding;
with ``engine.replicate`` R > 1, HSDP: groups of N/R ranks shard, the R groups
replicate). A block's full parameters exist only while it runs: ``fully_shard`` is applied
to every block the model declares (``ContrastiveModel.blocks``: a ViT's transformer
blocks, a ResNet's stages, the text tower's layers, from the backbone table) and to the
root, which keeps the rest (stem, projector, the learnable temperature and loss
parameters). Gradients are reduce-scattered, so each rank's optimiser updates its own
shard; LARS's per-layer norms are taken over the whole tensor (a DTensor reduction).

On a GPU with bf16 the parameters are gathered in bf16 and gradients reduced in fp32
(``MixedPrecisionPolicy``), but for batch norms, each its own unit in fp32; elsewhere
everything stays in the parameters' dtype.

Checkpoints hold the full state in the DDP layout (``state_dict``: every shard gathered
to rank 0's CPU memory), or with ``checkpoint.format=sharded`` each rank's shards
(``pretrain/run/sharded.py``); either way a run resumes under DDP or FSDP2 on any number
of ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from core.errors import RunError

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")  # not in state-dict keys


def device_mesh(replicate: int, device: torch.device) -> DeviceMesh:
    """All ranks sharding, or (``engine.replicate`` R) R groups replicating, each sharding
    over world / R ranks."""
    world = dist.get_world_size()
    if world % replicate:
        raise RunError(f"engine.replicate={replicate} must divide the {world} ranks")
    if replicate == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (replicate, world // replicate),
                            mesh_dim_names=("replicate", "shard"))


def shard_model(model: nn.Module, reshard_after_forward: bool, replicate: int,
                precision: str) -> None:
    """``fully_shard`` each of ``model.blocks()`` (``engine.reshard_after_forward``), then
    the root, in place (before the optimiser is built: it must see the sharded
    parameters)."""
    device = next(model.parameters()).device
    if device.type == "meta":  # not yet allocated (a shape check): the group's device
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    bf16 = precision == "bf16" and device.type == "cuda"  # run on one H100 (bench/gpu fsdp2)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else MixedPrecisionPolicy())
    mesh = device_mesh(replicate, device)
    for p in model.parameters():  # FSDP2 shards contiguous parameters only: a channels-last
        if not p.is_contiguous():  # convolution weight (model.channels_last) takes the
            p.data = p.data.contiguous()  # default layout; the activations keep theirs
    if bf16:  # batch norm keeps fp32 parameters beside its fp32 running statistics
        for norm in batch_norms(model):
            fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy(),
                        reshard_after_forward=reshard_after_forward)
    for block in model.blocks():
        fully_shard(block, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
    # the root keeps its parameters gathered from its forward to the backward: the
    # objective reads the learnable loss parameters after the model's forward has returned
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def batch_norms(model: nn.Module) -> list[nn.Module]:
    """The batch norms with parameters: under bf16 gathers each is a unit of its own in
    fp32, as ``F.batch_norm`` wants its weight in the dtype of its running statistics."""
    return [m for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine]


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimiser's parameters in its own order (DDP's state-dict numbering), by their
    state-dict names."""
    names = {id(p): clean_name(name) for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def numbered(state: dict[str, Any]) -> dict[str, Any]:
    """A full optimiser state keyed by parameter name -> keyed by position, as
    ``torch.optim.Optimizer.state_dict`` (and so DDP's checkpoints) has it."""
    order = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    groups = [{**group, "params": [index[name] for name in group["params"]]}
              for group in state["param_groups"]]
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": groups}


def named(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`numbered` for an optimiser whose parameters are ``names``."""
    groups = [{**group, "params": [names[i] for i in group["params"]]}
              for group in state["param_groups"]]
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": groups}


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The full model and optimiser state (DDP's layout) on rank 0's CPU, empty elsewhere;
    a collective."""
    state = get_optimizer_state_dict(model, optimizer, options=FULL)
    return {"model": get_model_state_dict(model, options=FULL),
            "optimizer": numbered(state) if state else {}}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any]) -> None:
    """A full state (DDP's layout, written by any number of ranks), each rank keeping its
    shard."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer,
                             named(state["optimizer"], parameter_names(model, optimizer)),
                             options=options)

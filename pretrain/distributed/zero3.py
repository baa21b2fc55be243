"""DeepSpeed ZeRO stage 3 (``engine.name=deepspeed`` with ``zero_optimization.stage=3``):
what the engine needs beyond stages 1 and 2.

Under ZeRO-3 each rank holds 1/N of every parameter (``param.ds_tensor``); a module's
parameters are gathered by DeepSpeed's hooks while it runs and freed after, so the
module's own ``state_dict`` holds empty placeholders. Checkpoints therefore gather the
model one module at a time to rank 0 (:func:`gathered_model_state`), as DeepSpeed's
``save_16bit_model`` does, and load it one module at a time (:func:`load_model_state`);
the optimizer's fp32 partitions are then refreshed from the loaded weights. The
optimizer state is each rank's flat sub-groups (``pretrain/run/reshard.py`` reads and cuts
that layout); :func:`sub_groups` and :func:`sub_group_shapes` describe this run's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from core.errors import RunError


def _own_tensors(module: nn.Module, prefix: str) -> tuple[list[tuple[str, nn.Parameter]],
                                                          list[tuple[str, torch.Tensor]]]:
    """A module's own parameters and persistent buffers, under their state-dict keys."""
    params = [(prefix + name, p) for name, p in module.named_parameters(recurse=False)]
    buffers = [(prefix + name, b) for name, b in module.named_buffers(recurse=False)
               if name not in module._non_persistent_buffers_set]
    return params, buffers


def refused_dtype(model: nn.Module) -> bool:
    """Whether DeepSpeed's own ZeRO-3 set-up may refuse ``model``'s parameter dtype (one
    outside half, bfloat16 and float: float64 in the equality tests); other models take
    DeepSpeed's own path unchanged."""
    first = next(model.parameters(), None)
    return first is not None and first.dtype not in (torch.half, torch.bfloat16, torch.float)


def partition(model: nn.Module, config: dict[str, Any]) -> None:
    """Partition ``model``'s parameters over the ranks (a collective), as DeepSpeed's engine
    would at ``initialize``; the parameters keep their own dtype (float64 in the equality
    tests).

    ``zero.Init`` also picks a dtype for tensors created inside its context (a built model
    creates none, so it changes no value here). No dtype is named: DeepSpeed 0.19.8's
    ``Init._set_dtype`` then takes the config's (float32: it enables neither bf16 nor
    fp16) on every CPU. A named one goes through ``dtype or float16 if fp16 else bfloat16
    ...``, which reads as ``(dtype or float16) if fp16 else ...``: the named dtype on a CPU
    with fp16 kernels (Intel AVX-512 FP16/AMX), bfloat16 on one without (AMD Zen)."""
    import deepspeed

    deepspeed.zero.Init(module=model, config_dict_or_path=config)


def gathered_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model state on rank 0's CPU, in ``state_dict`` order; empty on the other
    ranks. A collective: each module's parameters are gathered in turn (every rank holds
    at most one module whole at a time) and freed again."""
    import deepspeed

    state: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        params, buffers = _own_tensors(module, prefix + "." if prefix else "")
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            if dist.get_rank() == 0:
                for key, tensor in params + buffers:
                    state[key] = tensor.detach().to("cpu", copy=True)
    return state


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give the partitioned ``model`` the whole ``state`` (every rank holds it): each
    module's parameters gathered, set on rank 0 and partitioned from there; buffers set
    on every rank. The keys and shapes must be the model's, as ``load_state_dict``
    requires; every rank checks them before the first collective, so all stop alike."""
    import deepspeed

    modules = [_own_tensors(module, prefix + "." if prefix else "")
               for prefix, module in model.named_modules()]
    _check_fits(state, {key: getattr(tensor, "ds_shape", tensor.shape)
                        for params, buffers in modules for key, tensor in params + buffers})
    for params, buffers in modules:
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
            if dist.get_rank() == 0:
                for key, param in params:
                    param.data.copy_(state[key])
        for key, buffer in buffers:
            buffer.copy_(state[key])


def _check_fits(state: dict[str, torch.Tensor], shapes: dict[str, torch.Size]) -> None:
    """:class:`RunError` unless ``state`` holds exactly the keys of ``shapes``, each of its
    shape."""
    for key, shape in shapes.items():
        if key not in state:
            raise RunError(f"the checkpoint's model has no {key}")
        if state[key].shape != shape:
            raise RunError(f"size mismatch for {key}: {tuple(state[key].shape)} in the "
                           f"checkpoint, {tuple(shape)} in this model")
    extra = sorted(set(state) - set(shapes))
    if extra:
        raise RunError(f"the checkpoint's model holds keys this model has not: {extra[:5]}")


def zero_padding(optimizer: Any) -> None:
    """Set to 0 what this rank's flat partitions hold beyond its parameters' elements, and
    refresh the fp32 master partitions from them.

    ZeRO-3 pads every parameter of m elements to W * S (S = ceil(m / W)), so the last ranks'
    pieces end in padding, and DeepSpeed allocates the partitions uninitialised. An
    optimizer whose rule reads a whole flat partition (LARS's trust ratio, taken over each
    rank's flat sub-group) reads that padding too: a stray large or non-finite value there
    scaled the rank's whole update (a 2 -> 3 rank resume turned it NaN now and then). Zero
    padding stays zero: its gradient is zero and so is its update."""
    rank = dist.get_rank()
    with torch.no_grad():
        for params, flat in zip(optimizer.fp16_groups, optimizer.fp16_partitioned_groups_flat,
                                strict=True):
            offset = 0
            for p in params:
                size = p.partition_numel()
                real = min(max(p.ds_numel - rank * size, 0), size)  # this rank's own elements
                p.ds_tensor.data.view(-1)[real:].zero_()
                if flat is not None:
                    flat[offset + real:offset + size].zero_()
                offset += size
            if flat is not None:
                flat[offset:].zero_()
    optimizer.refresh_fp32_params()


def sub_groups(optimizer: Any) -> list[list[int]]:
    """Per ZeRO-3 sub-group of ``optimizer`` (DeepSpeed's stage 3 optimizer), in order:
    [its param group, how many parameters it holds] (``reshard.SUB_GROUPS``)."""
    return [[int(optimizer.sub_group_to_group_id[j]), len(group)]
            for j, group in enumerate(optimizer.fp16_groups)]


def sub_group_shapes(optimizer: Any) -> list[list[torch.Size]]:
    """The whole shapes of each sub-group's parameters, in order."""
    return [[p.ds_shape for p in group] for group in optimizer.fp16_groups]


def group_shapes(optimizer: Any) -> list[list[torch.Size]]:
    """The whole shapes of each param group's parameters, in order."""
    shapes: list[list[torch.Size]] = [[] for _ in optimizer.optimizer.param_groups]
    for (group, _), sub in zip(sub_groups(optimizer), sub_group_shapes(optimizer),
                               strict=True):
        shapes[group] += sub
    return shapes

"""Resuming a checkpoint on another number of ranks.

The model, step, schedules and ESS controller are in ``shared.pt`` and load unchanged on
any number of ranks, and so does DDP's replicated optimizer state. DeepSpeed ZeRO-1/2
state is sharded: each old rank saved its partition, and :func:`zero_partition_for`
cuts the new rank's partition out of their concatenation, or :func:`per_parameter_state`
turns them into a torch optimizer's state for a run under DDP or FSDP2. ZeRO-3 partitions
each parameter on its own: :func:`per_parameter_state` joins its partitions too, and
:func:`zero3_partition_for` cuts a new rank's out of per-parameter state. What else is per
rank is rebuilt for the new world:

- Data: the loader state (epoch, global batches delivered, the layout that delivered them
  and the epoch's earlier layouts) is the same on every old rank and is carried over whole.
  The new loader continues with the same global batches on any world; under another
  layout (another batch size) it deals exactly the work the old one left
  (``data_pipeline/loader/plan.py``): nothing of the epoch is lost or drawn again. A
  state saved before layouts were recorded continues at ``floor(b * G / G')`` batches of
  the new layout (less than one global batch drawn again).
- Skip counts: the old ranks' totals are summed into the new rank 0, so the run's
  totals continue.
- Random number generators: every new rank is seeded from (step, rank).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from core.errors import RunError
from data_pipeline.loader.state import GLOBAL_LAYOUTS

# Keys of DeepSpeed's ZeRO-1/2 optimizer state (deepspeed.checkpoint.constants).
BASE_STATE, FP32_PARTITIONS = "base_optimizer_state", "single_partition_of_fp32_groups"
PADDINGS, ALIGNMENT_PADDINGS = "group_paddings", "param_alignment_paddings"
# ZeRO-3's, and ours: which parameters each of its sub-groups holds
ZERO3_STATE, ZERO3_FLAT = "optimizer_state_dict", "fp32_flat_groups"
SUB_GROUPS = "sub_groups"  # per sub-group: [its param group, how many parameters]


def zero_stage_of(part: dict[str, Any]) -> str:
    """Which ZeRO layout a saved optimizer partition has: "3", or "1/2"."""
    return "3" if ZERO3_FLAT in part else "1/2"


def batches_done(batches: int, old_global: int, new_global: int) -> int:
    """Per-rank batches of the new layout that cover at most the ``batches * old_global``
    samples the old run consumed in the epoch (for states without a recorded layout)."""
    return batches * old_global // new_global


def loader_state_for(loaders: list[dict[str, Any]], rank: int, old_global: int,
                     new_global: int) -> dict[str, Any]:
    """The loader state of new ``rank`` from the states of the ranks that wrote the
    checkpoint (``loaders[r]`` of old rank ``r``) at global batch ``old_global``."""
    first = loaders[0]
    loader: dict[str, Any] = {"epoch": first["epoch"], "batches": first["batches"],
                              "layout": list(first.get("layout", [])),
                              "layouts": [list(x) for x in first.get("layouts", [])],
                              GLOBAL_LAYOUTS: first.get(GLOBAL_LAYOUTS, False),
                              "skipped": {}, "skipped_places": {}, "skipped_examples": []}
    if not loader["layout"]:
        loader["batches"] = batches_done(first["batches"], old_global, new_global)
    if rank == 0:
        for old in loaders:
            for name in ("skipped", "skipped_places"):
                for key, count in old.get(name, {}).items():
                    loader[name][key] = loader[name].get(key, 0) + count
            loader["skipped_examples"] += old.get("skipped_examples", [])
    return loader


def zero_partition_for(parts: list[dict[str, Any]], live: dict[str, Any], rank: int,
                       world: int, round_robin: bool = False) -> dict[str, Any]:
    """The ZeRO-1/2 optimizer state of new ``rank`` of ``world`` from the states the old
    ranks saved.

    ``parts[r]``: old rank ``r``'s state, ``live``: the state of this rank's freshly built
    optimizer, whose partition sizes and paddings describe the new layout. DeepSpeed's
    stage 1/2 layout (without round-robin gradients or parameter alignment): param group
    ``i`` is its parameters flattened in order, padded at the end to ``world * P`` (the
    smallest multiple of ``2 * world``: DeepSpeed's 4-byte alignment of fp16), and
    rank ``r`` owns ``[r * P, (r + 1) * P)``; the last ranks' padding is not stored.
    So the concatenation of the old ranks' unpadded partitions is the whole group, and the
    new partition is its slice ``[rank * P', (rank + 1) * P')``, padded with zeros. The same
    holds for every optimizer state tensor of a partition's length (momentum, Adam's
    moments); other state (Adam's step count) and the hyperparameters are the same on
    every rank and taken from old rank 0. ``round_robin`` (gradients partitioned round
    robin) and parameter alignment make the layout depend on the number of ranks: refused.

    Shapes: ``parts[r][FP32_PARTITIONS][i]`` [P - padding_r], state tensors [P];
    returned ``FP32_PARTITIONS[i]`` [P' - padding'], state tensors [P']."""
    if round_robin:
        raise RunError("zero_optimization.round_robin_gradients orders the partitions by the "
                       "number of ranks: resume on the number that wrote the checkpoint")
    refuse_alignment(parts, "resume it on the number of ranks that wrote it")
    states, partitions = {}, []
    for i, own in enumerate(live[FP32_PARTITIONS]):
        size = own.numel() + live[PADDINGS][i]  # P', this rank's padded partition
        lean = [part[FP32_PARTITIONS][i].reshape(-1) for part in parts]
        group = torch.cat(lean)
        mine = group[rank * size:(rank + 1) * size]
        if size != -(-group.numel() // (2 * world)) * 2 or mine.numel() != own.numel():
            raise RunError(f"parameter group {i} holds {group.numel()} values in the "
                           f"checkpoint, which does not fit this model's layout: resume it "
                           f"with the model and engine that wrote it")
        partitions.append(mine.clone())
        padded = [part[FP32_PARTITIONS][i].numel() + part[PADDINGS][i] for part in parts]
        old = [part[BASE_STATE]["state"][i] for part in parts]
        states[i] = {key: _repartition([state[key] for state in old], lean, padded, rank, size)
                     for key in old[0]}
    base = {"state": states, "param_groups": parts[0][BASE_STATE]["param_groups"]}
    scalars = {k: parts[0][k] for k in ("dynamic_loss_scale", "overflow", "clip_grad")
               if k in parts[0]}
    return {**live, **scalars, BASE_STATE: base, FP32_PARTITIONS: partitions}


def _repartition(values: list[Any], lean: list[Tensor], padded: list[int], rank: int,
                 size: int) -> Any:
    """One optimizer state entry of the new partition: a per-element tensor (one value
    per element of the old rank's padded partition) is joined over the old ranks without
    their padding (:func:`_joined`) and cut; anything else is the same on every rank."""
    group = _joined(values, lean, padded)
    if group is values[0]:
        return group
    mine = group[rank * size:(rank + 1) * size]
    return torch.cat([mine, mine.new_zeros(size - mine.numel())])


def per_parameter_state(parts: list[dict[str, Any]], shapes: list[list[torch.Size]]
                        ) -> dict[str, Any]:
    """The ZeRO-1/2 optimizer state of a checkpoint (``parts[r]``: old rank ``r``'s) as a
    torch optimizer's state dict, for an engine that keeps one (DDP, FSDP2): each
    parameter's state numbered in group order, as ``Optimizer.state_dict`` numbers it.

    ``shapes[i]``: the shapes of param group ``i``'s parameters, in order. The layout is
    :func:`zero_partition_for`'s: group ``i``'s values are the old ranks' unpadded
    partitions joined, parameter after parameter; each per-element state tensor is cut the
    same way and viewed to its parameter's shape; other state (Adam's step) is every
    parameter's. Shapes: ``parts[r][FP32_PARTITIONS][i]`` [P - padding_r]; returned
    ``state[k][key]`` of parameter ``k``'s shape. ZeRO-3 partitions: :func:`_zero3_joined`."""
    if zero_stage_of(parts[0]) == "3":
        return _zero3_joined(parts, shapes)
    refuse_alignment(parts, "resume it with DeepSpeed")
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for i, group_shapes in enumerate(shapes):
        lean = [part[FP32_PARTITIONS][i].reshape(-1) for part in parts]
        sizes = [shape.numel() for shape in group_shapes]
        if sum(t.numel() for t in lean) != sum(sizes):
            raise RunError(f"parameter group {i} holds {sum(t.numel() for t in lean)} values "
                           f"in the checkpoint and {sum(sizes)} in this model: resume it with "
                           "the model that wrote it")
        padded = [part[FP32_PARTITIONS][i].numel() + part[PADDINGS][i] for part in parts]
        old = [part[BASE_STATE]["state"][i] for part in parts]
        joined = {key: _joined([s[key] for s in old], lean, padded) for key in old[0]}
        cut = per_element(joined, sizes)
        first = len(state)
        for k, (shape, size, offset) in enumerate(zip(group_shapes, sizes,
                                                      _offsets(sizes), strict=True)):
            state[first + k] = {key: value[offset:offset + size].view(shape).clone()
                                if key in cut else value for key, value in joined.items()}
        groups.append({**parts[0][BASE_STATE]["param_groups"][i],
                       "params": list(range(first, first + len(group_shapes)))})
    return {"state": state, "param_groups": groups}


def refuse_alignment(parts: list[dict[str, Any]], advice: str) -> None:
    """Parameter alignment makes ZeRO's layout depend on the number of ranks: refused."""
    if any(any(group) for part in parts for group in part.get(ALIGNMENT_PADDINGS, [])):
        raise RunError("the checkpoint was written with zero_optimization.parameter_alignment"
                       f": {advice}")


def _joined(values: list[Any], lean: list[Tensor], padded: list[int]) -> Any:
    """A per-element state tensor joined over the old ranks without their padding; any
    other entry as old rank 0 has it (``values[0]`` itself)."""
    if not all(torch.is_tensor(v) and v.shape == (n,) for v, n in zip(values, padded,
                                                                       strict=True)):
        return values[0]
    return torch.cat([v[:part.numel()] for v, part in zip(values, lean, strict=True)])


def per_element(joined: dict[str, Any], sizes: list[int]) -> set[str]:
    """The entries of ``joined`` that hold one value per element of the group."""
    return {key for key, value in joined.items()
            if torch.is_tensor(value) and value.shape == (sum(sizes),)}


def _offsets(sizes: list[int]) -> list[int]:
    """Where each parameter starts in its flat group."""
    return [0, *itertools.accumulate(sizes)][:-1]


def zero3_partition_size(numel: int, world: int) -> int:
    """The elements of a parameter of ``numel`` each of ``world`` ranks holds under ZeRO-3:
    the parameter is padded at its end to a multiple of ``world`` and cut evenly."""
    return -(-numel // world)


def _zero3_joined(parts: list[dict[str, Any]], shapes: list[list[torch.Size]]
                  ) -> dict[str, Any]:
    """ZeRO-3 partitions (``parts[r]``: old rank ``r``'s) as a torch optimizer's state.

    DeepSpeed's stage 3 layout: param group ``g``'s parameters, in order, fall into
    sub-groups (``parts[r][SUB_GROUPS][j] = [g, n]``: sub-group ``j`` holds the next ``n``
    of group ``g``); every parameter of ``m`` elements is padded to ``W * S`` (``S`` =
    ``ceil(m / W)``, W ranks) and rank ``r`` holds ``[r * S, (r + 1) * S)``; a rank's flat
    sub-group (its fp32 weights and each per-element optimizer state, e.g. Adam's moments)
    is its pieces of the sub-group's parameters joined in order. So parameter ``k``'s
    value is the ranks' pieces of it joined, cut to ``m``. Shapes: ``parts[r][ZERO3_FLAT][j]``
    [sum of the sub-group's S]; returned ``state[k][key]`` of parameter ``k``'s shape."""
    world, sub_groups = len(parts), parts[0][SUB_GROUPS]
    counts = [sum(n for g, n in sub_groups if g == i) for i in range(len(shapes))]
    if counts != [len(group) for group in shapes]:
        raise RunError(f"the checkpoint's ZeRO-3 parameter groups hold {counts} parameters "
                       f"and this model's {[len(group) for group in shapes]}: resume it with "
                       "the model that wrote it")
    starts = [0, *itertools.accumulate(counts)][:-1]  # each group's first parameter number
    taken = [0] * len(shapes)
    state: dict[int, dict[str, Any]] = {}
    for j, (g, n) in enumerate(sub_groups):
        numbers = range(starts[g] + taken[g], starts[g] + taken[g] + n)
        group_shapes = shapes[g][taken[g]:taken[g] + n]
        taken[g] += n
        sizes = [zero3_partition_size(shape.numel(), world) for shape in group_shapes]
        if parts[0][ZERO3_FLAT][j].numel() != sum(sizes):
            raise RunError(f"ZeRO-3 sub-group {j} of the checkpoint holds "
                           f"{parts[0][ZERO3_FLAT][j].numel()} values per rank and this "
                           f"model's parameters {sum(sizes)}: resume it with the model that "
                           "wrote it")
        flat_state = [part[ZERO3_STATE]["state"].get(j, {}) for part in parts]
        cut = per_element(flat_state[0], sizes)  # the rest is every element's (Adam's step)
        for k, shape, size, offset in zip(numbers, group_shapes, sizes, _offsets(sizes),
                                          strict=True):
            state[k] = {key: torch.cat([s[key][offset:offset + size] for s in flat_state])
                        [:shape.numel()].view(shape).clone() if key in cut else value
                        for key, value in flat_state[0].items()}
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": list(range(start, start + count))}
              for group, start, count in zip(parts[0][ZERO3_STATE]["param_groups"], starts,
                                             counts, strict=True)]
    return {"state": state, "param_groups": groups}


def zero3_partition_for(state: dict[str, Any], sub_groups: list[list[torch.Size]],
                        rank: int, world: int) -> dict[int, dict[str, Any]]:
    """This rank's ZeRO-3 optimizer state, per sub-group, from a torch optimizer's
    per-parameter ``state`` (numbered in group order, as :func:`per_parameter_state` and
    ``Optimizer.state_dict`` number it): sub-group ``j`` (``sub_groups[j]``: the shapes of
    its parameters, the sub-groups in group order) gets each per-element entry as rank
    ``rank``'s pieces of its parameters joined (:func:`_zero3_joined`'s layout), each
    other entry as the first parameter has it. Shapes: ``state["state"][k][key]`` of
    parameter ``k``'s shape; returned ``[j][key]`` [sum of the sub-group's S]."""
    out: dict[int, dict[str, Any]] = {}
    number = 0
    for j, shapes in enumerate(sub_groups):
        numbers = range(number, number + len(shapes))
        number += len(shapes)
        saved = [state["state"].get(k) for k in numbers]
        if not any(saved):
            continue  # no step taken yet
        if not all(saved):
            raise RunError(f"the checkpoint holds optimizer state for some parameters of "
                           f"ZeRO-3 sub-group {j} and not for others")
        out[j] = {}
        for key, value in saved[0].items():
            if _parameter_shaped(key, [entry[key] for entry in saved], shapes):
                out[j][key] = torch.cat([_zero3_piece(entry[key], rank, world)
                                         for entry in saved])
            else:
                out[j][key] = value
    return out


def _parameter_shaped(key: str, values: list[Any], shapes: list[torch.Size]) -> bool:
    """Whether an optimizer state entry holds one value per element of its parameter
    (momentum, Adam's moments) rather than one for the parameter (its step count, a 0-d
    tensor, which a scalar parameter's moments also are: told apart by torch's name)."""
    return key != "step" and all(torch.is_tensor(v) and v.shape == shape
                                 for v, shape in zip(values, shapes, strict=True))


def _zero3_piece(value: Tensor, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s piece of a parameter-shaped tensor under ZeRO-3, zero-padded."""
    flat = value.reshape(-1)
    size = zero3_partition_size(flat.numel(), world)
    mine = flat[rank * size:(rank + 1) * size]
    return torch.cat([mine, mine.new_zeros(size - mine.numel())])

"""The optimizer layouts ``pretrain/run/reshard.py`` reads and cuts, against layouts built
directly: ZeRO-1/2's flat partitions cut for another world and joined per parameter,
ZeRO-3's per-parameter pieces joined and cut again, and the layouts that depend on the
world refused. Whole runs resumed on other numbers of ranks: ``test_reshard.py``."""

from __future__ import annotations

import pytest
import torch

from core.errors import RunError
from pretrain.run.reshard import per_parameter_state, zero3_partition_for, zero_partition_for


def zero_layout(groups: list[torch.Tensor], world: int, rank: int) -> dict:
    """The ZeRO-1/2 state rank ``rank`` of ``world`` saves for flat parameter groups
    ``groups`` (each also its own "velocity" and a shared "step"), built by slicing the
    padded groups directly: DeepSpeed pads a group to a multiple of 2 x world and gives
    every rank an equal slice, storing the slice of the fp32 weights without padding."""
    state: dict = {"base_optimizer_state": {"state": {},
                                            "param_groups": [{"lr": 0.1} for _ in groups]},
                   "single_partition_of_fp32_groups": [], "group_paddings": [],
                   "param_alignment_paddings": [[0] for _ in groups], "clip_grad": 0.0}
    for i, flat in enumerate(groups):
        align = 2 * world
        size = -(-flat.numel() // align) * align // world
        padded = torch.cat([flat, flat.new_zeros(size * world - flat.numel())])
        mine = padded[rank * size:(rank + 1) * size]
        lean = max(0, min(size, flat.numel() - rank * size))
        state["single_partition_of_fp32_groups"].append(mine[:lean].clone())
        state["group_paddings"].append(size - lean)
        state["base_optimizer_state"]["state"][i] = {"velocity": -mine.clone(),
                                                     "step": torch.tensor(7.0)}
    return state


@pytest.mark.parametrize(("old", "new"), [(1, 2), (2, 1), (3, 2), (2, 5), (4, 3)])
def test_zero_partitions_are_cut_as_the_new_world_would_have_written_them(old, new):
    groups = [torch.arange(1.0, 24.0), torch.arange(100.0, 103.0)]  # 23 and 3 values
    parts = [zero_layout(groups, old, r) for r in range(old)]
    for rank in range(new):
        expected = zero_layout(groups, new, rank)
        live = {**expected, "base_optimizer_state": {"state": {}, "param_groups": []},
                "single_partition_of_fp32_groups": [torch.zeros_like(t) for t in
                                                    expected["single_partition_of_fp32_groups"]]}
        got = zero_partition_for(parts, live, rank, new)
        for key in ("single_partition_of_fp32_groups", "group_paddings"):
            assert len(got[key]) == len(expected[key]) == 2
            for a, b in zip(got[key], expected[key], strict=True):
                assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), (key, rank)
        for i in (0, 1):
            state, want = (got["base_optimizer_state"]["state"][i],
                           expected["base_optimizer_state"]["state"][i])
            assert torch.equal(state["velocity"], want["velocity"]), (i, rank)
            assert torch.equal(state["step"], torch.tensor(7.0))
        assert got["base_optimizer_state"]["param_groups"] == [{"lr": 0.1}] * 2


@pytest.mark.parametrize("world", [1, 2, 3])
def test_zero_partitions_join_into_each_parameters_state(world):
    """Parameters of shapes [2, 3], [5] (group 0) and [3] (group 1) flattened into ZeRO's
    groups and partitioned over ``world`` ranks come back per parameter, numbered in
    group order, each velocity the negated parameter (as ``zero_layout`` stores it)."""
    params = [torch.arange(6.0).view(2, 3), torch.arange(10.0, 15.0), torch.arange(20.0, 23.0)]
    groups = [torch.cat([params[0].reshape(-1), params[1]]), params[2]]
    parts = [zero_layout(groups, world, r) for r in range(world)]
    state = per_parameter_state(parts, [[p.shape for p in params[:2]], [params[2].shape]])
    assert [g["params"] for g in state["param_groups"]] == [[0, 1], [2]]
    assert state["param_groups"][0]["lr"] == 0.1
    for k, param in enumerate(params):
        assert torch.equal(state["state"][k]["velocity"], -param), k
        assert torch.equal(state["state"][k]["step"], torch.tensor(7.0))
    with pytest.raises(RunError, match="parameter group 1 holds 3 values in the checkpoint "
                                       "and 4 in this model"):
        per_parameter_state(parts, [[p.shape for p in params[:2]], [torch.Size([4])]])


def zero3_layout(params: list[torch.Tensor], sub_groups: list[list[int]], world: int,
                 rank: int) -> dict:
    """The ZeRO-3 state rank ``rank`` of ``world`` saves for ``params`` (in group order;
    sub-group ``j`` = the next ``sub_groups[j][1]`` of group ``sub_groups[j][0]``), built
    directly: each parameter padded to a multiple of ``world`` and cut evenly, the rank's
    pieces of a sub-group joined; its "velocity" the negated weights, a shared "step"."""
    flats, taken = [], 0
    for _, n in sub_groups:
        pieces = []
        for param in params[taken:taken + n]:
            size = -(-param.numel() // world)
            padded = torch.cat([param.reshape(-1), param.new_zeros(size * world - param.numel())])
            pieces.append(padded[rank * size:(rank + 1) * size])
        flats.append(torch.cat(pieces))
        taken += n
    groups = sorted({g for g, _ in sub_groups})
    return {"fp32_flat_groups": flats, "sub_groups": sub_groups,
            "optimizer_state_dict": {
                "state": {j: {"velocity": -flat, "step": torch.tensor(7.0)}
                          for j, flat in enumerate(flats)},
                "param_groups": [{"lr": 0.1, "params": [j for j, (g, _) in
                                                        enumerate(sub_groups) if g == i]}
                                 for i in groups]}}


@pytest.mark.parametrize(("old", "new"), [(1, 2), (2, 3), (3, 2), (4, 1)])
def test_zero3_partitions_join_per_parameter_and_cut_for_another_world(old, new):
    """Parameters of shapes [2, 3], [5], [7] (group 0, in sub-groups of 2 and 1) and [3]
    (group 1): ``old`` ranks' ZeRO-3 partitions come back per parameter, numbered in group
    order, and are cut as ``new`` ranks would have written them."""
    params = [torch.arange(6.0).view(2, 3), torch.arange(10.0, 15.0),
              torch.arange(30.0, 37.0), torch.arange(20.0, 23.0)]
    sub_groups = [[0, 2], [0, 1], [1, 1]]
    parts = [zero3_layout(params, sub_groups, old, r) for r in range(old)]
    shapes = [[p.shape for p in params[:3]], [params[3].shape]]
    state = per_parameter_state(parts, shapes)
    assert [g["params"] for g in state["param_groups"]] == [[0, 1, 2], [3]]
    assert state["param_groups"][1]["lr"] == 0.1
    for k, param in enumerate(params):
        assert torch.equal(state["state"][k]["velocity"], -param), k
        assert torch.equal(state["state"][k]["step"], torch.tensor(7.0))
    by_sub_group = [[p.shape for p in params[:2]], [params[2].shape], [params[3].shape]]
    for rank in range(new):
        expected = zero3_layout(params, sub_groups, new, rank)["optimizer_state_dict"]["state"]
        got = zero3_partition_for(state, by_sub_group, rank, new)
        assert set(got) == {0, 1, 2}
        for j in got:
            assert torch.equal(got[j]["velocity"], expected[j]["velocity"]), (rank, j)
            assert torch.equal(got[j]["step"], torch.tensor(7.0))
    with pytest.raises(RunError, match=r"hold \[3, 1\] parameters and this model's \[2, 1\]"):
        per_parameter_state(parts, [[p.shape for p in params[:2]], [params[3].shape]])


def test_zero_layouts_that_depend_on_the_world_are_refused():
    parts = [zero_layout([torch.arange(8.0)], 2, r) for r in range(2)]
    live = zero_layout([torch.arange(8.0)], 1, 0)
    with pytest.raises(RunError, match="round_robin_gradients"):
        zero_partition_for(parts, live, 0, 1, round_robin=True)
    parts[1]["param_alignment_paddings"] = [[0, 3]]
    with pytest.raises(RunError, match="parameter_alignment"):
        zero_partition_for(parts, live, 0, 1)
    parts[1]["param_alignment_paddings"] = [[0]]
    small = zero_layout([torch.arange(6.0)], 1, 0)  # another model: 6 values, not 8
    with pytest.raises(RunError, match="does not fit this model"):
        zero_partition_for(parts, small, 0, 1)

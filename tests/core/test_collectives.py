"""Collectives over a real 2-rank gloo group: the uneven row gather and its backward,
and the small reductions the trainer takes its decisions with."""

from __future__ import annotations

import torch

from tests.core import rank_tasks


def test_uneven_gather_and_its_backward(gloo2):
    r0, r1 = gloo2.run(rank_tasks.gather_rows_on_rank)
    expected = torch.cat([torch.full((2, 3), 1.0), torch.full((3, 3), 2.0)])
    torch.testing.assert_close(r0["gathered"], expected)
    torch.testing.assert_close(r1["gathered"], expected)
    weights = torch.arange(15.0).view(5, 3)
    total = weights * (1 + 2)  # both ranks used every row, with factors 1 and 2
    torch.testing.assert_close(r0["grad"], total[:2])
    torch.testing.assert_close(r1["grad"], total[2:])


def test_reductions_agree_on_every_rank(gloo2):
    for result in gloo2.run(rank_tasks.reductions_on_rank):
        assert result["mean"] == {"a": 0.5, "b": 1.0}
        assert result["sum"] == 3.0
        assert result["agree_all"] is True and result["agree_one"] is False

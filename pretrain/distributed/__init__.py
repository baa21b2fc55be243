"""The one place that talks to torch.distributed on behalf of the objectives and trainer."""

from pretrain.distributed.collectives import (
    all_ranks_agree,
    barrier,
    broadcast_object,
    mean_over_ranks,
    sum_over_ranks,
)
from pretrain.distributed.global_batch import all_gather_rows, build_global_batch

__all__ = ["all_gather_rows", "all_ranks_agree", "barrier", "broadcast_object",
           "build_global_batch", "mean_over_ranks", "sum_over_ranks"]

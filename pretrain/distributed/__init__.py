"""The one place that talks to torch.distributed on behalf of the objectives."""

from pretrain.distributed.global_batch import all_gather_rows, build_global_batch

__all__ = ["all_gather_rows", "build_global_batch"]

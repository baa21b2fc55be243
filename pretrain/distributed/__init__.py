"""The gathering boundary: the one place that builds each rank's global batch.

May import ``pretrain.losses`` (the ContrastiveBatch it builds) and ``core``.
"""

from pretrain.distributed.global_batch import build_global_batch

__all__ = ["build_global_batch"]

"""Everything that spans ranks: the engines behind one interface (``engine``, one table of
DDP, DeepSpeed, ZeRO-3 and FSDP2; ``engine_base`` what each is, ``engine_state`` its part
of a checkpoint) and the gathering boundary (``global_batch``), the one place that builds
each rank's global batch.

May import ``pretrain.objectives`` and ``pretrain.contrast`` (the ContrastiveBatch it
builds), ``pretrain.run`` (the checkpoint formats the engines write) and ``core``.
"""

from pretrain.distributed.global_batch import build_global_batch

__all__ = ["build_global_batch"]

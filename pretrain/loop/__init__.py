"""The training loop: optimisers and the learning-rate schedule (``optim``), one step's
forward and loss (``step``; ``chunked`` for gradient caching), the collapse watch
(``collapse``), metrics kept on the device (``device_metrics``), the run's length in
samples (``run_length``) and the loop itself (``trainer``); the engines it drives are
``pretrain.distributed``'s.

May import every other sub-package of ``pretrain``; never ``registry``, ``serving`` or
``evaluation``: the trainer takes its kNN monitor as a callable, and ``app`` registers the
trained model.
"""

"""Training: the third layer (docs/architecture.md), in six sub-packages by role.

    objectives   the objectives, one file per paper (pure functions of a
                 ContrastiveBatch), their table and their configuration
    contrast     what they are written in: the batch, the vocabulary, the dense and
                 tiled operations, the temperature, learnable loss parameters
    distributed  the engines and their table; the gathering boundary: each rank's
                 global batch
    model        the networks: backbones and their table, the encoder, the text tower
    run          the run's life on a cluster: checkpoints, resharding, preemption, the
                 run lock, configuration drift, MLflow tracking
    loop         the training loop: optimisers, the step, the collapse watch,
                 device-side metrics

Within the layer they import one way only (``tests/test_layers.py``): ``contrast`` <
``objectives`` < ``distributed``, ``model`` < ``loop``, ``run`` < ``distributed`` and
``run`` < ``loop``; ``model`` and ``run`` never import each other or the loop. Nothing here
imports ``registry``, ``serving``, ``evaluation`` or ``app``: the loop gets what it needs
from above as plain callables.
"""

"""Training: the third layer (docs/architecture.md), in five sub-packages by role.

    losses       the objectives, pure functions of a ContrastiveBatch, and their table
    distributed  the gathering boundary: each rank's global batch
    model        the networks: backbones and their table, the encoder, the text tower
    run          the run's life on a cluster: checkpoints, resharding, preemption, the
                 run lock, configuration drift, MLflow tracking
    loop         the training loop: engines and their table, optimisers, the step, the
                 collapse watch, device-side metrics

Within the layer they import one way only (``tests/test_layers.py``): ``losses`` <
``distributed``, ``model`` < ``loop``, and ``run`` < ``loop``; ``model`` and ``run`` never
import each other or the loop. Nothing here imports ``serving`` (publishing), ``evaluation``
or ``app``: the loop gets what it needs from above as plain callables.
"""

"""The run's life on a cluster, apart from what it trains: atomic checkpoints
(``checkpoint``) and their resharding to another world size (``reshard``), preemption
signals (``preemption``), the run directory's lock (``run_lock``), what may change on a
resume (``config_drift``), the run's global batch on the current world (``batch_cut``) and
the MLflow tracking run (``tracking``).

May import ``core`` and ``data_pipeline`` only: nothing here knows the model, the loss or
the loop, so a checkpoint holds plain state dicts the loop hands it.
"""

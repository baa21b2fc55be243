"""The networks: images [B, 3, H, W] to features (``backbones``, one table of every
backbone), the encoder with its projector, the text tower and the objective's learnable
loss parameters (``encoder``), and the CLIP text tower (``text_tower``).

May import ``pretrain.objectives`` and ``pretrain.contrast`` (what an objective asks of
the model), ``data_pipeline`` (the text tower's tokenizer) and ``core``; never
the loop, the run's operations or torch.distributed.
"""

"""The machinery every objective is written in: the batch (``batch``: its rows, columns
and label groups), the vocabulary a loss's file uses (``vocabulary``), and behind it the
dense and tiled operations (``rows``, ``columns``, ``tiles``, ``symmetric_tiles``,
``pair_terms``, ``sigmoid_rows``, ``soft_targets``, ``target_top_k``, ``projections``),
the temperature and its ESS controller (``temperature``), learnable loss parameters
(``parameters``) and the objective's output (``common``).

May import ``core`` only: never the objectives, the model, the loop or torch.distributed.
"""

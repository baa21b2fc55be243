"""``graph-precompute``: caption embeddings and similarity graphs.

Also ``python -m data_pipeline.graph_precompute``.
"""

from __future__ import annotations

from pretrain.cli import stage_main

main = stage_main("graph-precompute", __doc__, run=None,
                  lands_with="the caption-graph issue (#5)")

if __name__ == "__main__":
    main()

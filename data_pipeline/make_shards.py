"""``make-shards``: write WebDataset shards and their manifest.

Also ``python -m data_pipeline.make_shards``.
"""

from __future__ import annotations

from pretrain.cli import stage_main

main = stage_main("make-shards", __doc__, run=None, lands_with="the data-pipeline issue (#3)")

if __name__ == "__main__":
    main()

"""``pretrain``: contrastive pretraining (``python -m pretrain.train`` or under torchrun)."""

from __future__ import annotations

from pretrain.cli import stage_main

main = stage_main("pretrain", __doc__, run=None,
                  lands_with="the distributed-training issue (#4)")

if __name__ == "__main__":
    main()

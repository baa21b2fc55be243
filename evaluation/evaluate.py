"""``evaluate``: kNN, linear probe and diagnostics of an encoder.

Also ``python -m evaluation.evaluate``.
"""

from __future__ import annotations

from pretrain.cli import stage_main

main = stage_main("evaluate", __doc__, run=None, lands_with="the evaluation issue (#6)")

if __name__ == "__main__":
    main()

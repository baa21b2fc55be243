"""The learning benchmark: every recipe trained and evaluated, and the papers' claims
checked (``python -m bench.learning``)."""

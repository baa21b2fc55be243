"""Soaks: long runs of the real launch under planted faults, measured against runs
without them (``chaos``)."""

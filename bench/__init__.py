"""Benchmarks, by subject; each folder's ``__init__`` says what it measures.

- ``perf/``: speed and memory of one part against a baseline run in the same process
  (``python -m bench.perf.<name>``).
- ``scale/``: costs that grow with samples, shards, ranks or workers, at real
  cardinalities (``python -m bench.scale``, ``python -m bench.scale.rehearsal``).
- ``soak/``: long runs under faults (``python -m bench.soak.chaos``).
- ``gpu/``: the GPU kit (``bash bench/gpu/run.sh``).
- ``learning/``: does training learn, and do the papers' claims reproduce
  (``python -m bench.learning``).

``common.py`` and ``processes.py`` are the helpers they share. Results are written under
``bench/results/`` (not kept); ``records.py`` keeps what the docs cite under
``bench/records/``, with the command, commit, date and machine that measured it.
"""

"""The GPU kit: one command that measures the GPU path on a bare, offline node.

    bash bench/gpu/fetch_wheels.sh            # on a connected machine: bench/gpu/wheels/
    bash bench/gpu/run.sh OUT_DIR             # on the node, with its own python3 and torch
    bash bench/gpu/run.sh --dry-run OUT_DIR   # the same code on CPU, tiny sizes (the suite)

Each part (:data:`bench.gpu.part.PARTS`) runs in a process of its own under a share of
the time budget, so one that fails or runs out of time leaves the others' figures;
``OUT_DIR/gpu.json`` holds every part's rows and ``OUT_DIR/gpu.md`` their tables.
"""

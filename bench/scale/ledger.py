"""``python -m bench.scale --part ledger``: the ledger command over one epoch of tars of
10,000 samples (img2dataset's layout and stats), its keys read from the tars' headers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.processes import run_command
from bench.scale.tables import SHARD, img2dataset_tars
from data_pipeline.loader.ledger import LedgerWriter


def run_ledger(tars: int, workdir: Path, global_batch: int = 2_048) -> dict[str, Any]:
    """The ledger command over one epoch of ``tars`` x 10,000 samples trained by 2 ranks in
    global batches of ``global_batch`` (the last, partial batch dropped): every key read
    from the tars' headers and judged against the ledger's reads."""
    folder = workdir / f"ledger-tars-{tars}"
    img2dataset_tars(folder, tars, SHARD)
    for t in range(tars):  # img2dataset's stats: the sample count without a counting pass
        (folder / f"{t:05d}_stats.json").write_text(json.dumps({"successes": SHARD}))
    run = workdir / f"ledger-run-{tars}"
    shutil.rmtree(run, ignore_errors=True)
    keys = [f"{t:05d}{i:05d}" for t in range(tars) for i in range(SHARD)]
    order = np.random.default_rng(0).permutation(len(keys))
    writers = [LedgerWriter(run, "00000000000001-r000", rank, 2) for rank in range(2)]
    for writer in writers:
        writer.start(0)
    half = global_batch // 2
    for step in range(len(keys) // global_batch):
        for rank, writer in enumerate(writers):
            rows = order[step * global_batch + rank * half:step * global_batch + (rank + 1) * half]
            writer.record(0, step + 1, {"keys": [keys[i] for i in rows]}, torch.tensor(True))
    for writer in writers:
        writer.commit(len(keys) // global_batch)
        writer.close()
    spec = f"{folder}/{{00000..{tars - 1:05d}}}.tar"
    result = run_command("data_pipeline.loader.ledger", [str(run), "--json", "--shards", spec])
    epoch = json.loads(result.pop("printed").splitlines()[-1])["epochs"]["0"]
    unread = len(keys) % global_batch
    assert (epoch["once"], epoch["unread"], epoch["unknown"]) == (len(keys) - unread, unread, 0)
    return {"samples": len(keys), "tars": tars, "seconds": result["seconds"],
            "command_rss_mib": result["command_rss_mib"],
            "keys_per_s": len(keys) / result["seconds"], "once": epoch["once"],
            "unread": epoch["unread"]}

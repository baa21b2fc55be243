"""The process group ``init_runtime`` joins: a rank that stops answering (a lost node) makes
the others' collective fail after ``engine.collective_timeout`` seconds, so torchrun can
restart the group on the ranks that are left."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.app.helpers import REPO
from tests.ports import free_port

RANK = """
import os, sys, time, torch, torch.distributed as dist
from core.runtime import init_runtime
init_runtime("cpu", "gloo", collective_timeout_s=float(sys.argv[1]))
if dist.get_rank() == 1:
    time.sleep(60)  # alive but silent, as a node cut off from the network
    sys.exit(0)
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError as err:
    print(f"failed after {time.monotonic() - start:.1f} s: {str(err).splitlines()[0]}",
          flush=True)
    os._exit(3)  # gloo's teardown after a timed-out collective may abort: not under test
"""


def test_a_silent_rank_fails_the_collective_after_the_timeout():
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, "3"], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(r),
                                   "LOCAL_RANK": str(r)})
             for r in range(2)]
    start = time.monotonic()
    out, err = ranks[0].communicate(timeout=120)
    elapsed = time.monotonic() - start
    ranks[1].kill()
    ranks[1].wait()
    assert ranks[0].returncode == 3, err[-2000:]
    waited = float(out.split()[2])
    assert 2.5 <= waited < 30, out  # 3 s, not the 10-minute default
    assert elapsed < 60

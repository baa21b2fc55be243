"""A GPU-kit part planted for ``tests/bench/gpu/test_gpu_kit.py``: it measures one row, starts a
child process (as a part starts pytest, torchrun or loader workers), records its pid, and
then never ends. Imported by the kit's fork server beside ``bench.gpu.part``, it adds itself to the
part table there."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu.part import PARTS, Part


def overrun(work: Path, rows: list, **_: Any) -> dict[str, Any]:
    rows.append({"never": "measured before the overrun"})
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (work / "child.pid").write_text(str(child.pid))
    print("planted: a child started, now past the deadline", flush=True)
    time.sleep(600)
    return {"rows": [], "ok": True, "summary": "never reached"}


PARTS["planted"] = Part(overrun, 0.01, "Planted overrun", ("never",))

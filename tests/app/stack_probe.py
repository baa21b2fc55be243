"""``python -m tests.app.stack_probe <pretrain overrides>``: the ``pretrain`` command, with
a profiler that writes, at the first ``torch.log_softmax`` an objective's step calls, the
project's frames on the stack from ``app/pretrain.py``'s ``main`` down (file, function),
one JSON list per rank to ``$STACK_PROBE_OUT.<rank>``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import FrameType

from app.pretrain import main

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "core", "data_pipeline", "pretrain", "registry", "serving", "evaluation")


def project_frames(frame: FrameType | None) -> list[tuple[str, str]]:
    """(path relative to the repository, function) of the project's frames, outermost
    first, from ``main`` of ``app/pretrain.py`` down to ``frame``."""
    frames = []
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path.is_relative_to(REPO) and path.relative_to(REPO).parts[0] in PACKAGES:
            frames.append((str(path.relative_to(REPO)), frame.f_code.co_name))
        frame = frame.f_back
    frames.reverse()
    start = frames.index(("app/pretrain.py", "main"))
    return frames[start:]


def probe(frame: FrameType, event: str, arg: object) -> None:
    if event != "c_call" or getattr(arg, "__name__", "") != "log_softmax":
        return
    frames = project_frames(frame)
    if any(path.startswith("pretrain/objectives/") for path, _ in frames):
        sys.setprofile(None)
        rank = os.environ.get("RANK", "0")
        Path(f"{os.environ['STACK_PROBE_OUT']}.{rank}").write_text(json.dumps(frames))


if __name__ == "__main__":
    sys.setprofile(probe)
    main(sys.argv[1:])

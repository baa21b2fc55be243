"""A run's log: every rank's records on stderr, rank 0's also in ``<run_dir>/train.log``."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from core.runtime import Runtime


class RunLogFile(logging.FileHandler):
    """``<run_dir>/train.log``. A write that fails (a full disk) stops this file with one
    line on stderr, not a traceback per record; stderr goes on carrying the log."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        if self.stream is None:
            return
        err = sys.exc_info()[1]
        sys.stderr.write(f"pretrain: warning: {self.baseFilename} is no longer written "
                         f"({type(err).__name__}: {err}); the log goes on on stderr\n")
        try:
            self.close()
        except OSError:  # the buffered lines cannot be written either
            pass

    def emit(self, record: logging.LogRecord) -> None:
        if not self._closed:
            super().emit(record)


def setup_logging(rt: Runtime, run_dir: Path) -> None:
    level = logging.INFO if rt.is_main else logging.WARNING
    fmt = f"%(asctime)s rank{rt.rank} %(name)s %(levelname)s: %(message)s"
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if rt.is_main:
        handlers.append(RunLogFile(run_dir / "train.log"))
    logging.basicConfig(level=level, format=fmt, handlers=handlers, force=True)

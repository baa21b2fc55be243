"""A command for ``tests/test_prewarmed.py``: what an interpreter shows a module run by
``python -m``, printed, then an ending chosen by its first argument."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time


def say(line: str, stream=None) -> None:
    """``line`` and its newline in one write: two unbuffered ranks share the agent's stdout,
    and ``print`` writes the newline separately, so their lines could interleave."""
    (stream or sys.stdout).write(line + "\n")


if __name__ == "__main__":
    ending = sys.argv[1]
    sigint = signal.getsignal(signal.SIGINT)  # SIG_IGN in a background job
    say(f"name={__name__} argv={sys.argv[1:]} file={os.path.basename(sys.argv[0])} "
        f"cwd={os.getcwd()} path0={sys.path[0]} probe={os.environ.get('PROBE')} "
        f"rank={os.environ.get('RANK')} unbuffered={not hasattr(sys.stdout.buffer, 'raw')} "
        f"stdin={sys.stdin.read()!r} sigint={getattr(sigint, '__name__', sigint)} "
        f"sigchld={signal.getsignal(signal.SIGCHLD)} threads={threading.active_count()}")
    say("to stderr\r\nsecond line", sys.stderr)
    atexit.register(say, "atexit ran")
    late = threading.Thread(target=lambda: (time.sleep(0.3), say("thread joined")))
    late.start()
    if ending == "exit-message":
        sys.exit("a one-line error")
    if ending == "exit-3":
        sys.exit(3)
    if ending == "exit-negative":
        sys.exit(-1)
    if ending == "raise":
        raise ValueError("uncaught")
    if ending == "interrupt":
        raise KeyboardInterrupt
    if ending == "sigterm":
        late.join()
        os.kill(os.getpid(), signal.SIGTERM)
    if ending == "sleep":
        time.sleep(600)
    if ending == "segfault":  # as an entry point's reported_faults reports one
        import ctypes
        import faulthandler

        late.join()
        faulthandler.enable()
        say("extension modules and a launcher's summary follow a crash report\n" * 80,
            sys.stderr)
        ctypes.string_at(0)

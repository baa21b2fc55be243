"""The node's step-timer server: torch's ``FileTimerServer``, beside the torchrun agent.

    python -m pretrain.run.step_timer PIPE        # launch/torchrun.sh starts it

Each training process moves its timer on after every step (:mod:`pretrain.run.hang`,
through torch's ``FileTimerClient`` on ``TORCHELASTIC_TIMER_FILE``). When one expires the
server kills the process with its process group (its loader workers) by SIGKILL, which
ends a frozen process at once, logs one line, and stays up for the next. The agent sees
its worker die and restarts the group as for a crash.

Why not the agent's own server (``TORCHELASTIC_ENABLE_FILE_TIMER=1``): after killing an
expired worker it kills its own process, the agent (torch 2.15,
``FileTimerServer._run_watchdog``), and the node would leave the job. This one differs
from torch's in what it reaps (the group, never itself) and in nothing else.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time

from torch.distributed.elastic.timer import FileTimerRequest, FileTimerServer

log = logging.getLogger("step_timer")


class StepTimerServer(FileTimerServer):
    """torch's server, reaping an expired worker's process group and never itself."""

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        if worker_pid == os.getpid():  # torch's ends its own process after a worker
            return True
        try:
            if os.getpgid(worker_pid) == worker_pid:  # torchrun starts each in its own group
                os.killpg(worker_pid, signal)
            else:
                os.kill(worker_pid, signal)
        except ProcessLookupError:
            pass
        return True


def log_event(name: str, request: FileTimerRequest | None) -> None:
    if name == "kill worker process" and request is not None:
        log.error("step timer: %s (pid %d) on %s made no step progress until its timer "
                  "expired: killed with its process group (SIGKILL); torchrun restarts the "
                  "group", request.scope_id, request.worker_pid, socket.gethostname())


def serve(pipe: str, parent: int) -> None:
    """Serve ``pipe`` until the process ``parent`` (the agent) is gone."""
    server = StepTimerServer(pipe, run_id=os.environ.get("RDZV_ID", ""), max_interval=0.1,
                             daemon=True, log_event=log_event)
    server.start()
    try:
        while os.getppid() == parent:
            time.sleep(1.0)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: "
                        "%(message)s")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        # a scheduler's signal to the job's group is the training processes' to answer;
        # the server serves them until the agent is gone
        signal.signal(sig, signal.SIG_IGN)
    pipe = (argv or sys.argv[1:])[0]
    serve(pipe, os.getppid())


if __name__ == "__main__":
    main()

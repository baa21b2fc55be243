"""Process setup for a run: rank, world, device, process group and autocast.

Under torchrun (or srun + torchrun) the environment names the rank and world; a plain
``python -m app.pretrain`` is one process. DeepSpeed needs a process group even for one
process, so one is created on a free local port. Backend ``auto`` is NCCL on GPU, gloo on
CPU.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class Runtime:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _store(rank: int, world: int, serve: bool = True,
           timeout: timedelta = timedelta(minutes=10)) -> dist.Store:
    """The rendezvous store. torchrun's agents share one store across their restarts
    (``TORCHELASTIC_USE_AGENT_STORE``): there the keys are private to this restart, as the
    previous attempt's (e.g. gloo's peer addresses) would otherwise be read as current.
    Otherwise rank 0 serves a new store at every attempt (torchrun publishes a new port for
    each rendezvous round under ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, the elastic
    launch), and no prefix is needed: nor could one be agreed, since an agent that joins a
    running job counts its restarts from 0. ``serve`` False: a client only."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=serve and rank == 0 and not agent_store,
                          timeout=timeout, wait_for_workers=serve)
    if not agent_store:
        return store
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                            store)


def init_runtime(device: str = "auto", backend: str = "auto", need_group: bool = False,
                 collective_timeout_s: float = 600.0) -> Runtime:
    """Join torchrun's process group (or make a 1-process one when ``need_group``), whose
    collectives fail after ``collective_timeout_s`` seconds without a peer."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(f"cuda:{local_rank}" if device == "cuda" else device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if (world > 1 or need_group) and not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group(backend, rank=rank, world_size=world, store=_store(rank, world),
                                device_id=dev if dev.type == "cuda" else None,
                                timeout=timedelta(seconds=collective_timeout_s))
    return Runtime(rank, world, local_rank, dev)


def side_store(rank: int, world: int, timeout_s: float = 5.0) -> dist.Store | None:
    """Another client of the job's store, whose calls fail after ``timeout_s`` (the hang
    watch's: a store served by a frozen rank 0 must not hold up the ranks that report
    it); None without a process group."""
    if not dist.is_initialized() or world < 2:
        return None
    return _store(rank, world, serve=False, timeout=timedelta(seconds=timeout_s))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto``: bf16 autocast on GPUs that support it, fp32 elsewhere."""
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    if precision == "bf16":
        with torch.autocast(device.type, dtype=torch.bfloat16):
            yield
    else:
        yield


def peak_memory_mib(device: torch.device) -> float:
    """Peak allocated GPU memory, or this process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

"""A CUDA dry run on a machine without a GPU: fake CUDA tensors (``FakeTensorMode``: shapes,
dtypes and devices, no values) and a process group whose only backend is registered for
CUDA (torch's ``fake`` backend, as NCCL has no CPU backend).

Inside :func:`fake_cuda`, a CPU tensor mixed with a CUDA one fails (FakeTensorMode's own
device check), and so does a CPU tensor handed to any collective (:class:`CudaCollectives`:
inside FakeTensorMode the fake backend would take it); the collectives that ran are listed.
Shapes that depend on values (``unique``, boolean indexing) become symbolic sizes. The fake
group moves no data, so code that reads values on the host (a count, an object gather, a
branch on ``torch.equal``) cannot run here: a test supplies those.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class CudaCollectives(TorchDispatchMode):
    """Refuses any ``c10d`` operation that is handed a tensor not on a CUDA device (not on
    ``device_type``); lists those that ran in ``ran``."""

    def __init__(self, device_type: str = "cuda") -> None:
        super().__init__()
        self.ran: list[str] = []
        self.device_type = device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.ran.append(str(func))
            if func.__name__.startswith("barrier"):
                # c10d hands a barrier its own placeholder (on the CPU for the fake backend,
                # on the GPU for NCCL)
                return func(*args, **(kwargs or {}))
            for value in tree_flatten((args, kwargs or {}))[0]:
                if isinstance(value, torch.Tensor) and value.device.type != self.device_type:
                    raise RuntimeError(f"{func}: a {value.device.type} tensor "
                                       f"{tuple(value.shape)} handed to a collective of a "
                                       f"{self.device_type.upper()} process group")
        return func(*args, **(kwargs or {}))


@contextmanager
def cuda_world(world: int = 2, rank: int = 0, backend: str = "cuda:fake") -> Iterator[None]:
    """A process group of ``world`` ranks (this process is ``rank``) served by the fake
    backend for CUDA tensors only: a CPU tensor in a collective fails as under NCCL
    (``backend="cpu:fake"``: for CPU tensors only)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def move_by_replacing(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """``Module.to`` for fake tensors: each parameter and buffer replaced by its moved copy
    (torch swaps a fake parameter in place, which its fake-tensor memo forbids)."""
    for part in module.modules():
        for slots in (part._parameters, part._buffers):
            for name, value in slots.items():
                if value is None:
                    continue
                options = dict(kwargs)
                if value.dim() not in (4, 5):
                    options.pop("memory_format", None)
                moved = value.to(*args, **options)
                slots[name] = (nn.Parameter(moved, value.requires_grad)
                               if isinstance(value, nn.Parameter) else moved)
    return module


@contextmanager
def fake_cuda(value_dependent_shapes: bool = True,
              device_type: str = "cuda") -> Iterator[CudaCollectives]:
    """Fake tensors (real CPU inputs are converted on use, value-dependent sizes symbolic)
    with collectives held to CUDA, and modules moved by :func:`move_by_replacing`; yields
    the mode that lists the collectives that ran. ``value_dependent_shapes=False`` makes
    every operator whose output shape depends on values (``unique``, ``nonzero``, boolean
    indexing) raise, as every read of a value (``item``, ``int``, ``torch.equal``) does:
    on a GPU each would wait for the device. ``device_type="cpu"``: collectives are held
    to CPU tensors instead (a ``cpu:fake`` group)."""
    shapes = ShapeEnv(allow_dynamic_output_shape_ops=True) if value_dependent_shapes else None
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=shapes), \
            CudaCollectives(device_type) as collectives, mock.patch.object(nn.Module, "to",
                                                                move_by_replacing), \
            no_gpu_context():
        yield collectives


@contextmanager
def driverless_streams() -> Iterator[None]:
    """FSDP2 on fake CUDA tensors without a driver: its streams and events (and the current
    device it asks for) become the CPU's no-op ones. Only the ordering between its
    gather, reduce and compute streams is lost, which moves no value to the host; the
    stream logic itself runs on a GPU only (``bench/gpu/sharded.py``)."""
    if torch.cuda.device_count() > 0:
        yield
        return
    stand_ins = {name: getattr(torch.cpu, name)
                 for name in ("Stream", "Event", "current_stream", "stream")}
    with contextlib.ExitStack() as stack:
        for name, value in stand_ins.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value))
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        yield


@contextmanager
def fake_mesh(world: int, device_type: str) -> Iterator[Any]:
    """A 1-D device mesh over the fake group, made outside fake tensors (its rank table is
    read on the host), handed to ``fsdp2.shard_model`` in place of the one it makes."""
    from torch.distributed.device_mesh import init_device_mesh

    import pretrain.distributed.fsdp2 as fsdp2

    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    with mock.patch.object(fsdp2, "device_mesh", lambda replicate, device: mesh):
        yield mesh


def no_gpu_context() -> contextlib.AbstractContextManager:
    """Without a GPU, keep fake CUDA tensors from making a real CUDA context: torch 2.11
    makes one for the first fake CUDA tensor whenever ``torch.cuda.is_available()`` says
    True, which the tests make it say for autocast (torch 2.15 asks the driver instead)."""
    if torch.cuda.device_count() > 0:
        return contextlib.nullcontext()
    return mock.patch.object(fake_tensor, "init_gpu_context", lambda device: None)

"""Where a collective's tensors travel: each backend moves only some memory.

NCCL moves CUDA memory only; gloo's send and recv move host memory only (its own collectives take either).
A collective is written once, for tensors wherever the caller keeps them; :func:`on_device` wraps it so that a
tensor in memory its backend cannot move takes a detour through memory it can, and what the collective wrote
is copied back.  The algorithms never see the detour.
"""
from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .base import Comm

WRITTEN = ("tensor", "output")  # what a collective writes: the only arguments copied back after a detour
READ = ("input", "stale")  # read only (``stale``: ps-async's list of old shards, one per destination)


def travels_through(nccl: bool, point_to_point: bool, device: torch.device) -> str | None:
    """The memory a tensor on ``device`` must detour through for this call, or None where it can stay.

    NCCL moves CUDA memory only.  gloo's *collectives* take CUDA tensors (torch stages them to the host
    itself), but gloo's ``send``/``recv`` hand the tensor's address straight to the socket: a CUDA address
    there fails with ``writev ... Bad address`` (seen on an H200, docs/gpu-results.md)."""
    if nccl:
        return "cuda" if device.type == "cpu" else None
    return "cpu" if point_to_point and device.type == "cuda" else None


def on_device(method=None, *, point_to_point: bool = False):
    """Under a collective's :func:`collective` wrapper, on every backend: a tensor in memory the backend
    cannot move travels through memory it can, and what the collective wrote is copied back.  Under NCCL
    that is the small CPU tensors of the bookkeeping (a loss for the log, bitmaps, the overflow flag,
    signatures, a checkpoint's barrier, consolidated states); under gloo, the CUDA tensors of the collectives
    minizero builds from send/recv (``point_to_point=True``: the ring, the tree, the parameter server's
    push and pull) -- one copy each way per call, not per message."""
    if method is None:
        return functools.partial(on_device, point_to_point=point_to_point)
    signature = inspect.signature(method)

    def moved(tensor: torch.Tensor, comm: "Comm") -> torch.Tensor:
        where = travels_through(comm._nccl, point_to_point, tensor.device)
        if where is None:
            return tensor
        return tensor.to(torch.device("cuda", torch.cuda.current_device()) if where == "cuda" else "cpu")

    @functools.wraps(method)
    def wrapper(self: "Comm", *args, **kwargs):
        # gloo's own collectives take any tensor; its send/recv meet a CUDA tensor only once CUDA is in use.
        if not self._nccl and (not point_to_point or not torch.cuda.is_initialized()):
            return method(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        originals = {}
        for k in WRITTEN + READ:
            value = bound.arguments.get(k)
            if isinstance(value, torch.Tensor):
                bound.arguments[k] = moved(value, self)
            elif isinstance(value, list):
                bound.arguments[k] = [moved(t, self) for t in value]
            else:
                continue
            originals[k] = value
        method(*bound.args, **bound.kwargs)
        for k in WRITTEN:  # not the read-only ones: an ``output`` may view its ``input`` (push, in place)
            if k in originals and bound.arguments[k] is not originals[k]:
                originals[k].copy_(bound.arguments[k])

    wrapper.point_to_point = point_to_point  # read by the tests: every send/recv collective is marked
    return wrapper

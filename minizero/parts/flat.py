"""Flat buffers: many tensors laid end to end in one.

One big message beats many small ones (latency is paid per message), so
every stage communicates flat buffers.  Tensors of different dtypes cannot
share a buffer, hence :func:`group_by_dtype`.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch


def group_by_dtype(tensors: Iterable[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.dtype].append(t)
    return dict(groups)


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A new flat tensor holding ``tensors`` one after another (one dtype)."""
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` (the inverse of :func:`pack`)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def keep_grad_in(param: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``param.grad`` the view ``view`` (into a bucket or flat buffer) again.

    If someone set ``.grad`` to None (``optimizer.zero_grad(set_to_none=True)``),
    autograd allocated a fresh tensor, or none: take its value in, or zeros."""
    grad = param.grad
    if grad is None:
        view.zero_()
    elif grad.data_ptr() != view.data_ptr():
        view.copy_(grad.reshape(view.shape))
    param.grad = view

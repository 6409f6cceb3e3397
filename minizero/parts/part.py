"""A rank's part of the training state, in the vocabulary every stage shares: ``[start, stop)`` of a
parameter, flattened.

A checkpoint must outlive the layout that wrote it: saved by ZeRO-3 on 4 ranks, it is loaded by ``ddp``
on 3.  So each stage describes what it holds as :class:`Part` s -- ranges of the *parameters*, never of its
flat buffers -- and any stage at any world size can find its own ranges in them (what DCP calls a
chunk, in one dimension: ZeRO's flat layout cuts a parameter at any element, which is a range of the
flattened parameter but rarely a box of the shaped one).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Part:
    """``[start, stop)`` of parameter ``name`` flattened: its value (the fp32 master under mixed precision)
    and its optimizer state -- per-element tensors cut to the same range, scalars (Adam's ``step``) whole."""

    name: str
    start: int
    stop: int
    value: torch.Tensor
    state: dict


def flat_range(state: dict | None, start: int, stop: int, like: torch.Tensor | None = None) -> dict:
    """One parameter's optimizer state cut to ``[start, stop)`` of it: per-element tensors (dim >= 1)
    flattened and sliced (cast to ``like``'s dtype and device, as torch's ``load_state_dict`` casts), 0-dim
    tensors and plain values whole (Adam's ``step`` keeps its own dtype, as torch keeps it)."""
    cut = {}
    for key, value in (state or {}).items():
        if torch.is_tensor(value) and value.dim() > 0:
            values = value.detach().reshape(-1)[start:stop]
            cut[key] = values.to(like.dtype, copy=True).to(like.device) if like is not None else values.clone()
        else:
            cut[key] = value.detach().clone() if torch.is_tensor(value) else value
    return cut

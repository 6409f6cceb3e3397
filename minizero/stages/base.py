"""What every stage shares: the wrapper interface and the wrap-time checks.

A stage wraps a model and its optimizer and is then driven exactly like the
plain pair -- ``stage(x)``, ``loss.backward()``, ``stage.step()``,
``stage.zero_grad()`` -- by the one training loop in :mod:`minizero.train`.
The single-device reference is a stage too, so a learner can diff any two.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager

import torch
from torch import nn

from ..comm import Comm


class Stage:
    """The plain model and optimizer, with no communication: the reference's behaviour."""

    name = "reference"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm | None = None):
        self.module = module
        self.optimizer = optimizer
        self.comm = comm
        self.rank = comm.rank if comm else 0
        self.world_size = comm.world_size if comm else 1
        self.require_backward_grad_sync = True  # torch DDP's name for "not inside no_sync()"

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; synchronise on the first backward after the block."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """Named trainable parameters, tied ones once, in registration order."""
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]


def _digest(text: str) -> float:
    # 48 bits of a hash: exactly representable in float64, the dtype we gather in.
    return float(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "big"))


def check_same_model(module: nn.Module, comm: Comm) -> None:
    """Refuse to wrap models whose structure differs across ranks.

    Names, shapes, dtypes and ``requires_grad`` of parameters and buffers must
    agree -- values may differ, rank 0's are broadcast.  This runs before any
    other collective, because a mismatch would otherwise show up later as a
    hang or as silently misaligned flat buffers.  Two cheap rounds: a
    fingerprint of the whole model, and only on mismatch one per tensor, so
    every rank can name the first tensor that differs.
    """
    signature = [f"param {n} {tuple(p.shape)} {p.dtype} grad={p.requires_grad}" for n, p in module.named_parameters()]
    signature += [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
    n = comm.world_size
    mine = torch.tensor([len(signature), _digest("\n".join(signature))], dtype=torch.float64)
    everyone = torch.empty(2 * n, dtype=torch.float64)
    comm.all_gather(everyone, mine)
    everyone = everyone.view(n, 2)
    if bool((everyone == everyone[0]).all()):
        return
    longest = int(everyone[:, 0].max())
    per_tensor = torch.full((longest,), -1.0, dtype=torch.float64)
    per_tensor[: len(signature)] = torch.tensor([_digest(s) for s in signature], dtype=torch.float64)
    table = torch.empty(n * longest, dtype=torch.float64)
    comm.all_gather(table, per_tensor)
    table = table.view(n, longest)
    first = int((table != table[0]).any(dim=0).nonzero()[0])
    differing = [r for r in range(n) if table[r, first] != table[comm.rank, first]]
    here = signature[first] if first < len(signature) else "(no such tensor here)"
    raise ValueError(
        f"rank {comm.rank}: the model differs across ranks at wrap time; first difference at tensor "
        f"#{first}: here {here}, but ranks {differing} have something else. Build the same model on "
        f"every rank (names, shapes, dtypes, requires_grad); only values may differ, rank 0's are broadcast."
    )


def broadcast_module(module: nn.Module, comm: Comm, src: int = 0) -> None:
    """Make every replica start from rank ``src``'s parameters and buffers (as torch DDP does)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            comm.broadcast(tensor.data, src)

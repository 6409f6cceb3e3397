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

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the gradients this rank holds -- all of them,
        already averaged, for the reference and DDP.  Sharded stages override it."""
        # Zero-size gradients add nothing to any norm, and torch refuses their inf-norm.
        params = [p for _, p in self.trainable() if p.grad is not None and p.grad.numel() > 0]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The model state this rank keeps between steps, by kind -- what memory accounting walks."""
        params = [p for _, p in self.trainable()]
        return {"params": params,
                "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": [t for state in self.optimizer.state.values() for t in state.values()
                              if torch.is_tensor(t)],
                # compression's error feedback: one full-size residual per buffer, on top of the formula
                "error_feedback": list(getattr(getattr(self, "averager", None), "residuals", {}).values())}


class Synchronised(Stage):
    """A stage that reduces gradients once backward has finished (all but the reference).

    The output's gradient is the first thing backward computes; from its hook
    we queue a callback that autograd runs after the *whole* pass, when every
    ``.grad`` holds its final (accumulated) value -- how torch's DDP reducer
    finalises, too.  Inside ``no_sync()`` nothing is queued: gradients
    accumulate locally and the first backward after it reduces the sums.
    """

    _syncing = False  # does the backward of the latest forward synchronise?
    _sync_queued = False

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():  # a no_grad forward (a quick eval) has no backward to plan for
            self._syncing = self.require_backward_grad_sync  # decided at forward, as torch does
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self._syncing:
            self._sync_after_backward(output)
        return output

    def _sync_after_backward(self, output) -> None:
        def queue_sync(grad):
            if not self._sync_queued:  # two forwards, one backward: synchronise once
                self._sync_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._run_sync)

        tensors = output if isinstance(output, (tuple, list)) else [output]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(queue_sync)
                return

    def _run_sync(self) -> None:
        self._sync_queued = False
        self.sync_gradients()

    def sync_gradients(self) -> None:
        raise NotImplementedError


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

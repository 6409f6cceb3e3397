"""The same interface over torch's built-in collectives (gloo, NCCL).

This is the yardstick the send/recv ring is measured against, and the backend
to use for real runs.  torch does not tell us what it sent, so the ledger is
fed the bytes the ring algorithm sends for the same call
(:func:`ring_bytes_sent`); tests check that the ring really sends exactly that.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Comm, ReduceOp, chunk_bounds, collective
from .progress import ANYONE


def ring_bytes_sent(kind: str, numel: int, element_size: int, world_size: int, rank: int, src: int = 0) -> int:
    """Bytes rank ``rank`` sends in minizero's ring version of ``kind`` on a
    full tensor of ``numel`` elements."""
    n = world_size
    if n == 1:
        return 0
    if kind in ("reduce_scatter", "all_gather"):
        return (n - 1) * (numel // n) * element_size
    if kind == "all_reduce":
        sizes = [b - a for a, b in chunk_bounds(numel, n)]
        # reduce-scatter sends every chunk but chunk r; all-gather every chunk but chunk r+1.
        return (numel - sizes[rank] + numel - sizes[(rank + 1) % n]) * element_size
    if kind == "broadcast":
        return 0 if (rank - src) % n == n - 1 else numel * element_size
    if kind == "root_all_reduce":
        return (n - 1) * numel * element_size if rank == 0 else numel * element_size
    raise ValueError(f"unknown collective kind {kind!r}")


_TORCH_OP = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.AVG, ReduceOp.MAX: dist.ReduceOp.MAX}
# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class NativeComm(Comm):
    name = "native"

    def _in_torch(self):
        """Inside torch's collective we cannot see the steps: blocked on every peer until it returns."""
        self._at("torch collective")
        return self.board.waiting_for(ANYONE)

    def _report_modelled(self, kind: str, tensor: torch.Tensor, src: int = 0) -> None:
        nbytes = ring_bytes_sent(kind, tensor.numel(), tensor.element_size(), self.world_size, self.rank, src)
        if nbytes:
            self._report_sent(nbytes)

    def _staged(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """NCCL moves CUDA tensors only: the small CPU tensors of the bookkeeping (bitmaps, the overflow
        flag, signatures, consolidated states) travel through the current CUDA device; :meth:`_unstage`
        copies results back."""
        if dist.get_backend(self.group) == "nccl" and any(t.device.type == "cpu" for t in tensors):
            return tuple(t.to(f"cuda:{torch.cuda.current_device()}") for t in tensors)
        return tensors

    @staticmethod
    def _unstage(staged: torch.Tensor, original: torch.Tensor) -> None:
        if staged is not original:
            original.copy_(staged)

    @collective("all_reduce")
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        (staged,) = self._staged(tensor)
        with self._in_torch():
            dist.all_reduce(staged, op=_TORCH_OP[op], group=self.group)
        self._unstage(staged, tensor)
        self._report_modelled("all_reduce", tensor)

    @collective("reduce_scatter")
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        staged_out, staged_in = self._staged(output, input)
        with self._in_torch():
            _reduce_scatter_flat(staged_out, staged_in, op=_TORCH_OP[op], group=self.group)
        self._unstage(staged_out, output)
        self._report_modelled("reduce_scatter", input)

    @collective("all_gather")
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        staged_out, staged_in = self._staged(output, input)
        with self._in_torch():
            _all_gather_flat(staged_out, staged_in, group=self.group)
        self._unstage(staged_out, output)
        self._report_modelled("all_gather", output)

    @collective("broadcast")
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        (staged,) = self._staged(tensor)
        with self._in_torch():
            dist.broadcast(staged, self.peer(src), group=self.group)
        self._unstage(staged, tensor)
        self._report_modelled("broadcast", tensor, src)

    @collective("root_all_reduce")
    def root_all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        with self._in_torch():
            dist.reduce(tensor, self.peer(0), op=dist.ReduceOp.MAX if op is ReduceOp.MAX else dist.ReduceOp.SUM,
                        group=self.group)
        if op is ReduceOp.AVG and self.rank == 0:
            tensor.div_(self.world_size)
        with self._in_torch():
            dist.broadcast(tensor, self.peer(0), group=self.group)
        self._report_modelled("root_all_reduce", tensor)

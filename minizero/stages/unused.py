"""Parameters without a gradient: refused by name, or -- with ``find_unused_parameters`` -- agreed on by every rank.

torch's DDP expects every parameter to get a gradient in every backward; a branch some ranks skip would leave their
buckets incomplete and the ranks waiting.  With ``find_unused_parameters=True`` the ranks instead agree, every
synchronising backward, on which parameters got a gradient anywhere: those are averaged (with zeros from the ranks
that did not use them: the gradient single-device training computes), the rest are not stepped.
"""
from __future__ import annotations

import torch

from ..comm import Comm, ReduceOp, Tag


def agree_on_use(comm: Comm, used: list[bool], tag: Tag) -> list[bool]:
    """Which parameters got a gradient on *any* rank: a bitmap all-reduced (MAX), as torch DDP does with
    ``find_unused_parameters``.  A parameter used on some ranks only is averaged with zeros from the
    others -- the gradient single-device training computes; one used nowhere is not stepped."""
    bitmap = torch.tensor([1.0 if u else 0.0 for u in used])
    comm.all_reduce(bitmap, ReduceOp.MAX, tag=tag)
    return [bool(u) for u in bitmap.tolist()]  # on the host by nature: which parameters to step is a host decision


def unused_error(rank: int, names: list[str], why: str) -> RuntimeError:
    return RuntimeError(
        f"rank {rank}: parameter(s) {names} got no gradient in this backward; {why}. If parameters may go unused "
        f"(on some ranks or in some steps), wrap with find_unused_parameters=True: ranks then agree every step on "
        f"which parameters got a gradient anywhere. If they are never trained, freeze them with requires_grad_(False).")


def used_after_backward(self) -> set[int]:
    """After a backward whose gradients stay full until the end (ZeRO-1, the parameter server): every
    parameter has one here -- or, with ``find_unused_parameters``, the ranks agree on which have one anywhere."""
    try:
        self.refuse_unused_here(self.groups)
        return self.used_anywhere([s.param for g in self.groups for s in g.segments])
    finally:
        self._used.clear()

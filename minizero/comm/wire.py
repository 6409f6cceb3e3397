"""What a collective over a wire calls: the one method every wire implements.

A stage averages its gradients over a wire by naming it in the collective --
``comm.reduce_scatter(shard, full, ReduceOp.AVG, tag=..., wire=self.wire, key=index)`` -- and the communication
layer hands the whole average to the wire, asking nothing else of it: the 16-bit wire encodes, has the plain
collective sum the encodings and decodes the sum (:mod:`minizero.compress.summed`); a codec's messages cannot be
added on the way, so it gathers them (:mod:`minizero.compress.gathered`); PowerSGD runs its own all-reduces of
low-rank factors (:mod:`minizero.compress.powersgd`).  torch's DDP comm hooks are the same idea: the hook is
handed the bucket and returns the future of its average.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch


class WireProtocol(Protocol):
    """A gradient wire: how an average travels."""

    def average(self, comm, collective: Callable[..., None], kind: str, arguments: dict, key, tag,
                layout: list | None) -> None:
        """Average ``arguments``' tensor over ``comm``'s ranks as the collective ``kind`` would -- an all-reduce
        in place (``tensor``), a reduce-scatter or a push into ``output`` -- and divide by N.  ``collective(comm,
        **arguments, tag=tag)`` runs the plain collective on whatever tensors the wire puts in ``arguments``;
        ``key`` names the buffer (its error-feedback residual); ``layout`` lists the ``(name, shape)`` of the
        tensors a flat buffer holds, for a wire that compresses each matrix on its own."""

    def held(self) -> list[torch.Tensor]:
        """What the wire keeps between steps (error-feedback residuals, warm starts): counted as memory."""

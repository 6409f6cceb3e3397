"""The parameter server's two exchanges, built from point-to-point messages: **push** and **pull**.

A flat tensor is cut into ``S`` equal shards; shard ``j`` belongs to *server*
``j`` (ranks ``0 .. S-1``).  Every rank is also a *worker* -- servers are
co-located with workers, as MXNet's KVStore allows (BytePS puts them on CPU
machines) -- so the global batch is the same as every other stage's.

* **push**: every rank sends shard ``j`` of its gradients to server ``j``;
  server ``j`` adds the ``N`` contributions.  A star, not a ring: each
  message goes straight to its owner.
* **pull**: server ``j`` sends its shard to every other rank.

Bytes.  A worker sends ``Psi`` (push) and nothing else; a server sends
``(S-1)/S * Psi`` (push) and ``(N-1)/S * Psi`` (pull).  Summed over ranks that
is ``2(N-1) Psi``, exactly a ring all-reduce's: a parameter server moves no
more bytes than DDP.  What differs is *where* they go: with ``S = 1`` the
server sends ``(N-1) Psi``, growing with ``N`` -- the bottleneck the ring
all-reduce was invented to remove -- and with ``S = N`` every rank sends
``2(N-1)/N Psi``, the ring's figure (it *is* a reduce-scatter and an
all-gather, done with direct messages instead of a ring).

**all-to-all** is the same star with every rank a server and nothing summed: chunk ``j`` of each rank's tensor
goes to rank ``j`` as it is -- for messages that cannot be added on the way (an int8 code with its own scale).

The server adds the contributions in the ring's order -- shard ``j`` starts
with rank ``j+1``'s and ends with its own -- so 16-bit sums round exactly as
a reduce-scatter's do, and the same-casts reference
(:mod:`minizero.course.harness.casts_reference`) serves both.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .collective import ReduceOp, collective
from .placement import on_device
from .progress import ANYONE


def _all_to_all_shapes(comm, output: torch.Tensor, input: torch.Tensor, kind: str, where: str, arguments: dict) -> None:
    """An all-to-all's shapes: one dtype and one size each way, N equal chunks."""
    if output.dtype != input.dtype or output.numel() != input.numel() or input.numel() % comm.world_size:
        raise ValueError(f"{where}: input and output must be one dtype and one size, a multiple of world_size "
                         f"{comm.world_size} (N equal chunks); got {input.dtype} x {input.numel()} and "
                         f"{output.dtype} x {output.numel()}")


def _star_shapes(comm, output: torch.Tensor, input: torch.Tensor, kind: str, where: str, arguments: dict) -> None:
    """A push's or pull's shapes: ``S`` shards, and a worker (rank >= S) owns none."""
    servers = arguments["servers"]
    full, shard = (input, output) if kind == "push" else (output, input)
    if output.dtype != input.dtype:
        raise TypeError(f"{where}: output dtype {output.dtype} differs from input dtype {input.dtype}")
    if not (isinstance(servers, int) and 1 <= servers <= comm.world_size):
        raise ValueError(f"{where}: servers must be a whole number from 1 to world_size "
                         f"{comm.world_size}, got {servers!r}")
    shard_size = full.numel() // servers if comm.rank < servers else 0
    if full.numel() % servers or shard.numel() != shard_size:
        raise ValueError(
            f"{where}: the full tensor must hold servers x shard elements ({servers} servers; a worker's "
            f"shard is empty), got {full.numel()} and {shard.numel()}; pad it to a multiple of servers "
            f"(see minizero.parts.layout)")


class StarExchanges:
    """Push, pull and all-to-all, for every :class:`~minizero.comm.base.Comm` (both backends: direct messages
    are point-to-point by definition, so ``native`` runs the same messages as ``ring``)."""

    shape_checks = {"push": _star_shapes, "pull": _star_shapes, "all_to_all": _all_to_all_shapes}

    @collective("push")
    @on_device(point_to_point=True)
    def push(self, output: torch.Tensor, input: torch.Tensor, servers: int, op: ReduceOp = ReduceOp.SUM) -> None:
        """``input``: this rank's full flat tensor (``S`` shards).  On server ``j``, ``output`` (its shard's
        size; it may view ``input``) gets shard ``j`` reduced over every rank; on a worker it is empty."""
        size, n = input.numel() // servers, self.world_size
        own = input[self.rank * size:(self.rank + 1) * size].clone() if self.rank < servers else None
        sends = [(input[j * size:(j + 1) * size], j) for j in range(servers) if j != self.rank]
        order = [(self.rank + k) % n for k in range(1, n)] if own is not None else []  # the ring's: j+1 first
        # One receive buffer, each contribution added as it arrives -- but NCCL takes every receive at once, each
        # into a buffer of its own: a server then holds N-1 incoming shards for a moment.
        one = [torch.empty_like(own)] if order else []
        buffers = [torch.empty_like(own) for _ in order] if self._nccl else one * len(order)

        def arrived(i: int) -> None:
            if i == 0:
                output.copy_(buffers[0])
            else:
                op.combine(output, buffers[i], out=output)

        self._at("push")
        self._exchange(sends, list(zip(buffers, order, strict=True)), arrived)
        if own is None:
            return
        if order:
            op.combine(output, own, out=output)  # our own contribution last, as the ring adds it
        else:
            output.copy_(own)
        if op is ReduceOp.AVG:
            output.div_(n)

    @collective("pull")
    @on_device(point_to_point=True)
    def pull(self, output: torch.Tensor, input: torch.Tensor, servers: int,
             stale: list[torch.Tensor] | None = None) -> None:
        """``output``: the full flat tensor every rank fills from the servers' shards; ``input``: this
        server's shard (empty on a worker).  ``stale`` (``ps-async``): per destination rank, the shard to
        send it instead -- an older version of ``input``."""
        size = output.numel() // servers
        sends = []
        if self.rank < servers:
            outgoing = stale if stale is not None else [input] * self.world_size
            output[self.rank * size:(self.rank + 1) * size].copy_(outgoing[self.rank])
            sends = [(outgoing[dst].contiguous(), dst) for dst in range(self.world_size) if dst != self.rank]
        recvs = [(output[j * size:(j + 1) * size], j) for j in range(servers) if j != self.rank]
        self._at("pull")
        self._exchange(sends, recvs)

    @collective("all_to_all")
    @on_device(point_to_point=True)
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``input``: N equal chunks, chunk ``j`` for rank ``j``; ``output``: N equal chunks, chunk ``i`` the one
        rank ``i`` sent here (this rank's own copied).  Every message straight to its owner, (N-1)/N of the tensor
        per rank in N-1 messages -- a reduce-scatter's bytes, without the sum on the way: what a wire whose
        messages do not add up needs to average a shard (ZeRO++'s qgZ, :mod:`minizero.compress.gathered`)."""
        n, r = self.world_size, self.rank
        size = input.numel() // n
        chunk = lambda t, j: t[j * size:(j + 1) * size]  # noqa: E731
        chunk(output, r).copy_(chunk(input, r))
        peers = [(r + k) % n for k in range(1, n)]  # send to the right first, receive from the left first
        self._at("all-to-all")
        self._exchange([(chunk(input, j), j) for j in peers], [(chunk(output, (r - k) % n), (r - k) % n)
                                                              for k in range(1, n)])

    def _exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                  arrived=lambda i: None) -> None:
        """Post every send, then take the receives in order, calling ``arrived(i)`` after the i-th.  Under NCCL
        all of them go in one group (``batch_isend_irecv``), which NCCL needs to pair sends and receives issued
        in different orders; it returns one handle for the whole group."""
        sends = [(t, dst) for t, dst in sends if t.numel() > 0]
        recvs = [(i, t, src) for i, (t, src) in enumerate(recvs) if t.numel() > 0]
        start = time.perf_counter()  # a dialled port receives while it sends (full duplex): see below
        for tensor, dst in sends:  # on a dialled network they leave one after another, through one port
            self._leaving(tensor.numel() * tensor.element_size(), dst)
        if self._nccl:
            ops = [dist.P2POp(dist.isend, t, self.peer(dst), group=self.group) for t, dst in sends]
            ops += [dist.P2POp(dist.irecv, t, self.peer(src), group=self.group) for _, t, src in recvs]
            with self.board.waiting_for(ANYONE):
                for request in dist.batch_isend_irecv(ops) if ops else []:
                    request.wait()
            for i, _, _ in recvs:
                arrived(i)
            requests = []
        else:
            requests = [(dist.isend(t, self.peer(dst), group=self.group), dst) for t, dst in sends]
            for i, tensor, src in recvs:
                with self.board.waiting_for(self.peer(src)):
                    dist.recv(tensor, self.peer(src), group=self.group)
                arrived(i)
        if self.port is not None:  # the incoming messages stream in through one port: a server's incast
            self.port.receive_all(start, [t.numel() * t.element_size() for _, t, _ in recvs],
                                  [self._members[src] for _, _, src in recvs])
        for request, dst in requests:
            with self.board.waiting_for(self.peer(dst)):
                request.wait()
        for tensor, dst in sends:  # every message has left (NCCL: the group's one handle said so)
            self._report_sent(tensor.numel() * tensor.element_size(), dst)

"""Collectives built from nothing but point-to-point ``isend``/``recv``.

Picture the ranks on a ring: rank ``r`` sends only to its right neighbour
``r+1`` and receives only from its left neighbour ``r-1``.  Cut the tensor
into ``N`` chunks.  Then

* **reduce-scatter** takes ``N-1`` steps: at each step a rank passes one
  partially reduced chunk to the right and adds its own contribution to the
  chunk arriving from the left.  After ``N-1`` steps rank ``r`` holds chunk
  ``r`` summed over all ranks.  Each rank sent ``(N-1)/N`` of the tensor.
* **all-gather** takes ``N-1`` more steps: each rank forwards the finished
  chunk it last received.  Another ``(N-1)/N`` of the tensor.
* **all-reduce** is reduce-scatter followed by all-gather:
  ``2(N-1)/N * S`` bytes per rank, independent of ``N`` as ``N`` grows --
  which is why ring all-reduce scales and the root all-reduce does not.

Every rank sends and receives at once (``isend`` then ``recv``), so each link
of the ring is busy in both steps of the pipeline and no rank waits for a
rank that waits for it (a deadlock with blocking ``send`` on both sides).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Comm
from .collective import ReduceOp, chunk_bounds, collective
from .placement import on_device
from .progress import ANYONE
from .star import StarExchanges


def broadcast_message(element_size: int) -> int:
    """Elements per message of the pipelined broadcast: 1 MiB."""
    return max(1, (1 << 20) // element_size)


class RingComm(StarExchanges, Comm):
    name = "ring"

    def __init__(self, group: dist.ProcessGroup | None = None, check: bool = False, network=None):
        super().__init__(group, check, network)
        self._scratch_buffers: dict[tuple, torch.Tensor] = {}
        self._pair_steps = self._nccl  # each ring step's send and receive in one group (_paired)

    # ---------------------------------------------------------------- p2p
    def _send_right_recv_left(self, send: torch.Tensor | None, recv: torch.Tensor | None, part: str,
                              step: int) -> None:
        """Ring step ``step`` of ``part``: send ``send`` to the right while receiving ``recv`` from the left.

        Empty chunks (fewer elements than ranks) are skipped on both ends: the
        chunk a rank sends is the chunk its right neighbour expects, so both
        sides agree on the skip.  (Splitting a step's chunk into smaller messages, so
        reducing one overlaps receiving the next, measured slower on gloo: one
        large message per step is best.)
        """
        if self.world_size == 1:  # gloo's own words would be "Pair is not connected"
            raise RuntimeError(f"rank {self.rank}: ring step {step} of the {part} on a world of one rank: it would "
                               f"send to itself -- a ring of N ranks takes N - 1 steps per phase, none at N = 1")
        right, left = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        self._at(part, step)
        if self._pair_steps:
            return self._paired(send, recv, right, left)
        request = None
        if send is not None and send.numel() > 0:
            self._leaving(send.numel() * send.element_size(), right)
            request = dist.isend(send, self.peer(right), group=self.group)
        if recv is not None and recv.numel() > 0:
            with self.board.waiting_for(self.peer(left)):  # the board is indexed by global rank
                dist.recv(recv, self.peer(left), group=self.group)
            self._arrived(recv.numel() * recv.element_size(), left)
        if request is not None:
            with self.board.waiting_for(self.peer(right)):
                request.wait()
            self._report_sent(send.numel() * send.element_size(), right)

    def _paired(self, send: torch.Tensor | None, recv: torch.Tensor | None, right: int, left: int) -> None:
        """NCCL: the send and the receive of a step go in one group (``batch_isend_irecv``).  Issued one by
        one, each rank's send would queue on its NCCL stream ahead of its receive, and every send waits for
        a receive queued behind its neighbour's send: the ring deadlocks."""
        ops = []
        if send is not None and send.numel() > 0:
            self._leaving(send.numel() * send.element_size(), right)
            ops.append(dist.P2POp(dist.isend, send, self.peer(right), group=self.group))
        if recv is not None and recv.numel() > 0:
            ops.append(dist.P2POp(dist.irecv, recv, self.peer(left), group=self.group))
        if ops:
            with self.board.waiting_for(self.peer(left)):
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
        if send is not None and send.numel() > 0:
            self._report_sent(send.numel() * send.element_size(), right)

    def _scratch(self, numel: int, like: torch.Tensor) -> list[torch.Tensor]:
        """Two receive buffers of ``numel`` elements, kept between calls.

        Fresh buffers would cost a page fault per 4 KiB on every call -- at
        64 MB that alone took a third of the all-reduce time.  They live on the
        Comm, not in any stage's model state.
        """
        key = (like.dtype, like.device)
        cached = self._scratch_buffers.get(key)
        if cached is None or cached.numel() < 2 * numel:
            cached = self._scratch_buffers[key] = torch.empty(2 * numel, dtype=like.dtype, device=like.device)
        return [cached[:numel], cached[numel:2 * numel]]

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        if tensor.numel() > 0:
            self._leaving(tensor.numel() * tensor.element_size(), dst)
            with self.board.waiting_for(self.peer(dst)):
                dist.send(tensor, self.peer(dst), group=self.group)
            self._report_sent(tensor.numel() * tensor.element_size(), dst)

    def _recv(self, tensor: torch.Tensor, src: int) -> None:
        if tensor.numel() > 0:
            with self.board.waiting_for(self.peer(src)):
                dist.recv(tensor, self.peer(src), group=self.group)
            self._arrived(tensor.numel() * tensor.element_size(), src)

    def _chunks(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        flat = tensor.view(-1)
        return [flat[a:b] for a, b in chunk_bounds(flat.numel(), self.world_size)]

    def _one_chunk_per_rank(self, chunks: list[torch.Tensor], phase: str) -> None:
        """A list of chunks that is not one per rank pairs a rank's chunk with the wrong peer's -- or indexes past its
        end, far from the cause: refused here, saying where such a list comes from."""
        if len(chunks) != self.world_size:
            raise ValueError(
                f"rank {self._root.rank}: the ring's {phase} takes one chunk per rank of its ring ({self.world_size}), "
                f"empty ones included, and got {len(chunks)} -- torch.chunk and torch.split return fewer pieces than "
                f"asked for a tensor of few elements; cut with minizero.comm.chunk_bounds (or self._chunks)")

    # ------------------------------------------------------ the two phases
    def _ring_reduce_scatter(self, chunks: list[torch.Tensor], out: torch.Tensor, op: ReduceOp) -> None:
        """Leave in ``out`` the sum over ranks of ``chunks[self.rank]``.

        ``chunks`` are this rank's contributions and are only read, except
        when ``out`` *is* ``chunks[rank]`` (all-reduce works in place).  The
        partial sums travelling round the ring live in two scratch buffers of
        one chunk each.
        Step ``s`` sends chunk ``r-s-1`` and receives chunk ``r-s-2``, so the
        last chunk to arrive, at step ``N-2``, is chunk ``r`` itself.
        """
        self._one_chunk_per_rank(chunks, "reduce-scatter")
        n, r = self.world_size, self.rank
        if n == 1:
            if out is not chunks[r]:
                out.copy_(chunks[r])
            return
        buffers = self._scratch(max(c.numel() for c in chunks), out)
        send = chunks[(r - 1) % n]
        for step in range(n - 1):
            index = (r - step - 2) % n
            # Receive into the buffer that is *not* in flight: two buffers alternate.
            incoming = buffers[step % 2][: chunks[index].numel()]
            self._send_right_recv_left(send, incoming, "reduce-scatter", step)
            if index == r:
                op.combine(incoming, chunks[index], out=out)
            else:
                send = op.combine(incoming, chunks[index], out=incoming)

    def _ring_all_gather(self, chunks: list[torch.Tensor]) -> None:
        """``chunks[rank]`` is complete on every rank; fill in the others.
        Step ``s`` forwards chunk ``r-s`` and receives chunk ``r-s-1``."""
        self._one_chunk_per_rank(chunks, "all-gather")
        n, r = self.world_size, self.rank
        for step in range(n - 1):
            self._send_right_recv_left(chunks[(r - step) % n], chunks[(r - step - 1) % n], "all-gather", step)

    # -------------------------------------------------------- collectives
    @collective("all_reduce")
    @on_device(point_to_point=True)
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        self._all_reduce(tensor, op)

    @collective("reduce_scatter")
    @on_device(point_to_point=True)
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        self._reduce_scatter(output, input, op)

    @collective("all_gather")
    @on_device(point_to_point=True)
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._all_gather(output, input)

    # The algorithms, apart from the checking and booking around them: a hierarchical Comm replaces them.
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        chunks = self._chunks(tensor)
        mine = chunks[self.rank]
        self._ring_reduce_scatter(chunks, mine, op)
        if op is ReduceOp.AVG:
            mine.div_(self.world_size)  # on 1/N of the data, before it is copied N-1 times
        self._ring_all_gather(chunks)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
        self._ring_reduce_scatter(self._chunks(input), output.view(-1), op)
        if op is ReduceOp.AVG:
            output.div_(self.world_size)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        chunks = self._chunks(output)
        chunks[self.rank].copy_(input.view(-1))
        self._ring_all_gather(chunks)

    @collective("broadcast")
    @on_device(point_to_point=True)
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """A pipelined chain ``src -> src+1 -> ... -> src-1``: 1 MiB messages are
        forwarded as soon as they arrive, so the chain costs about one tensor
        transfer, not ``N-1``.  Every rank but the last in the chain sends the
        tensor once."""
        n = self.world_size
        if n == 1:
            return
        position = (self.rank - src) % n
        messages = tensor.view(-1).split(broadcast_message(tensor.element_size()))
        requests = []
        right = (self.rank + 1) % n
        self._at("broadcast")
        for message in messages:
            if position > 0:
                self._recv(message, (self.rank - 1) % n)
            if position < n - 1 and message.numel() > 0:
                self._leaving(message.numel() * message.element_size(), right)
                requests.append((dist.isend(message, self.peer(right), group=self.group), message))
        for request, message in requests:
            with self.board.waiting_for(ANYONE):  # whoever is downstream in the chain
                request.wait()
            self._report_sent(message.numel() * message.element_size(), right)

    @collective("root_all_reduce")
    @on_device(point_to_point=True)
    def root_all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        """The naive all-reduce, for contrast: everyone sends to rank 0, rank 0
        adds, then sends the result back to everyone.  The root sends
        ``(N-1) * S`` bytes and receives as many: its link is the bottleneck
        and grows with ``N`` -- the parameter-server problem."""
        self._at("gather to root")
        if self.rank == 0:
            incoming = torch.empty_like(tensor)
            for src in range(1, self.world_size):
                self._recv(incoming, src)
                op.combine(tensor, incoming, out=tensor)
            if op is ReduceOp.AVG:
                tensor.div_(self.world_size)
            self._at("broadcast from root")
            for dst in range(1, self.world_size):
                self._send(tensor, dst)
        else:
            self._send(tensor, 0)
            self._recv(tensor, 0)

"""The same interface over torch's built-in collectives (gloo, NCCL).

This is the yardstick the send/recv ring is measured against, and the backend
to use for real runs.  torch does not tell us what it sent, so the ledger is
fed the bytes the ring algorithm sends for the same call
(:func:`ring_bytes_sent`); tests check that the ring really sends exactly that.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .base import Comm
from .collective import ReduceOp, chunk_bounds, collective
from .placement import on_device
from .progress import ANYONE
from .ring import broadcast_message
from .star import StarExchanges


def ring_messages(kind: str, numel: int, element_size: int, world_size: int, rank: int, src: int = 0) -> list[int]:
    """The bytes of each message rank ``rank`` sends in minizero's ring version of ``kind`` on a full
    tensor of ``numel`` elements, in order (empty chunks send nothing)."""
    n, r = world_size, rank
    if n == 1:
        return []
    if kind in ("reduce_scatter", "all_gather"):
        sizes = [numel // n] * (n - 1)
    elif kind == "all_reduce":
        chunks = [b - a for a, b in chunk_bounds(numel, n)]
        # reduce-scatter step s sends chunk r-s-1, all-gather step s chunk r-s: every chunk but r, then but r+1.
        sizes = [chunks[(r - s - 1) % n] for s in range(n - 1)] + [chunks[(r - s) % n] for s in range(n - 1)]
    elif kind == "broadcast":
        per = broadcast_message(element_size)
        sizes = [] if (r - src) % n == n - 1 else [min(per, numel - a) for a in range(0, numel, per)]
    elif kind == "root_all_reduce":
        sizes = [numel] * (n - 1 if r == 0 else 1)
    else:
        raise ValueError(f"unknown collective kind {kind!r}")
    return [k * element_size for k in sizes if k > 0]


def ring_bytes_sent(kind: str, numel: int, element_size: int, world_size: int, rank: int, src: int = 0) -> int:
    """Bytes rank ``rank`` sends in minizero's ring version of ``kind``."""
    return sum(ring_messages(kind, numel, element_size, world_size, rank, src))


_TORCH_OP = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.AVG, ReduceOp.MAX: dist.ReduceOp.MAX}
# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


#: The process groups views were given, by the group they were carved from, then by their global ranks.  A group
#: lives until it is destroyed -- in gloo, a device whose loop thread wakes every 10 ms, and two worker threads -- so a
#: Comm built per example must not make its own: the suite builds thousands on one pool of ranks, and their idle
#: groups (700 loop threads on two cores) once took more of the CPU than the tests.  Every rank builds the same Comms
#: in the same order, so each finds, or creates, the same groups at the same call (``new_group`` is collective).
_SUBGROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def subgroup(parent: dist.ProcessGroup, ranks: list[int]) -> dist.ProcessGroup:
    """The process group of global ranks ``ranks`` within ``parent``: made once per process, then reused."""
    made = _SUBGROUPS.setdefault(parent, {})
    if tuple(ranks) not in made:
        made[tuple(ranks)] = dist.new_group(ranks)
    return made[tuple(ranks)]


class NativeComm(StarExchanges, Comm):
    name = "native"

    def _in_torch(self, tensor: torch.Tensor | None = None, src: int | None = None):
        """Inside torch's collective we cannot see the steps: blocked on every peer until it returns.  On a dialled
        network the first of a collective's torch calls marks this rank's start, posted to the peers that count
        from it (every peer; in a broadcast, the source's start only): the collective starts on the wire when its
        last rank joins, and torch's transfer runs under the wait that follows (:meth:`_report_modelled`).  Not
        for an empty ``tensor``: torch returns at once, without its peers, and nothing goes on the wire."""
        self._at("torch collective")
        if self.port is not None and tensor is not None and tensor.numel() > 0 and \
                getattr(self._local, "began", None) is None:
            self._local.began = self.port.join(self._starts(src, posted=True))
        return self.board.waiting_for(ANYONE)

    def _starts(self, src: int | None, posted: bool) -> list[int]:
        """The global ranks this rank posts its start to (``posted``), or reads theirs from."""
        others = [self._members[r] for r in range(self.world_size) if r != self.rank]
        if src is None:
            return others
        return (others if self.rank == src else []) if posted else ([] if self.rank == src else [self._members[src]])

    def __init__(self, group: dist.ProcessGroup | None = None, check: bool = False, network=None):
        super().__init__(group, check, network)
        # torch's collectives over a view need a process group of just its ranks; creating one is collective
        # (every rank, every group, one order), so on a cluster of nodes every group a view may span is made now.
        parent = self.group if self.group is not None else dist.group.WORLD
        self._subgroups = {} if self.nodes is None else {
            tuple(ranks): subgroup(parent, [self.peer(r) for r in ranks]) for ranks in self.nodes.groups()}

    def _group_over(self, members: list[int]):
        if len(members) == self._root.world_size:
            return self._root.group
        try:
            return self._root._subgroups[tuple(members)]
        except KeyError:
            raise ValueError(f"rank {self.rank}: the native backend has process groups for nodes and across "
                             f"nodes only, not ranks {members}") from None

    def _report_modelled(self, kind: str, tensor: torch.Tensor, src: int = 0) -> None:
        """Book the ring version's bytes; on a dialled network, wait as the ring version would, counted from the
        start of torch's collective, whose transfer ran under the wait (as the ring's runs under its messages').
        Each message goes to the right neighbour; the root all-reduce's, between the root and each rank."""
        began, self._local.began = getattr(self._local, "began", None), None
        if self.port is not None and began is not None:
            began = self.port.started(began, self._starts(src if kind == "broadcast" else None, posted=False))
        if self.port is not None and self.world_size == 1 and self.port.stands_for > 1:
            # One GPU standing for a ring of N: hold what rank 0 of N would send (bench gpu-efficiency's dial).
            for nbytes in ring_messages(kind, tensor.numel(), tensor.element_size(), self.port.stands_for, 0, src):
                self.port.hold(self.port.wire_to(None).message_s(nbytes), kind, nbytes)
            return
        messages = ring_messages(kind, tensor.numel(), tensor.element_size(), self.world_size, self.rank, src)
        n = self.world_size
        to = ([dst for dst in range(1, n)] if self.rank == 0 else [0]) if kind == "root_all_reduce" \
            else [(self.rank + 1) % n] * len(messages)
        if self.port is not None:
            self._wait_like_the_ring(kind, tensor, src, list(zip(messages, to, strict=True)), began)
        for nbytes, dst in zip(messages, to, strict=True):
            self._report_sent(nbytes, dst)

    def _wait_like_the_ring(self, kind: str, tensor: torch.Tensor, src: int, messages: list[tuple[int, int]],
                            began: float | None) -> None:
        """In a ring step every rank sends one message and waits for one, so each rank's own messages are its
        time.  The root all-reduce and the chain broadcast are not symmetric: a rank's time is where it
        sits on the critical path (the root: N-1 tensors in through one port, N-1 out in turn; position p
        of the chain: p hops behind the source, then every message) -- on a cluster, at the slowest wire's pace."""
        n, nbytes = self.world_size, tensor.numel() * tensor.element_size()
        wires = [self.port.wire_to(self._members[r]) for r in range(n)]
        net = max((w for w in wires if w is not None), key=lambda w: w.message_s(nbytes), default=None)
        if net is None:
            return
        if kind == "root_all_reduce" and n > 1:
            gathered = net.alpha + (n - 1) * nbytes / net.bandwidth
            self.port.hold(gathered + (self.rank if self.rank else n - 1) * net.message_s(nbytes), kind, since=began)
        elif kind == "broadcast" and n > 1:
            position = (self.rank - src) % n
            chain = ring_messages(kind, tensor.numel(), tensor.element_size(), n, src, src)
            hops = [net.message_s(b) for b in chain]
            if hops:
                self.port.hold(position * hops[0] + sum(hops) - (hops[-1] if position == n - 1 else 0.0), kind,
                               since=began)
        else:  # modelled messages, one after another out of this port from the collective's start: nobody reads them
            for message, dst in messages:
                self.port.depart(message, kind, self._members[dst], now=began, post=False)

    @collective("all_reduce")
    @on_device
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        with self._in_torch(tensor):
            dist.all_reduce(tensor, op=_TORCH_OP[op], group=self.group)
        self._report_modelled("all_reduce", tensor)

    @collective("reduce_scatter")
    @on_device
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        with self._in_torch(input):
            _reduce_scatter_flat(output, input, op=_TORCH_OP[op], group=self.group)
        self._report_modelled("reduce_scatter", input)

    @collective("all_gather")
    @on_device
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        with self._in_torch(output):
            _all_gather_flat(output, input, group=self.group)
        self._report_modelled("all_gather", output)

    @collective("broadcast")
    @on_device
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        with self._in_torch(tensor, src):
            dist.broadcast(tensor, self.peer(src), group=self.group)
        self._report_modelled("broadcast", tensor, src)

    @collective("root_all_reduce")
    @on_device
    def root_all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        with self._in_torch(tensor):
            dist.reduce(tensor, self.peer(0), op=dist.ReduceOp.MAX if op is ReduceOp.MAX else dist.ReduceOp.SUM,
                        group=self.group)
        if op is ReduceOp.AVG and self.rank == 0:
            tensor.div_(self.world_size)
        with self._in_torch():
            dist.broadcast(tensor, self.peer(0), group=self.group)
        self._report_modelled("root_all_reduce", tensor)

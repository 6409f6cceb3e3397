"""Views of a Comm: the same ranks' communication layer, seen as a node's ranks or as the ranks at one place on
every node (:mod:`.nodes`) -- what the hierarchical collectives and HSDP's 2-D mesh run their collectives on.

A view is a shallow copy of the whole Comm with another ``rank``, ``world_size`` and member list.  Everything that
must stay one per rank is the whole Comm's and shared by reference: the communication thread (so every view's
collectives run in the one order all ranks issue them, and their messages never interleave), the byte ledger and
the other observers, the dialled port, the progress board.  torch's own collectives need a process group of the
view's ranks, made once at construction (:class:`~minizero.comm.native.NativeComm`); the ring's point-to-point
messages name their peers by global rank in the whole group.  The nodes' shared links, for a dialled cluster, are
opened here too -- and a dialled network's mailbox: one file each per run, its path agreed at construction.
"""
from __future__ import annotations

import copy
import os
import socket
import tempfile
import warnings
import weakref

import torch.distributed as dist

from .network import TwoLevel
from .nodes import Nodes, assumed_nodes
from .port import Mailbox, NodeLinks


class Views:
    """What :class:`~minizero.comm.base.Comm` offers for nodes: :meth:`over`, and its construction's shared links."""

    def _node_links(self, network) -> NodeLinks | None:
        """The nodes' shared links, for a cluster with a dialled inter-node wire."""
        if not isinstance(network, TwoLevel) or network.inter is None or network.nodes.count == 1:
            return None
        return NodeLinks(self._agreed_file("minizero-links-"), network.nodes.count)

    def _mailbox(self, network) -> Mailbox | None:
        """Where a dialled network's senders post each message's arrival time for its receiver (:mod:`.port`).
        None under NCCL, where a dialled wait is a kernel on the device instead, and for one rank."""
        if network is None or self._nccl or self.world_size == 1:
            return None
        return Mailbox(self._agreed_file("minizero-mailbox-"), self.world_size)

    def _agreed_file(self, prefix: str) -> str:
        """A file every rank opens: its path chosen by rank 0 and broadcast -- a collective, at construction, as
        torch's groups are.  A dialled network is simulated on one machine; a rank on another host is refused,
        since the file would not reach it."""
        agreed = [None]
        if self.rank == 0:
            handle, path = tempfile.mkstemp(prefix=prefix)
            os.close(handle)
            agreed[0] = (path, socket.gethostname())
            weakref.finalize(self, os.unlink, path)  # when rank 0's Comm goes: the others' open handles keep it
        dist.broadcast_object_list(agreed, src=self.peer(0), group=self.group)
        path, host = agreed[0]
        if host != socket.gethostname():
            raise ValueError(f"rank {self.rank}: a dialled network runs its ranks on one machine (each message's "
                             f"arrival time is shared through a file), but this rank is on {socket.gethostname()!r} "
                             f"and rank 0 on {host!r}; drop --network, or run the ranks on one host")
        return path

    def over(self, ranks: list[int]) -> "Views":
        """A Comm over some of this one's ranks (``ranks``, which include this rank), in that order: a
        node's ranks, or the ranks at one place on every node.  It is a *view*: its collectives see
        ``rank`` and ``world_size`` of the sub-group, but run on the whole Comm's communication thread, in
        the one order every rank issues them, so messages of the views never interleave; the ledger and the
        dialled port are the whole Comm's, so a view's bytes are booked with their links.  Called inside a
        collective, a view's collective is part of it (booked once, under the outer kind)."""
        if self.rank not in ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"rank {self.rank}: a view over ranks {ranks} must name distinct ranks of this Comm "
                             f"(0..{self.world_size - 1}), this one included")
        view = copy.copy(self)
        view._members = [self._members[r] for r in ranks]
        view.rank, view.world_size = ranks.index(self.rank), len(ranks)
        view._calls, view._failed = 0, None
        view.group = self._group_over(view._members)
        return view

    def _group_over(self, members: list[int]):
        """The process group a view's messages travel in: the whole one, for point-to-point messages (a
        view's peers are named by their global rank); torch's own collectives need a group of just those
        ranks (:class:`~minizero.comm.native.NativeComm`)."""
        return self._root.group

    def nodes_or_assumed(self, who: str) -> Nodes:
        """The nodes this Comm's ranks sit on -- or, for a Comm built without any, the nodes ``who`` (a stage or
        option whose mesh is the nodes) assumes: :func:`~minizero.comm.nodes.assumed_nodes`.  Not on the native
        backend, whose views need process groups made at construction."""
        if self.nodes is not None:
            return self.nodes
        nodes = assumed_nodes(self.world_size)
        if nodes.per_node == 1 and self.rank == 0:  # still equivalent training, but not what the user asked for
            warnings.warn(f"{who} on {self.world_size} ranks with no nodes given: assumed {nodes.count} nodes of 1 "
                          f"rank, so nothing is sharded within a node (G = 1) and every rank holds all the state. "
                          f"Say where the ranks sit: make_comm(..., network='nodes=MxG') (train: --network)",
                          stacklevel=3)
        if self.name == "native":
            raise ValueError(f"rank {self.rank}: {who} on the native backend needs the nodes at the Comm's "
                             f"construction (it creates their process groups): make_comm('native', "
                             f"network='nodes={nodes.count}x{nodes.per_node}')")
        return nodes

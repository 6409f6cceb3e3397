"""Lab hierarchical -- the two-level all-reduce, on a cluster of nodes (lessons/17_topology.ipynb).
Guided level: the method says what to do and which parts exist; the contract level states only what must hold.

N = M x G ranks sit on M nodes of G ranks; inside a node the link is fast, and each node's one slow link is shared
by its G ranks.  A flat ring all-reduce takes 2(N-1) steps, each crossing between nodes at every node's last rank.
Write it in two levels instead: the slow link carries 2(M-1)/M of the tensor per node, not 2(N-1)/N, in 2(M-1)
slow steps instead of 2(N-1).  Given: ``all_reduce``, which checks the call, books its bytes and calls your
``_all_reduce``; reduce-scatter, all-gather and every other collective (the package's); and two views of the Comm:
``self.node`` (your node's G ranks; its ``rank`` is your place j) and ``self.across`` (the M ranks at place j on
every node; its ``rank`` is your node k) -- each a flat ring over those ranks.

Check it:   python -m minizero check hierarchical --impl THIS_FILE
(or, in a notebook:  from minizero.course.labs import check; check("hierarchical", impl="THIS_FILE"))
The checker compares every result with the flat ring's on every node shape of up to four ranks, then counts each
rank's bytes on each link class -- inside its node and between nodes -- against the two-level formula: a flat ring
gives the right values and fails there.
"""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.given import Hierarchical as GivenHierarchical


class Hierarchical(GivenHierarchical):
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """Leave in every rank's ``tensor`` the reduction by ``op`` over all N ranks, in three phases.

        1. Inside the node, a reduce-scatter over G *columns*: cut the flat tensor into G chunks (``self.node._chunks``
           does: uneven sizes, some empty when there are fewer elements than ranks -- views into ``tensor``, so what
           is written to them is written to it) and run the node's ring reduce-scatter
           (``self.node._ring_reduce_scatter(chunks, out, op)``) with ``out`` your own column, the one at your place:
           it then holds your node's reduction of that column.
        2. Across the nodes, an all-reduce of your column alone among the M ranks at your place -- the across view's
           all-reduce is a flat ring's.  For AVG, reduce with SUM there (the across ring's AVG would divide by M), and
           divide your column by N yourself, once, after it: it now holds the final values.
        3. Inside the node, an all-gather of the columns (``self.node._ring_all_gather(chunks)``), so every rank
           gets every place's column.  Last: gathered before phase 2, the other columns would hold only your node's
           reduction.

        ``ReduceOp.SUM``/``AVG``/``MAX``: the ops; the ring phases combine with ``op`` (a sum for AVG).
        """
        raise NotImplementedError("write Hierarchical._all_reduce: every rank's tensor = the reduction over all N "
                                  "ranks, in two levels -- inside the node, then across the nodes")

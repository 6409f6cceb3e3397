"""Lab hierarchical -- the two-level all-reduce, on a cluster of nodes (lessons/17_topology.ipynb).

Contract level: the method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says how the three phases go and which parts exist: ``python -m minizero lab hierarchical FILE
--level guided``.)

N = M x G ranks sit on M nodes of G ranks each; rank r is on node k = r // G, at place j = r % G.  Inside a node the
link is fast; between nodes each node has one slow link its G ranks share.  A flat ring over all N ranks crosses
between nodes at every node's last rank on every one of its 2(N-1) steps.  You write the all-reduce that crosses as
little as it can, in two levels.

Your base, ``Hierarchical``, is the package's ``HierarchicalComm`` without its ``_all_reduce``: the public
``all_reduce`` (checks and booking) calls yours; reduce-scatter, all-gather and every other collective are given.
It holds two views of itself, each a Comm over some of the ranks, with that group's ``rank`` and ``world_size``:
  ``self.node``    the G ranks of your node (its rank: your place j);
  ``self.across``  the M ranks at your place j on every node (its rank: your node k).
Both are flat rings over their ranks: their collectives, and their ring phases (``_ring_reduce_scatter(chunks, out,
op)``, ``_ring_all_gather(chunks)``, ``_chunks(tensor)``: the ring lab's, given), run inside your all-reduce and are
booked with it, each message under the link class it crosses.  ``self.world_size`` is N.

The checker's properties, in order:
  1. your method is what runs: it is defined in this file and called by an all-reduce on 2 nodes;
  2. every all-reduce's result: SUM, AVG and MAX on every node shape of up to four ranks (M x G in 1x1, 1x2, 2x1,
     1x3, 3x1, 1x4, 2x2, 4x1), tensors of 0-29 elements (fewer than ranks included: 1 and 7 at every shape),
     float32 and float64, integer
     values -- SUM and MAX exactly the flat ring's, element by element on every rank; AVG the exact sum / N, to
     rounding;
  3. bytes per link class, on every shape: each rank sends, inside its node, what a ring all-reduce of the whole
     tensor over the node's G ranks sends (2(G-1)/G of it), and across the nodes what a ring all-reduce over the M
     ranks at its place sends of its 1/G column (2(M-1)/M of the column), the ring's message sizes exactly.

Check it:   python -m minizero check hierarchical --impl THIS_FILE
"""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.given import Hierarchical as GivenHierarchical


class Hierarchical(GivenHierarchical):
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """Called on every rank at once, with a tensor of the same size everywhere (any number of elements).

        After it: every rank's ``tensor`` holds, element by element, the reduction by ``op`` of every rank's
        ``tensor`` -- the sum for SUM, the sum divided by N for AVG, the max for MAX -- in place.  Holds on one node
        (M = 1) and with one rank per node (G = 1) too.
        Cost: only the ranks at one place share each message between nodes: per rank, 2(G-1)/G of the tensor inside
        the node and 2(M-1)/M of a 1/G share of it across the nodes (property 3).
        """
        raise NotImplementedError("write Hierarchical._all_reduce: every rank's tensor = the reduction over all N "
                                  "ranks, in two levels -- inside the node, then across the nodes")

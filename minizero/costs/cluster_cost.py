"""The α–β time of a collective on a cluster: ``M`` nodes of ``G`` ranks, a fast wire inside a node and a slow
one between nodes whose bandwidth the node's ranks share (:class:`~minizero.comm.network.TwoLevel`).

A ring step takes as long as its slowest hop, so:

* a **flat ring** over all ``N = M G`` ranks crosses between nodes at every node's last rank, in every step:
  ``steps(N) x max(alpha_inter + S/(N beta_inter), alpha_intra + S/(N beta_intra))`` -- the slow link's latency
  ``2(N-1)`` times in an all-reduce.  (One rank per node sends across per step: nothing to share.)
* the **two-level** all-reduce (:mod:`minizero.comm.hierarchical`) pays ``2(G-1)`` fast steps on the node's
  ``S/G`` chunks, and ``2(M-1)`` slow steps in which all ``G`` across rings send at once through the node's
  link: ``G x S/(G M) = S/M`` bytes per step.  Reduce-scatter and all-gather: half of each.
* a collective on a **view** (HSDP's mesh): ``node`` is a ring of ``G`` on the fast wire; ``across`` a ring of
  ``M`` on the slow one, all ``G`` places at once, sharing the node's link.

On one flat :class:`~minizero.comm.network.Network` every ring is a ring of its own size on that network.
Each function returns ``(seconds, the alpha part of them)``.
"""
from __future__ import annotations

from ..comm.network import Network, TwoLevel
from ..comm.nodes import Nodes, assumed_nodes

RING_STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}
SPANS = ("world", "node", "across")  # which ranks a collective runs among


def _ring(steps: int, alpha: float, seconds_per_step_bytes: float) -> tuple[float, float]:
    return steps * (alpha + seconds_per_step_bytes), steps * alpha


def _hop(wire: Network | None, nbytes: float) -> tuple[float, float]:
    """``(alpha, seconds for nbytes)`` on ``wire``; a wire left out of the dial costs nothing."""
    return (wire.alpha, nbytes / wire.bandwidth) if wire is not None else (0.0, 0.0)


def collective_s(kind: str, nbytes: float, network: "Network | TwoLevel", nodes: Nodes, span: str = "world",
                 hierarchical: bool = False) -> tuple[float, float]:
    """Seconds (and their alpha part) of ring ``kind`` on a full tensor of ``nbytes`` among the ``span`` ranks."""
    if span not in SPANS:
        raise ValueError(f"unknown span {span!r}; one of {SPANS}")
    g, m, n = nodes.per_node, nodes.count, nodes.world_size
    per = RING_STEPS[kind]
    if not isinstance(network, TwoLevel):  # one flat network: a ring of the span's size
        size = {"world": n, "node": g, "across": m}[span]
        return _ring(per * (size - 1), network.alpha, nbytes / size / network.bandwidth)
    intra, inter = network.intra, network.inter
    if span == "node":
        alpha, moved = _hop(intra, nbytes / g)
        return _ring(per * (g - 1), alpha, moved)
    if span == "across":  # all G places' rings at once: G messages of nbytes / M through the node's link per step
        alpha, moved = _hop(inter, g * nbytes / m)
        return _ring(per * (m - 1), alpha, moved)
    if hierarchical and m > 1 and g > 1:
        inside = collective_s(kind, nbytes, network, nodes, "node")
        across = collective_s(kind, nbytes / g, network, nodes, "across")
        return inside[0] + across[0], inside[1] + across[1]
    if m == 1:
        alpha, moved = _hop(intra, nbytes / n)
        return _ring(per * (n - 1), alpha, moved)
    slow, fast = _hop(inter, nbytes / n), _hop(intra, nbytes / n) if g > 1 else (0.0, 0.0)
    alpha, moved = max(slow, fast, key=sum)  # the step ends with its slowest hop
    return _ring(per * (n - 1), alpha, moved)


def nodes_for(world_size: int, network: "Network | TwoLevel") -> Nodes:
    """The nodes ``world_size`` ranks fill: on a cluster, nodes of its ``G`` ranks (fewer than ``G`` ranks: one
    node of those); on one flat network, the nodes a stage whose mesh is the nodes assumes there
    (:func:`~minizero.comm.nodes.assumed_nodes`) -- every ring on it alike, so only such a stage's view spans differ."""
    if not isinstance(network, TwoLevel):
        return assumed_nodes(world_size)
    g = network.nodes.per_node
    if world_size <= g:
        return Nodes(1, world_size)
    if world_size % g:
        raise ValueError(f"{world_size} ranks do not fill nodes of {g}: give world sizes that are multiples of {g} "
                         f"(or fewer than {g}, one node)")
    return Nodes(world_size // g, g)

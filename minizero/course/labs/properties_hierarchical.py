"""The hierarchical lab's properties: the learner's two-level all-reduce against the flat ring, value by value and
byte by byte on each link class.

* **results** -- drawn over every node shape of up to four ranks (``M`` nodes x ``G`` ranks, one node and one rank
  per node included), 0-29 elements (fewer than ranks included: some columns empty), float32 and float64: SUM, AVG
  and MAX of small integers.  Every sum is exact in any order, so SUM and MAX must be the flat ring's bit for bit
  (computed here, from every rank's input: what the flat ring gives, ``tests/test_hierarchical.py`` proves the
  package's two levels equal to it); AVG is the same exact sum divided by N -- once, as the flat ring does, or by G
  and M in turn, which may round differently: within a tolerance.  Then, whatever the draws, every shape at 7
  elements and at 1 -- a slip that shows only with several nodes *and* several ranks per node (2 x 2), or only when
  a node's ranks outnumber the elements (``torch.chunk`` then returns fewer than G columns), is found even on a
  short search.
* **link bytes** -- at every shape, each rank's bytes booked under each link class (the ledger knows which link a
  message crossed: :meth:`~minizero.comm.base.Comm._report_sent`) exactly
  :func:`~minizero.comm.hierarchical.link_bytes_sent`'s.  The values cannot see a flat ring over the whole world --
  it gives them exactly -- but the inter-node link can: that is the lesson.

A failure is compared with the known mistakes (:mod:`minizero.course.labs.mistakes_hierarchical`) on the same case.
"""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from ...comm import INTER, INTRA, Ledger, Nodes, ReduceOp, chunk_bounds, parse_network, ring_bytes_sent
from ...comm.hierarchical import link_bytes_sent
from ...run.launch import Rank
from .failed import Failed
from .loading import Impl
from .mistakes_hierarchical import HIERARCHICAL_MISTAKES
from .properties import PROPERTIES as SUITE
from .raised import Raised
from .yours_hierarchical import yours

#: Every node shape of up to four ranks, by world size: a failure shrinks towards one node of one rank.
SHAPES = ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (1, 4), (2, 2), (4, 1))
OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX)
#: AVG's tolerance: the exact sum divided by N in one step or two (G, then M) differs in the last bit.
RTOL = {"float32": 1e-6, "float64": 1e-14}
SWEPT = (7, 1)  # elements at every shape after the search: uneven columns at G = 2, 3, 4; empty ones at G > 1


def contribution(rank: int, numel: int, dtype: str, seed: int) -> torch.Tensor:
    """Rank ``rank``'s tensor: small integers, so every sum is exact whatever the order of the additions."""
    g = torch.Generator().manual_seed(seed * 131 + rank)
    return torch.randint(-64, 64, (numel,), generator=g).to(getattr(torch, dtype))


def all_reduce_round(me: Rank, impl: Impl, shape: tuple[int, int], numel: int, dtype: str, seed: int) -> dict | Raised:
    """On this rank: the learner's all-reduce -- SUM, AVG and MAX -- on ``shape``'s nodes; each result and the bytes
    the ledger booked under each link class."""
    try:
        comm = impl.cls()(None, True, parse_network(f"nodes={shape[0]}x{shape[1]}"))
        cases = {}
        for op in OPS:
            got, ledger = contribution(me.rank, numel, dtype, seed), Ledger()
            with ledger.attached(comm):
                comm.all_reduce(got, op)
            cases[op.name] = {"got": got, "links": ledger.links("all_reduce")}
        comm.close()
        return cases
    except Exception as error:  # noqa: BLE001 -- reported to the learner, in words
        return Raised.now(me.rank, error, impl.path)


def case(shape: tuple[int, int], numel: int, dtype: str, seed: int) -> str:
    nodes = Nodes(*shape)
    return f"world size {nodes.world_size} ({nodes.describe()}), tensors of {numel} element(s), {dtype}, data seed {seed}"


def run(checker, impl: Impl, drawn: tuple) -> list:
    """Every rank's :func:`all_reduce_round` on ``drawn`` (shape, numel, dtype, seed); a rank's error, a stall or a
    death raises :class:`Failed` naming the case."""
    try:
        return checker.on_ranks(Nodes(*drawn[0]).world_size, all_reduce_round, impl, *drawn)
    except Failed as failed:
        raise Failed(failed.why, failed.case or case(*drawn), final=failed.final) from None


# ------------------------------------------------------------------ results
def reduction(inputs: list[torch.Tensor], op: ReduceOp, divisor: int) -> torch.Tensor:
    stacked = torch.stack(inputs)
    return stacked.amax(0) if op is ReduceOp.MAX else stacked.sum(0) / (divisor if op is ReduceOp.AVG else 1)


def agrees(got: torch.Tensor, want: torch.Tensor, op: ReduceOp, dtype: str) -> torch.Tensor:
    """Element by element: SUM and MAX exactly (the flat ring's bits), AVG to rounding."""
    return torch.isclose(got, want, rtol=RTOL[dtype], atol=0) if op is ReduceOp.AVG else got.eq(want)


def wrong_value(rounds: list, shape: tuple[int, int], numel: int, dtype: str, seed: int) -> str | None:
    """The first wrong element -- SUM on every rank first, then AVG, then MAX -- in words, with what it looks like."""
    nodes = Nodes(*shape)
    inputs = [contribution(q, numel, dtype, seed) for q in range(nodes.world_size)]
    for op in OPS:
        want = reduction(inputs, op, nodes.world_size)
        for rank, cases in enumerate(rounds):
            got = cases[op.name]["got"]
            ok = agrees(got, want, op, dtype)
            if ok.all():
                continue
            i = int((~ok).nonzero()[0])
            said = (f"all_reduce {op.name} on rank {rank} (node {nodes.node_of(rank)}, place {rank % nodes.per_node}; "
                    f"{nodes.describe()}): element {i} is {got[i].item():g}, should be {want[i].item():g}")
            own_columns_right = all(  # on every rank, the column at its place (gathered too early, it alone is)
                agrees(c[op.name]["got"][lo:hi], want[lo:hi], op, dtype).all()
                for q, c in enumerate(rounds) for lo, hi in [chunk_bounds(numel, nodes.per_node)[q % nodes.per_node]])
            return said + looks_like(got, ok, i, op, dtype, inputs, nodes, rank, own_columns_right)
    return None


def looks_like(got, ok, i: int, op: ReduceOp, dtype: str, inputs: list, nodes: Nodes, rank: int,
               own_columns_right: bool) -> str:
    """What a wrong result is, when it is something: its node's reduction only (the across phase skipped), right in
    the rank's own column alone (the node's all-gather run too early), the rank's own input, the sum divided by
    something other than N."""
    n, m, g = nodes.world_size, nodes.count, nodes.per_node
    node_ranks = nodes.node_ranks(rank)
    node_only = ok.clone()
    for divisor in {n, g}:  # (a node's mean: divided by N as told, or by its own G)
        node_only |= agrees(got, reduction([inputs[q] for q in node_ranks], op, divisor), op, dtype)
    if g > 1 and own_columns_right:
        column = next(c for c, (lo, hi) in enumerate(chunk_bounds(got.numel(), g)) if lo <= i < hi)
        holds = (f", which holds node {nodes.node_of(rank)}'s {op.name.lower()} only (ranks {node_ranks})"
                 if m > 1 and node_only.all() else "")
        return (f" -- element {i} is in column {column}, place {column}'s part{holds}; on every rank the column at "
                f"its own place is right: what happened to it after the node's all-gather (the across phase, the "
                f"division) never reached the other places -- gather last")
    if m > 1 and node_only.all():
        return (f" -- the {op.name.lower()} over node {nodes.node_of(rank)}'s ranks {node_ranks} only: the other "
                f"nodes' tensors never entered it (did the across phase run, on the column this rank reduced?)")
    if n > 1 and torch.equal(got, inputs[rank]):
        return f" -- rank {rank}'s result is its own input: nothing reached it"
    total = reduction(inputs, ReduceOp.SUM, 1)
    if op is ReduceOp.AVG and total.ne(0).any():
        reasons = ((1, "never divided"), (g, f"G = {g}, the ranks of a node"),
                   (m, f"M = {m}, the nodes: the across ring's AVG divides by its own ranks"),
                   (n * m, "N and again M: AVG across, then your division"), (n * g, "N and again G"),
                   (n * n, "N twice, once per level"))
        for divisor in dict.fromkeys(d for d, _ in reasons if d != n):
            if agrees(got, total / divisor, op, dtype).all():  # (at 2 x 2, G and M are both 2: say both)
                why = "; or ".join(words for d, words in reasons if d == divisor)
                return (f" -- the exact sum divided by {divisor} ({why}), not by N = {n}: reduce with SUM across the "
                        f"nodes and divide once by N")
    if op is ReduceOp.MAX:  # what it is, if it is something: a divided max, or a sum
        biggest = reduction(inputs, ReduceOp.MAX, 1)
        for divisor, words in dict.fromkeys([(n, f"N = {n}"), (g, f"G = {g}"), (m, f"M = {m}")]):
            if divisor > 1 and biggest.ne(0).any() and agrees(got, biggest / divisor, op, dtype).all():
                return (f" -- the max divided by {divisor} ({words}): only AVG divides, a max is never divided "
                        f"(divide when op is AVG, not for every op)")
        if total.ne(biggest).any() and agrees(got, total, op, dtype).all():
            return " -- the sum, not the max: pass op on to every phase (a max is combined with op, not added)"
        return " -- a max is combined with op at every phase, never added and never divided"
    return ""


def results(checker) -> str:
    strategy = st.tuples(st.sampled_from(SHAPES), st.integers(0, 29), st.sampled_from(["float32", "float64"]),
                         st.integers(0, 1000))
    failing: dict = {}

    def examine(drawn):
        try:
            problem = wrong_value(run(checker, checker.impl, drawn), *drawn)
        except Failed:
            failing["drawn"] = drawn
            raise
        if problem:
            failing["drawn"] = drawn  # the last failure hypothesis sees is the one it reports: the smallest
            return problem, None
        return None

    try:
        checker.search(strategy, examine, case)
    except Failed as failed:
        if failed.final or "drawn" not in failing:
            raise
        raise Failed(failed.why, failed.case, named(checker, failing["drawn"])) from None
    # Whatever the draws: 2 x 2 is one shape in eight; and one element, fewer than G ranks share (empty columns).
    for drawn in [(shape, numel, "float64", 1) for numel in SWEPT for shape in SHAPES]:
        rounds = run(checker, checker.impl, drawn)
        problem = wrong_value(rounds, *drawn)
        if problem:
            raise Failed(problem, case(*drawn), named(checker, drawn, rounds))
    return (f"{checker.examples} drawn examples and every shape at {' and '.join(map(str, SWEPT))} element(s): SUM and "
            f"MAX the flat ring's bit for bit, AVG to rounding, on 1-4 nodes of 1-4 ranks, tensors of 0-29 elements")


# ------------------------------------------------------------------ bytes per link class
WHAT = {INTER: "2(M-1)/M of its 1/G column, in the ring of the ranks at its place on every node",
        INTRA: "2(G-1)/G of the tensor, in the ring of its node's ranks"}


def links_problem(rounds: list, shape: tuple[int, int], numel: int, element_size: int) -> str | None:
    """A rank whose bytes on a link class are not the two-level all-reduce's, in words -- the slow link first."""
    nodes = Nodes(*shape)

    def counted(cases, op):
        return {link: cases[op.name]["links"].get(link, 0) for link in (INTER, INTRA)}

    two_level = [link_bytes_sent("all_reduce", numel, element_size, nodes, r, True) for r in range(nodes.world_size)]
    flat = [link_bytes_sent("all_reduce", numel, element_size, nodes, r, False) for r in range(nodes.world_size)]
    for op in OPS:
        for link in (INTER, INTRA):
            off = [(rank, counted(cases, op)[link], two_level[rank][link]) for rank, cases in enumerate(rounds)
                   if counted(cases, op)[link] != two_level[rank][link]]
            if off:  # the rank with the most bytes too many first: the one overloading its link
                rank, got, want = max(off, key=lambda o: o[1] - o[2]) if any(o[1] > o[2] for o in off) else off[0]
                said = (f"all_reduce {op.name} on {nodes.describe()}, {numel} x {element_size}-byte elements: rank "
                        f"{rank} sent {got} bytes over the {link}-node link, {'too many' if got > want else 'too few'}: "
                        f"the two-level all-reduce sends {want} there ({WHAT[link]})")
                if [counted(c, op) for c in rounds] == flat:
                    said += (" -- exactly the flat ring's bytes on each link: one ring over all N ranks crosses "
                             "between nodes at every node's last rank, on each of its 2(N-1) steps")
                elif link == INTER and got == ring_bytes_sent("all_reduce", numel, element_size, nodes.count,
                                                              nodes.node_of(rank)):
                    said += " -- the whole tensor's all-reduce across the nodes: only your 1/G column must cross"
                return said
    return None


def link_bytes(checker) -> str:
    for shape in SHAPES:
        for numel in (3, 10):  # fewer elements than ranks (empty columns and chunks), and more
            drawn = (shape, numel, "float32", 0)
            rounds = run(checker, checker.impl, drawn)
            problem = links_problem(rounds, shape, numel, 4)
            if problem:
                raise Failed(problem, case(*drawn), named(checker, drawn, rounds))
    return ("on every shape of 1-4 ranks: inside a node 2(G-1)/G of the tensor per rank, across the nodes 2(M-1)/M of "
            "its 1/G column -- not the flat ring's share of the slow link")


# ------------------------------------------------------------------ naming a known mistake
CONFIRM = (((1, 2), 5, "float64", 2), ((2, 1), 5, "float64", 2), ((2, 2), 5, "float64", 2))


def _same(mine: list, theirs: list) -> bool:
    return all(torch.equal(a[op.name]["got"], b[op.name]["got"]) and a[op.name]["links"] == b[op.name]["links"]
               for a, b in zip(mine, theirs, strict=True) for op in OPS)


def named(checker, drawn: tuple, rounds: list | None = None) -> str | None:
    """The known mistake whose values and bytes per link on ``drawn`` are exactly the learner's -- confirmed on one
    shape of each kind (a slip in the division shows as the same numbers at 2 x 2 as another slip does)."""
    def outcome(impl, at):
        try:
            return run(checker, impl, at)
        except Failed:
            return None

    mine = rounds if rounds is not None else outcome(checker.impl, drawn)
    if mine is None:
        return None
    def gives(mistake, at, learners) -> bool:
        theirs = outcome(Impl.of(checker.lab, mistake), at)
        return learners is not None and theirs is not None and _same(learners, theirs)

    matching = [m for m in HIERARCHICAL_MISTAKES if gives(m, drawn, mine)]
    for at in CONFIRM:
        if not matching:
            break
        yours = outcome(checker.impl, at)
        matching = [m for m in matching if gives(m, at, yours)]
    return matching[0].mistake if len(matching) == 1 else None


PROPERTIES = {
    "yours on the nodes": (SUITE["yours"][0], yours),
    "hierarchical results": ("every all-reduce's result on every node shape: the flat ring's", results),
    "hierarchical link bytes": ("bytes per rank on each link class: the two-level all-reduce's", link_bytes),
}

"""One stage's row of ``compare``: how far from the reference, and what it sent and held beside its formulas.

Every figure is measured (the ledger's bytes, the live tensors' memory) and printed beside the stage's own formula,
never in its place; a row's "yes" needs both to agree and every value to be finite.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ...comm import INTER, INTRA, LINKS, TwoLevel, parse_network
from ...compress.overflow import flag_bytes
from ...stages import ZeRO
from ..harness.equivalence import agrees, judge
from ..harness.experiment import Experiment, element_size, network_of, precision_of
from ..harness.optimizers import STATE_TENSORS
from ..harness.registry import stage_class


@dataclass
class Summary:
    """One stage's row: how far from the reference, and what it sent and held beside its formulas."""

    stage: str
    world_size: int
    dtype: str
    backend: str
    accum: int
    compress: str
    precision: str
    max_abs_diff: float
    max_rel_diff: float
    loss_rel_diff: float
    within_tolerance: bool  # minizero.course.harness.equivalence.judge: every parameter, every step, every rank
    equivalent: bool  # the stage's own fact: False for designs that differ on purpose (their diff is measured)
    nonfinite: str | None
    sent_bytes_per_step: float  # per rank, as the ledger counted it
    sent_bytes_formula: float  # the stage's own formula (Stage.sent_bytes_per_step)
    busiest_sent_bytes_per_step: float  # the rank that sent most (a parameter server's server), as counted
    busiest_sent_bytes_formula: float  # the stage's own formula (Stage.busiest_sent_bytes_per_step)
    bytes_match: bool
    check_bytes_per_step: float  # fingerprints, apart
    state_bytes: float  # the most model state any rank held, counted from live tensors
    state_bytes_formula: float  # the stage's own formula (Stage.state_bytes)
    state_formula: str  # the same in the paper's notation: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N
    memory_match: bool
    gathered_peak_bytes: int
    step_ms: float
    max_abs_diff_exact: float  # with compression: the change it made against exact training
    skipped_steps: int  # fp16: steps skipped for overflow (the same on every rank, or the row fails)
    # On a cluster of nodes (--network nodes=MxG,...): per rank and step, the bytes inside a node and between
    # nodes as the ledger counted them, beside the stage's formula (nan off a cluster, or for a star)
    intra_bytes_per_step: float = math.nan
    inter_bytes_per_step: float = math.nan
    intra_bytes_formula: float = math.nan
    inter_bytes_formula: float = math.nan
    links_match: bool | None = None


def summarise(stage: str, results: list, reference, exp: Experiment, world_size: int, exact=None) -> Summary:
    """``reference`` is the truth to match (with compression: the same-casts reference);
    ``exact``, if given, the uncompressed one, to report how much compression changed."""
    verdict = judge(results, reference, exp.dtype)
    cls, first = stage_class(stage, exp.stages), results[0]
    nodes = nodes_of(exp, world_size)
    options = {**exp.options, "nodes": nodes} if nodes is not None else exp.options  # HSDP's facts need its mesh
    times = first.step_s[1:] or first.step_s  # the first step warms up
    sent = sum(r.sent_bytes for r in results) / (len(results) * exp.steps)
    sent_formula = cls.sent_bytes_per_step(first.psi, world_size, first.grad_bytes, first.param_bytes, **options)
    busiest = getattr(cls, "busiest_sent_bytes_per_step", cls.sent_bytes_per_step)  # torch's oracles state none
    flag = flag_bytes(world_size, exp.options.get("compress"), precision_of(exp)) \
        if issubclass(cls, ZeRO) else 0.0  # a sharded stage's ranks agree on an inf on its wire (compress.overflow)
    if first.wire_sent_bytes_per_step is not None or first.weight_sent_bytes_per_step is not None:
        # a codec's or PowerSGD's wire (the gradients), or quantized weights (ZeRO-3's gathers): their formulas on
        # the stage's own buffers; the other part of the traffic, the stage's own formula for it
        grads, params = first.wire_sent_bytes_per_step, first.weight_sent_bytes_per_step
        if grads is None:
            grads = cls.sent_bytes_per_step(first.psi, world_size, first.grad_bytes, 0, **options)
        if params is None:
            params = cls.sent_bytes_per_step(first.psi, world_size, 0, first.param_bytes, **options)
        sent_formula = grads + params
        busiest = lambda *args, **kwargs: grads + params  # noqa: E731  (every rank sends alike)
    sent_formula += flag
    busiest_formula = busiest(first.psi, world_size, first.grad_bytes, first.param_bytes, **options) + flag
    state = max(r.held_bytes["total"] for r in results)
    formula_args = (element_size(exp), STATE_TENSORS[exp.optimizer])  # masters' bytes and states per parameter
    state_formula = cls.state_bytes(first.psi, world_size, *formula_args, **options)
    skipped = {r.skipped_steps for r in results}
    return Summary(
        stage=stage, world_size=world_size, dtype=exp.dtype, backend=exp.backend, accum=exp.accum,
        compress=exp.options.get("compress") or "none", precision=precision_of(exp).name,
        max_abs_diff=verdict.max_abs_diff, max_rel_diff=verdict.max_rel_diff, loss_rel_diff=verdict.loss_rel_diff,
        within_tolerance=verdict.ok and len(skipped) == 1, equivalent=getattr(cls, "equivalent", True),
        nonfinite=verdict.nonfinite, sent_bytes_per_step=sent, sent_bytes_formula=sent_formula,
        busiest_sent_bytes_per_step=max(r.sent_bytes for r in results) / exp.steps,
        busiest_sent_bytes_formula=busiest_formula,
        bytes_match=agrees(sent, sent_formula),
        check_bytes_per_step=sum(r.check_bytes for r in results) / (len(results) * exp.steps),
        state_bytes=state, state_bytes_formula=state_formula, memory_match=agrees(state, state_formula),
        state_formula=cls.state_formula(*formula_args, **options) if hasattr(cls, "state_formula") else "",
        gathered_peak_bytes=max(r.gathered_peak_bytes for r in results),
        step_ms=1000 * statistics.median(times),
        max_abs_diff_exact=judge(results, exact, exp.dtype).max_abs_diff if exact else verdict.max_abs_diff,
        skipped_steps=max(skipped), **link_columns(cls, results, exp, world_size, nodes, options))


def nodes_of(exp: Experiment, world_size: int):
    """The nodes the run's ranks sit on (a two-level network), or None."""
    network = parse_network(network_of(exp, world_size))
    return network.nodes if isinstance(network, TwoLevel) else None


def link_columns(cls, results: list, exp: Experiment, world_size: int, nodes, options: dict) -> dict:
    """Bytes per link class, counted (the mean over ranks) and by the stage's formula, on a cluster of nodes."""
    if nodes is None:
        return {}
    first = results[0]
    formula = cls.sent_bytes_by_link(first.psi, world_size, first.grad_bytes, first.param_bytes,
                                     hierarchical=exp.backend == "hierarchical", **options)
    wire, weights = first.wire_sent_bytes_per_step, first.weight_sent_bytes_per_step
    if formula is not None and (wire is not None or weights is not None):
        # A codec's or quantized weights' bytes are their wire's own formula; which links carry them is stated by
        # a stage whose mesh is the nodes (HSDP: the gradients' wire across, the weights' gathers inside), by no other.
        if not getattr(cls, "needs_nodes", False):
            formula = None
        else:
            formula = cls.sent_bytes_by_link(first.psi, world_size, 0 if wire is not None else first.grad_bytes,
                                             0 if weights is not None else first.param_bytes, **options)
            formula = {INTRA: formula[INTRA] + (weights or 0.0), INTER: formula[INTER] + (wire or 0.0)}
    counted = {link: sum(r.sent_by_link.get(link, 0) for r in results) / (len(results) * exp.steps)
               for link in LINKS}
    if formula is None:
        return {"intra_bytes_per_step": counted[INTRA], "inter_bytes_per_step": counted[INTER]}
    return {"intra_bytes_per_step": counted[INTRA], "inter_bytes_per_step": counted[INTER],
            "intra_bytes_formula": formula[INTRA], "inter_bytes_formula": formula[INTER],
            "links_match": all(agrees(counted[link], formula[link]) for link in LINKS)}

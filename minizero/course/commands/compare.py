"""``python -m minizero compare``: every stage against the reference, one table.

For each stage: the largest parameter difference from single-device
training over every step and rank, the bytes each rank sent per step as the
ledger counted them beside the formula's value, and the step time.

A "yes" must be earned: a NaN or inf anywhere -- a loss, a parameter, an
optimizer state, on any rank or in the reference itself -- is a failure, named
under the table; so is a difference of NaN, which is no difference at all.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, replace

import torch.distributed as dist

from ...comm import parse_network
from ...comm.nodes import assumed_nodes
from ...parts.precision import Precision
from ...run.launch import RankError, RankPool, check_world_size
from ...run.torchrun import init_from_env, under_torchrun
from ...stages import check_stage_names
from ..harness import option_flags, preflight
from ..harness.equivalence import DTYPES, RTOL
from ..harness.experiment import (
    Experiment,
    exact_reference_of,
    precision_of,
    reference_of,
    rounds,
    run_experiment,
)
from ..harness.registry import LAB_STAGES, stage_class
from .compare_rows import Summary, summarise


def stage_options(stage: str, stages: dict | None = None, **cli) -> dict:
    """The command line's options that stage ``stage`` accepts, as its keyword arguments."""
    if cli.get("compress") in (None, "none"):
        cli.pop("compress", None)
        cli.pop("error_feedback", None)
    accepted = [o.name for o in getattr(stage_class(stage, stages), "options", ())]  # torch's declare none
    return {k: v for k, v in cli.items() if v is not None and k in accepted}


def check_options_used(stages: list[str], stages_known: dict | None, options: dict) -> None:
    """An option that none of the chosen stages takes would change nothing: refused, naming the stages that do
    (by their declarations, :func:`minizero.course.harness.option_flags.refuse_unused`)."""
    option_flags.refuse_unused(stages, LAB_STAGES if stages_known is None else stages_known, options)


def compare(world_size: int, stages: list[str], exp: Experiment, timeout_s: float = 300.0, **options) -> list[Summary]:
    """Run the reference and each stage on identical data; one summary per stage.

    ``timeout_s``: how long a collective may go without progress before the run is ended as stalled."""
    check_world_size(world_size)
    check_stage_names(stages, distributed_only=True, stages=exp.stages or LAB_STAGES)
    if options.get("error_feedback") and options.get("compress") in (None, "none"):
        raise ValueError("error feedback carries the rounding error of compression: it needs --compress (fp16, bf16, "
                         "int8, int4, topk:F, sign or powersgd:rank=R)")
    check_options_used(stages, exp.stages, options)
    experiments = [replace(exp, stage=stage, options=stage_options(stage, exp.stages, **options)) for stage in stages]
    if under_torchrun():
        return _compare_under_torchrun(experiments, timeout_s)
    exact = exact_reference_of(exp, world_size)
    rows, pool = [], None
    try:
        for e in experiments:
            pool = pool or RankPool(world_size, timeout_s=timeout_s)
            try:
                results = pool.run(run_experiment, e)
            except RankError as error:
                if "\nFloatingPointError: " not in "\n" + error.remote_traceback:
                    raise
                # fp16 at its minimum loss scale: gradients still inf or NaN -- a divergence, a NO row like any
                # other (the pool was stopped with the rank: the next stage gets a fresh one).
                pool = None
                rows.append(diverged_row(e, world_size, error))
                continue
            reference = reference_of(e, world_size) if rounds(e) else exact
            rows.append(summarise(e.stage, results, reference, e, world_size, exact))
    finally:
        if pool is not None:
            pool.close()
    return rows


def diverged_row(exp: Experiment, world_size: int, error: RankError) -> Summary:
    """A stage whose run raised FloatingPointError: infinitely far from the reference, nothing measured."""
    from ..harness.rank_verdict import raised
    cause = raised(error.remote_traceback).split(": ", 1)[-1]
    cls, nan = stage_class(exp.stage, exp.stages), math.nan
    return Summary(stage=exp.stage, world_size=world_size, dtype=exp.dtype, backend=exp.backend, accum=exp.accum,
                   compress=exp.options.get("compress") or "none", precision=precision_of(exp).name,
                   max_abs_diff=math.inf, max_rel_diff=math.inf, loss_rel_diff=math.inf, within_tolerance=False,
                   equivalent=getattr(cls, "equivalent", True), nonfinite=cause, sent_bytes_per_step=nan,
                   sent_bytes_formula=nan, busiest_sent_bytes_per_step=nan, busiest_sent_bytes_formula=nan,
                   bytes_match=False, check_bytes_per_step=nan, state_bytes=nan, state_bytes_formula=nan,
                   state_formula="", memory_match=False, gathered_peak_bytes=0, step_ms=nan,
                   max_abs_diff_exact=math.inf, skipped_steps=0)


def _compare_under_torchrun(experiments: list[Experiment], timeout_s: float) -> list[Summary]:
    """Each rank runs the references itself; rank 0 collects every rank's parameters."""
    me = init_from_env(timeout_s=timeout_s)
    rows = []
    for exp in experiments:
        reference, exact = reference_of(exp, me.world_size), exact_reference_of(exp, me.world_size)
        mine = run_experiment(me, exp)
        mine = replace(mine, params=[{k: v.cpu() for k, v in p.items()} for p in mine.params])
        gathered = [None] * me.world_size
        dist.all_gather_object(gathered, mine)
        rows.append(summarise(exp.stage, gathered, reference, exp, me.world_size, exact))
    return rows if me.rank == 0 else []


def passed(row: Summary) -> bool:
    """A row passes if it matches the reference -- or, for a stage that differs by design, if it stayed finite."""
    return row.within_tolerance or not row.equivalent and row.nonfinite is None


def verdict(row: Summary) -> str:
    if row.nonfinite or row.equivalent:
        return "yes" if row.within_tolerance else "NO"
    return "yes" if row.within_tolerance else "n/a"  # (H = 1 local SGD with plain SGD does match)


def format_table(rows: list[Summary]) -> str:
    paper = max([12] + [len(r.state_formula) + 1 for r in rows])
    header = (f"{'stage':<14}{'max|Δparam|':>13}{'rel':>10}{'ok':>4}{'sent B/step/rank':>18}{'formula':>12}"
              f"{'state B/rank':>14}{'formula':>12}  {'= (paper)':<{paper}}{'step ms':>9}{'vs exact':>10}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.stage:<14}{r.max_abs_diff:>13.3e}{r.max_rel_diff:>10.1e}"
                     f"{verdict(r):>4}{r.sent_bytes_per_step:>18,.0f}"
                     f"{r.sent_bytes_formula:>12,.0f}{r.state_bytes:>14,.0f}{r.state_bytes_formula:>12,.0f}"
                     f"  {r.state_formula:<{paper}}"
                     f"{r.step_ms:>9.2f}{r.max_abs_diff_exact:>10.1e}")
    lines += link_table(rows)
    lines += [f"{r.stage}: NO -- {r.nonfinite} (NaN or inf is never a pass)" for r in rows if r.nonfinite]
    lines += [f"{r.stage}: not single-device training by design -- max|Δparam| is how far it went, not a failure"
              for r in rows if not r.equivalent and not r.nonfinite and not r.within_tolerance]
    lines += [f"{r.stage}: the busiest rank sent {r.busiest_sent_bytes_per_step:,.0f} B/step "
              f"(formula {r.busiest_sent_bytes_formula:,.0f}), the mean {r.sent_bytes_per_step:,.0f}"
              for r in rows if r.busiest_sent_bytes_formula > 1.01 * r.sent_bytes_formula]
    lines += [f"{r.stage}: {r.skipped_steps} step(s) skipped for fp16 overflow, on every rank (dynamic loss scaling)"
              for r in rows if r.skipped_steps]
    return "\n".join(lines)


def link_table(rows: list[Summary]) -> list[str]:
    """On a cluster of nodes: the bytes each rank sent inside its node and to other nodes, beside the formulas."""
    rows = [r for r in rows if not math.isnan(r.intra_bytes_per_step)]
    if not rows:
        return []
    header = (f"{'stage':<14}{'intra-node B/step/rank':>24}{'formula':>12}{'inter-node B/step/rank':>24}"
              f"{'formula':>12}{'ok':>5}")
    lines = ["", "bytes per link class (the ledger, by the link each message crossed):", header, "-" * len(header)]
    for r in rows:
        ok = "n/a" if r.links_match is None else "yes" if r.links_match else "NO"
        lines.append(f"{r.stage:<14}{r.intra_bytes_per_step:>24,.0f}{r.intra_bytes_formula:>12,.0f}"
                     f"{r.inter_bytes_per_step:>24,.0f}{r.inter_bytes_formula:>12,.0f}{ok:>5}")
    return lines


def precision_option(args) -> Precision | None:
    """The command line's precision policy, or None for plain fp32 (so stages that lack the option run)."""
    knobs = {"reduce_dtype": args.reduce_dtype, "loss_scale": args.loss_scale,
             "loss_scale_window": args.loss_scale_window, "min_loss_scale": args.min_loss_scale}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    if args.precision == "fp32" and not knobs:
        return None
    return Precision(args.precision, **knobs)


def experiment_of(args) -> Experiment:
    """The command line's run, as an :class:`Experiment` (shared with ``soak``); ``args.registry``: the stages
    it chooses from, when not the lab's (``python -m minizero``'s ``main(argv, stages)``)."""
    return Experiment(task=args.task, dtype=args.dtype, steps=args.steps, optimizer=args.optimizer, lr=args.lr,
                      micro_batch=args.micro_batch, accum=args.accum, backend=args.backend, seed=args.seed,
                      clip=(args.clip, 2.0) if args.clip else None, check=args.check,
                      checkpoint_activations=args.checkpoint_activations,
                      network=args.network if parse_network(args.network) else None,  # refused here if bad
                      stages=getattr(args, "registry", None))


def check_before_launch(args) -> None:
    """What ``compare`` and ``soak`` refuse before any rank starts (minizero.course.harness.preflight)."""
    preflight.check_lr(args.lr, args.optimizer, DTYPES[args.dtype])  # the masters' dtype: fp32 under mixed precision
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size
    preflight.check_design_options(world_size, args.steps, option_flags.given(args), getattr(args, "registry", None),
                                   [s for s in args.stages.split(",") if s], precision_option(args))


def main(args) -> tuple[int, str]:
    stages = [s for s in args.stages.split(",") if s]
    check_before_launch(args)
    rows = compare(args.world_size, stages, experiment_of(args), timeout_s=args.timeout,
                   precision=precision_option(args), **option_flags.given(args))
    if not rows:  # a torchrun rank other than 0
        return 0, ""
    status = 0 if all(passed(r) for r in rows) else 1
    if args.json:
        return status, json.dumps([asdict(r) for r in rows], indent=2)
    world_size = rows[0].world_size  # under torchrun: the ranks that really ran, not --world-size
    lines = [f"{args.task} model, {args.dtype}, {args.optimizer}, N={world_size}, {args.steps} steps of "
             f"K={args.accum} micro-batches, {args.backend} collectives, precision {args.precision}, "
             f"compression {args.compress or 'none'}"
             f"{', activation checkpointing' if args.checkpoint_activations else ''}; "
             f"tolerance: relative {RTOL[args.dtype]:g}"]
    if args.precision != "fp32":
        lines.append(f"(precision {args.precision}: each stage is compared with a single-device reference applying the "
                     f"same casts and the same recipe -- masters, loss scaler; 'vs exact' is the change mixed "
                     f"precision made against fp32 single-device training; '(paper)' is the state formula in the ZeRO "
                     f"paper's terms, Psi parameters over N ranks)")
    elif args.compress or getattr(args, "quantized_weights", None):
        lines.append("(compressed stages are compared with a reference applying the same casts; "
                     "'vs exact' is the change compression made)")
    lines += assumed_nodes_notes(stages, args.network, world_size, getattr(args, "registry", None))
    lines.append(format_table(rows))
    return status, "\n".join(lines)


def assumed_nodes_notes(stages: list[str], network: str | None, world_size: int, registry: dict | None) -> list[str]:
    """A stage whose mesh is the nodes (HSDP), run without ``--network``: where its ranks were assumed to sit,
    said -- at N = 2 or an odd N that is one rank per node, which shards nothing (its state formula's G = 1)."""
    if network:
        return []
    nodes = assumed_nodes(world_size)
    alone = ": G = 1, so nothing is sharded within a node and every rank holds all the state" if nodes.per_node == 1 else ""
    return [f"({name}: no --network, so its ranks were assumed on {nodes.count} nodes of {nodes.per_node} "
            f"rank{'s' if nodes.per_node > 1 else ''}{alone}; say where they sit: --network nodes=MxG)"
            for name in stages if getattr(stage_class(name, registry), "needs_nodes", False)]

"""``python -m minizero soak``: every stage against single-device training, for hundreds of steps.

The property suite checks a few steps of many small runs; a soak checks many
steps of one run, where a slow leak -- a buffer not cleared, a state drifting
by an ulp per step, a rank falling out of step -- has time to show.  Each rank
trains its stage and, beside it, the reference on the same global batch, and
compares after every step, so nothing but one summary per rank crosses a
process boundary.  Reported per stage: the largest relative deviation of any
parameter on any rank over the whole run, the step and parameter where it
happened, the deviation at the end, and the first NaN or inf if there was one.

A command, not a CI test: ``python -m minizero soak --world-size 4 --steps 500``.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import torch.distributed as dist

from ...run.launch import Rank, RankPool, check_world_size
from ...run.torchrun import init_from_env, under_torchrun
from ...run.train import shard_step, train_step
from ...stages import REFERENCE, check_stage_names
from ..harness import option_flags
from ..harness.equivalence import DTYPES, RTOL, parameter_errors
from ..harness.experiment import Experiment, build, snapshot_parameters
from ..harness.tasks import TASKS
from .compare import check_before_launch, check_options_used, experiment_of, stage_options


def soak_on_rank(me: Rank, exp: Experiment) -> dict:
    """Train the stage and the reference side by side; the worst deviation seen, and where."""
    task, dtype, n = TASKS[exp.task], DTYPES[exp.dtype], me.world_size
    stage, model, comm, _ = build(me, exp)
    reference, reference_model, _, _ = build(None, replace(exp, stage=REFERENCE, options={}))
    worst = {"rel": 0.0, "step": None, "param": None}
    final, nonfinite, start = 0.0, None, time.perf_counter()
    for s in range(exp.steps):
        x, y = task.make_batch(exp.global_batch(n), exp.seed, s, dtype, **exp.model)
        loss = train_step(stage, shard_step(x, y, me.rank, n, exp.accum), clip=exp.clip)
        train_step(reference, shard_step(x, y, 0, 1, 1), clip=exp.clip)
        mine = snapshot_parameters(stage, model)
        reference_params = {name: p.detach() for name, p in reference_model.named_parameters()}
        final = 0.0
        for name, err, scale in parameter_errors(mine, reference_params, exp.dtype):  # the one rule
            rel = err / scale
            if not (math.isfinite(rel) and math.isfinite(loss)):
                nonfinite = nonfinite or f"rank {me.rank}: {name!r} or the loss at step {s} is not finite"
                rel = math.inf
            final = max(final, rel)
            if rel > worst["rel"]:
                worst = {"rel": rel, "step": s, "param": name}
        if nonfinite:
            break
    comm.close()
    return {"worst": worst, "final": final, "nonfinite": nonfinite, "seconds": time.perf_counter() - start}


def soak(world_size: int, stages: list[str], exp: Experiment, timeout_s: float = 300.0, **options) -> list[dict]:
    """``options``: the stages' options (``bucket_mb``, ``servers``, ...), each given to the stages that take it."""
    check_world_size(world_size)
    check_stage_names(stages, distributed_only=True, stages=exp.stages)
    check_options_used(stages, exp.stages, options)
    rows = []
    me = init_from_env(timeout_s=timeout_s) if under_torchrun() else None
    pool = None if me else RankPool(world_size, timeout_s=timeout_s)
    world_size = me.world_size if me else world_size  # under torchrun: the ranks that really run
    try:
        for name in stages:
            e = replace(exp, stage=name, options=stage_options(name, exp.stages, **options))
            if me:  # this process is one rank: every rank's summary comes to all, rank 0 reports
                per_rank = [None] * world_size
                dist.all_gather_object(per_rank, soak_on_rank(me, e))
            else:
                per_rank = pool.run(soak_on_rank, e)
            worst = max((r["worst"] for r in per_rank), key=lambda w: w["rel"])
            nonfinite = next((r["nonfinite"] for r in per_rank if r["nonfinite"]), None)
            final = max(r["final"] for r in per_rank)
            rows.append({"stage": name, "world_size": world_size, "steps": exp.steps, "dtype": exp.dtype,
                         "max_rel_diff": worst["rel"], "at_step": worst["step"], "in_param": worst["param"],
                         "final_rel_diff": final, "nonfinite": nonfinite,
                         "within_tolerance": nonfinite is None and worst["rel"] <= RTOL[exp.dtype],
                         "seconds": max(r["seconds"] for r in per_rank)})
    finally:
        if pool is not None:
            pool.close()
    return rows if me is None or me.rank == 0 else []


def main(args) -> tuple[int, str]:
    if args.precision != "fp32":
        raise ValueError("soak compares with exact fp32 single-device training; mixed precision differs from it by "
                         "design -- check it with `compare --precision ...` against the same-recipe reference")
    if args.compress or args.error_feedback:  # "--compress none" is None: not given
        raise ValueError("soak compares with exact single-device training; compressed stages differ from it by "
                         "design -- check them with `compare --compress ...` against the same-casts reference")
    stages = [s for s in args.stages.split(",") if s]
    check_before_launch(args)
    rows = soak(args.world_size, stages, experiment_of(args), timeout_s=args.timeout, **option_flags.given(args))
    if not rows:  # a torchrun rank other than 0
        return 0, ""
    status = 0 if all(r["within_tolerance"] for r in rows) else 1
    if args.json:
        return status, json.dumps(rows, indent=2)
    lines = [f"soak: {args.task} model, {args.dtype}, {args.optimizer}, N={rows[0]['world_size']}, {args.steps} steps of "
             f"K={args.accum}, {args.backend} collectives; every parameter of every rank after every step; "
             f"tolerance: relative {RTOL[args.dtype]:g}",
             f"{'stage':<14}{'max rel Δ':>11}{'at step':>9}  {'in parameter':<26}{'final rel Δ':>12}{'ok':>4}{'s':>8}"]
    for r in rows:
        at = "-" if r["at_step"] is None else str(r["at_step"])
        lines.append(f"{r['stage']:<14}{r['max_rel_diff']:>11.1e}{at:>9}  {str(r['in_param']):<26}"
                     f"{r['final_rel_diff']:>12.1e}{'yes' if r['within_tolerance'] else 'NO':>4}{r['seconds']:>8.1f}")
    lines += [f"{r['stage']}: NO -- {r['nonfinite']}" for r in rows if r["nonfinite"]]
    return status, "\n".join(lines)

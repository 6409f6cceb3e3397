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
import statistics
from dataclasses import replace

import torch.distributed as dist

from . import formulas
from .experiment import (RTOL, Experiment, exact_reference_of, first_nonfinite, loss_error, max_diff, reference_of,
                         run_experiment)
from .launch import RankPool, check_world_size
from .torchrun import init_from_env, under_torchrun
from .stages import check_stage_names


def summarise(stage: str, results: list[dict], reference: dict, exp: Experiment, world_size: int,
              exact: dict | None = None) -> dict:
    """``reference`` is the truth to match (with compression: the same-casts reference);
    ``exact``, if given, the uncompressed one, to report how much compression changed."""
    abs_diff, rel_diff = max_diff(results, reference)
    loss_rel = loss_error(results, reference)
    nonfinite = first_nonfinite(results, reference)
    first = results[0]
    times = first["step_s"][1:] or first["step_s"]  # the first step warms up
    sent = sum(r["sent_bytes"] for r in results) / (len(results) * exp.steps)
    return {
        "stage": stage,
        "world_size": world_size,
        "dtype": exp.dtype,
        "backend": exp.backend,
        "max_abs_diff": abs_diff,
        "max_rel_diff": rel_diff,
        "loss_rel_diff": loss_rel,
        "within_tolerance": nonfinite is None and rel_diff <= RTOL[exp.dtype] and loss_rel <= RTOL[exp.dtype],
        "nonfinite": nonfinite,
        "sent_bytes_per_step": sent,
        "check_bytes_per_step": sum(r["check_bytes"] for r in results) / (len(results) * exp.steps),
        "sent_bytes_formula": formulas.sent_bytes_per_step(
            "zero3-no-reshard" if stage == "zero3" and not exp.options.get("reshard_after_forward", True) else stage,
            first["psi"], world_size, first["grad_bytes"], first["param_bytes"]),
        "state_bytes": max(r["held_bytes"]["total"] for r in results),
        "state_bytes_formula": formulas.state_bytes(stage, first["psi"], world_size, first["param_bytes"],
                                                    formulas.STATE_TENSORS[exp.optimizer]),
        "step_ms": 1000 * statistics.median(times),
        "gathered_peak_bytes": max((r["gathered_peak_bytes"] or 0) for r in results),
        "accum": exp.accum,
        "compress": exp.options.get("compress") or "none",
        "max_abs_diff_exact": max_diff(results, exact)[0] if exact else abs_diff,
    }


def stage_options(stage: str, compress: str | None = None, bucket_mb: float | None = None,
                  error_feedback: bool = False) -> dict:
    """Command-line options, as the keyword arguments of ``stage``."""
    options = {}
    if compress and compress != "none":
        options.update(compress=compress, error_feedback=error_feedback)
    if bucket_mb is not None and stage in ("ddp-bucketed", "zero2"):
        options["bucket_mb"] = bucket_mb
    return options


def compare(world_size: int, stages: list[str], exp: Experiment, timeout_s: float = 300.0, **options) -> list[dict]:
    """Run the reference and each stage on identical data; one summary per stage.

    ``timeout_s``: how long a collective may go without progress before the run is ended as stalled."""
    check_world_size(world_size)
    check_stage_names(stages, distributed_only=True)
    if options.get("error_feedback") and options.get("compress") in (None, "none"):
        raise ValueError("error feedback carries the rounding error of compression: it needs --compress fp16 or bf16")
    experiments = [replace(exp, stage=stage, options=stage_options(stage, **options)) for stage in stages]
    if under_torchrun():
        return _compare_under_torchrun(experiments, timeout_s)
    exact = exact_reference_of(exp, world_size)
    rows = []
    with RankPool(world_size, timeout_s=timeout_s) as pool:
        for e in experiments:
            results = pool.run(run_experiment, e)
            reference = reference_of(e, world_size) if e.options.get("compress") else exact
            rows.append(summarise(e.stage, results, reference, e, world_size, exact))
    return rows


def _compare_under_torchrun(experiments: list[Experiment], timeout_s: float) -> list[dict]:
    """Each rank runs the references itself; rank 0 collects every rank's parameters."""
    me = init_from_env(timeout_s=timeout_s)
    rows = []
    for exp in experiments:
        reference, exact = reference_of(exp, me.world_size), exact_reference_of(exp, me.world_size)
        mine = run_experiment(me, exp)
        mine = {**mine, "params": [{k: v.cpu() for k, v in p.items()} for p in mine["params"]]}
        gathered = [None] * me.world_size
        dist.all_gather_object(gathered, mine)
        rows.append(summarise(exp.stage, gathered, reference, exp, me.world_size, exact))
    return rows if me.rank == 0 else []


def format_table(rows: list[dict]) -> str:
    header = (f"{'stage':<14}{'max|Δparam|':>13}{'rel':>10}{'ok':>4}{'sent B/step/rank':>18}{'formula':>12}"
              f"{'state B/rank':>14}{'formula':>12}{'step ms':>9}{'vs exact':>10}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['stage']:<14}{r['max_abs_diff']:>13.3e}{r['max_rel_diff']:>10.1e}"
                     f"{'yes' if r['within_tolerance'] else 'NO':>4}{r['sent_bytes_per_step']:>18,.0f}"
                     f"{r['sent_bytes_formula']:>12,.0f}{r['state_bytes']:>14,.0f}{r['state_bytes_formula']:>12,.0f}"
                     f"{r['step_ms']:>9.2f}{r['max_abs_diff_exact']:>10.1e}")
    lines += [f"{r['stage']}: NO -- {r['nonfinite']} (NaN or inf is never a pass)" for r in rows if r["nonfinite"]]
    return "\n".join(lines)


def experiment_of(args) -> Experiment:
    """The command line's run, as an :class:`Experiment` (shared with ``soak``)."""
    return Experiment(task=args.task, dtype=args.dtype, steps=args.steps, optimizer=args.optimizer, lr=args.lr,
                      micro_batch=args.micro_batch, accum=args.accum, backend=args.backend, seed=args.seed,
                      clip=(args.clip, 2.0) if args.clip else None, check=args.check)


def main(args) -> tuple[int, str]:
    stages = [s for s in args.stages.split(",") if s]
    rows = compare(args.world_size, stages, experiment_of(args), timeout_s=args.timeout, compress=args.compress,
                   bucket_mb=args.bucket_mb, error_feedback=args.error_feedback)
    if not rows:  # a torchrun rank other than 0
        return 0, ""
    status = 0 if all(r["within_tolerance"] for r in rows) else 1
    if args.json:
        return status, json.dumps(rows, indent=2)
    world_size = rows[0]["world_size"]  # under torchrun: the ranks that really ran, not --world-size
    lines = [f"{args.task} model, {args.dtype}, {args.optimizer}, N={world_size}, {args.steps} steps of "
             f"K={args.accum} micro-batches, {args.backend} collectives, compression {args.compress}; "
             f"tolerance: relative {RTOL[args.dtype]:g}"]
    if args.compress != "none":
        lines.append("(compressed stages are compared with a reference applying the same casts; "
                     "'vs exact' is the change compression made)")
    lines.append(format_table(rows))
    return status, "\n".join(lines)

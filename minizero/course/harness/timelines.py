"""Run an experiment with a :class:`~minizero.observe.timeline.Timeline` on every rank, and draw one step.

Lessons 4, 6 and 9 and the overlap tests use it on a dialled network
(``Experiment(network=...)``): each rank returns its steps' spans, the caller
reads hidden fractions, overlaps and waits from them, or plots them."""
from __future__ import annotations

from ...observe.timeline import StepTimeline, Timeline, minus, union
from ...parts.unit_plan import resolve_units
from ...run.launch import Rank
from ...run.train import shard_step, train_step
from .equivalence import DTYPES
from .experiment import Experiment, build
from .registry import stage_class
from .tasks import TASKS


def timeline_on_rank(me: Rank, exp: Experiment) -> list[StepTimeline]:
    """Train ``exp`` on this rank, recording every step."""
    stage, model, comm, _ = build(me, exp)
    units = resolve_units(model, exp.options.get("units")) if "units" in stage_class(exp.stage, exp.stages).option_names() \
        else []
    timeline = Timeline(stage, model, comm, units)
    try:
        task, dtype = TASKS[exp.task], DTYPES[exp.dtype]
        for s in range(exp.steps):
            x, y = task.make_batch(exp.global_batch(me.world_size), exp.seed, s, dtype, **exp.model)
            timeline.start()
            train_step(stage, shard_step(x, y, me.rank, me.world_size, exp.accum), clip=exp.clip,
                       syncs=exp.syncs)
    finally:
        comm.close()
    return timeline.steps


LANES = {"compute": ("compute", "#4c72b0"), "comm": ("communication", "#dd8452"), "exposed": ("exposed wait", "#c44e52")}


def plot_step(ax, step: StepTimeline, title: str = "") -> None:
    """Three lanes in milliseconds: compute, communication (one bar per collective) and the exposed wait."""
    rows = {"compute": [(s, e) for _, s, e in step.compute], "comm": [(s, e) for _, s, e in step.comm]}
    rows["exposed"] = minus(union(rows["comm"]), union(rows["compute"]))
    for y, lane in enumerate(("exposed", "comm", "compute")):
        label, color = LANES[lane]
        ax.broken_barh([(s * 1e3, (e - s) * 1e3) for s, e in rows[lane]], (y - 0.35, 0.7), color=color,
                       edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(3), [LANES[lane][0] for lane in ("exposed", "comm", "compute")])
    ax.set_xlabel("ms since the step began")
    ax.set_xlim(0, step.end * 1e3 * 1.02)
    ax.set_title(title or f"compute {step.compute_s() * 1e3:.0f} ms, communication {step.comm_s() * 1e3:.0f} ms, "
                          f"exposed {step.exposed_s() * 1e3:.0f} ms ({step.hidden():.0%} hidden)", fontsize=9)

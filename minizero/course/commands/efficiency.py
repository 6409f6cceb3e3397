"""Efficiency against the α–β bound: how close each stage's measured step on a dialled wire comes to the
fastest step the wire allows.

A speed ratio against torch says which of two implementations is faster; it cannot say whether both leave
time on the table.  The bound can: on a network of latency ``alpha`` and bandwidth ``beta``
(:class:`~minizero.comm.network.Network`) no step can take less than its own compute plus the
communication that, by the stage's schedule, has nothing to hide behind.  The bound is built from parts
measured and parts derived, never from the run it is compared with:

* **compute** -- forward, backward and the optimizer step of the same model and stage, run *without* the
  dial (the slowest rank's median over the steps after the first);
* **what communication cannot hide** -- the stage's own :meth:`~minizero.stages.base.Stage.schedule`
  replayed by :func:`minizero.costs.cost_model.predict` on that compute and the dial's alpha and beta exactly
  (the plan of the model's own units and buckets: :func:`minizero.course.commands.scale.measured_plan`).

Unlike :func:`minizero.course.commands.scale.model_against_measured`, whose prediction takes a message's latency as the
larger of alpha and loopback's measured cost per message (to *predict* the step), the bound leaves loopback out: on
a real NIC a transfer costs no CPU, so what loopback adds is time beyond the bound, and each row says how much of it
went where.  The dial runs loopback's transfer under its wait (:mod:`minizero.comm.port`), so what is left beyond
the bound is the CPU each message still costs the ranks: the ring's Python, the thread's wake-ups, the reduction.

``fraction = bound / measured`` is 1 when the stage hides everything its schedule lets it hide and adds
nothing of its own; below 1 is the time lost.  Above 1 would mean the step beat the wire -- impossible on
the dial, so it says the bound is wrong: the undialled compute ran slower than the dialled one (a busy
machine during the undialled run), or the schedule claims less overlap than the stage achieves.

Rounds interleave the stages (each round runs every stage once, in a fresh random order, its undialled run
just before its dialled one), so a burst of other work on a shared machine lands on one round of every stage,
not on every round of one stage; each round's fraction divides that round's bound by that round's step.

The undialled compute of a stage that overlaps (ddp-bucketed, zero2, zero3) carries loopback's transfers,
which run on the same cores during backward: the bound is then generous, and a dialled round's compute
can come out *below* it (a negative "+compute").
"""
from __future__ import annotations

import random
import statistics
from dataclasses import replace

from ...comm.network import parse_network
from ...costs.cost_model import RING_STEPS, predict
from ...run.launch import RankPool
from ...stages import STAGES, distributed
from ..harness.experiment import Experiment
from ..harness.models import BENCH_GPT
from ..harness.timelines import timeline_on_rank
from .scale import measured_plan

#: The options that let a stage overlap on the bench GPT (3 MB of gradients: the default 25 MiB bucket would be
#: one bucket, which cannot leave before backward ends), each given to the stages that accept it -- zero1's
#: ``overlap`` (DeepSpeed stage 1's overlap_comm) included, and two reduce-scatter buffers for ZeRO-2 and -3
#: (FSDP2's set_reduce_scatter_max_input_buffers(2)): with one, each bucket is packed only once the reduce-scatter
#: before it has finished, so the hand-off and the packing sit between two reduce-scatters on the wire.
OVERLAP_OPTIONS = {"bucket_mb": 0.5, "prefetch": 1, "overlap": True, "reduce_scatter_buffers": 2}


def stage_options() -> dict[str, dict]:
    """Every stage that takes single-device training's step (the contrast designs aside: their step is
    another algorithm's), with the :data:`OVERLAP_OPTIONS` it accepts -- read from the stages' own facts."""
    return {name: {k: v for k, v in OVERLAP_OPTIONS.items() if k in STAGES[name].option_names()}
            for name in distributed() if not STAGES[name].contrast}


COMPUTE = ("forward", "backward", "optimizer step")  # the timeline's compute spans


def _base(stage: str, steps: int, model: dict) -> Experiment:
    """The dialled benches' experiment (:mod:`minizero.course.commands.bench_network`): no fingerprints, which would
    add messages the bound leaves out."""
    return Experiment(stage=stage, task="gpt", model=model, optimizer="sgd", steps=steps, micro_batch=8,
                      dtype="float32", check=False, options=stage_options()[stage])


def _slowest_median(per_rank, what) -> float:
    """The slowest rank's median over the steps after the first (the first pays autograd's and the
    buffers' setup)."""
    return max(statistics.median(what(step) for step in steps[1:]) for steps in per_rank)


def _span(name: str):
    return lambda step: sum(e - s for w, s, e in step.compute if w == name)


def _compute(step) -> float:
    return sum(_span(name)(step) for name in COMPUTE)


def bound(exp: Experiment, world_size: int, network: str, quiet) -> dict:
    """The α–β bound of ``exp``'s step from its undialled timelines ``quiet`` (one list of steps per rank)."""
    forward_s, backward_s, step_s = (_slowest_median(quiet, _span(name)) for name in COMPUTE)
    plan = measured_plan(exp, world_size, parse_network(network), forward_s, backward_s, step_s)
    p = predict(STAGES[exp.stage], plan)
    return {"bound_ms": p.step_s * 1e3, "compute_ms": p.compute_s * 1e3, "unhidden_ms": p.exposed_s * 1e3,
            "wire_ms": p.comm_s * 1e3}


def _where(runs, bound_row: dict) -> dict:
    """Where a round's time beyond the bound went, in ms (medians over rounds), read on the round's slowest
    rank (the one whose step the row measures -- taking each part's maximum over ranks would count the
    skew twice: the late rank's compute and the early rank's wait for it): compute slower than undialled
    (the loopback's transfers take CPU from backward), communication exposed beyond what the schedule
    exposes (the loopback under the dial, sleeps that overrun), and the rest of the step (hooks, launches,
    Python between spans).  Medians over steps, so the three add up to measured - bound only roughly."""
    parts = []
    for run in runs:
        per_rank = [tuple(statistics.median(f(st) for st in steps[1:]) for f in (lambda st: st.end, _compute,
                                                                                   lambda st: st.exposed_s()))
                    for steps in run]
        parts.append(max(per_rank))  # the slowest rank's (end, compute, exposed)
    end, compute, exposed = (statistics.median(p[i] for p in parts) * 1e3 for i in range(3))
    return {"extra_compute_ms": compute - bound_row["compute_ms"],
            "extra_exposed_ms": exposed - bound_row["unhidden_ms"], "other_ms": end - compute - exposed}


def messages(steps, world_size: int) -> int:
    """Ring messages a rank sends per step (the median step after the first): each one pays the dial's
    alpha, so an overhead per message grows with the stage's count of collectives."""
    return int(statistics.median(_messages(st, world_size) for st in steps[1:]))


def _messages(step, world_size: int) -> int:
    return sum(RING_STEPS.get(w.split()[0], 1) for w, _, _ in step.comm) * (world_size - 1)


def loopback_per_message(quiet, world_size: int) -> float:
    """Seconds one ring message costs undialled -- loopback's transfer, the ring's Python, the thread's wake-up --
    read as :func:`minizero.course.commands.scale.model_against_measured` reads it: on the rank that arrives last at each
    collective (it does not wait for the others, so its spans are the transfer).  The dial waits on top of
    it, so it is the first suspect for the exposed time beyond the bound."""
    return min(statistics.median(sum(e - s for _, s, e in st.comm) / max(_messages(st, world_size), 1)
                                 for st in steps[1:]) for steps in quiet)


def bench_efficiency(world_size: int, network: str = "lesson", steps: int = 5, rounds: int = 3,
                     model: dict | None = None, stages: list[str] | None = None, seed: int = 0) -> list[dict]:
    """One row per stage: its measured dialled step per round beside its α–β bound on ``network``.

    ``model``: the bench GPT's shape by default (a smaller one for tests); ``stages``: a subset of
    :func:`stage_options`; ``seed`` draws the order of the stages in each round."""
    wire = parse_network(network)  # a bad name fails here, before any rank is spawned
    if world_size < 2:
        raise ValueError(f"world_size {world_size}: the bound is about communication; give 2 or more ranks")
    if steps < 2:
        raise ValueError(f"steps {steps}: the first step is warm-up and untimed; give 2 or more")
    if rounds < 1:
        raise ValueError(f"rounds {rounds}: give 1 or more")
    known = stage_options()
    names = list(known) if stages is None else stages
    for name in names:
        if name not in known:
            raise ValueError(f"stage {name!r} has no efficiency row; choose from {', '.join(known)}")
    exps = {name: _base(name, steps, BENCH_GPT if model is None else model) for name in names}
    order = random.Random(seed)
    quiet: dict[str, list] = {name: [] for name in names}
    runs: dict[str, list] = {name: [] for name in names}
    with RankPool(world_size) as pool:
        for _ in range(rounds):
            for name in order.sample(names, len(names)):  # each stage's undialled run just before its dialled one
                quiet[name].append(pool.run(timeline_on_rank, exps[name]))
                runs[name].append(pool.run(timeline_on_rank, replace(exps[name], network=network)))
    rows = []
    for name in names:
        bounds = [bound(exps[name], world_size, network, q) for q in quiet[name]]
        measured = [_slowest_median(run, lambda st: st.end) * 1e3 for run in runs[name]]
        fractions = [b["bound_ms"] / m for b, m in zip(bounds, measured, strict=True)]
        b = {k: statistics.median(r[k] for r in bounds) for k in bounds[0]}
        rows.append({"name": name, "options": known[name], "world_size": world_size, "network": network,
                     "preset": wire.describe(), "measured_ms": measured, "bounds_ms": [r["bound_ms"] for r in bounds],
                     **b, "fraction": statistics.median(fractions), "fraction_min": min(fractions),
                     "fraction_max": max(fractions), "rounds": rounds, "steps": steps, **_where(runs[name], b),
                     "messages": messages(runs[name][-1][0], world_size),
                     "loopback_ms_per_message": statistics.median(loopback_per_message(q, world_size) * 1e3
                                                                  for q in quiet[name])})
    return rows


def format_efficiency(rows: list[dict]) -> str:
    """The rows as a short table: measured step (median and range over rounds), the bound and its parts,
    the fraction, and where the time beyond the bound went."""
    if not rows:
        return "no stages measured"
    first = rows[0]
    lines = [f"efficiency against the α–β bound, N={first['world_size']}, network {first['preset']}: "
             f"{first['rounds']} rounds of {first['steps']} steps (first untimed), stages interleaved",
             "bound = undialled compute + what the stage's schedule cannot hide on the dial (loopback left out); "
             "fraction = bound / measured (1 = no time lost; > 1 would mean the bound is wrong)",
             f"  {'stage':<14}{'measured ms':>18}{'bound':>8}{'compute':>9}{'unhidden':>9}{'fraction':>10}"
             f"{'min-max':>12}   beyond the bound (ms): +compute, +exposed (per message; loopback's), other"]
    for r in rows:
        m = r["measured_ms"]
        measured = f"{statistics.median(m):.1f} ({min(m):.0f}-{max(m):.0f})"
        lines.append(f"  {r['name']:<14}{measured:>18}{r['bound_ms']:>8.1f}{r['compute_ms']:>9.1f}"
                     f"{r['unhidden_ms']:>9.1f}{r['fraction']:>10.2f}"
                     f"{r['fraction_min']:>6.2f}-{r['fraction_max']:.2f}   "
                     f"{r['extra_compute_ms']:+.1f}, {r['extra_exposed_ms']:+.1f} "
                     f"({r['extra_exposed_ms'] / max(r['messages'], 1):+.1f} x {r['messages']}; "
                     f"{r['loopback_ms_per_message']:.1f}), {r['other_ms']:+.1f}")
    return "\n".join(lines)

"""``python -m minizero scale``: predicted step time per stage from 1 to thousands of ranks, and the check
of that prediction against runs measured on a dialled wire (:mod:`minizero.cost_model`)."""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace

import torch

from ..comm.network import Network, format_rate, format_time, parse_network
from ..cost_model import StepPlan, predict
from ..launch import RankPool
from ..precision import Precision
from ..stages import STAGES, distributed
from ..units import resolve_units
from .experiment import Experiment, build, precision_of, wire_bytes
from .models import BENCH_GPT, count_params
from .tasks import TASKS
from .timelines import timeline_on_rank


def world_sizes(text: str) -> list[int]:
    """``1,2,4,8`` or ``1..1024`` (the powers of two from 1 to 1024)."""
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split(".."))
            sizes = [n for n in (1 << k for k in range(64)) if lo <= n <= hi]
        else:
            sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--world-size {text!r}: give whole numbers, '1,2,4,8' or '1..1024'") from None
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"--world-size {text!r}: every world size must be 1 or more")
    return sizes


def uniform_plan(params: float, world_size: int, network: Network, compute_s: float, layers: int = 12,
                 precision: str = "fp32", **options) -> StepPlan:
    """A model of ``params`` parameters in ``layers`` equal blocks; backward takes twice forward's time."""
    if world_size > params:
        raise ValueError(f"world size {world_size} is more ranks than the model has parameters ({params:g}): "
                         f"a rank's shard would hold less than one; use fewer ranks or more --params")
    element = Precision.of(precision).working_bytes(4)
    return StepPlan(world_size, network, compute_s / 3, 2 * compute_s / 3, (0.0,) + (params / layers,) * layers,
                    element, element, options=options)


def measure_compute_s(params: float, micro_batch: int = 8, repeats: int = 5) -> tuple[float, str]:
    """Forward+backward of minizero's bench GPT on this machine, one process, scaled to ``params``."""
    task = TASKS["gpt"]
    model = task.make_model(0, torch.float32, **BENCH_GPT)
    x, y = task.make_batch(micro_batch, 0, 0, torch.float32, **BENCH_GPT)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten()).backward()
        times.append(time.perf_counter() - start)
    measured, psi = statistics.median(times[1:]), count_params(model)
    return measured * params / psi, (f"measured here: the bench GPT ({psi:,} parameters, micro-batch {micro_batch}) "
                                    f"took {measured * 1e3:.1f} ms forward+backward; scaled by Psi")


def table(stages: list[str], params: float, sizes: list[int], network: Network, compute_s: float,
          layers: int = 12, precision: str = "fp32", **options) -> list[dict]:
    rows = []
    for name in stages:
        accepted = {k: v for k, v in options.items() if k in STAGES[name].options()}
        for n in sizes:
            p = predict(STAGES[name], uniform_plan(params, n, network, compute_s, layers, precision, **accepted))
            rows.append({"stage": name, "world_size": n, "step_ms": p.step_s * 1e3, "compute_ms": p.compute_s * 1e3,
                         "comm_ms": p.comm_s * 1e3, "exposed_ms": p.exposed_s * 1e3,
                         "ring_latency_ms": p.latency_s * 1e3, "tree_latency_ms": p.tree_latency_s * 1e3,
                         "efficiency": p.efficiency})
    return rows


def main(args) -> tuple[int, str]:
    network = parse_network(args.network)
    stages = distributed() if args.stage == "all" else args.stage.split(",")
    for name in stages:
        if name not in distributed():
            raise ValueError(f"--stage {name!r} is not a stage; choose from {', '.join(distributed())} or 'all'")
    sizes = world_sizes(args.world_size)
    if args.measure:
        compute_s, how = measure_compute_s(args.params)
    else:
        compute_s, how = args.compute_ms / 1e3, "given (--compute-ms)"
    options = {"bucket_mb": args.bucket_mb, "prefetch": args.prefetch}
    rows = table(stages, args.params, sizes, network, compute_s, args.layers, args.precision, **options)
    if args.json:
        return 0, json.dumps({"network": {"name": network.name, "alpha_s": network.alpha,
                                          "bandwidth_Bps": network.bandwidth, "source": network.source},
                              "params": args.params, "compute_ms": compute_s * 1e3, "compute": how,
                              "precision": args.precision, "rows": rows}, indent=2)
    lines = [f"predicted step per rank: Psi={args.params:.3g} in {args.layers} blocks, {args.precision}, "
             f"network {network.describe()}",
             f"compute {compute_s * 1e3:.1f} ms per step ({how}); ring collectives; the alpha terms are part of comm",
             f"{'stage':<13}{'N':>6}{'step ms':>11}{'comm ms':>11}{'exposed ms':>12}{'ring α ms':>11}"
             f"{'tree α ms':>11}{'efficiency':>12}"]
    for r in rows:
        lines.append(f"{r['stage']:<13}{r['world_size']:>6}{r['step_ms']:>11.2f}{r['comm_ms']:>11.2f}"
                     f"{r['exposed_ms']:>12.2f}{r['ring_latency_ms']:>11.3f}{r['tree_latency_ms']:>11.3f}"
                     f"{r['efficiency']:>11.0%}")
    if network.source:
        lines.append(f"network source: {network.source}")
    return 0, "\n".join(lines)


# ---------------------------------------------------------------- the model against measured runs
def measured_plan(exp: Experiment, world_size: int, network: Network, forward_s: float,
                  backward_s: float) -> StepPlan:
    """The plan of ``exp``'s own model: its units (root first) and, for a bucketed stage, its buckets."""
    model = TASKS[exp.task].make_model(0, torch.float32, **exp.model)
    units = resolve_units(model, exp.options.get("units"))
    unit_params = [sum(p.numel() for p in u.parameters()) for u in units]
    blocks = (float(count_params(model) - sum(unit_params)),) + tuple(float(k) for k in unit_params)
    stage = STAGES[exp.stage]
    buckets = None
    if "bucket_mb" in stage.options():
        from .optimizers import make_optimizer
        numel = {n: p.numel() for n, p in model.named_parameters()}
        layout = stage.reduction(model, make_optimizer(exp.optimizer, model, exp.lr), world_size, **exp.options)
        buckets = tuple(float(sum(numel[n] for n in names)) for names in layout.buffers)
    element = precision_of(exp).working_bytes(4)
    return StepPlan(world_size, network, forward_s, backward_s, blocks, wire_bytes(exp), element, buckets,
                    {k: v for k, v in exp.options.items() if k in stage.options()})


def model_against_measured(pool: RankPool, exp: Experiment, network: str) -> dict:
    """Run ``exp`` without a dial (its compute: forward and backward, the slowest rank's median), then on
    ``network`` (its step time); predict the second from the first."""
    quiet = pool.run(timeline_on_rank, replace(exp, network=None))
    dialled = pool.run(timeline_on_rank, replace(exp, network=network))

    def median(per_rank, what) -> float:
        return max(statistics.median(what(step) for step in steps[1:]) for steps in per_rank)

    span = lambda name: lambda st: sum(e - s for w, s, e in st.compute if w == name)  # noqa: E731
    forward_s, backward_s = median(quiet, span("forward")), median(quiet, span("backward"))
    measured = median(dialled, lambda st: st.end)
    plan = measured_plan(exp, pool.world_size, parse_network(network), forward_s, backward_s)
    predicted = predict(STAGES[exp.stage], plan)
    return {"stage": exp.stage, "world_size": pool.world_size, "options": exp.options,
            "measured_ms": measured * 1e3, "predicted_ms": predicted.step_s * 1e3,
            "error": predicted.step_s / measured - 1, "compute_ms": (forward_s + backward_s) * 1e3,
            "comm_ms": predicted.comm_s * 1e3, "network": network}


def describe_network(network: Network) -> str:
    return f"alpha {format_time(network.alpha)}, bandwidth {format_rate(network.bandwidth)}"

"""``python -m minizero scale``: predicted step time per stage from 1 to thousands of ranks, and the check
of that prediction against runs measured on a dialled network (:mod:`minizero.costs.cost_model`)."""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace

import torch

from ...comm.network import Network, TwoLevel, parse_network
from ...costs.cost_model import MAX_COLLECTIVES, RING_STEPS, StepPlan, predict
from ...parts.precision import Precision
from ...parts.unit_plan import resolve_units
from ...run.launch import RankPool
from ...stages import STAGES, distributed
from ..harness.experiment import Experiment, precision_of, wire_bytes
from ..harness.models import BENCH_GPT, count_params
from ..harness.option_flags import given
from ..harness.tasks import TASKS
from ..harness.timelines import timeline_on_rank


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
                 precision: str = "fp32", hierarchical: bool = False, **options) -> StepPlan:
    """A model of ``params`` parameters in ``layers`` equal blocks; backward takes twice forward's time."""
    if not 1 <= layers <= min(params, MAX_COLLECTIVES):
        raise ValueError(f"--layers {layers} must be between 1 and the number of parameters ({params:g}), and at "
                         f"most {MAX_COLLECTIVES:,}: a block holds at least one parameter")
    if world_size > params:
        raise ValueError(f"world size {world_size} is more ranks than the model has parameters ({params:g}): "
                         f"a rank's shard would hold less than one; use fewer ranks or more --params")
    element = Precision.of(precision).working_bytes(4)
    return StepPlan(world_size, network, compute_s / 3, 2 * compute_s / 3, (0.0,) + (params / layers,) * layers,
                    element, element, options=options, hierarchical=hierarchical)


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


def variants(stages: list[str], collectives: list[str]) -> list[tuple[str, bool]]:
    """``(stage, hierarchical)`` to predict: each stage with each kind of world collective it has -- HSDP's are its
    mesh's own (a node's, across the nodes), the parameter server's a star: flat only."""
    return [(name, mode == "hierarchical") for name in stages for mode in collectives
            if mode == "flat" or not getattr(STAGES[name], "needs_nodes", False) and STAGES[name].sent_bytes_by_link(
                1.0, 2, 4, 4) is not None]


def table(stages: list[str], params: float, sizes: list[int], network: Network, compute_s: float,
          layers: int = 12, precision: str = "fp32", collectives=("flat",), **options) -> list[dict]:
    rows = []
    for name, hierarchical in variants(stages, list(collectives)):
        accepted = {k: v for k, v in options.items() if k in STAGES[name].option_names()}
        for n in sizes:
            plan = uniform_plan(params, n, network, compute_s, layers, precision, hierarchical, **accepted)
            p = predict(STAGES[name], plan)
            nodes = plan.nodes
            rows.append({"stage": name + (" (hierarchical)" if hierarchical else ""), "world_size": n,
                         "nodes": nodes.count, "per_node": nodes.per_node,
                         "step_ms": p.step_s * 1e3, "compute_ms": p.compute_s * 1e3,
                         "comm_ms": p.comm_s * 1e3, "exposed_ms": p.exposed_s * 1e3,
                         "ring_latency_ms": p.latency_s * 1e3, "tree_latency_ms": p.tree_latency_s * 1e3,
                         "efficiency": p.efficiency})
    return rows


def main(args) -> tuple[int, str]:
    network = parse_network(args.network)
    if args.compress and isinstance(network, TwoLevel):
        raise ValueError(f"scale --compress prices a wire on one flat network (alpha, bandwidth), not on a cluster "
                         f"of two link classes ({args.network}): give the network between the nodes alone, where "
                         f"compression pays (its inter= preset: --network ethernet-100g, say), or leave --compress out")
    if args.compress:
        from ...compress import split_specs
        from .break_even import format_table
        from .break_even import table as compress_table
        rows = compress_table(split_specs(args.compress), args.params, world_sizes(args.world_size), network,
                              args.layers)
        return 0, (json.dumps({"network": network.describe(), "params": args.params, "rows": rows}, indent=2)
                   if args.json else format_table(rows, args.params, network))
    if not (args.measure or args.compute_ms):
        raise ValueError("scale needs the compute per step: --compute-ms MS or --measure (or --compress WIRES for "
                         "when compression pays)")
    stages = distributed() if args.stage == "all" else args.stage.split(",")
    for name in stages:
        if name not in distributed():
            raise ValueError(f"--stage {name!r} is not a stage; choose from {', '.join(distributed())} or 'all'")
    sizes = world_sizes(args.world_size)
    if args.measure:
        compute_s, how = measure_compute_s(args.params)
    else:
        compute_s, how = args.compute_ms / 1e3, "given (--compute-ms)"
    collectives = [c for c in args.collectives.split(",") if c]
    if not collectives or set(collectives) - {"flat", "hierarchical"}:
        raise ValueError(f"--collectives {args.collectives!r}: give flat, hierarchical or flat,hierarchical")
    rows = table(stages, args.params, sizes, network, compute_s, args.layers, args.precision, collectives, **given(args))
    if args.json:
        return 0, json.dumps({"network": describe_network(network),
                              "params": args.params, "compute_ms": compute_s * 1e3, "compute": how,
                              "precision": args.precision, "rows": rows}, indent=2)
    width = max(13, *(len(r["stage"]) + 2 for r in rows))
    lines = [f"predicted step per rank: Psi={args.params:.3g} in {args.layers} blocks, {args.precision}, "
             f"network {network.describe()}",
             f"compute {compute_s * 1e3:.1f} ms per step ({how}); ring collectives; the alpha terms are part of comm",
             f"{'stage':<{width}}{'N':>6}{'nodes':>7}{'step ms':>11}{'comm ms':>11}{'exposed ms':>12}{'ring α ms':>11}"
             f"{'tree α ms':>11}{'efficiency':>12}"]
    for r in rows:
        lines.append(f"{r['stage']:<{width}}{r['world_size']:>6}{r['nodes']:>7}{r['step_ms']:>11.2f}{r['comm_ms']:>11.2f}"
                     f"{r['exposed_ms']:>12.2f}{r['ring_latency_ms']:>11.3f}{r['tree_latency_ms']:>11.3f}"
                     f"{r['efficiency']:>11.0%}")
    lines += [f"network source ({wire}): {source}" for wire, source in describe_network(network)["sources"].items()]
    return 0, "\n".join(lines)


def describe_network(network) -> dict:
    """The network as the JSON output states it: each wire's alpha, bandwidth and source."""
    wires = {"intra": network.intra, "inter": network.inter} if isinstance(network, TwoLevel) else {"": network}
    out = {"description": network.describe(), "sources": {k or network.name: w.source for k, w in wires.items()
                                                           if w is not None and w.source}}
    if isinstance(network, TwoLevel):
        out["per_node"] = network.nodes.per_node
    out.update({f"{k + '_' if k else ''}alpha_s": w.alpha for k, w in wires.items() if w is not None})
    out.update({f"{k + '_' if k else ''}bandwidth_Bps": w.bandwidth for k, w in wires.items() if w is not None})
    return out


# ---------------------------------------------------------------- the model against measured runs
def measured_plan(exp: Experiment, world_size: int, network: Network, forward_s: float, backward_s: float,
                  step_s: float = 0.0) -> StepPlan:
    """The plan of ``exp``'s own model: its units (root first) and, for a bucketed stage, its buckets."""
    model = TASKS[exp.task].make_model(0, torch.float32, **exp.model)
    units = resolve_units(model, exp.options.get("units"))
    unit_params = [sum(p.numel() for p in u.parameters()) for u in units]
    blocks = (float(count_params(model) - sum(unit_params)),) + tuple(float(k) for k in unit_params)
    stage = STAGES[exp.stage]
    buckets = None
    if "bucket_mb" in stage.option_names():
        from ..harness.optimizers import make_optimizer
        numel = {n: p.numel() for n, p in model.named_parameters()}
        layout = stage.reduction(model, make_optimizer(exp.optimizer, model, exp.lr), world_size, **exp.options)
        buckets = tuple(float(sum(numel[n] for n in names)) for names in layout.buffers)
    element = precision_of(exp).working_bytes(4)
    return StepPlan(world_size, network, forward_s, backward_s, blocks, wire_bytes(exp), element, buckets,
                    {k: v for k, v in exp.options.items() if k in stage.option_names()}, step_s,
                    hierarchical=exp.backend == "hierarchical")


def with_loopback(network, loopback_s: float):
    """The dial as a message costs on this machine: loopback's own transfer runs under the dial's wait
    (:mod:`minizero.comm.port`), so a message's latency is the larger of the dial's alpha and loopback's cost per
    message -- on every wire the dial has (a wire left out of a cluster's dial costs the loopback alone)."""
    if not isinstance(network, TwoLevel):
        return replace(network, alpha=max(network.alpha, loopback_s))
    free = Network(0.0, 1e30, "free")
    return replace(network, intra=replace(network.intra or free, alpha=max((network.intra or free).alpha, loopback_s)),
                   inter=replace(network.inter or free, alpha=max((network.inter or free).alpha, loopback_s)))


def model_against_measured(pool: RankPool, exp: Experiment, network: str, repeats: int = 1) -> dict:
    """Run ``exp`` without a dial, then ``repeats`` times on ``network``; predict the dialled step from the
    undialled run.

    From the undialled run: forward, backward and optimizer-step compute (the slowest rank's median), and
    the loopback's own cost per ring message -- the transfer runs under the dial's wait, so the model's latency
    is the larger of the dial's alpha and loopback's (measured, not assumed).  Each dialled run gives
    its step time and hidden fraction (the slowest rank's median over steps after the first); ``steps``
    is rank 0's timeline of the last run, to draw."""
    if exp.accum != 1:
        raise ValueError(f"the model replays one forward and backward per step; got accum={exp.accum}: compare "
                         f"a run with accum=1")
    exp = replace(exp, check=False)  # a fingerprint is (N-1) more messages per collective, which the model leaves out
    dialled = parse_network(network)  # undialled, a cluster's ranks still sit where they sit: its placement only
    placement = f"nodes={dialled.nodes.count}x{dialled.nodes.per_node}" if isinstance(dialled, TwoLevel) else None
    quiet = pool.run(timeline_on_rank, replace(exp, network=placement))
    runs = [pool.run(timeline_on_rank, replace(exp, network=network)) for _ in range(repeats)]

    def median(per_rank, what) -> float:
        return max(statistics.median(what(step) for step in steps[1:]) for steps in per_rank)

    span = lambda name: lambda st: sum(e - s for w, s, e in st.compute if w == name)  # noqa: E731
    forward_s, backward_s = median(quiet, span("forward")), median(quiet, span("backward"))
    step_s = median(quiet, span("optimizer step"))
    # What the quiet step spent in neither a compute span nor a collective: the host's own work between them --
    # a compressed wire's encoding and decoding, which run around its collectives, are counted here.
    outside_s = median(quiet, lambda st: st.end - sum(e - s for _, s, e in st.compute) - sum(e - s for _, s, e in st.comm))
    messages = lambda st: sum(RING_STEPS.get(w.split()[0], 1) for w, _, _ in st.comm) * (pool.world_size - 1)  # noqa: E731
    # The rank that arrives last at a collective does not wait for the others: its spans are the transfer.
    loopback = min(statistics.median(sum(e - s for _, s, e in st.comm) / max(messages(st), 1) for st in steps[1:])
                   for steps in quiet)
    plan = measured_plan(exp, pool.world_size, with_loopback(dialled, loopback), forward_s, backward_s,
                         step_s)
    predicted = predict(STAGES[exp.stage], plan)
    measured = [median(run, lambda st: st.end) for run in runs]
    hidden = [min(statistics.median(st.hidden() for st in steps[1:]) for steps in run) for run in runs]
    exposed = [median(run, lambda st: st.exposed_s()) for run in runs]
    return {"stage": exp.stage, "world_size": pool.world_size, "options": exp.options, "network": network,
            "measured_ms": statistics.median(measured) * 1e3, "runs_ms": [m * 1e3 for m in measured],
            "predicted_ms": predicted.step_s * 1e3, "error": predicted.step_s / statistics.median(measured) - 1,
            "hidden": statistics.median(hidden), "runs_hidden": hidden,
            "predicted_hidden": max(0.0, 1 - predicted.exposed_s / predicted.comm_s) if predicted.comm_s else 0.0,
            "exposed_ms": statistics.median(exposed) * 1e3, "predicted_exposed_ms": predicted.exposed_s * 1e3,
            "compute_ms": (forward_s + backward_s + step_s) * 1e3, "comm_ms": predicted.comm_s * 1e3,
            "loopback_ms_per_message": loopback * 1e3, "outside_ms": outside_s * 1e3,
            "steps": runs[-1][0]}  # rank 0's timeline, last run

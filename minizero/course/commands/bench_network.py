"""Benchmarks on a dialled network (``--network``): what overlap, bucket size, prefetch and compression buy,
measured in rounds (``--rounds``) and set beside the scaling model's prediction (:mod:`minizero.costs.cost_model`):
the ratio measured/model is the median of the rounds' ratios, with its order-statistic interval (95% from 6 rounds)
(:mod:`minizero.course.harness.rounds`); fp16 compression's step is set against fp32's the same way, run by run.

On loopback these effects drown in the CPU that moving bytes costs; on a dialled network a transfer is a wait
that costs no CPU, as on a real NIC, so each figure comes out the same run to run -- the spread over the
repeats is printed with it."""
from __future__ import annotations

import statistics
import time

import torch

from ...comm import ReduceOp, make_comm
from ...run.launch import Rank, RankPool
from ...run.train import shard_step, sum_loss
from ...stages import STAGES
from ..harness.experiment import Experiment
from ..harness.models import BENCH_GPT
from ..harness.optimizers import make_optimizer
from ..harness.registry import accepting, build_stage, sharding, stage_class
from ..harness.rounds import check_rounds, compare, describe, measure_rounds
from ..harness.tasks import TASKS
from .scale import model_against_measured, with_loopback

REPEATS = 3


def _base(network: str, steps: int = 5, **changes) -> Experiment:
    return Experiment(task="gpt", model=BENCH_GPT, optimizer="sgd", steps=steps, micro_batch=8, dtype="float32",
                      check=False, network=network, **changes)


def _spread(values: list[float]) -> float:
    """(max - min) / median: how far apart the repeats landed."""
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle else 0.0


def _row(name: str, r: dict, **extra) -> dict:
    return {"name": name, "value": r["measured_ms"], "unit": "ms", "baseline": "model", "baseline_value":
            r["predicted_ms"], **compare(r["runs_ms"], [r["predicted_ms"]] * len(r["runs_ms"])),
            "runs_ms": r["runs_ms"],
            "spread": _spread(r["runs_ms"]), "hidden": r["hidden"], "runs_hidden": r["runs_hidden"],
            "hidden_spread": max(r["runs_hidden"]) - min(r["runs_hidden"]), "predicted_hidden": r["predicted_hidden"],
            "exposed_ms": r["exposed_ms"], "predicted_exposed_ms": r["predicted_exposed_ms"],
            "compute_ms": r["compute_ms"], "comm_ms": r["comm_ms"], "world_size": r["world_size"],
            "network": r["network"], **extra}


def bench_overlap_dialled(world_size: int, network: str, bucket_mb: float = 0.5, rounds: int = REPEATS) -> list[dict]:
    """ddp-bucketed on the bench GPT: the share of communication hidden behind backward, measured against
    the model's prediction."""
    stage = _bucketed()
    with RankPool(world_size) as pool:
        r = model_against_measured(pool, _base(network, stage=stage, options={"bucket_mb": bucket_mb}), network,
                                   check_rounds(rounds))
    return [_row(f"{stage} step, {bucket_mb:g} MiB buckets", r, bucket_mb=bucket_mb)]


def _bucketed() -> str:
    """The stage that all-reduces in buckets: unsharded, with a bucket size (its own facts)."""
    return next(s for s in sharding() if s in accepting("bucket_mb"))


def bench_buckets(world_size: int, network: str, sizes=(0.01, 0.05, 0.25, 1.0, 8.0),
                  rounds: int = REPEATS) -> list[dict]:
    """ddp-bucketed across bucket sizes: tiny buckets pay alpha per bucket (latency-bound), one huge
    bucket cannot leave before backward ends (nothing hides); the best lies between."""
    rows, stage = [], _bucketed()
    with RankPool(world_size) as pool:
        for mb in sizes:
            r = model_against_measured(pool, _base(network, stage=stage, options={"bucket_mb": mb}), network, check_rounds(rounds))
            rows.append(_row(f"{stage} step, {mb:g} MiB buckets", r, bucket_mb=mb))
    return rows


def bench_prefetch(world_size: int, network: str, depths=(0, 1, 2), rounds: int = REPEATS) -> list[dict]:
    """zero3 with prefetch 0, 1, 2: the exposed all-gather wait shrinks as gathers start earlier."""
    rows = []
    with RankPool(world_size) as pool:
        for stage in accepting("prefetch"):
            for depth in depths:
                r = model_against_measured(pool, _base(network, stage=stage, options={"prefetch": depth}), network,
                                           check_rounds(rounds))
                rows.append(_row(f"{stage} step, prefetch={depth}", r, prefetch=depth))
    return rows


def bench_compress(world_size: int, network: str, rounds: int = REPEATS) -> list[dict]:
    """ddp and ddp-bucketed with fp16 compression against fp32: the step falls by the communication saved
    (half the bytes; the same number of messages, so not half the latency) -- and no more.  Then the wires
    beyond 16 bits on ddp (:func:`bench_codecs`)."""
    rows = []
    with RankPool(world_size) as pool:
        for stage in sharding():  # the unsharded stages: their one reduction is what compression halves
            for compress in (None, "fp16"):
                options = {"compress": compress} if compress else {}
                r = model_against_measured(pool, _base(network, stage=stage, options=options), network, check_rounds(rounds))
                rows.append(_row(f"{stage} step, {compress or 'fp32'} gradients", r, compress=compress or "fp32"))
    for fp32, fp16 in zip(rows[::2], rows[1::2], strict=True):
        fp16["saved_ms"] = fp32["value"] - fp16["value"]
        fp16["predicted_saved_ms"] = fp32["baseline_value"] - fp16["baseline_value"]
        fp16["step_ratio"] = fp16["value"] / fp32["value"]
        fp16["against_fp32"] = compare(fp16["runs_ms"], fp32["runs_ms"])
    return rows + bench_codecs(world_size, network, rounds)


#: The wires beyond 16 bits ``bench compress`` measures on ddp (the one all-reduce, not overlapped).
CODECS = ("int8", "topk:0.01", "sign", "powersgd:rank=2")


def bench_codecs(world_size: int, network: str, rounds: int = REPEATS, specs=CODECS) -> list[dict]:
    """``ddp`` under each wire beyond 16 bits against its fp32 step on the same dial, run by run: the
    prediction is fp32's measured step, less fp32's averaging on the alpha-beta ring, plus the compressor's
    (:func:`minizero.course.commands.break_even.wire_terms`: an all-gather of messages, or PowerSGD's three all-reduces)
    and its compute -- the break-even model of ``scale --compress``, checked where it can be.  The compute is
    measured on the ranks, in the undialled run: the time its step spent outside compute and collectives,
    beyond fp32's (``scale`` times it alone, :func:`~minizero.course.commands.break_even.compute_s`; with more ranks than
    cores the ranks' decoding competes for them, which a timing alone cannot see)."""
    from ...comm.network import parse_network
    from ..harness.tasks import TASKS
    from .break_even import compute_s, wire_terms

    stage = next(s for s in sharding() if s not in accepting("bucket_mb"))  # unsharded, one all-reduce: ddp
    model = TASKS["gpt"].make_model(0, torch.float32, **BENCH_GPT)
    shapes = [(name, p.shape) for name, p in model.named_parameters() if p.requires_grad]
    with RankPool(world_size) as pool:
        base = model_against_measured(pool, _base(network, stage=stage), network, check_rounds(rounds))
        dialled = parse_network(network)

        def averaging_s(spec: str, run: dict) -> float:
            """The wire's averaging on the dial, each message's latency at least what loopback cost per message in
            that run's own undialled step (PowerSGD's small messages cost loopback less than fp32's large ones)."""
            net = with_loopback(dialled, run["loopback_ms_per_message"] / 1e3)
            latency, nbytes, _ = wire_terms(spec, shapes, world_size, net)
            return latency + nbytes / net.bandwidth

        fp32_s = averaging_s("none", base)
        rows = [_row(f"{stage} step, fp32 gradients", base, compress="fp32")]
        for spec in specs:
            r = model_against_measured(pool, _base(network, stage=stage, options={"compress": spec}), network,
                                       check_rounds(rounds))
            compute = max(0.0, r["outside_ms"] - base["outside_ms"]) / 1e3
            alone = compute_s(spec, shapes, world_size)
            change_ms = (averaging_s(spec, r) + compute - fp32_s) * 1e3
            predicted = [m + change_ms for m in base["runs_ms"]]
            row = _row(f"{stage} step, {spec}", {**r, "predicted_ms": statistics.median(predicted)}, compress=spec)
            row.update(compare(r["runs_ms"], predicted), predicted_change_ms=change_ms, compute_ms_codec=compute * 1e3,
                       compute_ms_timed_alone=alone * 1e3,
                       against_fp32=compare(r["runs_ms"], base["runs_ms"]), saved_ms=base["measured_ms"] - r["measured_ms"])
            rows.append(row)
    return rows


def bench_servers(world_size: int, network: str, rounds: int = REPEATS) -> list[dict]:
    """The parameter server at N = 2 .. world_size, with one server and with every rank serving: one server
    sends the model to every other rank, so its step grows with N; S = N sends the ring's bytes and stays flat."""
    stage = next(s for s in accepting("servers") if STAGES[s].equivalent)
    rows = []
    for n in range(2, world_size + 1):
        with RankPool(n) as pool:
            for servers in sorted({1, n}):
                r = model_against_measured(pool, _base(network, stage=stage, options={"servers": servers}), network,
                                           check_rounds(rounds))
                rows.append(_row(f"{stage} step, N={n}, S={servers}", r, servers=servers))
    return rows


def format_rows(what: str, world_size: int, network: str, rows: list[dict]) -> str:
    lines = [f"{what} on a dialled network ({network}), N={world_size}: median step of {len(rows[0]['runs_ms'])} runs "
             f"(spread = (max-min)/median), beside the scaling model; measured/model: median of the runs' ratios "
             f"[k-th smallest, k-th largest: a 95% interval from 6 rounds]",
             f"  {'':<40}{'measured':>10}{'model':>9}{'spread':>8}{'hidden':>8}{'model':>7}{'exposed':>9}"]
    for r in rows:
        lines.append(f"  {r['name']:<40}{r['value']:>8.1f}ms{r['baseline_value']:>7.1f}ms{r['spread']:>8.1%}"
                     f"{r['hidden']:>8.0%}{r['predicted_hidden']:>7.0%}{r['exposed_ms']:>7.1f}ms")
        lines.append(f"    measured/model {describe(r)}")
        if "predicted_saved_ms" in r:
            lines.append(f"    saved {r['saved_ms']:.1f} ms (model {r['predicted_saved_ms']:.1f} ms): the step is "
                         f"{r['step_ratio']:.2f}x fp32's, not 0.5x; fp16/fp32 {describe(r['against_fp32'])}")
        elif "predicted_change_ms" in r:
            lines.append(f"    saved {r['saved_ms']:.1f} ms (model {-r['predicted_change_ms']:.1f} ms, with the compressor's "
                         f"compute on the ranks {r['compute_ms_codec']:.1f} ms; timed alone "
                         f"{r['compute_ms_timed_alone']:.1f} ms); against fp32 {describe(r['against_fp32'])}")
    return "\n".join(lines)


# ------------------------------------------------------------- overlap on loopback (no dial): bench overlap
def _overlap_on_rank(me: Rank, name: str, backend: str, bucket_mb: float, repeats: int, rounds: int) -> dict:
    task, comm = TASKS["gpt"], make_comm(backend)
    model = task.make_model(0, torch.float32, **BENCH_GPT)
    stage = build_stage(name, model, make_optimizer("sgd", model, 0.0), comm, bucket_mb=bucket_mb)
    # The communication alone: all-reduces of buffers the size of the stage's buckets (its own fact).
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    buffers = [torch.zeros(sum(sizes[n] for n in names))
               for names in stage_class(name).reduction(model, None, me.world_size, bucket_mb=bucket_mb).buffers]
    x, y = task.make_batch(8 * me.world_size, 0, 0, torch.float32, **BENCH_GPT)
    (xb, yb), = shard_step(x, y, me.rank, me.world_size).micro_batches

    def backward(sync: bool):
        stage.zero_grad()
        start = time.perf_counter()
        if sync:
            sum_loss(stage(xb), yb).backward()  # ends after every bucket's all-reduce has finished
        else:
            with stage.no_sync():
                sum_loss(stage(xb), yb).backward()
        return time.perf_counter() - start

    def communicate():
        start = time.perf_counter()
        for buffer in buffers:
            comm.all_reduce(buffer, ReduceOp.AVG)
        return time.perf_counter() - start

    # The three alternate in rounds; every rank draws the same seeded order, so the collectives meet.
    runs = {"compute": lambda: backward(False), "comm": communicate, "overlapped": lambda: backward(True)}
    times = measure_rounds(lambda what: statistics.median([runs[what]() for _ in range(repeats)]), list(runs), rounds)
    return {**times, "buckets": len(buffers)}


def bench_overlap(world_size: int, bucket_mb: float = 0.5, repeats: int = 3, rounds: int = REPEATS) -> list[dict]:
    """Forward+backward alone, the bucket all-reduces alone, and both overlapped -- for the bucketed
    all-reduce stage (unsharded, with buckets), alternating in rounds; the ratio is overlapped against
    compute + comm in sequence, round by round."""
    name, rows = next(s for s in sharding() if s in accepting("bucket_mb")), []
    check_rounds(rounds)
    with RankPool(world_size) as pool:
        for backend in ("native", "ring"):
            per_rank = pool.run(_overlap_on_rank, name, backend, bucket_mb, repeats, rounds)
            per_round = {k: [max(r[k][i] for r in per_rank) * 1e3 for i in range(rounds)]
                         for k in ("compute", "comm", "overlapped")}
            sequence = [c + m for c, m in zip(per_round["compute"], per_round["comm"], strict=True)]
            t = {k: statistics.median(v) / 1e3 for k, v in per_round.items()}
            hidden = (t["compute"] + t["comm"] - t["overlapped"]) / t["comm"]
            common = {"world_size": world_size, "buckets": per_rank[0]["buckets"]}
            rows += [
                {"name": f"{backend}: forward+backward alone", "value": t["compute"] * 1e3, "unit": "ms", **common},
                {"name": f"{backend}: bucket all-reduces alone", "value": t["comm"] * 1e3, "unit": "ms", **common},
                {"name": f"{backend}: forward+backward with overlapped all-reduces", "value": t["overlapped"] * 1e3,
                 "unit": "ms", "baseline": f"{backend}: compute + comm in sequence",
                 "baseline_value": statistics.median(sequence), **compare(per_round["overlapped"], sequence),
                 "round_ms": per_round["overlapped"], "baseline_round_ms": sequence, **common},
                {"name": f"{backend}: communication hidden", "value": max(0.0, min(1.0, hidden)), "unit": "fraction",
                 **common},
            ]
    return rows

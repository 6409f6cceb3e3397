"""``python -m minizero bench ...``: speed, as ratios against torch in the same run.

Timings are never asserted in tests; they are measured here, on demand.  The
stages run as in production, with fingerprint checking off; ``bench check``
measures what turning it on costs.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace

import torch

from ...comm import NativeComm, ReduceOp, RingComm, parse_network
from ...run.launch import Rank, RankPool
from ...stages import distributed
from ..harness.experiment import Experiment, run_experiment
from ..harness.machine import Recorded
from ..harness.machine import describe as describe_machine
from ..harness.models import BENCH_GPT
from ..harness.registry import accepting, sharding
from ..harness.rounds import FEWEST_ROUNDS, METHOD, check_rounds, compare, describe, measure_rounds
from . import bench_all
from .bench_network import (
    bench_buckets,
    bench_compress,
    bench_overlap,
    bench_overlap_dialled,
    bench_prefetch,
    bench_servers,
    format_rows,
)
from .codec_compute import bench_codec_compute, format_codec_compute
from .efficiency import bench_efficiency, format_efficiency
from .gpu_efficiency import GPU_DIAL, bench_gpu_efficiency, format_gpu_efficiency

MB = 1 << 20
ROUNDS = FEWEST_ROUNDS  # the default --rounds: the fewest whose interval holds the median 95% of the time (6)
STEPS = 6  # steps per run, two of them untimed warm-up


def _time_all_reduce(comm, tensor: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        comm.all_reduce(tensor, ReduceOp.SUM)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collectives_on_rank(me: Rank, sizes_mb: list[int], repeats: int, rounds: int) -> dict:
    """Each (size, implementation) in rounds; every rank draws the same seeded order, so the collectives meet."""
    comms = {"native": NativeComm(), "ring": RingComm()}
    tensors = {size: torch.ones(size * MB // 4, dtype=torch.float32) for size in sizes_mb}
    pairs = [(size, impl) for size in sizes_mb for impl in comms]
    return measure_rounds(lambda pair: _time_all_reduce(comms[pair[1]], tensors[pair[0]], repeats), pairs, rounds)


def bench_collectives(world_size: int, sizes_mb=(1, 16, 64), repeats: int = 5, rounds: int = ROUNDS) -> list[dict]:
    """The send/recv ring's all-reduce against gloo's native one, per size: time ratio ring/native."""
    check_rounds(rounds)
    with RankPool(world_size) as pool:
        per_rank = pool.run(_collectives_on_rank, list(sizes_mb), repeats, rounds)
    # A collective is as slow as its slowest rank, round by round.
    slowest = {pair: [max(rank[pair][i] for rank in per_rank) for i in range(rounds)] for pair in per_rank[0]}
    rows = []
    for size in sizes_mb:
        ring, native = slowest[(size, "ring")], slowest[(size, "native")]
        to_busbw = 2 * (world_size - 1) / world_size * size * MB / 1e9
        rows.append({"name": f"all_reduce_ring_{size}MB", "value": to_busbw / statistics.median(ring), "unit": "GB/s",
                     "baseline": f"all_reduce_native_{size}MB", "baseline_value": to_busbw / statistics.median(native),
                     **compare(ring, native), "round_s": ring, "baseline_round_s": native, "world_size": world_size})
    return rows


def _ratio_row(name: str, mine: dict, baseline: str, theirs: dict, world_size: int, **extra) -> dict:
    """A timed row: the medians over the rounds, and the rounds' ratio with its interval and verdict."""
    return {"name": name, "value": statistics.median(mine["round_ms"]), "unit": "ms", "baseline": baseline,
            "baseline_value": statistics.median(theirs["round_ms"]), **compare(mine["round_ms"], theirs["round_ms"]),
            "round_ms": mine["round_ms"], "baseline_round_ms": theirs["round_ms"], "world_size": world_size, **extra}


def _base(steps: int, **changes) -> Experiment:
    return Experiment(task="gpt", model=BENCH_GPT, optimizer="adamw", steps=steps, micro_batch=8, dtype="float32",
                      check=False, **changes)


def bench_ddp(world_size: int, steps: int = STEPS, rounds: int = ROUNDS) -> list[dict]:
    """Step time of ddp and ddp-bucketed (ring and native) against torch DDP, in one pool, in rounds."""
    base = _base(steps)
    variants = [("torch-ddp", replace(base, stage="torch-ddp"))] + [
        (f"{stage}/{backend}", replace(base, stage=stage, backend=backend))
        for stage in sharding() for backend in ("native", "ring")]
    measured = _measure(world_size, variants, rounds)
    return [_ratio_row(f"{name} step", m, "torch-ddp step", measured["torch-ddp"], world_size)
            for name, m in measured.items() if name != "torch-ddp"]


def _measure(world_size: int, variants: list[tuple[str, Experiment]], rounds: int) -> dict[str, dict]:
    """Every variant once per round, in a shuffled order, one pool: per round the median step of the slowest
    rank (each run's first two steps are its untimed warm-up); and per step what each rank sent, Psi and
    the fingerprint bytes (deterministic: the last round's)."""
    experiments, last = dict(variants), {}

    def measure(name: str) -> float:
        exp = experiments[name]
        per_rank = pool.run(run_experiment, exp)
        per_step = world_size * exp.steps
        last[name] = {"sent": sum(r.sent_bytes for r in per_rank) / per_step, "psi": per_rank[0].psi,
                      "check_bytes": sum(r.check_bytes for r in per_rank) / per_step}
        return max(statistics.median(r.step_s[2:]) for r in per_rank) * 1e3  # skip two warm-up steps

    check_rounds(rounds)
    with RankPool(world_size) as pool:
        times = measure_rounds(measure, list(experiments), rounds, warmup=False)
    return {name: {**last[name], "round_ms": times[name]} for name in experiments}


def bench_check(world_size: int, steps: int = STEPS, model: dict | None = None, rounds: int = ROUNDS,
                cases: list[tuple[str, dict]] | None = None, backends=("native", "ring")) -> list[dict]:
    """What fingerprinting every collective costs: the same stage with the check off and on, in rounds.

    One small all-gather (9 float64 per rank) before each collective: its cost is a latency, paid
    once per bucket or unit -- so the stages with many small collectives pay most.  ``cases``: (stage, options)
    to time (default: every stage with buckets, at 0.5 MB, and every stage with units)."""
    base = replace(_base(steps), model=BENCH_GPT if model is None else model)
    # Stages with many small collectives pay most: small buckets, and one all-gather per unit.
    if cases is None:
        cases = [(stage, {"bucket_mb": 0.5}) for stage in accepting("bucket_mb")] + [(stage, {}) for stage in accepting("units")]
    variants = [(f"{stage}/{backend}" + (" check" if check else ""),
                 replace(base, stage=stage, backend=backend, check=check, options=options))
                for stage, options in cases for backend in backends for check in (False, True)]
    measured = _measure(world_size, variants, rounds)
    return [_ratio_row(f"{off} step, check on", measured[on], "check off", measured[off], world_size,
                       check_bytes_per_step=measured[on]["check_bytes"])
            for (off, _), (on, _) in zip(variants[::2], variants[1::2], strict=True)]


def bench_zero(world_size: int, steps: int = STEPS, rounds: int = ROUNDS) -> list[dict]:
    """zero1 / zero2 (ring and native) against torch's ZeroRedundancyOptimizer + DDP, in rounds.

    Bytes: minizero's from the ledger; torch's modelled as its DDP all-reduce
    (2(N-1)/N Psi b) plus each owner broadcasting its updated parameters
    (about (N-1)/N Psi b per rank): the 3 Psi of an all-reduce-based ZeRO-1."""
    base = _base(steps)
    variants = [("torch-zero", replace(base, stage="torch-zero"))] + [
        (f"{stage}/{backend}", replace(base, stage=stage, backend=backend))
        for stage in sharding(optimizer_states=True) + sharding(optimizer_states=True, gradients=True)
        for backend in ("native", "ring")]
    measured = _measure(world_size, variants, rounds)
    theirs = measured.pop("torch-zero")
    torch_bytes = 3 * (world_size - 1) / world_size * theirs["psi"] * 4
    rows = []
    for name, m in measured.items():
        rows.append(_ratio_row(f"{name} step", m, "torch-zero step", theirs, world_size))
        rows.append({"name": f"{name} bytes sent per rank per step", "value": m["sent"], "unit": "B",
                     "baseline": "torch-zero bytes (modelled)", "baseline_value": torch_bytes,
                     "ratio": m["sent"] / torch_bytes, "world_size": world_size})
    return rows


def bench_zero3(world_size: int, steps: int = STEPS, rounds: int = ROUNDS) -> list[dict]:
    """zero3 (native and ring, prefetch on and off) against FSDP2's fully_shard, in rounds."""
    base = _base(steps)
    variants = [("torch-fsdp2", replace(base, stage="torch-fsdp2"))] + [
        (f"{stage}/{backend}/prefetch={depth}", replace(base, stage=stage, backend=backend, options={"prefetch": depth}))
        for stage in sharding(optimizer_states=True, gradients=True, parameters=True)
        for backend in ("native", "ring") for depth in (1, 0)]
    measured = _measure(world_size, variants, rounds)
    theirs = measured.pop("torch-fsdp2")
    return [_ratio_row(f"{name} step", m, "torch-fsdp2 step", theirs, world_size, sent_bytes=m["sent"])
            for name, m in measured.items()]


def bench_precision(world_size: int, steps: int = STEPS, precision: str = "bf16", rounds: int = ROUNDS) -> list[dict]:
    """Every stage in mixed precision against FSDP2 with its own ``MixedPrecisionPolicy`` (16-bit compute and
    reduction, fp32 shards), in rounds; and each stage against itself in fp32.  On CPU 16-bit arithmetic
    is emulated and often slower than fp32: the ratios say what the recipe costs here, not on a GPU."""
    base = _base(steps, backend="native")
    variants = [("torch-fsdp2", replace(base, stage="torch-fsdp2", options={"precision": precision}))]
    stages = [stage for stage in distributed() if stage in accepting("precision")]  # local-sgd takes none
    for stage in stages:
        variants += [(stage, replace(base, stage=stage, options={"precision": precision})),
                     (f"{stage}/fp32", replace(base, stage=stage))]
    measured = _measure(world_size, variants, rounds)
    theirs, rows = measured["torch-fsdp2"], []
    for stage in stages:
        m, fp32 = measured[stage], measured[f"{stage}/fp32"]
        rows.append(_ratio_row(f"{stage} {precision} step", m, f"torch-fsdp2 {precision} step", theirs, world_size,
                               sent_bytes=m["sent"]))
        rows.append({"name": f"{stage} {precision} bytes sent per rank per step", "value": m["sent"], "unit": "B",
                     "baseline": "the same stage in fp32", "baseline_value": fp32["sent"],
                     "ratio": m["sent"] / fp32["sent"], "world_size": world_size})
        rows.append(_ratio_row(f"{stage} {precision} step vs fp32", m, "the same stage in fp32", fp32, world_size))
    return rows


#: The benches on a dialled network (--network).
DIALLED = ("overlap", "buckets", "prefetch", "compress", "servers", "efficiency", "gpu-efficiency")
#: ``python -m minizero bench WHAT``: each benchmark, from the command line's arguments.
BENCHES = {
    "collectives": lambda args: bench_collectives(args.world_size, repeats=args.repeats, rounds=args.rounds),
    "ddp": lambda args: bench_ddp(args.world_size, rounds=args.rounds),
    "zero": lambda args: bench_zero(args.world_size, rounds=args.rounds),
    "zero3": lambda args: bench_zero3(args.world_size, rounds=args.rounds),
    "overlap": lambda args: (bench_overlap_dialled(args.world_size, args.network, rounds=args.rounds) if args.network
                             else bench_overlap(args.world_size, repeats=args.repeats, rounds=args.rounds)),
    "buckets": lambda args: bench_buckets(args.world_size, _dial(args), rounds=args.rounds),
    "prefetch": lambda args: bench_prefetch(args.world_size, _dial(args), rounds=args.rounds),
    "compress": lambda args: bench_compress(args.world_size, _dial(args), rounds=args.rounds),
    "servers": lambda args: bench_servers(args.world_size, _dial(args), rounds=args.rounds),
    "check": lambda args: bench_check(args.world_size, rounds=args.rounds),
    "precision": lambda args: bench_precision(args.world_size, rounds=args.rounds),
    "codecs": lambda args: bench_codec_compute(args.world_size, model=args.model or "medium"),
    "all": bench_all.main,  # every stage beside its torch counterpart: step, bytes, memory
    "efficiency": lambda args: bench_efficiency(args.world_size, _dial(args), rounds=args.rounds),
    "gpu-efficiency": lambda args: bench_gpu_efficiency(args.network or GPU_DIAL, rounds=args.rounds,
                                                        model=args.model),
}


def _dial(args) -> str:
    """The dialled benches measure on a network: the one given, else the lessons' slow one."""
    return args.network or "lesson"


def main(args) -> tuple[int, str]:
    bench_all.refuse_elsewhere(args)  # --model, --device, ...: before any rank starts
    check_rounds(args.rounds)
    if args.network is not None:
        parse_network(args.network)  # a bad dial is refused before any rank starts
        if args.what not in DIALLED:
            raise ValueError(f"bench {args.what} does not take --network; the dialled benches are {', '.join(DIALLED)}")
    with Recorded(own=args.world_size) as recorded:
        rows = BENCHES[args.what](args)
    if args.json:
        return 0, json.dumps({"machine": recorded.state, "rows": rows}, indent=2)
    return 0, format_result(args, rows) + "\n" + describe_machine(recorded.state)


def format_result(args, rows: list[dict]) -> str:
    """The rows as text: every timed ratio with its interval, and a verdict only where the interval allows."""
    if args.what == "all":
        return bench_all.format_table(rows)
    if args.what == "efficiency":
        return format_efficiency(rows)
    if args.what == "gpu-efficiency":
        return format_gpu_efficiency(rows)
    if args.what == "codecs":
        return format_codec_compute(rows)
    if args.what in DIALLED and (args.what != "overlap" or args.network):
        return format_rows(args.what, args.world_size, _dial(args), rows)
    if args.what == "collectives":
        lines = [f"all-reduce bus bandwidth, N={args.world_size} ranks, gloo on CPU (higher is better); time ratio "
                 f"ring/native over {args.rounds} rounds ({METHOD})",
                 f"{'size':>6}{'ring (send/recv)':>18}{'native':>10}   time ratio [95% interval] verdict"]
        for r in rows:
            size = r["name"].rsplit("_", 1)[1]
            lines.append(f"{size:>6}{r['value']:>14.3f} GB/s{r['baseline_value']:>10.3f}   {describe(r)}")
        return "\n".join(lines)
    lines = [f"{args.what}, N={args.world_size} ranks, gloo on CPU, {args.rounds} rounds ({METHOD})"]
    for r in rows:
        ratio = f"   {r['ratio']:.2f}x {r['baseline']}" if "ratio" in r else ""
        if "interval" in r:
            ratio = f"   {describe(r)} (against {r['baseline']})"
        lines.append(f"  {r['name']:<58}{r['value']:>12,.2f} {r['unit']:<8}{ratio}")
    return "\n".join(lines)

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

from ..comm import NativeComm, ReduceOp, RingComm, make_comm, parse_network
from ..launch import Rank, RankPool
from ..stages import distributed
from ..train import shard_step, sum_loss
from . import bench_all
from .bench_network import bench_buckets, bench_compress, bench_overlap_dialled, bench_prefetch, bench_servers, format_rows
from .experiment import Experiment, run_experiment
from .models import BENCH_GPT
from .optimizers import make_optimizer
from .registry import accepting, build_stage, sharding, stage_class
from .tasks import TASKS

MB = 1 << 20


def _time_all_reduce(comm, tensor: torch.Tensor, repeats: int) -> float:
    comm.all_reduce(tensor, ReduceOp.SUM)  # warm-up: connections, allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        comm.all_reduce(tensor, ReduceOp.SUM)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collectives_on_rank(me: Rank, sizes_mb: list[int], repeats: int) -> list[dict]:
    ring, native = RingComm(), NativeComm()
    rows = []
    for size in sizes_mb:
        tensor = torch.ones(size * MB // 4, dtype=torch.float32)
        for comm in (native, ring):
            seconds = _time_all_reduce(comm, tensor, repeats)
            # Bus bandwidth (as in nccl-tests): the bytes a ring all-reduce must move per rank.
            busbw = 2 * (me.world_size - 1) / me.world_size * tensor.numel() * 4 / seconds / 1e9
            rows.append({"size_mb": size, "impl": comm.name, "seconds": seconds, "busbw": busbw})
    return rows


def bench_collectives(world_size: int, sizes_mb=(1, 16, 64), repeats: int = 5) -> list[dict]:
    with RankPool(world_size) as pool:
        per_rank = pool.run(_collectives_on_rank, list(sizes_mb), repeats)
    rows = []
    for size in sizes_mb:
        # A collective is as slow as its slowest rank.
        native = max(r["seconds"] for rank in per_rank for r in rank if r["size_mb"] == size and r["impl"] == "native")
        ring = max(r["seconds"] for rank in per_rank for r in rank if r["size_mb"] == size and r["impl"] == "ring")
        to_busbw = 2 * (world_size - 1) / world_size * size * MB / 1e9
        rows.append({"name": f"all_reduce_ring_{size}MB", "value": to_busbw / ring, "unit": "GB/s",
                     "baseline": f"all_reduce_native_{size}MB", "baseline_value": to_busbw / native,
                     "ratio": native / ring, "world_size": world_size})
    return rows


def bench_ddp(world_size: int, steps: int = 12) -> list[dict]:
    """Step time of ddp and ddp-bucketed (ring and native) against torch DDP, in one pool, one run."""
    base = Experiment(task="gpt", model=BENCH_GPT, optimizer="adamw", steps=steps, micro_batch=8, dtype="float32",
                      check=False)
    variants = [("torch-ddp", replace(base, stage="torch-ddp"))] + [
        (f"{stage}/{backend}", replace(base, stage=stage, backend=backend))
        for stage in sharding() for backend in ("native", "ring")]
    rows = _step_times(world_size, variants)
    torch_ms = rows[0][1]
    return [{"name": f"{name} step", "value": ms, "unit": "ms", "baseline": "torch-ddp step",
             "baseline_value": torch_ms, "ratio": ms / torch_ms, "world_size": world_size}
            for name, ms, _, _ in rows[1:]]


def _step_times(world_size: int, variants: list[tuple[str, Experiment]]) -> list[tuple[str, float, float, int]]:
    """(name, median step ms of the slowest rank, bytes sent per rank per step, Psi) per variant, one pool."""
    return [(name, ms, sent, psi) for name, ms, sent, psi, _ in _measure(world_size, variants)]


def _measure(world_size: int, variants: list[tuple[str, Experiment]]) -> list[tuple[str, float, float, int, float]]:
    """:func:`_step_times` plus the fingerprint bytes per rank per step."""
    rows = []
    with RankPool(world_size) as pool:
        for name, exp in variants:
            per_rank = pool.run(run_experiment, exp)
            ms = max(statistics.median(r.step_s[2:]) for r in per_rank) * 1e3  # skip two warm-up steps
            per_step = world_size * exp.steps
            rows.append((name, ms, sum(r.sent_bytes for r in per_rank) / per_step, per_rank[0].psi,
                         sum(r.check_bytes for r in per_rank) / per_step))
    return rows


def bench_check(world_size: int, steps: int = 12, model: dict | None = None) -> list[dict]:
    """What fingerprinting every collective costs: the same stage with the check off and on, one run.

    One small all-gather (9 float64 per rank) before each collective: its cost is a latency, paid
    once per bucket or unit -- so the stages with many small collectives pay most."""
    base = Experiment(task="gpt", model=BENCH_GPT if model is None else model, optimizer="adamw", steps=steps,
                      micro_batch=8, dtype="float32")
    # Stages with many small collectives pay most: small buckets, and one all-gather per unit.
    cases = [(stage, {"bucket_mb": 0.5}) for stage in accepting("bucket_mb")] + [(stage, {}) for stage in accepting("units")]
    variants = [(f"{stage}/{backend}", replace(base, stage=stage, backend=backend, check=check, options=options))
                for stage, options in cases for backend in ("native", "ring") for check in (False, True)]
    measured = _measure(world_size, variants)
    rows = []
    for (name, off_ms, _, _, _), (_, on_ms, _, _, check_bytes) in zip(measured[::2], measured[1::2], strict=True):
        rows.append({"name": f"{name} step, check on", "value": on_ms, "unit": "ms", "baseline": "check off",
                     "baseline_value": off_ms, "ratio": on_ms / off_ms, "world_size": world_size,
                     "check_bytes_per_step": check_bytes})
    return rows


def bench_zero(world_size: int, steps: int = 12) -> list[dict]:
    """zero1 / zero2 (ring and native) against torch's ZeroRedundancyOptimizer + DDP, in one run.

    Bytes: minizero's from the ledger; torch's modelled as its DDP all-reduce
    (2(N-1)/N Psi b) plus each owner broadcasting its updated parameters
    (about (N-1)/N Psi b per rank): the 3 Psi of an all-reduce-based ZeRO-1."""
    base = Experiment(task="gpt", model=BENCH_GPT, optimizer="adamw", steps=steps, micro_batch=8, dtype="float32",
                      check=False)
    variants = [("torch-zero", replace(base, stage="torch-zero"))] + [
        (f"{stage}/{backend}", replace(base, stage=stage, backend=backend))
        for stage in sharding(optimizer_states=True) + sharding(optimizer_states=True, gradients=True)
        for backend in ("native", "ring")]
    measured = _step_times(world_size, variants)
    torch_ms, psi = measured[0][1], measured[0][3]
    torch_bytes = 3 * (world_size - 1) / world_size * psi * 4
    rows = []
    for name, ms, sent, _ in measured[1:]:
        rows.append({"name": f"{name} step", "value": ms, "unit": "ms", "baseline": "torch-zero step",
                     "baseline_value": torch_ms, "ratio": ms / torch_ms, "world_size": world_size})
        rows.append({"name": f"{name} bytes sent per rank per step", "value": sent, "unit": "B",
                     "baseline": "torch-zero bytes (modelled)", "baseline_value": torch_bytes,
                     "ratio": sent / torch_bytes, "world_size": world_size})
    return rows


def bench_zero3(world_size: int, steps: int = 12) -> list[dict]:
    """zero3 (native and ring, prefetch on and off) against FSDP2's fully_shard, in one run."""
    base = Experiment(task="gpt", model=BENCH_GPT, optimizer="adamw", steps=steps, micro_batch=8, dtype="float32",
                      check=False)
    variants = [("torch-fsdp2", replace(base, stage="torch-fsdp2"))] + [
        (f"{stage}/{backend}/prefetch={depth}", replace(base, stage=stage, backend=backend, options={"prefetch": depth}))
        for stage in sharding(optimizer_states=True, gradients=True, parameters=True)
        for backend in ("native", "ring") for depth in (1, 0)]
    measured = _step_times(world_size, variants)
    torch_ms = measured[0][1]
    return [{"name": f"{name} step", "value": ms, "unit": "ms", "baseline": "torch-fsdp2 step",
             "baseline_value": torch_ms, "ratio": ms / torch_ms, "world_size": world_size, "sent_bytes": sent}
            for name, ms, sent, _ in measured[1:]]


def _overlap_on_rank(me: Rank, name: str, backend: str, bucket_mb: float, repeats: int) -> dict:
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

    measure = lambda f, *a: statistics.median([f(*a) for _ in range(repeats)])  # noqa: E731
    backward(True)  # warm-up
    return {"compute": measure(backward, False), "comm": measure(communicate),
            "overlapped": measure(backward, True), "buckets": len(buffers)}


def bench_overlap(world_size: int, bucket_mb: float = 0.5, repeats: int = 7) -> list[dict]:
    """Forward+backward alone, the bucket all-reduces alone, and both overlapped -- for the bucketed
    all-reduce stage (unsharded, with buckets)."""
    name, rows = next(s for s in sharding() if s in accepting("bucket_mb")), []
    with RankPool(world_size) as pool:
        for backend in ("native", "ring"):
            per_rank = pool.run(_overlap_on_rank, name, backend, bucket_mb, repeats)
            t = {k: max(r[k] for r in per_rank) for k in ("compute", "comm", "overlapped")}
            hidden = (t["compute"] + t["comm"] - t["overlapped"]) / t["comm"]
            common = {"world_size": world_size, "buckets": per_rank[0]["buckets"]}
            rows += [
                {"name": f"{backend}: forward+backward alone", "value": t["compute"] * 1e3, "unit": "ms", **common},
                {"name": f"{backend}: bucket all-reduces alone", "value": t["comm"] * 1e3, "unit": "ms", **common},
                {"name": f"{backend}: forward+backward with overlapped all-reduces", "value": t["overlapped"] * 1e3,
                 "unit": "ms", "baseline": f"{backend}: compute + comm in sequence",
                 "baseline_value": (t["compute"] + t["comm"]) * 1e3,
                 "ratio": t["overlapped"] / (t["compute"] + t["comm"]), **common},
                {"name": f"{backend}: communication hidden", "value": max(0.0, min(1.0, hidden)), "unit": "fraction",
                 **common},
            ]
    return rows


#: ``python -m minizero bench WHAT``: each benchmark, from the command line's arguments.
def bench_precision(world_size: int, steps: int = 12, precision: str = "bf16") -> list[dict]:
    """Every stage in mixed precision against FSDP2 with its own ``MixedPrecisionPolicy`` (16-bit compute and
    reduction, fp32 shards), in one run; and each stage against itself in fp32.  On CPU 16-bit arithmetic
    is emulated and often slower than fp32: the ratios say what the recipe costs here, not on a GPU."""
    base = Experiment(task="gpt", model=BENCH_GPT, optimizer="adamw", steps=steps, micro_batch=8, dtype="float32",
                      check=False, backend="native")
    variants = [("torch-fsdp2", replace(base, stage="torch-fsdp2", options={"precision": precision}))]
    for stage in distributed():
        variants += [(stage, replace(base, stage=stage, options={"precision": precision})),
                     (f"{stage}/fp32", replace(base, stage=stage))]
    measured = _step_times(world_size, variants)
    torch_ms = measured[0][1]
    rows = []
    for (name, ms, sent, _), (_, fp32_ms, fp32_sent, _) in zip(measured[1::2], measured[2::2], strict=True):
        rows.append({"name": f"{name} {precision} step", "value": ms, "unit": "ms",
                     "baseline": f"torch-fsdp2 {precision} step", "baseline_value": torch_ms, "ratio": ms / torch_ms,
                     "world_size": world_size, "sent_bytes": sent})
        rows.append({"name": f"{name} {precision} bytes sent per rank per step", "value": sent, "unit": "B",
                     "baseline": "the same stage in fp32", "baseline_value": fp32_sent, "ratio": sent / fp32_sent,
                     "world_size": world_size})
        rows.append({"name": f"{name} {precision} step vs fp32", "value": ms, "unit": "ms",
                     "baseline": "the same stage in fp32", "baseline_value": fp32_ms, "ratio": ms / fp32_ms,
                     "world_size": world_size})
    return rows


DIALLED = ("overlap", "buckets", "prefetch", "compress", "servers")  # measured on a dialled network (--network)
BENCHES = {
    "collectives": lambda args: bench_collectives(args.world_size, repeats=args.repeats),
    "ddp": lambda args: bench_ddp(args.world_size),
    "zero": lambda args: bench_zero(args.world_size),
    "zero3": lambda args: bench_zero3(args.world_size),
    "overlap": lambda args: (bench_overlap_dialled(args.world_size, args.network) if args.network
                             else bench_overlap(args.world_size, repeats=args.repeats)),
    "buckets": lambda args: bench_buckets(args.world_size, _dial(args)),
    "prefetch": lambda args: bench_prefetch(args.world_size, _dial(args)),
    "compress": lambda args: bench_compress(args.world_size, _dial(args)),
    "servers": lambda args: bench_servers(args.world_size, _dial(args)),
    "check": lambda args: bench_check(args.world_size),
    "precision": lambda args: bench_precision(args.world_size),
    "all": bench_all.main,  # every stage beside its torch counterpart: step, bytes, memory
}


def _dial(args) -> str:
    """The dialled benches measure on a network: the one given, else the lessons' slow one."""
    return args.network or "lesson"


def main(args) -> tuple[int, str]:
    bench_all.refuse_elsewhere(args)  # --model, --device, ...: before any rank starts
    if args.network is not None:
        parse_network(args.network)  # a bad dial is refused before any rank starts
        if args.what not in DIALLED:
            raise ValueError(f"bench {args.what} does not take --network; the dialled benches are {', '.join(DIALLED)}")
    rows = BENCHES[args.what](args)
    if args.json:
        return 0, json.dumps(rows, indent=2)
    if args.what == "all":
        return 0, bench_all.format_table(rows)
    if args.what in DIALLED and (args.what != "overlap" or args.network):
        return 0, format_rows(args.what, args.world_size, _dial(args), rows)
    if args.what == "collectives":
        lines = [f"all-reduce bus bandwidth, N={args.world_size} ranks, gloo on CPU (higher is better)",
                 f"{'size':>6}{'ring (send/recv)':>18}{'native':>10}{'ratio':>8}"]
        for r in rows:
            size = r["name"].rsplit("_", 1)[1]
            lines.append(f"{size:>6}{r['value']:>14.3f} GB/s{r['baseline_value']:>10.3f}{r['ratio']:>8.2f}x")
        return 0, "\n".join(lines)
    lines = [f"{args.what}, N={args.world_size} ranks, gloo on CPU"]
    for r in rows:
        ratio = f"   {r['ratio']:.2f}x {r['baseline']}" if "ratio" in r else ""
        lines.append(f"  {r['name']:<58}{r['value']:>12,.2f} {r['unit']:<8}{ratio}")
    return 0, "\n".join(lines)

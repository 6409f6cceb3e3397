"""``python -m minizero bench ...``: speed, as ratios against torch in the same run.

Timings are never asserted in tests; they are measured here, on demand.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from .comm import NativeComm, RingComm, ReduceOp
from .launch import Rank, RankPool

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


def main(args) -> int:
    if args.what == "collectives":
        rows = bench_collectives(args.world_size, repeats=args.repeats)
    else:
        raise SystemExit(f"unknown benchmark {args.what!r}; choose: collectives")
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"all-reduce bus bandwidth, N={args.world_size} ranks, gloo on CPU (higher is better)")
        print(f"{'size':>6}{'ring (send/recv)':>18}{'native':>10}{'ratio':>8}")
        for r in rows:
            size = r["name"].rsplit("_", 1)[1]
            print(f"{size:>6}{r['value']:>14.3f} GB/s{r['baseline_value']:>10.3f}{r['ratio']:>8.2f}x")
    return 0

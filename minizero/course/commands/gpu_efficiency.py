"""Overlap you can see on one GPU: the CPU's ``bench efficiency``, on a device whose wire is dialled.

One GPU cannot run NCCL at N = 2 (NCCL refuses two ranks on one device), and at N = 1 a collective moves nothing.
So the GPU stands for a ring of ``stands_for`` ranks: before the (trivial) NCCL collective completes, the stream
it runs on spins ``alpha + bytes/bandwidth`` for each message rank 0 of that ring would send
(:class:`~minizero.comm.stream.DeviceClock`, ``torch.cuda._sleep``).  The spin sits where the collective sits --
on the communication stream under minizero's GPU path (:mod:`minizero.comm.stream`), on the compute stream under
the communication thread's -- so the step time says whether backward's kernels ran beside it.

Each row is one stage, once on its own stream and once on the thread (``own_stream=False``: the path before issue
48, whose kernels join the compute stream).  As on the CPU (:mod:`.efficiency`):

* **compute** -- forward, backward and the optimizer step of the same stage run *without* the dial, timed by CUDA
  events on the compute stream (medians over the steps after the first);
* **bound** -- that compute, and the communication the stage's own schedule cannot hide on the dial at
  ``stands_for`` ranks (:func:`minizero.costs.cost_model.predict`);
* **measured** -- the dialled step's wall time (the host waits for the device at each step's end);
* ``fraction = bound / measured``; ``hidden`` = the share of the wire's time (``wire``) that did not add to the
  step: ``(compute + wire - measured) / wire``; 0 when nothing overlapped.

Rounds interleave the rows in a fresh random order, each row's undialled run just before its dialled one.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from ...comm import make_comm
from ...comm.network import parse_network
from ...costs.cost_model import predict
from ...run.train import sum_loss
from ...stages import STAGES, BucketedDDP, ZeRO1, ZeRO2, ZeRO3, make_stage
from ..harness.experiment import Experiment
from ..harness.models import BENCH_GPT, GPT_SIZES
from ..harness.tasks import TASKS
from .efficiency import OVERLAP_OPTIONS
from .scale import measured_plan

#: A wire on which the bench GPT's all-reduce (3.2 MB at N = 2: two messages of 1.6 MB) takes about as long as
#: its compute on an H100-class GPU, so that overlap has something to hide and something to hide it behind.
GPU_DIAL = "alpha=50us,bandwidth=1GB/s"
#: The core stages that overlap, with the options that let them (zero1's ``overlap`` included), and ZeRO-3 again
#: without prefetch: what it overlaps then.
ROWS = [(stage.name, {k: v for k, v in OVERLAP_OPTIONS.items() if k in stage.option_names()})
        for stage in (BucketedDDP, ZeRO1, ZeRO2, ZeRO3)] + [(ZeRO3.name, {"prefetch": 0})]
NO_GPU = ("bench gpu-efficiency measures a GPU's streams: torch.cuda.is_available() is False here; run it on a "
          "machine with a CUDA GPU (scripts/gpu_overlap.py runs it with the rest of the GPU checks)")


def one_rank_group() -> None:
    """A process group of one under NCCL, unless one is already up (torchrun's)."""
    if dist.is_initialized():
        return
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))  # port 0: a free one
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))


def _experiment(stage: str, options: dict, steps: int, model: dict, micro_batch: int = 8) -> Experiment:
    return Experiment(stage=stage, task="gpt", model=model, optimizer="sgd", steps=steps, micro_batch=micro_batch,
                      dtype="float32", check=False, options=options)


def run_steps(exp: Experiment, own_stream: bool, network: str | None, stands_for: int, profile=None) -> list[dict]:
    """``exp.steps`` steps of ``exp``'s stage on CUDA; per step its wall time and its phases' device times.

    The loop is :func:`minizero.run.train.train_step`'s, with events between its phases and without the loss's
    ``.item()`` (a host wait in the middle of the step would hide what the streams do)."""
    model = TASKS[exp.task].make_model(0, torch.float32, **exp.model).cuda()
    comm = make_comm("native", network=network)
    comm.own_stream = own_stream
    if comm.port is not None:
        comm.port.stands_for = stands_for
        if comm.port.clock is not None:  # under NCCL (always, on the GPU this bench runs on)
            comm.port.clock.calibrate()
    stage = make_stage(exp.stage, model, torch.optim.SGD(model.parameters(), lr=exp.lr), comm, **exp.options)
    steps = []
    for s in range(exp.steps):
        x, y = (t.cuda() for t in TASKS[exp.task].make_batch(exp.micro_batch, 0, s, torch.float32, **exp.model))
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        stage.zero_grad()
        events[0].record()
        loss = sum_loss(stage(x), y) * (stage.world_size / y.numel())
        events[1].record()
        stage.scale_loss(loss).backward()
        events[2].record()
        stage.step()
        events[3].record()
        torch.cuda.synchronize()
        steps.append({"wall_s": time.perf_counter() - start,
                      **{name: events[i].elapsed_time(events[i + 1]) / 1e3
                         for i, name in enumerate(("forward_s", "backward_s", "step_s"))}})
        if profile is not None:
            profile.step()
    comm.close()
    return steps


def _median(steps: list[dict], key: str) -> float:
    return statistics.median(st[key] for st in steps[1:])  # the first step pays the buffers' setup


def bench_gpu_efficiency(network: str = GPU_DIAL, stands_for: int = 2, steps: int = 6, rounds: int = 3,
                         model: str | dict | None = None, micro_batch: int = 8, bucket_mb: float | None = None,
                         seed: int = 0) -> list[dict]:
    """One row per stage and path (its own stream, or the thread): measured dialled step beside the α–β bound.

    ``model``: a GPT's size by name (``--model``) or its shape (the bench GPT by default); ``bucket_mb``: the
    bucketed stages' bucket size, if not :data:`ROWS`'."""
    wire = parse_network(network)  # a bad dial is refused first, GPU or not
    if not torch.cuda.is_available():
        raise ValueError(NO_GPU)
    one_rank_group()
    model = GPT_SIZES[model] if isinstance(model, str) else BENCH_GPT if model is None else model
    rows = [(stage, {**options, **({"bucket_mb": bucket_mb} if bucket_mb and "bucket_mb" in options else {})}, own)
            for stage, options in ROWS for own in (True, False)]
    quiet: dict[int, list] = {i: [] for i in range(len(rows))}
    dialled: dict[int, list] = {i: [] for i in range(len(rows))}
    order = random.Random(seed)
    for _ in range(rounds):
        for i in order.sample(range(len(rows)), len(rows)):
            stage, options, own = rows[i]
            exp = _experiment(stage, options, steps, model, micro_batch)
            quiet[i].append(run_steps(exp, own, None, stands_for))
            dialled[i].append(run_steps(exp, own, network, stands_for))
    out = []
    for i, (stage, options, own) in enumerate(rows):
        plan = measured_plan(_experiment(stage, options, steps, model, micro_batch), stands_for, wire, 0.0, 0.0)
        bounds, measured, hidden = [], [], []
        for q, d in zip(quiet[i], dialled[i], strict=True):
            phases = {k: _median(q, k) for k in ("forward_s", "backward_s", "step_s")}
            p = predict(STAGES[stage], replace(plan, **phases))
            m = _median(d, "wall_s")
            bounds.append(p)
            measured.append(m)
            hidden.append((_median(q, "wall_s") + p.comm_s - m) / p.comm_s if p.comm_s else float("nan"))
        fractions = [b.step_s / m for b, m in zip(bounds, measured, strict=True)]
        out.append({"name": stage, "options": options, "path": "own stream" if own else "thread",
                    "network": wire.describe(), "stands_for": stands_for, "rounds": rounds, "steps": steps,
                    "model": model, "micro_batch": micro_batch,
                    "measured_ms": [m * 1e3 for m in measured],
                    "bound_ms": statistics.median(b.step_s for b in bounds) * 1e3,
                    "compute_ms": statistics.median(b.compute_s for b in bounds) * 1e3,
                    "unhidden_ms": statistics.median(b.exposed_s for b in bounds) * 1e3,
                    "wire_ms": statistics.median(b.comm_s for b in bounds) * 1e3,
                    "quiet_ms": statistics.median(_median(q, "wall_s") for q in quiet[i]) * 1e3,
                    "fraction": statistics.median(fractions), "fraction_min": min(fractions),
                    "fraction_max": max(fractions), "hidden": statistics.median(hidden)})
    return out


def format_gpu_efficiency(rows: list[dict]) -> str:
    if not rows:
        return "no stages measured"
    first = rows[0]
    names = [r["name"] + "".join(f" {k}={v}" for k, v in r["options"].items()) for r in rows]
    width = max(len(n) for n in names) + 2
    lines = [f"efficiency against the α–β bound on one GPU standing for N={first['stands_for']}, network "
             f"{first['network']}: {first['rounds']} rounds of {first['steps']} steps (first untimed), rows interleaved",
             "bound = undialled compute + what the stage's schedule cannot hide on the dial; fraction = bound / "
             "measured; hidden = share of the wire's time that did not add to the step",
             f"  {'stage':<{width}}{'path':<12}{'measured ms':>18}{'bound':>8}{'compute':>9}{'wire':>8}{'undialled':>10}"
             f"{'fraction':>10}{'min-max':>12}{'hidden':>8}"]
    for r, name in zip(rows, names, strict=True):
        m = r["measured_ms"]
        lines.append(f"  {name:<{width}}{r['path']:<12}{statistics.median(m):>10.2f} ({min(m):.1f}-{max(m):.1f})"
                     f"{r['bound_ms']:>8.2f}{r['compute_ms']:>9.2f}{r['wire_ms']:>8.2f}{r['quiet_ms']:>10.2f}"
                     f"{r['fraction']:>10.2f}{r['fraction_min']:>6.2f}-{r['fraction_max']:.2f}{r['hidden']:>8.2f}")
    return "\n".join(lines)

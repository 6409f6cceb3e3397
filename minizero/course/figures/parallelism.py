"""Lesson 15's pictures, each drawn from what :mod:`minizero.course.harness.parallelism` computes -- not typed by hand.

* :func:`pipeline` draws the replayed GPipe and 1F1B schedules, so the bubble a learner sees is the one the
  replay measured;
* :func:`crossover` draws bytes and ring time per step of ZeRO-3 and tensor parallelism against the tokens a
  group processes, with the crossover where the curves meet;
* :func:`large_batch` draws Goyal et al.'s warm-up schedule and the per-layer trust ratios of a model.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ..harness.parallelism import replay_pipeline, tensor_parallel_step, zero3_step


def pipeline(stages: int = 4, micro_batches: int = 8, forward: float = 1.0, backward: float = 2.0):
    """Two Gantt charts, one per schedule: a box per forward (light) and backward (dark), numbered by
    micro-batch; white is the bubble."""
    fig, axes = plt.subplots(2, 1, figsize=(9, 3.6), sharex=True)
    for ax, kind in zip(axes, ("gpipe", "1f1b"), strict=True):
        for s, op, j, start, end in replay_pipeline(kind, stages, micro_batches, forward, backward):
            ax.barh(s, end - start, left=start, color="C0" if op == "F" else "C3", alpha=0.45 if op == "F" else 0.9,
                    edgecolor="k", lw=0.5)
            ax.text((start + end) / 2, s, str(j), ha="center", va="center", fontsize=7)
        ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
        ax.invert_yaxis()
        ax.set_title(f"{'GPipe' if kind == 'gpipe' else '1F1B'}: p = {stages} stages, m = {micro_batches} "
                     f"micro-batches (light: forward, dark: backward)", fontsize=9)
    axes[-1].set_xlabel("time (a forward takes 1, a backward 2)")
    fig.tight_layout()
    return fig


def crossover(models, networks, ranks: int = 8, tokens=np.logspace(3, 6, 400)):
    """Left: bytes each rank sends per step for each ``(layers, hidden)`` model, ZeRO-3 flat, tensor
    parallelism rising with tokens.  Right: ring time for the first model on each network."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.4))
    first = networks[0]
    for i, (layers, hidden) in enumerate(models):
        z = zero3_step(layers, hidden, ranks, first)[0]
        tp = [tensor_parallel_step(layers, hidden, int(t), ranks, first)[0] for t in tokens]
        label = f"L={layers}, h={hidden}"
        a1.loglog(tokens, tp, color=f"C{i}", label=f"TP, {label}")
        a1.axhline(z, color=f"C{i}", ls="--", lw=1, label=f"ZeRO-3, {label}")
        a1.axvline(4.5 * hidden, color=f"C{i}", ls=":", lw=0.8)
    a1.set_xlabel("tokens per step through the group")
    a1.set_ylabel("bytes sent per rank per step")
    a1.set_title(f"bytes (t = N = {ranks}); dotted: 4.5·h", fontsize=9)
    a1.legend(fontsize=6)
    layers, hidden = models[0]
    for i, net in enumerate(networks):
        z = zero3_step(layers, hidden, ranks, net)[1]
        tp = [tensor_parallel_step(layers, hidden, int(t), ranks, net)[1] for t in tokens]
        a2.loglog(tokens, np.array(tp) * 1e3, color=f"C{i + 3}", label=f"TP, {net.name}")
        a2.axhline(z * 1e3, color=f"C{i + 3}", ls="--", lw=1, label=f"ZeRO-3, {net.name}")
    a2.set_xlabel("tokens per step through the group")
    a2.set_ylabel("ms of ring collectives per step")
    a2.set_title(f"α–β time, L={layers}, h={hidden}", fontsize=9)
    a2.legend(fontsize=6)
    fig.tight_layout()
    return fig


def large_batch(epochs, lrs, names, ratios):
    """Left: learning rate against epoch.  Right: LARS's and LAMB's ratio per parameter tensor (log scale)."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [2, 3]})
    a1.plot(epochs, lrs)
    a1.set_xlabel("epoch")
    a1.set_ylabel("learning rate")
    a1.set_title("linear scaling + gradual warm-up (k = 32)", fontsize=9)
    a1.grid(alpha=0.3)
    x = np.arange(len(names))
    a2.bar(x - 0.2, [r[0] for r in ratios], 0.4, label="LARS ‖w‖/‖g‖")
    a2.bar(x + 0.2, [r[1] for r in ratios], 0.4, label="LAMB ‖w‖/‖r‖")
    a2.set_yscale("log")
    a2.set_xticks(x, names, rotation=60, ha="right", fontsize=6)
    a2.set_title("trust ratio per parameter tensor, after one batch", fontsize=9)
    a2.legend(fontsize=7)
    fig.tight_layout()
    return fig

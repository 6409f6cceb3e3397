"""What a compressor's own compute costs, against the compute of the step it compresses (``bench codecs``).

A codec saves bytes and spends compute: encode one message, then decode and add every rank's (N of them for a
gathered codec; N shards' worth -- one whole buffer -- through ZeRO's all-to-all).  On a GPU that compute is
small; on a CPU it can be a large part of the step (Agarwal et al., MLSys 2022, found it one reason compression
seldom pays).  Both are timed here on one thread, as a rank runs: the codec by
:func:`~minizero.course.commands.break_even.codec_compute` (the figure ``scale --compress`` puts into its break-even),
the step as a GPT's forward, backward and AdamW step on one micro-batch of the benches' size.
"""
from __future__ import annotations

import time

import torch

from ..harness.models import GPT_SIZES
from ..harness.tasks import TASKS
from .break_even import codec_compute

#: The codecs the issue that sped them up held to 10% of an fp32 step (issue 48), and int4 beside them.
CODECS = ("int8", "int4", "topk:0.01", "sign")
MICRO_BATCH = 8  # sequences, as bench all's step


def step_s(model_name: str, repeats: int = 5) -> float:
    """The fastest of ``repeats`` fp32 steps (forward, backward, AdamW) of the GPT ``model_name``, after one
    untimed step."""
    size = GPT_SIZES[model_name]
    model = TASKS["gpt"].make_model(0, torch.float32, **size)
    x, y = TASKS["gpt"].make_batch(MICRO_BATCH, 0, 0, torch.float32, **size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        best = min(best, time.perf_counter() - start) if i else best
    return best


def bench_codec_compute(world_size: int, model: str = "medium", codecs=CODECS) -> list[dict]:
    """One row per codec and averaging collective: its compute per step in ms, and that as a share of the fp32
    step's (``ratio``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        step = step_s(model)
        shapes = [(n, p.shape) for n, p in TASKS["gpt"].make_model(0, torch.float32, **GPT_SIZES[model]).named_parameters()]
        rows = []
        for spec in codecs:
            timed = codec_compute(spec, shapes)  # once, read for both collectives
            for averaging in ("all_reduce", "reduce_scatter"):
                compute = timed.at(world_size, averaging)
                rows.append({"name": f"{spec} over {averaging.replace('_', '-')}: encode 1, decode {world_size}"
                                     + (" shards" if averaging == "reduce_scatter" else ""),
                             "value": compute * 1e3, "unit": "ms", "ratio": compute / step, "step_ms": step * 1e3,
                             "baseline": f"the {model} GPT's fp32 step ({step * 1e3:.0f} ms)", "world_size": world_size})
        return rows
    finally:
        torch.set_num_threads(threads)


def format_codec_compute(rows: list[dict]) -> str:
    first = rows[0]
    lines = [f"each compressor's compute per step at N={first['world_size']}, against {first['baseline']}: both timed "
             f"on one thread, as a rank runs, the fastest of a few (a busy machine slows both)",
             f"{'codec and its averaging':<56}{'compute ms':>12}{'of the step':>13}"]
    lines += [f"{r['name']:<56}{r['value']:>12.1f}{r['ratio']:>12.1%}" for r in rows]
    return "\n".join(lines)

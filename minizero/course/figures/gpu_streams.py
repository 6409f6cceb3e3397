"""The GPU's streams in one dialled step, from a ``torch.profiler`` trace: lesson 5's schematic, measured.

Each lane is a CUDA stream; each bar a kernel the profiler saw on it (CUPTI's device times).  Three kinds:
the compute kernels of forward, backward and the step; NCCL's own kernels; and the dial's spins
(``torch.cuda._sleep``'s ``spin_kernel``), which stand for the wire's time and sit wherever the collective was
queued -- beside backward on minizero's communication stream, in backward's way on the compute stream when the
communication thread issues them (the path before issue 48).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

COLOURS = {"compute": "#4c72b0", "nccl": "#55a868", "wire": "#dd8452"}


def kind_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    if "spin" in name:
        return "wire"
    return "nccl" if "nccl" in name else "compute"


def kernels(trace_path: str) -> list[dict]:
    """The kernels of a chrome trace (``prof.export_chrome_trace``): stream, kind, start and duration in µs."""
    events = json.loads(Path(trace_path).read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [{"stream": e["args"].get("stream"), "kind": kind_of(e["name"]), "name": e["name"],
             "start_us": float(e["ts"]), "dur_us": float(e.get("dur", 0.0))}
            for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]


def profile_kernels(run) -> list[dict]:
    """Run ``run(profile)`` (which calls ``profile.step()`` after each training step) under the profiler, recording
    only its last step, and return that step's kernels."""
    import torch

    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/trace.json"

        def save(prof):
            prof.export_chrome_trace(path)

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA],
                                    schedule=torch.profiler.schedule(wait=0, warmup=2, active=1, repeat=1),
                                    on_trace_ready=save) as prof:
            run(prof)
        return kernels(path)


def stream_summary(found: list[dict]) -> dict:
    """Per stream: microseconds of each kind of kernel (what the results file prints beside the picture)."""
    out: dict = {}
    for k in found:
        lane = out.setdefault(str(k["stream"]), {"compute": 0.0, "nccl": 0.0, "wire": 0.0})
        lane[k["kind"]] += k["dur_us"]
    return out


def draw(panels: list[tuple[str, list[dict]]], path: str) -> None:
    """One panel per run, one lane per stream, time in ms from each run's first kernel on one shared axis: a
    panel that ends sooner is a step that took less time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = [sorted({k["stream"] for k in found}, key=lambda s: (s is None, s)) for _, found in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.2 + sum(0.55 * len(s) + 0.7 for s in lanes)),
                             sharex=True, squeeze=False, gridspec_kw={"height_ratios": [len(s) for s in lanes]})
    for ax, (title, found), streams in zip(axes[:, 0], panels, lanes, strict=True):
        t0 = min((k["start_us"] for k in found), default=0.0)
        for y, stream in enumerate(streams):
            for k in (k for k in found if k["stream"] == stream):
                ax.barh(y, k["dur_us"] / 1e3, left=(k["start_us"] - t0) / 1e3, height=0.6,
                        color=COLOURS[k["kind"]], linewidth=0)
        ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams], fontsize=8)
        ax.set_ylim(len(streams) - 0.5, -0.5)
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms since the step's first kernel (torch.profiler, CUPTI)")
    seen = {k["kind"] for _, found in panels for k in found}
    names = {"compute": "compute kernels", "nccl": "NCCL kernels", "wire": "the dialled wire (spin kernel)"}
    fig.legend([plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in COLOURS if k in seen],
               [names[k] for k in COLOURS if k in seen], loc="upper right", fontsize=8, ncol=3)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=120)
    plt.close(fig)

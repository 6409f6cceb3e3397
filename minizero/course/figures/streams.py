"""Lesson 5's picture: the CPU timeline measured here, beside a GPU timeline drawn as a schematic.

The top panel is data: intervals the lesson timed with ``time.perf_counter`` on this machine (the main thread's
compute, minizero's communication thread holding the dialled wire, a gloo ``Work`` waited on); a call too short to
see as a bar is a labelled diamond. The bottom panel is *not* measured -- this machine has no GPU -- and says so in
its title: it lays out, in order only, what the lesson's text says a GPU does (kernels queued on a compute stream,
an NCCL kernel on its own stream behind an event, ``work.wait()`` as a stream-side wait while the host runs ahead)
-- torch's ``async_op=True`` path; with ``async_op=False`` the kernel would sit on the compute stream instead. Its
lengths are arbitrary.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

#: One colour per kind of work, shared by both panels so that "compute" and "communication" read the same.
COLOURS = {"compute": "#4c72b0", "comm": "#dd8452", "wait": "#c44e52", "launch": "#8c8c8c"}


def _lane(ax, y: float, spans, colour: str, labels=None) -> None:
    for i, (start, stop) in enumerate(spans):
        ax.barh(y, stop - start, left=start, height=0.6, color=colour, edgecolor="white")
        if labels:
            ax.text((start + stop) / 2, y, labels[i], ha="center", va="center", fontsize=7, color="white")


def draw_measured(ax, lanes: list[tuple[str, str, list[tuple[float, float]]]], t0: float) -> None:
    """``lanes``: (name, colour key, [(start, stop), ...]) in seconds from ``perf_counter``; drawn in ms from ``t0``.

    The lanes come from experiments run one after the other, each timed from its own call, so a dashed line
    parts lanes whose names begin with a different word.  A call shorter than 1% of the axis would be an
    invisible bar -- and its shortness is the point -- so it is drawn as a diamond labelled with its time ("returned
    after" for a call or a wait).  Many short spans of work (one backward pass after another) belong in one span: as
    diamonds they would overprint each other."""
    ms = [[((a - t0) * 1e3, (b - t0) * 1e3) for a, b in spans] for _, _, spans in lanes]
    right = max((b for spans in ms for _, b in spans), default=1.0)
    for y, ((name, kind, _), spans) in enumerate(zip(lanes, ms, strict=True)):
        long = [(a, b) for a, b in spans if b - a >= 0.01 * right]
        _lane(ax, y, long, COLOURS[kind])
        for a, b in spans:
            if b - a < 0.01 * right:
                ax.plot(a, y, marker="D", markersize=6, color=COLOURS[kind])
                left = a > 0.7 * right  # near the right edge, the label goes left of the diamond
                said = f"returned after {b - a:.2f} ms" if kind in ("launch", "wait") else f"{b - a:.2f} ms"
                ax.text(a + (-0.015 if left else 0.015) * right, y, said, fontsize=7,
                        va="center", ha="right" if left else "left")
        if y and name.split()[0] != lanes[y - 1][0].split()[0]:
            ax.axhline(y - 0.5, color="#8c8c8c", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(lanes)), [name for name, _, _ in lanes], fontsize=8)
    ax.set_xlim(-0.02 * right, 1.05 * right)  # a diamond at 0 ms stays whole
    ax.invert_yaxis()
    ax.set_xlabel("ms since each experiment's call (measured on this machine)")
    ax.set_title("CPU, measured: minizero's thread and gloo's Work, one experiment after the other", fontsize=9)


def draw_gpu_schematic(ax) -> None:
    """The order of events on one GPU rank during a bucketed backward, lengths arbitrary."""
    lanes = ["host thread", "compute stream", "NCCL stream"]
    # host: launches are short; it reaches work.wait() and the optimizer long before the GPU does
    _lane(ax, 0, [(0, 0.9), (1.0, 2.2), (2.3, 3.2), (3.3, 4.2), (4.3, 5.2)], COLOURS["launch"],
          ["bwd", "all_reduce", "bwd", "wait()", "step"])
    ax.text(5.4, 0, "host: launches only, then runs ahead", fontsize=7, va="center")
    _lane(ax, 1, [(0.5, 2.6), (2.6, 4.6), (4.6, 6.4)], COLOURS["compute"], ["backward layer 3", "layer 2", "layer 1"])
    _lane(ax, 1, [(8.2, 9.6)], COLOURS["compute"], ["optimizer step"])
    _lane(ax, 1, [(6.4, 8.2)], COLOURS["wait"], ["waits for NCCL"])
    _lane(ax, 2, [(2.6, 8.2)], COLOURS["comm"], ["all-reduce kernel: uses SMs and HBM too"])
    ax.annotate("", xy=(2.6, 1.7), xytext=(2.6, 1.3), arrowprops=dict(arrowstyle="->"))
    ax.text(2.7, 1.5, "event: gradients ready", fontsize=7, va="center")
    ax.annotate("", xy=(8.2, 1.3), xytext=(8.2, 1.7), arrowprops=dict(arrowstyle="->"))
    ax.text(8.3, 1.5, "wait(): the stream waits, not the host", fontsize=7, va="center")
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(2.6, -0.6)
    ax.set_xticks([])
    ax.set_xlabel("time (schematic: order only, lengths arbitrary)")
    ax.set_title("GPU, SCHEMATIC (not measured: no GPU here): one rank, bucketed backward, async_op=True",
                 fontsize=9)


def figure(lanes, t0: float):
    """Both panels, the measured one on top."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 4.6), gridspec_kw={"height_ratios": [len(lanes), 3]})
    draw_measured(top, lanes, t0)
    draw_gpu_schematic(bottom)
    fig.tight_layout()
    return fig

"""Lesson 3's picture: what DDP does in one optimizer step -- replicate, split the batch, average, step alike.

The split is not drawn by hand: :func:`draw_ddp_flow` takes each rank's micro-batch sizes as the training loop's
:func:`minizero.run.train.shard_step` cut them from a real global batch, and the bytes label from the stage's own
``sent_bytes_per_step`` (the mean over the ranks).  So the picture shows the samples each replica really sees.
"""
from __future__ import annotations


def draw_ddp_flow(micro_batches: list[list[int]], psi: int, sent_bytes: float, title: str = ""):
    """``micro_batches[r]``: the sample counts of rank ``r``'s micro-batches, in order (contiguous in the global
    batch); ``psi``: parameters per replica; ``sent_bytes``: what a rank sends per step, averaged over the ranks."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    n = len(micro_batches)
    total = sum(sum(m) for m in micro_batches)
    fig, ax = plt.subplots(figsize=(9, 0.8 * n + 1.4))
    colors = [plt.get_cmap("tab10")(r) for r in range(n)]
    row_y = [n - 1 - r for r in range(n)]

    # 1. the global batch, one bar: each rank's contiguous slice, its micro-batches hatched apart
    start = 0
    for r, sizes in enumerate(micro_batches):
        for k, size in enumerate(sizes):
            ax.add_patch(Rectangle((0, (n - (start + size) / total * n)), 1.2, size / total * n, facecolor=colors[r],
                                   alpha=0.75, hatch="//" if k % 2 else None, edgecolor="white"))
            start += size
    ax.text(0.6, n + 0.15, f"global batch\n{total} samples", ha="center", fontsize=8)

    # 2. one full replica per rank, fed its own slice
    for r, y in enumerate(row_y):
        ax.add_patch(Rectangle((2.6, y + 0.15), 2.6, 0.7, facecolor=colors[r], alpha=0.25, edgecolor=colors[r]))
        ax.text(3.9, y + 0.5, f"rank {r}: full model ({psi:,} params)\nforward + backward on "
                f"{sum(micro_batches[r])} samples, K = {len(micro_batches[r])}", ha="center", va="center", fontsize=7)
        ax.add_patch(FancyArrowPatch((1.25, y + 0.5), (2.55, y + 0.5), arrowstyle="->", mutation_scale=10))
        ax.add_patch(FancyArrowPatch((5.25, y + 0.5), (6.15, y + 0.5), arrowstyle="->", mutation_scale=10))
        ax.text(5.7, y + 0.62, "local .grad", ha="center", fontsize=6)

    # 3. one all-reduce (AVG) of the gradients across every rank
    ax.add_patch(Rectangle((6.2, 0.1), 1.3, n - 0.2, facecolor="0.85", edgecolor="0.4"))
    # a mean over the ranks: where N does not divide psi, the ring's chunks differ by one element, so do the sends
    about = "" if sent_bytes == round(sent_bytes) else "≈ "
    ax.text(6.85, n / 2, f"all-reduce\nAVG\n\n{about}{sent_bytes:,.0f} B\nper rank (mean)", ha="center", va="center",
            fontsize=7)

    # 4. the same averaged gradient, the same optimizer step: the replicas stay equal
    for r, y in enumerate(row_y):
        ax.add_patch(FancyArrowPatch((7.55, y + 0.5), (8.35, y + 0.5), arrowstyle="->", mutation_scale=10))
        ax.add_patch(Rectangle((8.4, y + 0.15), 1.9, 0.7, facecolor=colors[r], alpha=0.25, edgecolor=colors[r]))
        ax.text(9.35, y + 0.5, "mean gradient\nsame step, same weights", ha="center", va="center", fontsize=7)

    ax.set_xlim(-0.1, 10.4)
    ax.set_ylim(0, n + 0.7)
    ax.axis("off")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig

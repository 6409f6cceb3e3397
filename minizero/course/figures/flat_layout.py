"""Lesson 7's picture: ZeRO's flat layout, and who owns which shard.

The layout is not redrawn from a description: :func:`layout` builds :mod:`minizero.parts.layout`'s own flat groups for
a model and its optimizer, once per rank, exactly as ZeRO-1 builds them (``build_groups``).  :func:`draw` then
shows each group as one bar -- the parameters end to end, the padding to a multiple of N, the shard boundaries
and the owning ranks -- and marks the parameters that straddle two ranks, whose pieces are uneven.
"""
from __future__ import annotations

import copy

import matplotlib.pyplot as plt
import torch

from ...parts.layout import FlatGroup, build_groups

STRADDLES, WHOLE, PADDING = "C1", ("#c6dbef", "#9ecae1"), "C3"


def layout(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int) -> list[list[FlatGroup]]:
    """``groups[r][g]``: rank ``r``'s flat group ``g``, built by :func:`minizero.parts.layout.build_groups` on a copy of
    the model (building one makes its parameters views into the group's buffer)."""
    out = []
    for rank in range(world_size):
        twin = copy.deepcopy(model)
        by_id = dict(zip((id(p) for p in model.parameters()), twin.parameters(), strict=True))
        groups = [{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
        out.append(build_groups(groups, rank, world_size, {id(p): n for n, p in twin.named_parameters()}))
    return out


def owners(groups: list[list[FlatGroup]], g: int) -> dict[str, list[tuple[int, int, int]]]:
    """For flat group ``g``: each parameter's ``(rank, start, stop)`` pieces, flat within the parameter."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for rank, rank_groups in enumerate(groups):
        for piece in rank_groups[g].pieces:
            out.setdefault(piece.segment.name, []).append((rank, piece.start, piece.stop))
    return out


def straddlers(groups: list[list[FlatGroup]]) -> list[tuple[int, str, list[tuple[int, int, int]]]]:
    """``(group, parameter, pieces)`` for every parameter cut between two or more ranks."""
    return [(g, name, pieces) for g in range(len(groups[0]))
            for name, pieces in owners(groups, g).items() if len(pieces) > 1]


def _short(name: str) -> str:
    """``blocks.0.attn.qkv.weight`` -> ``0.qkv``: enough to tell the wide parameters apart."""
    for long, short in (("blocks.", ""), ("attn.", ""), (".weight", ""), ("_embedding", "_emb")):
        name = name.replace(long, short)
    return name


def draw(groups: list[list[FlatGroup]], titles: list[str] | None = None):
    """One bar per flat group: parameters end to end (a straddling one in orange), the padding (red, hatched),
    and a line at each shard boundary with the owning rank above its shard."""
    n_groups, world_size = len(groups[0]), len(groups)
    fig, axes = plt.subplots(n_groups, 1, figsize=(8, 1.3 * n_groups + 0.4), squeeze=False)
    cut = {(g, name) for g, name, _ in straddlers(groups)}
    for g, ax in enumerate(axes[:, 0]):
        group = groups[0][g]
        padded = group.shard_size * world_size
        for i, s in enumerate(group.segments):
            color = STRADDLES if (g, s.name) in cut else WHOLE[i % 2]
            ax.barh(0, s.stop - s.start, left=s.start, height=1, color=color, edgecolor="white", linewidth=0.3)
            if (s.stop - s.start) / padded > 0.06:
                ax.text((s.start + s.stop) / 2, 0, _short(s.name), ha="center", va="center", fontsize=6)
        if group.padding:
            ax.barh(0, group.padding, left=group.numel, height=1, color="white", edgecolor=PADDING, hatch="////")
            ax.annotate(f"padding: {group.padding}", (padded, -0.5), (padded, -1.0), ha="right", fontsize=7,
                        color=PADDING, arrowprops={"arrowstyle": "->", "color": PADDING})
        for r in range(world_size):
            ax.axvline(r * group.shard_size, color="k", linewidth=1.5)
            ax.text((r + 0.5) * group.shard_size, 0.65, f"rank {r}: [{r * group.shard_size:,}, "
                    f"{(r + 1) * group.shard_size:,})", ha="center", va="bottom", fontsize=7)
        ax.axvline(padded, color="k", linewidth=1.5)
        ax.set_xlim(0, padded)
        ax.set_ylim(-1.2, 1.1)
        ax.set_yticks([])
        ax.set_title(titles[g] if titles else f"flat group {g}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("element of the flat buffer")
    fig.tight_layout()
    return fig

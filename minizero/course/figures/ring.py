"""Lesson 1's picture: the ring all-reduce, step by step, as the ring code really ran it.

Nothing here is typed from the schedule.  Each rank all-reduces a *tagged* tensor -- one element per chunk, whose
value says which chunk it is and which ranks' contributions it sums -- and :func:`recording` notes what every ring
step (``RingComm._send_right_recv_left``) sent and received.  Reading the tags back gives, for each step, the chunk
each rank sent to its right neighbour and the partial sum it held: the picture is the run, not a drawing of it.
"""
from __future__ import annotations

import contextlib

import torch


def tagged(rank: int, world_size: int) -> torch.Tensor:
    """One float64 element per chunk: chunk ``c`` of rank ``r`` holds ``c * 2**N + 2**r``.

    A sum over a set of ranks R is ``|R| * c * 2**N + mask(R)``: the low N bits name the ranks it sums, the rest
    (divided by how many they are) the chunk.  Exact in float64 for any N a laptop runs."""
    n = world_size
    return torch.tensor([c * 2.0 ** n + 2.0 ** rank for c in range(n)], dtype=torch.float64)


def read_tag(value: float, world_size: int) -> tuple[int, frozenset[int]]:
    """(chunk, the ranks whose contributions it sums) of a tagged element or of any sum of them."""
    whole = int(value)
    mask = whole % 2 ** world_size
    ranks = frozenset(r for r in range(world_size) if mask >> r & 1)
    return whole // 2 ** world_size // len(ranks), ranks


@contextlib.contextmanager
def recording(comm):
    """Note every ring step of ``comm`` (a ``RingComm`` whose tensor is :func:`tagged`): a list of
    ``(part, step, sent, received)``, ``sent``/``received`` as :func:`read_tag` reads them."""
    steps, original = [], comm._send_right_recv_left
    n = comm.world_size

    def step(send, recv, part, index):
        sent = read_tag(float(send[0]), n)  # before the call: the buffer may be reused after it
        original(send, recv, part, index)
        steps.append((part, index, sent, read_tag(float(recv[0]), n)))

    comm._send_right_recv_left = step  # the instance's attribute shadows the class's method
    try:
        yield steps
    finally:
        del comm._send_right_recv_left


def holdings(rank: int, steps, world_size: int) -> list[list[frozenset[int]]]:
    """What ``rank`` holds of each chunk before its first step and after each step: a chunk received during the
    reduce-scatter is combined with the rank's own contribution, one received during the all-gather replaces it."""
    held = [frozenset([rank])] * world_size
    states = [list(held)]
    for part, _, _, (chunk, ranks) in steps:
        held = list(held)
        held[chunk] = ranks | {rank} if part == "reduce-scatter" else ranks
        states.append(held)
    return states


def draw_ring_schedule(per_rank_steps, title: str = ""):
    """One row per rank, one column per ring step: the rank's chunks shaded by how many ranks' contributions each
    holds after the step; the chunk it sent to the right in that step outlined in red."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n = len(per_rank_steps)
    columns = len(per_rank_steps[0])
    fig, ax = plt.subplots(figsize=(9, 0.55 * n + 1.3))
    cmap = plt.get_cmap("Blues")
    for rank, steps in enumerate(per_rank_steps):
        states = holdings(rank, steps, n)
        y = n - 1 - rank
        for col in range(columns + 1):
            x0 = col * (n + 1)
            sent = steps[col - 1][2][0] if col else None
            for chunk, ranks in enumerate(states[col]):
                shade = cmap(0.15 + 0.8 * len(ranks) / n)
                box = Rectangle((x0 + chunk, y + 0.1), 0.9, 0.8, facecolor=shade,
                                edgecolor="red" if chunk == sent else "white", linewidth=2 if chunk == sent else 0.5)
                ax.add_patch(box)
                ax.text(x0 + chunk + 0.45, y + 0.5, str(chunk), ha="center", va="center", fontsize=7,
                        color="white" if len(ranks) > n / 2 else "black")
    labels = ["start"] + [f"{'RS' if part == 'reduce-scatter' else 'AG'} {step}" for part, step, _, _ in
                          per_rank_steps[0]]
    ax.set_xticks([col * (n + 1) + n / 2 for col in range(columns + 1)], labels, fontsize=8)
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=8)
    ax.set_xlim(-0.3, (columns + 1) * (n + 1))
    ax.set_ylim(0, n)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig

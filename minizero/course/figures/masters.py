"""Lesson 10's picture: where each byte of mixed-precision Adam lives, per stage and per rank.

A learner reads ``4Ψ + 12Ψ/N`` more easily as a drawing: for each stage, one row per rank, one column per kind
of model state (16-bit parameters, 16-bit gradients, fp32 master, Adam's m and v), each column as wide as its
bytes per parameter.  A kind the stage keeps whole fills the rank's row; a kind it shards fills only the rank's
1/N of the column -- the parameters that rank owns.  The area a row covers is the rank's bytes per parameter.

Nothing here is typed by hand: which kinds a stage divides comes from the stage's own ``shards``, their sizes from
:class:`minizero.parts.precision.Precision`, and :func:`kinds` checks the sum against the stage's ``state_bytes`` -- the
formula the lesson measures beside.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from ...parts.precision import Precision
from ...stages import STAGES

#: Bytes of the optimizer's own precision (the masters, and Adam's states): fp32.
MASTER_BYTES = 4
#: Adam's full-size states per parameter: m and v.
ADAM_STATES = 2
COLORS = {"parameters": "C0", "gradients": "C1", "fp32 master": "C3", "Adam m": "C2", "Adam v": "C8"}


def kinds(stage: str, precision: str = "bf16") -> list[tuple[str, int, bool]]:
    """``(kind, bytes per parameter, sharded?)`` for each kind of model state ``stage`` keeps under Adam.

    Parameters and gradients take the working precision's bytes; the master exists only in mixed precision.
    Raises if the kinds do not add up to the stage's own formula (:meth:`Stage.state_terms`)."""
    cls, policy = STAGES[stage], Precision.of(precision)
    working = policy.working_bytes(MASTER_BYTES)
    out = [("parameters", working, cls.shards.parameters), ("gradients", working, cls.shards.gradients)]
    if policy.mixed:
        out.append(("fp32 master", MASTER_BYTES, cls.shards.optimizer_states))
    out += [("Adam m", MASTER_BYTES, cls.shards.optimizer_states),
            ("Adam v", MASTER_BYTES, cls.shards.optimizer_states)]
    whole = sum(b for _, b, sharded in out if not sharded)
    divided = sum(b for _, b, sharded in out if sharded)
    if (whole, divided) != cls.state_terms(MASTER_BYTES, ADAM_STATES, precision):
        raise AssertionError(f"{stage}: kinds {out} disagree with the stage's formula")
    return out


def bytes_per_parameter(stage: str, world_size: int, precision: str = "bf16") -> float:
    """What one rank holds per parameter: the whole kinds, plus 1/N of the sharded ones."""
    return sum(b / world_size if sharded else b for _, b, sharded in kinds(stage, precision))


def draw(stages: list[str], world_size: int, precision: str = "bf16", measured: dict[str, float] | None = None):
    """One panel per stage, one row per rank; ``measured`` (bytes per parameter by stage), if given, is printed
    in each panel's title beside the formula."""
    fig, axes = plt.subplots(len(stages), 1, figsize=(8, 1.1 * len(stages) + 0.8), sharex=True)
    for ax, stage in zip(axes, stages, strict=True):
        x = 0.0
        for kind, width, sharded in kinds(stage, precision):
            for r in range(world_size):
                left, span = (x + width * r / world_size, width / world_size) if sharded else (x, width)
                label = f"{8 * width}-bit {kind}" if kind in ("parameters", "gradients") else kind
                ax.barh(r, span, left=left, height=0.8, color=COLORS[kind], edgecolor="white", linewidth=0.5,
                        label=label if r == 0 else None)
            ax.axvline(x, color="grey", linewidth=0.5)
            x += width
        formula = STAGES[stage].state_formula(MASTER_BYTES, ADAM_STATES, precision)
        title = f"{stage}: {formula} = {bytes_per_parameter(stage, world_size, precision):.3g} B per parameter"
        if measured and stage in measured:
            title += f"  (measured {measured[stage]:.2f})"
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, x)
    axes[0].legend(ncol=5, fontsize=7, loc="lower left", bbox_to_anchor=(0, 1.35), frameon=False)
    axes[-1].set_xlabel(f"bytes per parameter, by kind; a sharded kind: each rank holds its 1/N (N = {world_size})")
    fig.tight_layout()
    return fig

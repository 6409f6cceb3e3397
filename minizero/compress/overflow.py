"""An inf or NaN some ranks see and others do not: agreed on before anyone raises.

A wire refuses a mean that is not finite: it raises, and the weights are never touched.  After an all-reduce that
is safe, because every rank holds the same sum and raises at the same bucket.  After a reduce-scatter it is not:
each rank decodes only its own shard of the sum, so an inf in rank 1's shard is invisible to rank 0.  Were rank 1
to raise alone, a caller that catches the error and goes on would leave the ranks out of step -- rank 0 steps and
all-gathers while rank 1 starts the next backward, and its reduce-scatter pairs with rank 0's all-gather (gloo:
"Received data size doesn't match expected size", or worse, two collectives of one size that pair silently).  The
same holds for HSDP's all-reduce across replicas, which only the ranks at one place of every node share.

So a wire on a sharded stage (``defer_overflow``) notes what it found, and the stage asks every rank once per
synchronising backward (:func:`agree_on_overflow`): every rank raises, naming the ranks that found it, or none
does.  That is one small all-reduce per step -- the price torch's ``ShardedGradScaler`` (its ``found_inf``) and
DeepSpeed's ``has_overflow`` pay for the same reason.  Under fp16 loss scaling the masters agree instead
(:mod:`minizero.parts.masters`): the wire lets the inf through and the step is skipped.
"""
from __future__ import annotations

import torch

from ..comm import Comm, ReduceOp, Tag
from ..costs.formulas import all_reduce_bytes
from ..parts.precision import Precision


class RefusesNonFinite:
    """What every averaging wire does with a mean that is not finite: raise now, or note it for the agreement."""

    overflow_raises = True
    defer_overflow = False  # set by a stage whose ranks decode different pieces of one sum (ZeRO, HSDP)

    def refuse_non_finite(self, message: str) -> None:
        if not self.defer_overflow:
            raise FloatingPointError(message)
        self.found = [*getattr(self, "found", []), message]

    def take_found(self) -> list[str]:
        """What this rank noted since it was last asked, forgotten as it is handed over."""
        found, self.found = getattr(self, "found", []), []
        return found


def defer(wires: list) -> list:
    """The wires of ``wires`` (None: no wire) set to note an inf for the agreement instead of raising alone."""
    wires = [wire for wire in wires if wire is not None]
    for wire in wires:
        wire.defer_overflow = True
    return wires


def flag_bytes(world_size: int, compress=None, precision=None) -> float:
    """What one agreement sends per rank, beside the paper's formula: a bitmap of N floats all-reduced, once per
    synchronising backward, wherever a wire may refuse an inf (compression, or a reduce_dtype without loss
    scaling).  ``compare`` adds it to a sharded stage's formula."""
    precision = Precision.of(precision)
    refuses = compress not in (None, "none") or precision.reduce_dtype is not None
    return all_reduce_bytes(4 * world_size, world_size) if refuses and not precision.scaled else 0.0


def agree_on_overflow(comm: Comm, wires: list, tag: Tag) -> None:
    """Every rank raises FloatingPointError if any rank's ``wires`` found an inf or NaN since the last agreement;
    else nothing.  A bitmap of the ranks, all-reduced (MAX), so every message can say where it was found."""
    found = [message for wire in wires for message in wire.take_found()]
    bitmap = torch.zeros(comm.world_size)
    bitmap[comm.rank] = 1.0 if found else 0.0
    comm.all_reduce(bitmap, ReduceOp.MAX, tag=tag)
    ranks = [r for r, flag in enumerate(bitmap.tolist()) if flag]
    if ranks:
        here = f"; here: {found[0]}" if found else ""
        raise FloatingPointError(f"rank {comm.rank}: the averaged gradients hold inf/NaN on rank(s) {ranks}, so "
                                 f"every rank refuses this step together (each rank sees only its shard of the "
                                 f"sum){here}")

"""The paper's numbers, to print beside what was measured.

Ψ = parameters that receive gradients, N = data-parallel ranks, b = bytes per
gradient element.  Ring collectives: reduce-scatter and all-gather each send
(N-1)/N of the tensor per rank; an all-reduce is both (ZeRO paper, section 7).
"""
from __future__ import annotations


def sent_bytes_per_step(stage: str, psi: int, world_size: int, element_size: int) -> float:
    """Bytes each rank sends per optimizer step, on average over ranks."""
    n = world_size
    ring = (n - 1) / n * psi * element_size
    if stage == "reference":
        return 0.0
    if stage in ("ddp", "ddp-bucketed"):
        return 2 * ring  # one all-reduce of the gradients per optimizer step, however many micro-batches
    if stage in ("zero1", "zero2"):
        return 2 * ring  # reduce-scatter gradients + all-gather parameters: the same as DDP
    raise ValueError(f"no byte formula for stage {stage!r}")


def root_all_reduce_bytes(nbytes: int, world_size: int) -> tuple[int, int]:
    """(bytes the root sends, bytes each other rank sends) in a gather-reduce-broadcast all-reduce."""
    return (world_size - 1) * nbytes, nbytes if world_size > 1 else 0


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> float:
    return 2 * (world_size - 1) / world_size * nbytes

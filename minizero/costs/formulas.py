"""What the ring collectives cost: bytes each rank sends (ZeRO paper, section 7; nccl-tests' bus bandwidth).

A ring reduce-scatter or all-gather of a buffer of B bytes sends (N-1)/N * B
per rank; an all-reduce is one of each.  These are the only formulas here: each
stage states its own bytes per step and memory from them, in its own module
(``Stage.sent_bytes_per_step``, ``Stage.state_bytes``).
"""
from __future__ import annotations


def reduce_scatter_bytes(nbytes: float, world_size: int) -> float:
    return (world_size - 1) / world_size * nbytes


def all_gather_bytes(nbytes: float, world_size: int) -> float:
    return (world_size - 1) / world_size * nbytes


def all_reduce_bytes(nbytes: float, world_size: int) -> float:
    return reduce_scatter_bytes(nbytes, world_size) + all_gather_bytes(nbytes, world_size)


def root_all_reduce_bytes(nbytes: int, world_size: int) -> tuple[int, int]:
    """(bytes the root sends, bytes each other rank sends) in a gather-reduce-broadcast all-reduce."""
    return (world_size - 1) * nbytes, nbytes if world_size > 1 else 0


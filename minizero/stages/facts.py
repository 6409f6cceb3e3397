"""What a stage states about itself: what it shards, and how it lays gradients out for reduction."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shards:
    """What a stage divides among its N ranks -- the ZeRO paper's P_os, P_os+g, P_os+g+p (section 5)."""

    optimizer_states: bool = False
    gradients: bool = False
    parameters: bool = False


@dataclass(frozen=True)
class Reduction:
    """How a stage lays gradients out for reduction: the parameter names in each flat buffer, in the
    order they are reduced; ``padded``: each buffer is padded to a multiple of N and reduce-scattered;
    ``packs_unused``: a parameter without a gradient on any rank still has its (zero) slot in the buffer;
    ``slices``: how many slices a padded buffer is cut into, if not N (a parameter server's S); ``whole``:
    the buffers (by index) all-reduced as they are even so, neither padded nor cut (ZeRO-3's replicated
    modules)."""

    buffers: list[list[str]]
    padded: bool = False
    packs_unused: bool = True
    slices: int | None = None
    whole: frozenset = frozenset()

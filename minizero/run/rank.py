"""Who a process is in a distributed run, and how long torch itself waits for a collective."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rank:
    """Who this process is.  ``device`` is where its tensors live."""

    rank: int
    world_size: int
    local_rank: int = 0
    backend: str = "gloo"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")


def backstop_s(timeout_s: float) -> float:
    """torch's own collective timeout: after the watchdog's, which can name the rank that stopped."""
    return 2 * timeout_s + 10

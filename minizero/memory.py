"""Memory accounting: the bytes of model state a stage actually holds.

Walks the live tensors a stage reports (:meth:`Stage.held_tensors`) and
adds up their *storages*, each once: a parameter that is a view into a flat
buffer counts the whole buffer (padding included), a gradient that is a view
into a bucket counts the bucket.  Nothing here is computed from a formula;
the formula is printed beside it (each stage's ``state_bytes``).
Communication scratch buffers are the comm layer's, not model state, and are
not counted.
"""
from __future__ import annotations

import torch


def held_bytes(held: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes per kind (params, grads, optimizer) and in total; shared storage counted once."""
    seen: set[int] = set()
    out = {}
    for kind, tensors in held.items():
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        out[kind] = total
    out["total"] = sum(out.values())
    return out


class GatheredMemory:
    """An observer of a stage (``stage.add_observer``): the bytes of gathered full parameters alive now,
    and the most at any moment -- ZeRO-3's working set, measured outside the algorithm."""

    def __init__(self):
        self.now = self.peak = 0

    def __call__(self, event: str, nbytes: int, source=None) -> None:
        self.now += nbytes if event == "gather" else -nbytes
        self.peak = max(self.peak, self.now)

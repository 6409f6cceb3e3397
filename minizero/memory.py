"""Memory accounting: the bytes of model state a stage actually holds.

Walks the live tensors a stage reports (:meth:`Stage.held_tensors`) and
adds up their *storages*, each once: a parameter that is a view into a flat
buffer counts the whole buffer (padding included), a gradient that is a view
into a bucket counts the bucket.  Nothing here is computed from a formula;
the formula is printed beside it (``minizero.formulas.state_bytes``).
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


def cuda_peak_bytes(device: torch.device) -> int | None:
    """On a GPU, torch's own count of the peak allocated bytes -- a second opinion."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None

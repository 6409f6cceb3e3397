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

import contextlib
import os
import sys
from typing import Callable

import torch

from .offload import HOST_KIND


def held_bytes(held: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes per kind (params, grads, optimizer) and in ``total`` on the device; shared storage counted once.
    What is kept in host memory (kinds named ``host_...``) adds up to ``host`` instead."""
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
    out["total"] = sum(v for k, v in out.items() if not k.startswith(HOST_KIND))
    out["host"] = sum(v for k, v in out.items() if k.startswith(HOST_KIND))
    return out


class GatheredMemory:
    """An observer of a stage (``stage.add_observer``): the bytes of gathered full parameters alive now,
    and the most at any moment -- ZeRO-3's working set, measured outside the algorithm."""

    def __init__(self):
        self.now = self.peak = 0

    def __call__(self, event: str, nbytes: int, source=None) -> None:
        self.now += nbytes if event == "gather" else -nbytes
        self.peak = max(self.peak, self.now)


def profiled_step(step: Callable[[], None], device: str = "cpu") -> dict[str, int]:
    """The allocator's own account of one training step: ``step()`` run under torch's profiler with memory
    profiling, each allocation sorted into torch's categories (parameter, optimizer state, gradient, activation,
    autograd detail, temporary, input) by ``torch.profiler._memory_profiler`` -- what ``export_memory_timeline``
    draws.  Returns the bytes of each category at the step's peak, ``peak`` itself, and each category's own
    largest figure (``most_<category>``), on ``device`` (the CPU here: torch.cuda's statistics need no profiler)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                                  with_stack=True) as prof:
        step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(device)
    names = {index + 1: "unknown" if category is None else category.name.lower()
             for category, index in _CATEGORY_TO_INDEX.items()}
    at_peak = max(sizes, key=sum)
    out = {name: at_peak[i] for i, name in names.items()}
    out["peak"] = sum(at_peak)
    out.update({f"most_{name}": max(row[i] for row in sizes) for i, name in names.items()})
    return out


class CudaStepPeaks:
    """The CUDA allocator's figures around each training step (``torch.cuda``'s statistics: every allocation of
    this process on its device, the libraries' included): ``resident`` -- allocated as the step begins (the model
    states, and what CUDA libraries keep between steps: a cuBLAS workspace per thread that ran a matrix product) --
    and ``peak``, the most allocated during the step, counted from a reset at its start.  ``run_peak`` is the
    most over the whole run, as ``max_memory_allocated`` would have said without the resets."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.steps: list[tuple[int, int]] = []  # (resident, peak) per step
        self.run_peak = 0

    def __enter__(self) -> "CudaStepPeaks":
        torch.cuda.synchronize(self.device)
        self.run_peak = max(self.run_peak, torch.cuda.max_memory_allocated(self.device))
        self._resident = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.steps.append((self._resident, peak))
        self.run_peak = max(self.run_peak, peak)


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side writes a line to the process's stderr as it starts and stops (and warns of blocks
    allocated before it started, which it leaves out): noise under every measurement, so file descriptor 2 is
    pointed at the null device while it runs, and restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)

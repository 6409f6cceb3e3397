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
import ctypes
import gc
import os
import sys
import threading
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..parts.offload import HOST_KIND


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
        self._lock = threading.Lock()  # events come from the main thread and the communication thread (hpZ's frees)

    def __call__(self, event: str, nbytes: int, source=None) -> None:
        with self._lock:
            self.now += nbytes if event == "gather" else -nbytes
            self.peak = max(self.peak, self.now)


#: torch's memory categories of what a step keeps between steps (and the batch): the rest is the step's own.
KEPT_CATEGORIES = ("parameter", "optimizer_state", "gradient", "input")


def profiled_step(step: Callable[[], None], device: str = "cpu") -> dict[str, int]:
    """The allocator's own account of one training step: ``step()`` run under torch's profiler with memory
    profiling, each allocation sorted into torch's categories (parameter, optimizer state, gradient, activation,
    autograd detail, temporary, input) by ``torch.profiler._memory_profiler`` -- what ``export_memory_timeline``
    draws.  Returns the bytes of each category at the step's peak, ``peak`` itself, each category's own largest
    figure (``most_<category>``), and the most of all but :data:`KEPT_CATEGORIES` at any moment
    (``most_besides_kept``: activations, autograd's buffers, temporaries), on ``device`` (the CPU here: torch.cuda's
    statistics need no profiler)."""
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
    kept = [i for i, name in names.items() if name in KEPT_CATEGORIES]
    out["most_besides_kept"] = max(sum(row) - sum(row[i] for i in kept) for row in sizes)
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
        gc.collect()  # as HostStepPeaks
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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_in_use() -> Callable[[], int]:
    """A function returning the bytes this process's C heap has handed out and not taken back, in every thread:
    glibc's ``mallinfo2()`` -- ``uordblks`` (the arenas' chunks in use, every arena summed) plus ``hblkhd`` (the
    large blocks mmap'ed one by one: a tensor of more than 128 kB, say).  torch's CPU allocator takes its memory from
    malloc, so this is the CPU's ``torch.cuda.memory_allocated``, with Python's and the libraries' own heap
    besides.  Refused where the C library has no ``mallinfo2`` (glibc before 2.33, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(None)
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        raise RuntimeError("measuring a CPU step's memory reads glibc's mallinfo2() (glibc 2.33 or later, Linux); "
                           "this C library has none: measure on Linux, or on a GPU (--device cuda)") from None
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd
    return in_use


class _AfterEveryOp(TorchDispatchMode):
    """Calls ``sample()`` after every aten operator this thread runs -- autograd's backward included, which runs
    the mode stack of the thread that called it -- when the operator's outputs are made and its inputs still held."""

    def __init__(self, sample: Callable[[], None]):
        super().__init__()
        self._sample = sample

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sample()
        return out


class HostStepPeaks:
    """:class:`CudaStepPeaks` on the CPU: around each training step, ``resident`` -- the bytes malloc had handed out
    as the step began -- and ``peak``, the most it had out at any moment sampled during the step: after every aten
    operator of the rank's main thread (forward, backward and the optimizer step), so what the communication
    thread holds then -- buckets in flight, a collective's output -- is in it too.  A sampled peak: a buffer made
    and freed *inside* one operator, or between two samples on the other thread, is missed, so it can only be
    below the true one.  A sample costs about 4 us in a fresh process, but mallinfo2 walks every free chunk of the
    heap: in a rank forked from a long-lived, fragmented process it costs milliseconds, so measure in spawned ranks
    (:func:`minizero.course.commands.memory_table.measured_rows` does)."""

    def __init__(self):
        self._in_use = malloc_in_use()
        self.steps: list[tuple[int, int]] = []  # (resident, peak) per step
        self._peak = 0
        self._mode = None

    def _sample(self) -> None:
        now = self._in_use()
        if now > self._peak:
            self._peak = now

    def __enter__(self) -> "HostStepPeaks":
        # Tensors the last step left in reference cycles would count as resident, and be freed mid-step.  (The run
        # sets the objects that existed before it aside -- gc.freeze -- so this walks only what the run made.)
        gc.collect()
        self._resident = self._peak = self._in_use()
        self._mode = _AfterEveryOp(self._sample)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None
        self._sample()
        self.steps.append((self._resident, self._peak))


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

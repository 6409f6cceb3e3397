"""The communication interface every stage talks to.

A stage never calls ``torch.distributed`` directly: it calls a :class:`Comm`.
Two implementations exist and are interchangeable per run:

* :class:`~minizero.comm.ring.RingComm` builds every collective from
  point-to-point ``send``/``recv`` -- the lesson;
* :class:`~minizero.comm.native.NativeComm` forwards to torch's built-in
  collectives (gloo on CPU, NCCL on GPU) -- the yardstick.

Two cross-cutting concerns live here, once, so the algorithms stay clean:

* **Observers** (the byte ledger, later timers) learn how many bytes each
  collective sent, without a line of accounting code in any stage.
* **Async collectives** run on one background thread per ``Comm``.  Every
  rank issues collectives in the same order and the single thread runs them in
  that order, so messages of two collectives never interleave.  That is the
  invariant that makes overlap (bucketed DDP, ZeRO prefetch) safe.
"""
from __future__ import annotations

import enum
import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as dist


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"  # SUM, then divide by the world size
    MAX = "max"  # e.g. the inf-norm of a sharded gradient

    def combine(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """How two partial results meet on the way round the ring."""
        return torch.maximum(a, b, out=out) if self is ReduceOp.MAX else torch.add(a, b, out=out)


#: Collective kinds, the keys of the byte ledger.
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "root_all_reduce", "exchange")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``world_size`` contiguous chunks.

    The padding rule of the ring all-reduce: **there is none**.  Chunks follow
    ``torch.tensor_split``: the first ``numel % world_size`` chunks hold one
    element more, so with fewer elements than ranks some chunks are empty and
    those ring steps send nothing.  Reduce-scatter and all-gather, whose output
    is a per-rank shard, instead require equal shards -- the caller pads (see
    the flat layout), exactly like ``torch.distributed.reduce_scatter_tensor``.
    """
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class Work:
    """Handle of an asynchronous collective; ``wait()`` re-raises its error."""

    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def result(self):
        """Wait, and return what the submitted function returned."""
        return self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()


def collective(kind: str):
    """Mark a ``Comm`` method as a collective of ``kind``.

    Adds ``async_op=`` (returns a :class:`Work`) and tags the bytes sent while
    it runs with ``kind``.  A collective built from others (all-reduce =
    reduce-scatter + all-gather) is booked under the outermost kind.
    """

    def decorate(method):
        @functools.wraps(method)
        def wrapper(self: "Comm", *args, async_op: bool = False, **kwargs):
            if async_op or self._executor is not None and not self._on_comm_thread():
                work = Work(self._background().submit(self._tagged, kind, method, args, kwargs))
                if async_op:
                    return work
                work.wait()
                return None
            return self._tagged(kind, method, args, kwargs)

        return wrapper

    return decorate


def check_tensor(tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what}: dtype {tensor.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous (call .contiguous() first)")


class Comm:
    """Collectives over a process group; subclasses implement the algorithms.

    Every collective is in place or writes into a caller-given ``output``,
    like ``torch.distributed``; ``output`` shards are ``1/world_size`` of the
    full tensor.
    """

    name = "abstract"

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._observers: list[Callable[[str, int], None]] = []
        self._local = threading.local()
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # ----------------------------------------------------------- observers
    def add_observer(self, observer: Callable[[str, int], None]) -> None:
        """``observer(kind, nbytes)`` is called for every message this rank sends."""
        self._observers.append(observer)

    def remove_observer(self, observer: Callable[[str, int], None]) -> None:
        self._observers.remove(observer)

    def _report_sent(self, nbytes: int) -> None:
        kind = getattr(self._local, "kind", None) or "exchange"
        for observer in self._observers:
            observer(kind, nbytes)

    def _tagged(self, kind, method, args, kwargs):
        outer = getattr(self._local, "kind", None)
        if outer is None:
            self._local.kind = kind
        try:
            return method(self, *args, **kwargs)
        finally:
            if outer is None:
                self._local.kind = None

    # ---------------------------------------------------------- async thread
    def _background(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"comm-rank{self.rank}")
                self._thread_ident = self._executor.submit(threading.get_ident).result()
            return self._executor

    def _on_comm_thread(self) -> bool:
        return threading.get_ident() == getattr(self, "_thread_ident", None)

    def submit(self, fn: Callable[[], object]) -> Work:
        """Run ``fn`` on the communication thread, after every collective issued
        before it; collectives it calls run inline.  Bucketed DDP uses this to
        cast, reduce and unpack a bucket while backward goes on computing."""
        return Work(self._background().submit(fn))

    def synchronize(self) -> None:
        """Wait until every collective issued so far has finished."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ----------------------------------------------------------- interface
    def peer(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` (what ``dist.send`` expects)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        raise NotImplementedError

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        raise NotImplementedError

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        raise NotImplementedError

    def root_all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------- helpers
    def _check_shards(self, output: torch.Tensor, input: torch.Tensor, full: torch.Tensor, shard: torch.Tensor, what: str):
        check_tensor(output, f"{what} output")
        check_tensor(input, f"{what} input")
        if output.dtype != input.dtype:
            raise TypeError(f"{what}: output dtype {output.dtype} differs from input dtype {input.dtype}")
        if full.numel() != shard.numel() * self.world_size:
            raise ValueError(
                f"rank {self.rank}: {what} needs the full tensor to hold world_size x shard elements, "
                f"got {full.numel()} and {shard.numel()} with world_size {self.world_size}; "
                f"pad the full tensor to a multiple of world_size (see minizero.flat)"
            )

"""A collective, as every :class:`~minizero.comm.base.Comm` method that is one: the decorator that runs it, the
reduce operations, and how a tensor splits into a ring's chunks.

:func:`collective` adds ``async_op=`` and ``tag=`` to a method and runs it through :meth:`Comm._run` (fingerprint,
progress board, bytes booked under its kind); an average also takes ``wire=``, which it hands the whole call
(:mod:`.wire`).
"""
from __future__ import annotations

import enum
import functools
import inspect

import torch

from .fingerprint import DTYPES, CollectiveMismatch, Tag
from .thread import DueWork
from .wire import WireProtocol


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"  # SUM, then divide by the world size
    MAX = "max"  # e.g. the inf-norm of a sharded gradient

    def combine(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """How two partial results meet on the way round the ring."""
        return torch.maximum(a, b, out=out) if self is ReduceOp.MAX else torch.add(a, b, out=out)


SUPPORTED_DTYPES = DTYPES  # see fingerprint.DTYPES


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


def collective(kind: str):
    """Mark a ``Comm`` method as a collective of ``kind``.

    Adds ``async_op=`` (returns a :class:`~minizero.comm.thread.Work`) and ``tag=`` (a :class:`Tag`:
    what the collective is for), and runs it through :meth:`Comm._run`:
    fingerprint check, progress board, bytes booked under ``kind``.  A
    collective built from others (all-reduce = reduce-scatter + all-gather) is
    checked and booked once, as the outermost kind.

    An average (``op=ReduceOp.AVG``) also takes ``wire=``: a wire (:mod:`minizero.compress`), which the call is
    handed whole (``wire.average``, :mod:`.wire`) -- the 16-bit wire encodes, lets the collective sum the encodings
    and decodes the sum; a codec gathers its messages; PowerSGD all-reduces its factors.  ``key`` names the buffer,
    whose rounding error the wire may carry to the next step, and ``layout`` lists the tensors a flat buffer holds
    (``(name, shape)``, in order) for a wire that compresses each matrix on its own.  Without a wire the tensor
    travels as it is.
    """

    def decorate(method):
        signature = inspect.signature(method)

        @functools.wraps(method)
        def wrapper(self, *args, async_op: bool = False, tag: Tag | None = None, wire=None, key=None,
                    layout=None, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            if wire is not None:
                if async_op:
                    raise ValueError(f"rank {self.rank}: a {kind} over a wire runs where it is called; submit the "
                                     f"call (comm.submit) to overlap it")
                return _over_wire(self, wrapper, kind, bound.arguments, wire, key, tag, layout)
            runner = self._root._thread
            if async_op and self.port is not None and self.port.clock is None:  # a dialled wire on the host
                return DueWork(self._background().submit(self._run, kind, method, bound.arguments, tag, True))
            if async_op or runner is not None and runner.runs_elsewhere and not runner.here:
                work = self._background().submit(self._run, kind, method, bound.arguments, tag)
                if async_op:
                    return work
                work.wait()
                return None
            return self._run(kind, method, bound.arguments, tag)

        return wrapper

    return decorate


def _over_wire(comm, run, kind: str, arguments: dict, wire: WireProtocol, key, tag: Tag | None, layout) -> None:
    """An average over a wire: the wire's own business, whatever it is (:mod:`.wire`).

    The wire's steps -- encode, its collectives, decode -- are one call to the peers: an error on this rank between
    them (an encode that raised, say) leaves its peers inside a collective this rank skipped, and this rank's next
    collective would pair with theirs.  So, as for a collective that failed part-way, the Comm takes no more.  A
    ``FloatingPointError`` is the wire refusing a mean every rank holds alike -- raised on every rank at the same
    call, still in step -- and stays recoverable."""
    arguments = {k: v for k, v in arguments.items() if k != "self"}
    if arguments.get("op") is not ReduceOp.AVG:
        raise ValueError(f"rank {comm.rank}: a {kind} over a wire averages: pass op=ReduceOp.AVG")
    try:
        wire.average(comm, run, kind, arguments, key, tag, layout)
    except (FloatingPointError, CollectiveMismatch):
        raise
    except BaseException as error:
        comm.failed_part_way(f"the {kind} over a wire for {(tag or Tag()).describe()}", error)
        raise


def _tensors(arguments: dict) -> list[torch.Tensor]:
    """The tensors of one collective call, by the names every collective uses."""
    return [arguments[k] for k in ("tensor", "input", "output") if k in arguments]

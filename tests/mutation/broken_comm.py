"""Broken copies of communication and launcher code, each one realistic bug (registered in ``register.py``).

A copy that changes one thing and calls the real code for the rest finds it with
:func:`~tests.mutation.original_of` when it runs, so a renamed function breaks its own mutant, not this file."""
from __future__ import annotations

import time
from dataclasses import replace

import torch.distributed as dist

from minizero.comm import ReduceOp, ring
from minizero.comm import fingerprint as _fingerprint
from minizero.comm.collective import collective
from minizero.run import launch as _launch
from tests.mutation import original_of


def rs_forgets_own_chunk(self, chunks, out, op):
    """Reduce-scatter whose last step keeps the neighbour's partial sum, forgetting this rank's part."""
    n, r = self.world_size, self.rank
    if n == 1:
        if out is not chunks[r]:
            out.copy_(chunks[r])
        return
    buffers = self._scratch(max(c.numel() for c in chunks), out)
    send = chunks[(r - 1) % n]
    for step in range(n - 1):
        index = (r - step - 2) % n
        incoming = buffers[step % 2][: chunks[index].numel()]
        self._send_right_recv_left(send, incoming, "reduce-scatter", step)
        if index == r:
            out.copy_(incoming)
        else:
            send = op.combine(incoming, chunks[index], out=incoming)


def ag_one_step_short(self, chunks):
    """The ring all-gather's loop one step short (``range(n - 2)``): the chunk that should arrive last never
    does, and the rank keeps whatever its buffer held there -- at N = 2, every chunk but its own."""
    n, r = self.world_size, self.rank
    for step in range(n - 2):
        self._send_right_recv_left(chunks[(r - step) % n], chunks[(r - step - 1) % n], "all-gather", step)


@collective("reduce_scatter")
def rs_avg_not_divided(self, output, input, op=ReduceOp.SUM):
    self._ring_reduce_scatter(self._chunks(input), output.view(-1), op)  # AVG: forgot to divide


@collective("broadcast")
def broadcast_from_zero(self, tensor, src=0):
    original_of(broadcast_from_zero).__wrapped__(self, tensor, 0)  # every broadcast starts at rank 0, whatever src says


@collective("all_reduce")
def all_reduce_through_root(self, tensor, op=ReduceOp.SUM):
    """Right values, the parameter-server bytes: the root sends (N-1) x S."""
    ring.RingComm.root_all_reduce.__wrapped__(self, tensor, op)


def p2p_unreported(self, send, recv, part, step):
    right, left = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
    request = dist.isend(send, self.peer(right), group=self.group) if send is not None and send.numel() else None
    if recv is not None and recv.numel():
        dist.recv(recv, self.peer(left), group=self.group)
    if request is not None:
        request.wait()  # bytes left, but nobody told the ledger


def modelled_bytes_ignore_uneven_chunks(kind, numel, element_size, world_size, rank, src=0):
    """Every all-reduce message the size of an even chunk: the uneven chunks' extra elements forgotten."""
    if kind == "all_reduce" and world_size > 1:
        return [(numel // world_size) * element_size] * (2 * (world_size - 1))
    return original_of(modelled_bytes_ignore_uneven_chunks)(kind, numel, element_size, world_size, rank, src)


def fingerprint_without_tag(call):
    return original_of(fingerprint_without_tag)(replace(call, tag=_fingerprint.Tag()))  # kind, size and dtype only


def keeps_going_after_failure(self, kind, method, arguments, tag):
    self._failed = None  # forgets that a collective failed part-way
    return original_of(keeps_going_after_failure)(self, kind, method, arguments, tag)


# ------------------------------------------------------------------------------- the launcher, the watchdog
def blames_the_waiter(first, records, *rest):
    culprits, reason = original_of(blames_the_waiter)(first, records, *rest)
    return [first["rank"]], reason


def progress_only_at_entry(self, **fields):
    """The stall clock starts when the collective starts and never restarts: a slow one is 'stalled'."""
    if "state" not in fields:  # only enter() and leave() set the state
        fields.pop("progress", None)
    original_of(progress_only_at_entry)(self, **fields)


def run_with_a_deadline(self, fn, *args, **kwargs):
    """The old launcher: the timeout bounds the whole run, not a stall."""
    deadline = time.monotonic() + 1.25 * self.timeout_s + 2.0
    original_watch = self._watch

    def watch(finished, *rest):
        original_watch(finished, *rest)
        if time.monotonic() > deadline:
            self.close(kill=True)
            raise _launch.RankError("ranks did not finish within the timeout")
    self._watch = watch
    try:
        return original_of(run_with_a_deadline)(self, fn, *args, **kwargs)
    finally:
        del self._watch


def swallows_errors(self, fn, *args, **kwargs):
    try:
        return original_of(swallows_errors)(self, fn, *args, **kwargs)
    except _launch.RankError as error:
        if "raised" in str(error):
            return [None] * self.world_size
        raise


def sixteen_bit_checks_each_ranks_values(self, flat, key=None):
    """The 16-bit wire's overflow check on each rank's own values, before the sum (and none after it): every rank
    finite, the sum infinite, passes -- and the weights would take the inf."""
    import torch

    wire = original_of(sixteen_bit_checks_each_ranks_values)(self, flat, key)
    if not bool(torch.isfinite(wire).all()):
        raise FloatingPointError(f"rank {self.comm.rank}: gradients overflowed {self.wire_dtype} in the reduction")
    self.overflow_raises = False  # ... and the sum is not looked at again
    return wire


def raises_alone(wires: list) -> list:
    """``compress.overflow.defer`` as if it were never written: nothing deferred, nothing agreed on -- each rank
    raises on its own shard's inf, alone."""
    return []


def launch_raises_the_oldest(self, index: int) -> None:
    """``BucketPipeline._launch`` as it was: the oldest bucket waited for with its error, mid-backward -- on some
    ranks (where it was still running), not on others."""
    if self.max_in_flight is not None:
        pending = self.in_flight()
        for oldest in pending[:max(0, len(pending) - self.max_in_flight + 1)]:
            self._works[oldest].wait()
    self._works[index] = self.comm.submit(self._start(index))


def over_wire_goes_on(comm, run, kind, arguments, wire, key, tag, layout) -> None:
    """``comm.collective._over_wire`` as it was: a wire's steps that failed part-way leave the Comm taking more,
    so the raising rank's next collective pairs with its peers' pending one."""
    arguments = {k: v for k, v in arguments.items() if k != "self"}
    wire.average(comm, run, kind, arguments, key, tag, layout)

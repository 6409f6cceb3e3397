"""Lab 1 -- the ring reduce-scatter and all-gather, from send/recv (lessons/01_collectives_from_send_recv.ipynb).

Contract level: each method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says which parts of minizero exist for it: ``python -m minizero lab ring FILE --level guided``.)

You write the two phases of the ring all-reduce.  Your base, ``minizero.course.labs.given.Ring``, is the package's
ring Comm without them; its collectives call your phases: ``all_reduce`` = your reduce-scatter into this
rank's chunk, then (AVG) a division of that chunk by N, then your all-gather; ``reduce_scatter`` and
``all_gather`` call one phase each.  A tensor of ``numel`` elements is cut into N contiguous chunks as
``torch.tensor_split`` cuts it (the first ``numel % N`` chunks one element longer; with fewer elements than
ranks some chunks are empty).

Messages: the one way data leaves a rank here is a ring step,
``self._send_right_recv_left(send, recv, part, step)`` -- it sends tensor ``send`` to rank r+1 while it receives
into tensor ``recv`` from rank r-1 (both at once: no deadlock); an empty or None tensor is skipped at both ends;
``part`` (``"reduce-scatter"`` or ``"all-gather"``; any other label is taken too) and ``step`` say where you
are, for a stall's report.  The byte ledger counts what it sends, and
nothing else.  ``self.rank`` is r, ``self.world_size`` is N.

The checker's properties, in order:
  1. your methods are what runs: both are defined in this file and called while a stage trains over your ring;
  2. every collective's result: all-reduce (SUM, AVG, MAX), reduce-scatter (SUM) and all-gather, on drawn
     world sizes 1-4 and tensors of 0-40 elements (fewer than N included), float64 and float32, integer
     values (every sum exact) -- every element on every rank exactly equal to what it must be, and the
     reduce-scatter's and all-gather's inputs left as they were;
  3. bytes and messages per rank: each phase sends (N-1)/N of the tensor in at most N-1 messages (exactly N-1
     when every chunk has an element) -- in the reduce-scatter rank r sends every chunk's size but chunk r's,
     in the all-gather every chunk's size but chunk (r+1) mod N's;
  4. ddp and zero2 trained over your ring equal single-device training (world size 3, K = 2, float64).

Check it:   python -m minizero check ring --impl THIS_FILE
"""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.given import Ring as GivenRing


class Ring(GivenRing):
    def _ring_reduce_scatter(self, chunks: list[torch.Tensor], out: torch.Tensor, op: ReduceOp) -> None:
        """Called on every rank at once, with chunks of the same sizes everywhere.

        ``chunks``: this rank's N contributions (views into one flat tensor).  After it: ``out`` holds, element by
        element, the reduction by ``op`` (``op.combine(a, b, out=...)``: a sum for SUM and AVG, a max for MAX) of
        ``chunks[r]`` over every rank.  ``chunks`` are left as they were, except that ``out`` may *be*
        ``chunks[r]`` (all-reduce works in place).  Holds at N = 1 too.
        Cost: rank r sends each chunk but chunk r once -- (N-1)/N of the tensor -- in N-1 ring steps.
        """
        raise NotImplementedError("write Ring._ring_reduce_scatter: out = the reduction of chunks[rank] over ranks, "
                                  "in N-1 ring steps")

    def _ring_all_gather(self, chunks: list[torch.Tensor]) -> None:
        """Called on every rank at once.  Before: ``chunks[k]`` is complete on rank k.  After, in place: every
        ``chunks[k]`` on every rank holds rank k's ``chunks[k]``.
        Cost: rank r sends each chunk but chunk (r+1) mod N once -- (N-1)/N of the tensor -- in N-1 ring steps.
        """
        raise NotImplementedError("write Ring._ring_all_gather: every chunk on every rank, in N-1 ring steps")

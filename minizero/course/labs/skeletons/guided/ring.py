"""Lab 1 -- the ring reduce-scatter and all-gather, from send/recv (lessons/01_collectives_from_send_recv.ipynb).
Guided level: each method says what to do and which parts exist; the contract level states only what must hold.

Write the two phases of the ring all-reduce.  Everything else is given:
``all_reduce`` = your reduce-scatter, then (AVG) a division on 1/N of the data,
then your all-gather; ``reduce_scatter`` and ``all_gather`` call your phases too.

Check it:   python -m minizero check ring --impl THIS_FILE
(or, in a notebook:  from minizero.course.labs import check; check("ring", impl="THIS_FILE"))
The checker compares every result with the sum it must be, counts the bytes
and messages each rank sent -- (N-1)/N of the tensor and N-1 messages per
phase -- and finally trains a stage over your ring against single-device training.
"""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.given import Ring as GivenRing


class Ring(GivenRing):
    def _ring_reduce_scatter(self, chunks: list[torch.Tensor], out: torch.Tensor, op: ReduceOp) -> None:
        """Leave in ``out`` the reduction over all ranks of ``chunks[self.rank]``.

        ``chunks`` are this rank's N contributions (views into one flat tensor, sizes may differ by one);
        read them, don't change them -- except that ``out`` may *be* ``chunks[self.rank]`` (all-reduce
        works in place).  Ranks sit on a ring: in each of N-1 steps, send one partially reduced chunk to the
        right and receive one from the left, combining what arrives with your own contribution to that chunk.
        Choose which chunk travels at each step so that the last one to arrive on rank r is chunk r; what you
        send after the first step is what you combined at the step before, not your raw chunk.  With N = 1
        there is nothing to send, but ``out`` must still hold ``chunks[self.rank]``.

        The parts you have: ``self.rank`` and ``self.world_size``; ``self._send_right_recv_left`` (one ring
        step: a send to the right and a receive from the left at once -- no deadlock -- and the ledger counts
        what it sends); ``op.combine`` (how two partial results meet: a sum, or a max); a receive buffer of
        your own for each step.
        """
        raise NotImplementedError("write Ring._ring_reduce_scatter: N-1 ring steps, each a send right and a "
                                  "receive left, combining what arrives with your own chunk")

    def _ring_all_gather(self, chunks: list[torch.Tensor]) -> None:
        """``chunks[self.rank]`` is complete on this rank (and chunk k on rank k); fill in all the others, in place.

        In each of N-1 ring steps, forward to the right the complete chunk that arrived last (at the first step:
        your own), receiving the next one from the left -- straight into its place in ``chunks``.
        """
        raise NotImplementedError("write Ring._ring_all_gather: N-1 ring steps, each forwarding the chunk that "
                                  "arrived last")

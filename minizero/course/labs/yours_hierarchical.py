"""The hierarchical lab's first property: the learner's own methods are what runs, on a Comm of nodes.

As :func:`minizero.course.labs.ranks.yours_run` for the stage labs, but no stage needs to train over this Comm:
the lab's methods must be defined in the learner's file and called by one all-reduce on two nodes.
"""
from __future__ import annotations

import torch

from ...comm import ReduceOp, parse_network
from ...run.launch import Rank
from .failed import Failed
from .loading import Impl
from .raised import Raised
from .yours import probe


def yours_on_rank(me: Rank, impl: Impl) -> list[str] | Raised | None:
    """:func:`minizero.course.labs.ranks.yours_run` for a Comm on nodes (no stage needs to train over it): the lab's method
    defined in the learner's file, and called by an all-reduce."""
    def one_all_reduce():
        comm = impl.cls()(None, False, parse_network("nodes=2x1"))
        try:
            comm.all_reduce(torch.ones(4), ReduceOp.SUM)
        finally:
            comm.close()

    return probe(me.rank, impl, one_all_reduce,
                 lambda never: "by an all_reduce: is your Hierarchical the class your file defines last?")


def yours(checker) -> str:
    if checker.impl.path is None:
        return "the package's own class (the answer key)"
    problems = checker.on_ranks(2, yours_on_rank, checker.impl)[0]
    if problems:
        raise Failed("; ".join(problems), final=True)
    if problems is None:  # the all-reduce raised: the next property shows where, on the smallest case
        return f"{', '.join(checker.lab.todo)}: written in your file (an all-reduce raised before it returned)"
    return f"{', '.join(checker.lab.todo)}: yours, called by an all-reduce on 2 nodes"

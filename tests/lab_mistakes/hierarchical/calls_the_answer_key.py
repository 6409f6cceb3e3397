"""The two-level all-reduce handed to the package's ``HierarchicalComm._all_reduce`` by name: right sums and bytes on
every link, none of it the learner's."""
from __future__ import annotations

from minizero.comm.hierarchical import HierarchicalComm
from minizero.course.labs import given


class Hierarchical(given.Hierarchical):
    def _all_reduce(self, tensor, op) -> None:
        HierarchicalComm._all_reduce(self, tensor, op)

"""Writes the reduce and calls the package's tree broadcast by name: right results, half the tree not the
learner's."""
from __future__ import annotations

from minizero.comm.tree import TreeComm
from minizero.course.labs import given


class Tree(given.Tree):
    def _tree_reduce(self, tensor, op) -> None:
        TreeComm._tree_reduce(self, tensor, op)

    def _tree_broadcast(self, tensor) -> None:
        TreeComm._tree_broadcast(self, tensor)

"""A filled-in skeleton, written from its docstrings alone (tests/test_labs.py checks it passes).

Lab 6 -- ZeRO-2's per-bucket reduce-scatter during backward (lessons/06_zero2.ipynb).

Given: buckets that are flat sharded groups of their own (``self.groups``,
last layer first, each padded to a multiple of N), the pipeline that launches a
complete bucket on the communication thread, ``sync_gradients`` (launch the rest,
wait, add each bucket's averaged slice to the pieces' ``.grad``) and the step
(ZeRO-1's).
Yours: what happens when a gradient is ready, and what a complete bucket does.

Check it:   python -m minizero check zero2 --impl THIS_FILE
Besides equivalence and bytes, the checker measures the gradients each rank
holds after backward -- 1/N of them: no full gradient may outlive its bucket --
and watches a backward for overlap.
"""
from __future__ import annotations

from minizero.stages import ZeRO2 as GivenZeRO2


class ZeRO2(GivenZeRO2):
    def _on_gradient_ready(self, param) -> None:
        """A post-accumulate-grad hook: ``param.grad`` is final for this backward.
        Record it (``self._used.add(id(param))``) and, if this backward synchronises (``self._syncing``),
        mark it ready: ``self.pipeline.mark(param)``."""
        self._used.add(id(param))
        if self._syncing:
            self.pipeline.mark(param)

    def _reduce_scatter(self, index: int):
        """Bucket ``index`` is complete.  Here, on the main thread: pack its gradients into a new flat tensor
        (``full = group.pack_grads()`` with ``group = self.groups[index]``) and *free* every full gradient
        (``s.param.grad = None`` for ``s in group.segments``) -- the memory ZeRO-2 saves.  Return a function
        of no arguments, run later on the communication thread, that reduce-scatters ``full`` into a new
        shard-sized tensor (``torch.empty_like(group.shard)``) with
        ``minizero.compress.reduce_scatter_mean(self.comm, self.wire, full, averaged, index, names, tag)``
        (``names = [s.name for s in group.segments]``, ``tag = self.tag(f"bucket {index}")``) and returns it.
        """
        import torch

        from minizero.compress import reduce_scatter_mean
        group = self.groups[index]
        full = group.pack_grads()
        for s in group.segments:
            s.param.grad = None
        names, tag = [s.name for s in group.segments], self.tag(f"bucket {index}")

        def run():
            averaged = torch.empty_like(group.shard)
            reduce_scatter_mean(self.comm, self.wire, full, averaged, index, names, tag)
            return averaged
        return run

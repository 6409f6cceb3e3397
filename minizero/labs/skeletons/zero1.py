"""Lab 5 -- ZeRO-1's step: reduce-scatter, step the owned shard, all-gather (lessons/05_zero1.ipynb).

Given: the flat sharded layout (``self.groups``: one ``FlatGroup`` per optimizer
param group and dtype, padded to a multiple of N, each rank owning one shard), the
full gradient buffers (``self.grad_buffers``, each ``.grad`` a view into them),
the pieces (this rank's part of each parameter, a view into the owned shard),
and the user's optimizer rebuilt over the pieces (``self.optimizer``).
Yours: the gradient reduction and the sharing of the updated parameters.

Check it:   python -m minizero check zero1 --impl THIS_FILE
Besides equivalence, the checker counts your bytes -- a reduce-scatter plus an
all-gather, 2(N-1)/N x Psi x b, exactly DDP's -- and the optimizer state each
rank holds: 1/N of DDP's.
"""
from __future__ import annotations

from minizero.stages import ZeRO1 as GivenZeRO1


class ZeRO1(GivenZeRO1):
    def sync_gradients(self) -> None:
        """Given: which parameters got a gradient anywhere; then your reduce-scatter."""
        used = self._agree_on_use([s.param for group in self.groups for s in group.segments])
        self.reduce_scatter_gradients(used)
        self._window_open = False

    def reduce_scatter_gradients(self, used: set[int]) -> None:
        """For each group ``g`` (index ``index``) and its full gradient buffer ``buffer``:

        1. reduce-scatter the buffer into this rank's slice of it, averaged over ranks:
           ``owned = group.shard_of(buffer)``, then
           ``minizero.compress.reduce_scatter_mean(self.comm, self.wire, buffer, owned, index, names, tag)``
           with ``names = [s.name for s in group.segments]`` and ``tag = self.tag(f"group {index} gradients")``;
        2. zero the rest of the buffer -- the other ranks' slices: they own those averages.  (Only a backward
           *without* ``zero_grad()`` before it would see them again -- torch allows that, the training loop the
           checker runs never does it, so the checker cannot tell; the package's answer zeroes them.)
        3. give each piece its part of the averaged slice as ``.grad``: for ``piece in group.pieces`` whose
           ``id(piece.segment.param)`` is in ``used``,
           ``piece.param.grad = owned[piece.offset:piece.offset + piece.stop - piece.start]``.
        (Left out here, as the training loop never needs them, and kept by the package's answer: a parameter
        without a gradient on some rank is named; a piece's gradient left from before a backward without
        ``zero_grad()`` is added back to its part.)  This rank's slice of ``buffer`` is
        ``buffer[group.rank * group.shard_size:(group.rank + 1) * group.shard_size]``.
        """
        raise NotImplementedError("write ZeRO1.reduce_scatter_gradients: reduce-scatter each buffer into the "
                                  "owned slice and hand it to the pieces")

    def _step(self) -> None:
        """Given: step the owned pieces (False: a step skipped for fp16 overflow -- nothing changed), share them."""
        if self.optimizer.step_owned():
            self.all_gather_parameters()
            self._shared_versions = [group.data._version for group in self.groups]  # shared: none owed later

    def all_gather_parameters(self) -> None:
        """Every rank stepped only its own shard; every rank needs every updated parameter for the next forward.

        For each group (index ``g``), all-gather its owned shard into the full flat parameters ``group.data``:
        ``self.comm.all_gather(group.data, group.shard.detach().clone(), tag=self.tag(f"group {g} parameters"))``
        (the clone: ``group.shard`` is a view into ``group.data``, which the all-gather writes).
        """
        raise NotImplementedError("write ZeRO1.all_gather_parameters: all-gather each group's updated shard")

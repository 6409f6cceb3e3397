"""Stage ``zero2``: gradients sharded too (ZeRO paper, section 5.2, P_os+g).

ZeRO-1 still holds every gradient in full, only to keep 1/N of the average.
ZeRO-2 reduce-scatters gradients *during backward*, bucket by bucket, as they
become ready, and frees the full gradients at once: each rank keeps only its
slice of each bucket's averaged gradient.  The parameter update and the
all-gather are ZeRO-1's.  Bytes: the same reduce-scatter + all-gather,
2(N-1)/N * Psi * b per step.  Memory (fp32 Adam): 4Psi + (4 + 8)Psi/N.

Buckets are flat groups of their own (padded to a multiple of N, filled in
reverse registration order), so each one's reduce-scatter is an ordinary
reduce-scatter, and the owned slices of all buckets together are the rank's
shard.

Gradient accumulation: the K-1 micro-batches inside ``no_sync()``
accumulate full gradients locally and the last one reduce-scatters the sums.
That keeps the bytes at DDP's (once per step); its price is that *during*
accumulation a rank holds full gradients, as DDP does.  The alternative --
reduce-scatter every micro-batch into the shard, holding only 1/N throughout --
costs K reduce-scatters per step: memory against bytes (DeepSpeed does the
latter).
"""
from __future__ import annotations

import torch

from ..buckets import MiB, ReadyOrder, check_bucket_mb
from ..comm.thread import drain
from ..layout import FlatGroup, build_groups
from .zero1 import ZeRO1


class ZeRO2(ZeRO1):
    name = "zero2"

    def __init__(self, module, optimizer, comm, bucket_mb: float = 25.0, compress: str | None = None,
                 error_feedback: bool = False, find_unused_parameters: bool = False):
        check_bucket_mb(bucket_mb)
        self.bucket_mb = bucket_mb
        super().__init__(module, optimizer, comm, compress, error_feedback, find_unused_parameters)

    def _build_groups(self, optimizer) -> list[FlatGroup]:
        element_size = next((p.element_size() for g in optimizer.param_groups for p in g["params"]), 4)
        return build_groups(optimizer, self.module, self.rank, self.world_size,
                            max_numel=max(1, int(self.bucket_mb * MiB // element_size)))

    def _init_gradients(self) -> None:
        """The only gradient memory kept between steps: this rank's slice of each bucket."""
        self.shards = [g.shard.new_zeros(g.shard_size) for g in self.groups]
        self._ready = ReadyOrder([[s.param for s in g.segments] for g in self.groups], self._launch)
        self._works: dict[int, object] = {}
        self.zero_grad()

    def _zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradient shards: the gradients this stage will step with, whoever calls it."""
        for shard in self.shards:
            shard.zero_()
        for group in self.groups:
            for s in group.segments:
                s.param.grad = None

    def grad_shards(self) -> list[torch.Tensor]:
        return self.shards

    def _on_gradient_ready(self, param) -> None:
        self._used.add(id(param))
        if self._syncing:
            self._ready.mark(param)

    def _group_label(self, index: int) -> str:
        return f"bucket {index}"

    def _launch(self, index: int) -> None:
        """A bucket is complete: pack its gradients, free them, reduce-scatter on the comm thread."""
        group = self.groups[index]
        full = group.pack_grads()  # a transient flat copy, freed once the reduce-scatter is done
        for s in group.segments:
            s.param.grad = None  # the point of ZeRO-2: no full gradient outlives its bucket
        names, tag = [s.name for s in group.segments], self.tag(self._group_label(index))

        def reduce_scatter():
            # Into a fresh shard, then added: gradients accumulate in the shard until zero_grad(), across
            # synchronising backwards and steps alike -- as .grad does in torch.
            averaged = torch.empty_like(self.shards[index])
            self.averager.reduce_scatter(full, averaged, index, names, tag)
            self.shards[index].add_(averaged)

        self._works[index] = self.comm.submit(reduce_scatter)

    def sync_gradients(self) -> None:
        try:
            self._refuse_unused_here()
            self._ready.complete_all()  # buckets whose gradients came only from earlier micro-batches
            self._agree_on_use(self._checked_params())
            for index in sorted(self._works):
                self._works.pop(index).wait()
        finally:  # after an error too: nothing left running, nothing left marked
            drain(list(self._works.values()))
            self._works.clear()
            self._ready.reset()
            self._used.clear()

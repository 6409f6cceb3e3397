"""Stage ``zero2``: gradients sharded too (ZeRO paper, section 5.2, P_os+g).

ZeRO-1 still holds every gradient in full, only to keep 1/N of the average.  ZeRO-2 reduce-scatters gradients
*during backward*, bucket by bucket, as they become ready, and frees the full gradients at once: each rank keeps only
its shard of each bucket's averaged gradient -- the pieces' ``.grad``.

1. buckets are flat groups of their own (``bucket_mb``, padded to a multiple of N, filled in reverse registration
   order), so each one's reduce-scatter is an ordinary reduce-scatter, and the rank's shards of all buckets
   together are its 1/N of the gradients;
2. a post-accumulate-grad hook marks each parameter ready; a complete bucket is packed, its full gradients freed, and
   its reduce-scatter started on the communication thread while backward goes on (``parts.buckets.BucketPipeline``,
   as in ``ddp-bucketed``) -- once the one before has finished, so a slow wire cannot pile packed copies up
   (``reduce_scatter_buffers=2``, FSDP2's ``set_reduce_scatter_max_input_buffers``: once the one before *that*);
3. the optimizer steps the owned pieces, and the updated shards are all-gathered, as in ZeRO-1.

Bytes: the same reduce-scatter + all-gather, 2(N-1)/N * Psi * b per step.  Memory (fp32 Adam): 4Psi + (4 + 8)Psi/N;
mixed precision: 2Psi + (2 + 12)Psi/N.

Gradient accumulation: the K-1 micro-batches inside ``no_sync()`` accumulate full gradients locally and the last one
reduce-scatters the sums.  That keeps the bytes at DDP's (once per step); its price is that *during* accumulation a
rank holds full gradients, as DDP does.  The alternative -- reduce-scatter every micro-batch into the shard, holding
only 1/N throughout -- costs K reduce-scatters per step: memory against bytes (DeepSpeed does the latter).
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm, ReduceOp
from ..comm.thread import wait_all
from ..costs.formulas import all_gather_bytes, reduce_scatter_bytes
from ..parts.buckets import MAX_IN_FLIGHT, BucketPipeline, check_bucket_mb
from ..parts.layout import build_groups
from .facts import GradientMemory, Shards, bucket_numel
from .options import BUCKET_MB, OFFLOAD_OPTIMIZER, REDUCE_SCATTER_BUFFERS, WIRE_AND_USE, check_reduce_scatter_buffers
from .zero import ZeRO


class ZeRO2(ZeRO):
    name = "zero2"
    shards = Shards(optimizer_states=True, gradients=True)
    gradient_memory = GradientMemory(buckets="bucket_mb")
    options = (BUCKET_MB, REDUCE_SCATTER_BUFFERS, *WIRE_AND_USE, OFFLOAD_OPTIMIZER)

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, comm: Comm | None = None,
                 bucket_mb: float = 25.0, reduce_scatter_buffers: int = MAX_IN_FLIGHT, **common):
        check_bucket_mb(bucket_mb)
        check_reduce_scatter_buffers(reduce_scatter_buffers)
        super().__init__(module, optimizer, comm, **common)  # wire, find_unused_parameters, precision, offload
        self.bucket_mb = bucket_mb
        self.shard(build_groups(self.param_groups(), self.rank, self.world_size, self.names(),
                                max_numel=bucket_numel(bucket_mb, self.param_groups(), self.precision)))
        self.pipeline = BucketPipeline(comm, [[s.param for s in b.segments] for b in self.buckets],
                                       self.deferred_reduce_scatter, max_in_flight=reduce_scatter_buffers)
        self.zero_grad()
        self.hook_grouped_parameters()

    @property
    def buckets(self) -> list:  # ZeRO-2's flat groups are its buckets: cut at bucket_mb, one reduce-scatter each
        return self.groups

    # ------------------------------------------------------------ backward
    def pre_forward(self) -> None:
        if self.stepped_outside():  # an optimizer built over stage.parameters() stepped: share it first
            self.all_gather_parameters()

    def post_accumulate_grad(self, param: nn.Parameter) -> None:
        self._used.add(id(param))
        if self._syncing:
            self.pipeline.mark(param)

    def deferred_reduce_scatter(self, index: int):
        """Bucket ``index`` is complete: pack its gradients and free them (the point of ZeRO-2: no full
        gradient outlives its bucket); the reduce-scatter runs on the communication thread."""
        bucket, tag = self.buckets[index], self.tag(f"bucket {index}")
        full = bucket.take_gradients()

        def reduce_scatter() -> torch.Tensor:
            averaged = torch.empty_like(bucket.shard)
            self.comm.reduce_scatter(averaged, full, ReduceOp.AVG, tag=tag, wire=self.wire, key=index)
            return averaged
        return reduce_scatter

    def post_backward(self) -> None:
        """Backward has finished: launch the buckets that never completed, and give each piece its averaged gradient."""
        with self.pipeline.round():
            try:
                self.refuse_unused_here(self.buckets)
                self.pipeline.launch_rest()  # buckets whose gradients came only from earlier micro-batches
                used = self.used_anywhere([s.param for b in self.buckets for s in b.segments])
                for index, averaged in self.pipeline.wait_all():
                    self.accumulate(self.buckets[index], averaged, used)
            finally:
                self._used.clear()

    # ------------------------------------------------------------ optimizer
    def step(self) -> None:
        """Step the owned pieces, then all-gather, as ZeRO-1 does (not after a step skipped for overflow)."""
        with self.stepping():
            if self.optimizer.step_owned():
                self.all_gather_parameters()

    def all_gather_parameters(self) -> None:
        """Everyone gets everyone's updated shard, bucket by bucket: every all-gather issued before any is waited
        for, as ZeRO-1 does (:meth:`~minizero.stages.zero1.ZeRO1.all_gather_parameters`)."""
        works = [self.comm.all_gather(bucket.data, bucket.shard.detach().clone(), async_op=True,
                                      tag=self.tag(f"bucket {b} parameters after step"))
                 for b, bucket in self.stepped_groups()]
        wait_all(works)
        self.remember_shared()

    # ------------------------------------------------------------------ facts
    @classmethod
    def sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, **options) -> float:
        """ZeRO-1's bytes: the buckets' reduce-scatters and all-gathers add up to one of each over Psi."""
        return reduce_scatter_bytes(psi * grad_bytes, world_size) + all_gather_bytes(psi * param_bytes, world_size)

    @classmethod
    def schedule(cls, s, bucket_mb: float = 25.0, **options) -> None:
        """ZeRO-2's reduce-scatters leave bucket by bucket during backward; after the step each bucket's
        all-gather (:meth:`all_gather_parameters`: one per flat group, and a bucket is a group) has nothing to
        hide behind -- small buckets pay their latency twice."""
        s.forward()
        s.backward_in_buckets("reduce_scatter", bucket_mb)
        s.optimizer_step()
        for numel in s.plan.bucket_sizes(bucket_mb):
            s.blocking("all_gather", numel, s.plan.param_bytes)


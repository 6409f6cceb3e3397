"""Stage ``zero1``: optimizer states sharded (ZeRO paper, section 5.1, P_os).

DDP keeps N identical copies of everything.  The optimizer states are the
biggest part (Adam: two fp32 values per parameter) and the optimizer update
is element-wise, so rank ``r`` can update just *its* 1/N of the parameters,
if it has the averaged gradient for that shard, and then share the result:

1. gradients accumulate as in DDP, into one flat (padded) buffer per group
   (a param group's parameters in the order backward produces them, cut at
   ``bucket_mb``: DeepSpeed's reduce buckets);
2. when backward finishes, **reduce-scatter** each buffer: rank ``r`` receives
   the average of its own shard only -- half an all-reduce;
3. the optimizer -- the user's class and hyper-parameters, rebuilt over the
   owned pieces -- updates that shard (states exist for it alone);
4. **all-gather** the updated shards: the other half of an all-reduce.

Bytes: reduce-scatter + all-gather = 2(N-1)/N * Psi * b, exactly DDP's.
ZeRO-1 saves memory, not communication -- and it is the *same* update as DDP
and as single-device training, which the property suite proves.  (An
all-reduce followed by an all-gather, seen in public code, costs 3Psi.)

Memory per rank (fp32 Adam): parameters 4Psi + gradients 4Psi + states 8Psi/N;
in mixed precision (the paper's setting) 2Psi + 2Psi + (4 + 8)Psi/N: the fp32
masters are optimizer state, sharded with the moments.

After the reduce-scatter the owned shard *is* the pieces' ``.grad`` and the
other shards are zeroed; how accumulation across steps without ``zero_grad()``
keeps torch's semantics is :mod:`minizero.parts.grad_buffers`'s.

``overlap=True`` is DeepSpeed's stage 1 with ``overlap_comm``: each group's
reduce-scatter starts during backward, in place, as soon as its gradients are
final (``BucketPipeline``, as ddp-bucketed's all-reduces) -- the full gradients
kept, so the memory is ZeRO-1's and only the wait changes.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm, ReduceOp
from ..comm.thread import wait_all
from ..costs.formulas import all_gather_bytes, reduce_scatter_bytes
from ..parts.buckets import BucketPipeline, check_bucket_mb
from ..parts.grad_buffers import FullGradients
from ..parts.layout import build_groups
from .facts import GradientMemory, Shards, bucket_numel
from .options import BUCKET_MB, OFFLOAD_OPTIMIZER, OVERLAP, WIRE_AND_USE
from .zero import ZeRO


class ZeRO1(ZeRO):
    name = "zero1"
    shards = Shards(optimizer_states=True)
    gradient_memory = GradientMemory(kept=True)  # FullGradients: one flat buffer per group, zeroed in place
    options = (BUCKET_MB, OVERLAP, *WIRE_AND_USE, OFFLOAD_OPTIMIZER)

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, comm: Comm | None = None,
                 bucket_mb: float = 25.0, overlap: bool = False, **common):
        check_bucket_mb(bucket_mb)
        super().__init__(module, optimizer, comm, **common)  # wire, find_unused_parameters, precision, offload
        self.shard(build_groups(self.param_groups(), self.rank, self.world_size, self.names(),
                                max_numel=bucket_numel(bucket_mb, self.param_groups(), self.precision)))
        self.full_grads = FullGradients(self.groups)  # one flat buffer per group; each .grad a view into it
        self.pipeline = BucketPipeline(comm, [[s.param for s in g.segments] for g in self.groups],
                                       self.deferred_reduce_scatter) if overlap else None
        self.zero_grad()
        self.hook_grouped_parameters()

    # ------------------------------------------------------------ backward
    def pre_forward(self) -> None:
        if self.stepped_outside():  # an optimizer built over stage.parameters() stepped: share it first
            self.all_gather_parameters()
        if torch.is_grad_enabled():
            self.full_grads.open_if_closed()

    def pre_backward(self) -> None:
        self.full_grads.open_if_closed()

    def post_accumulate_grad(self, param: nn.Parameter) -> None:
        self._used.add(id(param))
        self.full_grads.keep(param)
        if self.pipeline is not None and self._syncing:
            self.pipeline.mark(param)

    def post_backward(self) -> None:
        """Backward has finished: reduce-scatter each group's gradients into the owned shard, in place."""
        if self.pipeline is not None:
            return self.post_backward_overlapped()
        used = self.used_after_backward()
        for index, (group, buffer) in enumerate(zip(self.groups, self.full_grads.buffers, strict=True)):
            self.comm.reduce_scatter(group.shard_of(buffer), buffer, ReduceOp.AVG,
                                     tag=self.tag(f"group {index} gradients"), wire=self.wire, key=index)
            self.full_grads.take_averaged(index, used)
        self.full_grads.window_open = False

    def deferred_reduce_scatter(self, index: int):
        """With overlap: bucket ``index``'s gradients are final -- its reduce-scatter, in place, for the
        communication thread (nothing is packed or freed: ZeRO-1 keeps the full gradients)."""
        group, buffer, tag = self.groups[index], self.full_grads.buffers[index], self.tag(f"bucket {index} gradients")
        return lambda: self.comm.reduce_scatter(group.shard_of(buffer), buffer, ReduceOp.AVG, tag=tag,
                                                wire=self.wire, key=index)

    def post_backward_overlapped(self) -> None:
        """With overlap: launch the buckets that never completed, wait for every reduce-scatter, and take the
        averaged shards (the used-parameter bitmap queues behind the buckets, on every rank alike)."""
        with self.pipeline.round():
            self.pipeline.launch_rest()
            used = self.used_after_backward()
            for index, _ in self.pipeline.wait_all():
                self.full_grads.take_averaged(index, used)
        self.full_grads.window_open = False

    # ------------------------------------------------------------ optimizer
    def step(self) -> None:
        """Step the owned pieces (those without a gradient are skipped, as torch.optim skips None), then
        all-gather: every rank's parameters current again.  Not after a step skipped for fp16 overflow."""
        with self.stepping():
            if self.optimizer.step_owned():
                self.all_gather_parameters()

    def all_gather_parameters(self) -> None:
        """Everyone gets everyone's updated shard (the parameters are views of ``group.data``); a group
        whose parameters had no gradient anywhere did not change.  Every group's all-gather is issued before any
        is waited for: nothing reads a parameter until the step ends, so they run back to back (on NCCL's stream,
        or a dialled wire) with no wait of the host between them."""
        works = [self.comm.all_gather(group.data, group.shard.detach().clone(), async_op=True,
                                      tag=self.tag(f"group {g} parameters after step"))
                 for g, group in self.stepped_groups()]
        wait_all(works)
        self.remember_shared()

    # ------------------------------------------------------------------ facts
    @classmethod
    def sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, **options) -> float:
        return reduce_scatter_bytes(psi * grad_bytes, world_size) + all_gather_bytes(psi * param_bytes, world_size)

    @classmethod
    def schedule(cls, s, bucket_mb: float = 25.0, overlap: bool = False, **options) -> None:
        """Reduce-scatter after backward, all-gather after the step: neither hides.  With overlap the buckets'
        reduce-scatters leave during backward, as ZeRO-2's; the all-gathers still wait for the step."""
        s.forward()
        if overlap:
            s.backward_in_buckets("reduce_scatter", bucket_mb)
        else:
            s.backward()
            for numel in s.plan.bucket_sizes(bucket_mb):
                s.blocking("reduce_scatter", numel, s.plan.grad_bytes)
        s.optimizer_step()
        for numel in s.plan.bucket_sizes(bucket_mb):
            s.blocking("all_gather", numel, s.plan.param_bytes)

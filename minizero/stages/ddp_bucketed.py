"""Stage ``ddp-bucketed``: all-reduce gradients in buckets, overlapped with backward.

Plain ``ddp`` waits for the whole backward, then sends everything: the
network idles while the CPU/GPU computes, and vice versa.  But backward
produces gradients layer by layer, last layer first.  So:

1. gradients live in flat **buckets** (``bucket_mb``, 25 MiB as in torch),
   filled in reverse registration order; each ``.grad`` is a view into its
   bucket, so autograd accumulates straight into what will be sent;
2. a **post-accumulate-grad hook** marks a parameter ready once its ``.grad``
   holds this backward's final value.  (A tensor hook, ``p.register_hook``,
   fires *before* accumulation -- syncing there averages only the last
   micro-batch.  And the post-accumulate hook receives the *parameter*:
   all-reduce ``p.grad``, not ``p``.)
3. when a bucket is complete, its all-reduce starts on the communication
   thread while backward goes on; buckets start in index order on every rank
   (:class:`~minizero.parts.buckets.BucketPipeline`);
4. when backward ends, wait for all buckets.  ``.grad`` is then averaged,
   as after torch DDP's backward.

The bytes are plain ``ddp``'s: the same all-reduce, cut into buckets.

Parameters that get no gradient in a step: with ``find_unused_parameters``
their bucket is completed at the end of backward and a bitmap of which
parameters were used anywhere is all-reduced, so a parameter unused on every
rank keeps ``.grad = None`` (the optimizer skips it, as single-device training
would).  Without it, the run stops naming the parameter -- a bucket that
never completes would otherwise hang the other ranks.

``no_sync()`` must be entered on every rank alike (as in torch).  With
fingerprint checking on (``make_comm(check=True)``), a rank that synchronises
a micro-batch the others accumulate is stopped at its first bucket, the error
naming both ranks' calls; without it, the run stalls and the launcher names
the rank that did not come.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import Comm, ReduceOp
from ..parts.buckets import BucketPipeline, MiB, check_bucket_mb
from ..parts.flat import keep_grad_in
from .ddp import DDP
from .facts import GradientMemory, Reduction
from .hooks import when_accumulated
from .options import BUCKET_MB, WIRE_AND_USE
from .unused import unused_error


@dataclass
class Bucket:
    """Parameters whose gradients are views into one flat ``buffer``, all-reduced as one message (torch DDP's
    ``gradient_as_bucket_view=True``: autograd accumulates into the bucket in place, sent without a copy)."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    buffer: torch.Tensor  # all gradients of the bucket, end to end
    views: list[torch.Tensor] = field(default_factory=list)  # views[i] is params[i]'s gradient


def assign_buckets(named_params: list[tuple[str, nn.Parameter]], bucket_mb: float) -> list[Bucket]:
    """Pack parameters, last registered first, into buckets of at most ``bucket_mb`` MiB.

    A bucket holds one dtype; a parameter larger than the cap gets a bucket
    of its own.  Every rank builds the same buckets (same model, same cap).
    """
    check_bucket_mb(bucket_mb)
    cap = bucket_mb * MiB
    groups: list[list[tuple[str, nn.Parameter]]] = []
    for name, p in reversed(named_params):
        current = groups[-1] if groups else None
        if (current is None or current[0][1].dtype != p.dtype
                or sum(q.numel() * q.element_size() for _, q in current) + p.numel() * p.element_size() > cap):
            groups.append([])
        groups[-1].append((name, p))
    buckets = []
    for index, group in enumerate(groups):
        params = [p for _, p in group]
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        bucket = Bucket(index, [n for n, _ in group], params, buffer)
        offset = 0
        for p in params:
            bucket.views.append(buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        buckets.append(bucket)
    return buckets


class BucketedDDP(DDP):
    name = "ddp-bucketed"
    gradient_memory = GradientMemory(kept=True)  # each .grad a view into its bucket, all-reduced in place
    options = (BUCKET_MB, *WIRE_AND_USE)

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, comm: Comm | None = None,
                 bucket_mb: float = 25.0, **common):
        super().__init__(module, optimizer, comm, **common)  # wire, find_unused_parameters, precision: as DDP
        self.buckets: list[Bucket] = assign_buckets(self.trainable(), bucket_mb)
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.pipeline = BucketPipeline(comm, [b.params for b in self.buckets], self.deferred_all_reduce)
        self._point_grads_into_buckets()
        for _, p in self.trainable():
            when_accumulated(p, self)

    # -------------------------------------------------------------- backward
    def post_accumulate_grad(self, param: nn.Parameter) -> None:
        """``param.grad`` is final for this backward: back into its bucket's view, and marked ready."""
        bucket, i = self._slot[id(param)]
        keep_grad_in(param, bucket.views[i])
        self._used.add(id(param))
        if self._syncing:
            self.pipeline.mark(param)

    def deferred_all_reduce(self, index: int):
        """Bucket ``index`` is complete: its all-reduce, to run on the communication thread."""
        bucket, tag = self.buckets[index], self.tag(f"bucket {index}")
        return lambda: self.comm.all_reduce(bucket.buffer, ReduceOp.AVG, tag=tag, wire=self.wire, key=index,
                                            layout=self.layout(bucket.params))

    def post_backward(self) -> None:
        """Backward has finished: launch the buckets that never completed, wait for every bucket."""
        with self.pipeline.round():
            try:
                missing = self.pipeline.missing()  # no gradient in this backward; maybe an earlier micro-batch's
                never = [self.buckets[b].names[i] for b, i in missing
                         if id(self.buckets[b].params[i]) not in self._used]
                if never and not self.find_unused_parameters:
                    raise unused_error(self.rank, never, "their bucket can never be reduced")
                cleared = [self.buckets[b].params[i] for b, i in missing if self.buckets[b].params[i].grad is None]
                for b, i in missing:  # reattach slots a user's optimizer.zero_grad(set_to_none=True) detached
                    keep_grad_in(self.buckets[b].params[i], self.buckets[b].views[i])
                self.pipeline.launch_rest()  # unused slots hold zeros (or earlier micro-batches' sums): correct
                used = self.used_anywhere([p for b in self.buckets for p in b.params])
                self.pipeline.wait_all()
                for p in cleared:  # cleared by the user and used nowhere since: no gradient, as on one device
                    if id(p) not in used:
                        p.grad = None
            finally:
                self._used.clear()

    # ------------------------------------------------------------- optimizer
    def step(self) -> None:
        with self.stepping():
            self._drop_unused_grads()
            self.optimizer_step()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self._drop_unused_grads()  # before mixed precision's unscale: the masters get exactly the step's gradients
        return super().clip_grad_norm_(max_norm, norm_type)

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        self._drop_unused_grads()  # an unused parameter's slot in its bucket holds zeros, not a gradient
        return super().full_gradients()

    def _drop_unused_grads(self) -> None:
        """As on a single device: a parameter with no gradient -- unused everywhere, or no backward since
        zero_grad() -- is not stepped (no weight decay, no momentum).  Its .grad comes back at zero_grad()."""
        for b in self.buckets:
            for p in b.params:
                if id(p) not in self._has_grad:
                    p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``.grad`` stays a view into its bucket: the buckets are zeroed and the views put back."""
        self.forget_gradients(set_to_none)
        if self.optimizer is None:
            nn.Module.zero_grad(self.module, set_to_none=set_to_none)  # the model's own (its zero_grad is ours)
        self._point_grads_into_buckets()

    def _point_grads_into_buckets(self) -> None:
        """Zero the buckets and point every ``.grad`` back into them."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            for p, view in zip(bucket.params, bucket.views, strict=True):
                p.grad = view

    # ------------------------------------------------------------------ facts
    @classmethod
    def after_backward_elements(cls, psi, world_size, **options) -> float:
        """Every bucket is all-reduced in place during backward: no flat copy after it (DDP's)."""
        return 0.0

    @classmethod
    def schedule(cls, s, bucket_mb: float = 25.0, **options) -> None:
        """Each bucket's all-reduce leaves as its last gradient is ready; backward goes on meanwhile."""
        s.forward()
        s.backward_in_buckets("all_reduce", bucket_mb)
        s.optimizer_step()

    @classmethod
    def reduction(cls, model, optimizer, world_size, bucket_mb: float = 25.0, **options) -> Reduction:
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return Reduction([b.names for b in assign_buckets(trainable, bucket_mb)])

"""The synchronisation every communicating stage shares: after backward, once.

Every stage but the reference derives from :class:`Synchronised`: it hooks the
output's gradient to queue one synchronisation after the whole backward pass,
honours ``no_sync()``, tags each collective with where in training it is, and
keeps torch's optimizer semantics (a parameter is stepped only if it has a
gradient somewhere).  What each stage does in ``sync_gradients`` and ``_step``
is its own file.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm, ReduceOp, Tag
from ..precision import Precision
from .base import Stage
from .wrap import check_wrappable, claim


class Synchronised(Stage):
    """A stage that reduces gradients once backward has finished (all but the reference).

    The output's gradient is the first thing backward computes; from its hook
    we queue a callback that autograd runs after the *whole* pass, when every
    ``.grad`` holds its final (accumulated) value -- how torch's DDP reducer
    finalises, too.  Inside ``no_sync()`` nothing is queued: gradients
    accumulate locally and the first backward after it reduces the sums.

    Every collective a stage issues carries a :class:`~minizero.comm.Tag`: what
    it is for, and where in training -- optimizer steps taken, backward passes
    since, synchronising or not.  With fingerprint checking on, ranks that
    disagree (``no_sync()`` on some ranks only) are stopped before they pair
    the wrong tensors.

    Optimizer semantics are torch's: a parameter is stepped only if it has a
    gradient (``_has_grad``).  Every rank must give every parameter a gradient,
    or, with ``find_unused_parameters``, the ranks agree on a bitmap of which
    got one anywhere (:meth:`_agree_on_use`).  The user's optimizer's ``step``
    and ``zero_grad`` are routed to the stage's, so whichever the user calls,
    the stage's runs.
    """

    _syncing = False  # does the backward of the latest forward synchronise?
    _sync_queued = False

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, comm: Comm,
                 find_unused_parameters: bool = False, precision: str | Precision = "fp32"):
        if comm is None:
            raise ValueError(f"stage {self.name!r} communicates: pass a Comm (minizero.comm.make_comm)")
        super().__init__(module, optimizer, comm, precision)
        claim(module, self)
        check_wrappable(module, self.rank)
        self.find_unused_parameters = find_unused_parameters
        self.steps_taken = 0  # optimizer steps so far
        self.backwards = 0  # backward passes through the stage's output since the last step
        self._local_grads = False  # a backward ran inside no_sync(), and no synchronising one since
        self._forwarding = False  # inside the stage's own forward
        self._used: set[int] = set()  # parameters that got a gradient here since the last synchronisation
        self._has_grad: set[int] = set()  # parameters with a gradient anywhere since zero_grad(): stepped
        self.pipeline = None  # the BucketPipeline of a stage that overlaps its collectives with backward
        module.register_forward_pre_hook(self._refuse_direct_call)
        if optimizer is not None:
            self._route(optimizer)

    def tag(self, what: str) -> Tag:
        return Tag(what, self.steps_taken, self.backwards, int(self._syncing))

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():  # a no_grad forward (a quick eval) has no backward to plan for
            self._syncing = self.require_backward_grad_sync  # decided at forward, as torch does
            if self._sync_queued:  # a backward that raised never ran its queued synchronisation
                self._sync_queued = False
                self._abandon_backward()
        output = self.call_module(*args, **kwargs)
        if torch.is_grad_enabled():
            self._hook_backward(output, self._syncing)
        return output

    def call_module(self, *args, **kwargs):
        """The wrapped model's forward, as the stage's own (see :meth:`_refuse_direct_call`)."""
        self._forwarding = True
        try:
            return self._cast_call(*args, **kwargs)
        finally:
            self._forwarding = False

    def _refuse_direct_call(self, module, args) -> None:
        """``model(x)`` instead of ``stage(x)`` would compute gradients no one synchronises: the
        replicas would drift apart silently.  (Under ``torch.no_grad()`` -- evaluation -- it is fine.)"""
        if torch.is_grad_enabled() and not self._forwarding:
            raise RuntimeError(
                f"rank {self.rank}: the wrapped model was called directly with autograd on. Call the stage -- "
                f"stage(x), not model(x) -- so that its backward synchronises gradients; for evaluation, "
                f"wrap the call in torch.no_grad().")

    def _hook_backward(self, output, syncing: bool) -> None:
        def on_backward(grad):
            self.backwards += 1
            if not syncing:
                self._local_grads = True
            elif not self._sync_queued:  # two forwards, one backward: synchronise once
                self._sync_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._run_sync)

        tensors = output if isinstance(output, (tuple, list)) else [output]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(on_backward)
                return

    def _run_sync(self) -> None:
        self._sync_queued = False
        self.sync_gradients()
        self._local_grads = False

    def sync_gradients(self) -> None:
        raise NotImplementedError

    def _abandon_backward(self) -> None:
        """A backward raised part-way (its synchronisation never ran): let go of what it started."""
        self._used.clear()
        if self.pipeline is not None:
            self.pipeline.abandon()

    def _agree_on_use(self, params: list[nn.Parameter]) -> set[int]:
        """Which of ``params`` now have a gradient anywhere -- called after every collective of this
        backward was issued, so the bitmap queues behind them in the same place on every rank."""
        used = [id(p) in self._used for p in params]
        self._used.clear()
        if self.find_unused_parameters:
            used = agree_on_use(self.comm, used, self.tag("used-parameter bitmap"))
        anywhere = {id(p) for p, u in zip(params, used) if u}
        self._has_grad.update(anywhere)
        return anywhere

    def step(self) -> None:
        """Refuse to step on gradients that never left this rank; then the stage's update."""
        if self._local_grads:  # stays set: a second step() is refused too, until zero_grad() or a sync
            raise RuntimeError(
                f"rank {self.rank}: step() after backward passes inside no_sync() only: those gradients were "
                f"never averaged across ranks, so the replicas would drift apart silently. Run the last "
                f"micro-batch of each step outside no_sync() (train_step does), or call zero_grad() first.")
        self._require_optimizer("step")
        self._step()
        self.steps_taken += 1
        self.backwards = 0

    def _step(self) -> None:
        self._update()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._local_grads = False
        if set_to_none:  # as in torch: None is not stepped; set_to_none=False zeroes what exists (still stepped)
            self._has_grad.clear()
        if self.master is not None:
            self.master.reset()
        self._zero_grad(set_to_none)

    def _zero_grad(self, set_to_none: bool) -> None:
        if self.optimizer is None:
            self.module.zero_grad(set_to_none=set_to_none)
        else:
            self._optimizer_zero_grad(set_to_none=set_to_none)


def agree_on_use(comm: Comm, used: list[bool], tag: Tag) -> list[bool]:
    """Which parameters got a gradient on *any* rank: a bitmap all-reduced (MAX), as torch DDP does with
    ``find_unused_parameters``.  A parameter used on some ranks only is averaged with zeros from the
    others -- the gradient single-device training computes; one used nowhere is not stepped."""
    bitmap = torch.tensor([1.0 if u else 0.0 for u in used])
    comm.all_reduce(bitmap, ReduceOp.MAX, tag=tag)
    return [bool(u) for u in bitmap.tolist()]  # on the host by nature: which parameters to step is a host decision


def unused_error(rank: int, names: list[str], why: str) -> RuntimeError:
    return RuntimeError(
        f"rank {rank}: parameter(s) {names} got no gradient in this backward; {why}. If parameters may go unused "
        f"(on some ranks or in some steps), wrap with find_unused_parameters=True: ranks then agree every step on "
        f"which parameters got a gradient anywhere. If they are never trained, freeze them with requires_grad_(False).")

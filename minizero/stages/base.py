"""What every stage shares: the wrapper interface and the wrap-time checks.

A stage wraps a model and its optimizer and is then driven exactly like the
plain pair -- ``stage(x)``, ``loss.backward()``, ``stage.step()``,
``stage.zero_grad()`` -- by the one training loop in :mod:`minizero.train`.
The single-device reference is a stage too, so a learner can diff any two.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..comm import Comm, ReduceOp, Tag
from ..comm.fingerprint import digest


class Stage:
    """The plain model and optimizer, with no communication: the reference's behaviour."""

    name = "reference"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm | None = None):
        self.module = module
        self.optimizer = optimizer
        self.comm = comm
        self.rank = comm.rank if comm else 0
        self.world_size = comm.world_size if comm else 1
        self.require_backward_grad_sync = True  # torch DDP's name for "not inside no_sync()"

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; synchronise on the first backward after the block."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """Named trainable parameters, tied ones once, in registration order."""
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the gradients this rank holds -- all of them,
        already averaged, for the reference and DDP.  Sharded stages override it."""
        # Zero-size gradients add nothing to any norm, and torch refuses their inf-norm.
        params = [p for _, p in self.trainable() if p.grad is not None and p.grad.numel() > 0]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The model state this rank keeps between steps, by kind -- what memory accounting walks."""
        params = [p for _, p in self.trainable()]
        return {"params": params,
                "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": [t for state in self.optimizer.state.values() for t in state.values()
                              if torch.is_tensor(t)],
                # compression's error feedback: one full-size residual per buffer, on top of the formula
                "error_feedback": list(getattr(getattr(self, "averager", None), "residuals", {}).values())}


class Synchronised(Stage):
    """A stage that reduces gradients once backward has finished (all but the reference).

    The output's gradient is the first thing backward computes; from its hook
    we queue a callback that autograd runs after the *whole* pass, when every
    ``.grad`` holds its final (accumulated) value -- how torch's DDP reducer
    finalises, too.  Inside ``no_sync()`` nothing is queued: gradients
    accumulate locally and the first backward after it reduces the sums.

    Every collective a stage issues carries a :class:`~minizero.comm.Tag`: what
    it is for, and where in training -- optimizer steps taken, forward passes
    since, synchronising or not.  With fingerprint checking on, ranks that
    disagree (``no_sync()`` on some ranks only) are stopped before they pair
    the wrong tensors.
    """

    _syncing = False  # does the backward of the latest forward synchronise?
    _sync_queued = False

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm):
        super().__init__(module, optimizer, comm)
        check_wrappable(module, self.rank)
        self.steps_taken = 0  # optimizer steps so far
        self.forwards = 0  # forward passes (with autograd) since the last step
        self._local_grads = False  # a backward ran inside no_sync(), and no synchronising one since
        self._forwarding = False  # inside the stage's own forward
        module.register_forward_pre_hook(self._refuse_direct_call)

    def tag(self, what: str) -> Tag:
        return Tag(what, self.steps_taken, self.forwards, int(self._syncing))

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():  # a no_grad forward (a quick eval) has no backward to plan for
            self.forwards += 1
            self._syncing = self.require_backward_grad_sync  # decided at forward, as torch does
        output = self.call_module(*args, **kwargs)
        if torch.is_grad_enabled():
            self._hook_backward(output, self._syncing)
        return output

    def call_module(self, *args, **kwargs):
        """The wrapped model's forward, as the stage's own (see :meth:`_refuse_direct_call`)."""
        self._forwarding = True
        try:
            return self.module(*args, **kwargs)
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

    def step(self) -> None:
        """Refuse to step on gradients that never left this rank; then the stage's update."""
        if self._local_grads:
            self._local_grads = False
            raise RuntimeError(
                f"rank {self.rank}: step() after backward passes inside no_sync() only: those gradients were "
                f"never averaged across ranks, so the replicas would drift apart silently. Run the last "
                f"micro-batch of each step outside no_sync() (train_step does), or call zero_grad() first.")
        self._step()
        self.steps_taken += 1
        self.forwards = 0

    def _step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._local_grads = False
        self._zero_grad(set_to_none)

    def _zero_grad(self, set_to_none: bool) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def agree_on_use(comm: Comm, used: list[bool], tag: Tag) -> list[bool]:
    """Which parameters got a gradient on *any* rank: a bitmap all-reduced (MAX), as torch DDP does with
    ``find_unused_parameters``.  A parameter used on some ranks only is averaged with zeros from the
    others -- the gradient single-device training computes; one used nowhere keeps ``.grad = None``."""
    bitmap = torch.tensor([1.0 if u else 0.0 for u in used])
    comm.all_reduce(bitmap, ReduceOp.MAX, tag=tag)
    return [bool(u) for u in bitmap.tolist()]


def unused_error(rank: int, names: list[str], why: str) -> RuntimeError:
    return RuntimeError(
        f"rank {rank}: parameter(s) {names} got no gradient in this backward; {why}. If parameters may go unused "
        f"(on some ranks or in some steps), wrap with find_unused_parameters=True: ranks then agree every step on "
        f"which parameters got a gradient anywhere. If they are never trained, freeze them with requires_grad_(False).")


def check_wrappable(module: nn.Module, rank: int) -> None:
    """What no stage can work with, refused at wrap time naming the tensor and the fix."""
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.is_meta:
            raise ValueError(
                f"rank {rank}: {name!r} is on the meta device (a shape without storage), so there is nothing to "
                f"broadcast or shard. Materialise the model first (model.to_empty(device=...) and initialise it).")
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            raise ValueError(
                f"rank {rank}: module {name!r} produces sparse gradients (sparse=True); minizero's buffers hold "
                f"dense gradients. Construct it with sparse=False.")


def check_same_model(module: nn.Module, comm: Comm) -> None:
    """Refuse to wrap models whose structure differs across ranks.

    Names, shapes, dtypes and ``requires_grad`` of parameters and buffers must
    agree -- values may differ, rank 0's are broadcast.  This runs before any
    other collective, because a mismatch would otherwise show up later as a
    hang or as silently misaligned flat buffers.  Two cheap rounds: a
    fingerprint of the whole model, and only on mismatch one per tensor, so
    every rank can name the first tensor that differs.
    """
    signature = [f"param {n} {tuple(p.shape)} {p.dtype} grad={p.requires_grad}" for n, p in module.named_parameters()]
    signature += [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
    n = comm.world_size
    mine = torch.tensor([len(signature), digest("\n".join(signature))], dtype=torch.float64)
    everyone = torch.empty(2 * n, dtype=torch.float64)
    comm.all_gather(everyone, mine, tag=Tag("model signature"))
    everyone = everyone.view(n, 2)
    if bool((everyone == everyone[0]).all()):
        return
    longest = int(everyone[:, 0].max())
    per_tensor = torch.full((longest,), -1.0, dtype=torch.float64)
    per_tensor[: len(signature)] = torch.tensor([digest(s) for s in signature], dtype=torch.float64)
    table = torch.empty(n * longest, dtype=torch.float64)
    comm.all_gather(table, per_tensor, tag=Tag("model signature, tensor by tensor"))
    table = table.view(n, longest)
    first = int((table != table[0]).any(dim=0).nonzero()[0])
    differing = [r for r in range(n) if table[r, first] != table[comm.rank, first]]
    here = signature[first] if first < len(signature) else "(no such tensor here)"
    raise ValueError(
        f"rank {comm.rank}: the model differs across ranks at wrap time; first difference at tensor "
        f"#{first}: here {here}, but ranks {differing} have something else. Build the same model on "
        f"every rank (names, shapes, dtypes, requires_grad); only values may differ, rank 0's are broadcast."
    )


def broadcast_module(module: nn.Module, comm: Comm, src: int = 0) -> None:
    """Make every replica start from rank ``src``'s parameters and buffers (as torch DDP does) --
    integer buffers (BatchNorm's counter) and non-contiguous tensors included."""
    with torch.no_grad():
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            flat = tensor.data if tensor.is_contiguous() else tensor.data.contiguous()
            comm.broadcast(flat, src, tag=Tag(f"broadcast {name}"))
            if flat is not tensor.data:
                tensor.data.copy_(flat)

"""What every stage shares: the wrapper interface, the facts each stage states, and the
synchronisation after backward.

A stage is an ``nn.Module`` that wraps a model -- and, if given one, its
optimizer -- and is then driven exactly like the plain pair: ``stage(x)``,
``loss.backward()``, ``stage.step()``, ``stage.zero_grad()``, by the one
training loop in :mod:`minizero.train`, or by a loop written for torch's DDP
with the optimizer built afterwards over ``stage.parameters()``.  The
single-device reference is a stage too, so a learner can diff any two.

Each stage also *states its facts* as class attributes and class methods: what
it shards, the bytes it sends per step, the model-state bytes it keeps, and how
it lays gradients out for reduction.  The measuring harness (:mod:`minizero.lab`)
reads them from the class and never switches on a stage's name, so a new stage
is one file and one registry line.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..comm import Comm
from ..kept_state import check_keepable, keep_state
from ..precision import MasterWeights, Precision, cast_parameters, check_half_model, check_supported
from ..rebuilt import follow, rebuild
from .facts import Reduction, Shards
from .options import PRECISION
from .state import StateDicts


class Stage(StateDicts, nn.Module):
    """The plain model and optimizer, with no communication: the reference's behaviour.

    ``precision`` (``"fp32"``, ``"bf16"``, ``"fp16"`` or a :class:`~minizero.precision.Precision`) is an
    option of every stage, the reference included: with 16 bits the model computes with a 16-bit working
    copy, the optimizer steps fp32 masters (:mod:`minizero.precision`), and fp16 scales the loss."""

    name = "reference"
    shards = Shards()  # nothing divided: every rank (here, the only one) holds everything
    #: Takes the same step as single-device training.  False for the designs the lessons set beside DDP
    #: and ZeRO to show what breaks it (stale gradients, local steps): compare measures how far they go.
    equivalent = True
    #: A design set beside DDP and ZeRO to contrast with them (lesson 11: parameter server, async, local SGD),
    #: not one of the stages the summary weighs against each other.
    contrast = False
    options = (PRECISION,)

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, comm: Comm | None = None,
                 precision: str | Precision = "fp32"):
        check_keepable(optimizer, module, comm.rank if comm else 0)  # before anything changes: a refusal leaves all
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.comm = comm
        self.rank = comm.rank if comm else 0
        self.world_size = comm.world_size if comm else 1
        self.require_backward_grad_sync = True  # torch DDP's name for "not inside no_sync()"
        self.precision = Precision.of(precision)
        self.master: MasterWeights | None = None  # mixed precision: the fp32 masters and the loss scaler
        self._frozen: dict[int, torch.Tensor] = {}  # mixed precision: frozen parameters' values before the cast
        self._optimizer_step = optimizer.step if optimizer is not None else None
        self._optimizer_zero_grad = optimizer.zero_grad if optimizer is not None else None
        if self.precision.mixed:
            self._check_mixed_precision()
            if comm is None:  # the reference; a stage that communicates keeps masters after its broadcast
                self.keep_masters()

    # ------------------------------------------------------------------ mixed precision
    def _check_mixed_precision(self) -> None:
        if self.optimizer is None:
            raise ValueError(
                f"rank {self.rank}: precision={self.precision.name!r} keeps fp32 master weights, which only the "
                f"optimizer steps -- so the stage must own it: pass your optimizer to make_stage(name, model, "
                f"optimizer, comm, precision=...) (as deepspeed.initialize takes it), instead of building one over "
                f"stage.parameters() afterwards.")
        if type(self.optimizer) is torch.optim.LBFGS:
            raise TypeError(
                f"rank {self.rank}: LBFGS cannot step fp32 master weights: it re-evaluates the loss through a "
                f"closure on the parameters it holds, which under precision={self.precision.name!r} are not the "
                f"model's. Use an element-wise optimizer (SGD, Adam, AdamW, ...) or precision='fp32'.")
        check_half_model(self.module, self.precision, self.rank)
        device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        check_supported(self.precision.working_dtype, device, self.rank)

    def keep_masters(self) -> None:
        """Mixed precision where every rank keeps every parameter (the reference, ddp): fp32 masters of
        all trainable parameters, a 16-bit working copy in the model, and the user's optimizer rebuilt over
        the masters (its ``step`` routed to the stage's, which goes through them)."""
        if not self.precision.mixed:
            return
        optimizer, trainable = self.optimizer, [p for _, p in self.trainable()]
        masters = [nn.Parameter(p.detach().clone()) for p in trainable]
        originals = cast_parameters(self.module, self.precision.working_dtype)
        self._frozen = {k: v for k, v in originals.items() if k not in {id(p) for p in trainable}}
        self.master = MasterWeights(trainable, masters, self.precision, self.comm,
                                    self.tag if self.comm else None)
        self._settle_wire()
        self.master_optimizer = rebuild(type(optimizer), optimizer.defaults, optimizer.param_groups,
                                        [[self.master.master_of(p) for p in group["params"] if p.requires_grad]
                                         for group in optimizer.param_groups])
        # State the optimizer already holds moves to the masters' optimizer, whole (minizero.kept_state).
        keep_state(optimizer, self.master_optimizer,
                   lambda p: [(0, p.numel(), self.master.master_of(p))] if p.requires_grad else [])
        self._route(optimizer)

    def _settle_wire(self) -> None:
        """Compression's error feedback keeps a step's residuals only if every rank took the step (the MAX
        verdict, not this rank's shard: a skipped step's may hold inf - inf), rescaled as the loss scale moves."""
        wire = getattr(self, "wire", None)
        if wire is not None:
            self.master.settled.append(wire.settle)

    def _route(self, optimizer: torch.optim.Optimizer) -> None:
        """Whichever the user calls -- the stage's step()/zero_grad() or their optimizer's -- the stage's runs:
        the optimizer's own would step on unsynchronised (under ZeRO, unsharded; under mixed precision,
        16-bit) gradients."""
        optimizer.step, optimizer.zero_grad = self.step, self.zero_grad

    @property
    def loss_scale(self) -> float:
        """The loss scale of the next backward (1 without dynamic loss scaling)."""
        return self.master.loss_scale if self.master else 1.0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because some rank's gradients overflowed (fp16)."""
        return self.master.skipped_steps if self.master else 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale: what to call ``backward()`` on (DeepSpeed's ``engine.backward``
        does this inside; torch's ``GradScaler.scale`` is the same call)."""
        return self.master.scale_loss(loss) if self.master else loss

    def _cast_call(self, *args, **kwargs):
        """The model's forward in its working precision: floating inputs cast to 16 bits (FSDP2's
        ``cast_forward_inputs``), floating outputs back to the masters' dtype, so the loss is computed in fp32."""
        if self.master is None:
            return self.module(*args, **kwargs)
        working, full = self.precision.working_dtype, self.master.masters_dtype
        args, kwargs = _cast_floating((args, kwargs), working)
        return _cast_floating(self.module(*args, **kwargs), full)

    # ------------------------------------------------------------------ facts
    @classmethod
    def option_names(cls) -> list[str]:
        """The keywords of :attr:`options`, the stage's declared options (:mod:`minizero.stages.options`)."""
        return [option.name for option in cls.options]

    @classmethod
    def sent_bytes_per_step(cls, psi: int, world_size: int, grad_bytes: int, param_bytes: int, **options) -> float:
        """Bytes each rank sends per optimizer step (Psi parameters, b bytes per element on the wire)."""
        return 0.0

    @classmethod
    def busiest_sent_bytes_per_step(cls, psi: int, world_size: int, grad_bytes: int, param_bytes: int,
                                    **options) -> float:
        """Bytes the busiest rank sends per step: every rank's share alike, but for a parameter server."""
        return cls.sent_bytes_per_step(psi, world_size, grad_bytes, param_bytes, **options)

    @classmethod
    def state_terms(cls, element_size: int, state_tensors: int, precision=None) -> tuple[int, int]:
        """Model-state bytes per parameter as ``(kept whole on every rank, divided by N)`` -- the ZeRO paper's
        Table 1 from :attr:`shards`.  Parameters and gradients take the working precision's bytes (2 under
        mixed precision); the optimizer's K bytes are its ``state_tensors`` states in ``element_size`` (the
        model's precision), plus, under mixed precision, the fp32 master: Adam's K = 4 + 4 + 4 = 12."""
        precision = Precision.of(precision)
        working = precision.working_bytes(element_size)
        k = (element_size if precision.mixed else 0) + state_tensors * element_size
        kinds = [(working, cls.shards.parameters), (working, cls.shards.gradients), (k, cls.shards.optimizer_states)]
        return (sum(b for b, divided in kinds if not divided), sum(b for b, divided in kinds if divided))

    @classmethod
    def state_bytes(cls, psi: int, world_size: int, element_size: int, state_tensors: int, precision=None,
                    **options) -> float:
        """Model-state bytes per rank (ZeRO paper, Table 1): Psi * (whole + divided / N), see :meth:`state_terms`."""
        whole, divided = cls.state_terms(element_size, state_tensors, precision)
        return psi * (whole + divided / world_size)

    @classmethod
    def state_formula(cls, element_size: int, state_tensors: int, precision=None, **options) -> str:
        """:meth:`state_bytes` in the paper's notation: ``16Ψ``, ``4Ψ + 12Ψ/N``, ``2Ψ + 14Ψ/N``, ``16Ψ/N``."""
        whole, divided = cls.state_terms(element_size, state_tensors, precision)
        return " + ".join([f"{whole}Ψ"] * bool(whole) + [f"{divided}Ψ/N"] * bool(divided)) or "0"

    @classmethod
    def schedule(cls, s, **options) -> None:
        """One step as the scaling model replays it (:class:`minizero.cost_model.Schedule`): what computes,
        what communicates, and what waits for what.  Single-device training only computes."""
        s.forward()
        s.backward()
        s.optimizer_step()

    @classmethod
    def reduction(cls, model: nn.Module, optimizer: torch.optim.Optimizer, world_size: int, **options) -> Reduction:
        """How gradients are laid out for reduction; the reference reduces nothing."""
        return Reduction([])

    # ------------------------------------------------------------------ training
    def forward(self, *args, **kwargs):
        return self._cast_call(*args, **kwargs)

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
        self._require_optimizer("step")
        self._update()

    def _update(self) -> None:
        """The user's optimizer step -- under mixed precision through the masters, skipped on overflow."""
        if self.master is None:
            self._optimizer_step()
        else:
            follow(self.master_optimizer, self.optimizer.param_groups)
            self.master.step(self.master_optimizer.step)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's zero_grad if the stage was given one, else the model's (as on nn.Module)."""
        if self.master is not None:
            self.master.reset()
        if self._optimizer_zero_grad is not None:
            self._optimizer_zero_grad(set_to_none=set_to_none)
        else:
            self.module.zero_grad(set_to_none=set_to_none)

    def _require_optimizer(self, what: str) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError(
                f"rank {self.rank}: stage.{what}() needs the optimizer the stage was wrapped with, and this one was "
                f"wrapped without. Call {what}() on the optimizer you built over stage.parameters(), or pass yours "
                f"to make_stage(name, model, optimizer, comm).")
        return self.optimizer

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """Named trainable parameters, tied ones once, in registration order."""
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the gradients this rank holds -- all of them,
        already averaged, for the reference and DDP.  Sharded stages override it."""
        # Zero-size gradients add nothing to any norm, and torch refuses their inf-norm.  Under mixed
        # precision the clipped gradients are the masters' (unscaled, fp32), as after GradScaler.unscale_.
        params = self.master.unscaled_masters() if self.master else [p for _, p in self.trainable()]
        return torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None and p.grad.numel() > 0],
                                              max_norm, norm_type)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The model state this rank keeps between steps, by kind -- what memory accounting walks."""
        params = [p for _, p in self.trainable()]
        return {"params": params,
                "grads": [p.grad for p in params if p.grad is not None],
                "master": self.master.masters if self.master else [],
                "optimizer": optimizer_tensors(self.master_optimizer if self.master else self.optimizer)}

    def add_observer(self, observer) -> None:
        """Instrumentation outside the algorithm: ``observer(event, nbytes, source)`` hears of memory a stage
        takes and gives back while it computes (ZeRO-3's gathered parameters, by unit).  Most stages have none."""


def _cast_floating(tree, dtype: torch.dtype):
    """Every floating-point tensor in a nest of tuples, lists and dicts, cast to ``dtype``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(_cast_floating(t, dtype) for t in tree)
    if isinstance(tree, dict):
        return {k: _cast_floating(v, dtype) for k, v in tree.items()}
    return tree


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)] if optimizer else []

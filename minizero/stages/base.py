"""What every stage is: the wrapper, its lifecycle, the facts it states.

A stage is an ``nn.Module`` wrapping a model (and, if given one, its optimizer), driven like the plain pair --
``stage(x)``, ``loss.backward()``, ``stage.step()``, ``stage.zero_grad()`` -- by the one training loop
(:mod:`minizero.run.train`) or a loop written for torch's DDP.  The single-device reference is :class:`Stage`
itself, so a learner can diff any two.  The lifecycle, named as FSDP2 names it:

* :meth:`Stage.pre_forward` / :meth:`Stage.pre_backward` -- before the model computes / a backward's gradients (ZeRO-1's window);
* :meth:`Stage.post_accumulate_grad` -- one parameter's ``.grad`` holds its final value for this backward;
* :meth:`Stage.post_backward` -- the whole backward has finished: where a stage averages its gradients.  The
  output's gradient hook queues a callback that autograd runs after the *whole* pass, as torch's DDP reducer
  finalises.  Inside ``no_sync()`` nothing is queued;
* :meth:`Stage.step` and :meth:`Stage.zero_grad` -- the optimizer's.

Each stage writes its own hooks and collectives in its own file; its facts (what it shards, sends, keeps, takes)
are class attributes the course reads.  Every collective carries a :class:`~minizero.comm.Tag`, so with
fingerprint checking on, ranks that disagree stop before they pair tensors.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..comm import Comm, Tag
from ..parts.kept_state import check_keepable
from ..parts.masters import MasterWeights
from ..parts.precision import Precision
from ..parts.rebuilt import follow
from . import accumulation, clip, facts, mixed, state
from . import options as options_module
from .facts import GradientMemory, Shards
from .hooks import refuse_direct_calls
from .options import PRECISION
from .unsynchronised import let_go_of_a_failed_backward, no_optimizer_error, refuse_unsynchronised_step
from .unused import agree_on_use
from .wrap import check_wrappable, claim, route, route_model


class Stage(nn.Module):
    """The plain model and optimizer, with no communication: the reference, and the base of every stage.
    ``precision`` (``"fp32"``, ``"bf16"``, ``"fp16"``, a :class:`~minizero.parts.precision.Precision`) is an option
    of every stage: in 16 bits the model computes with a 16-bit copy and the optimizer steps fp32 masters."""

    name = "reference"
    shards = Shards()  # nothing divided: every rank (here, the only one) holds everything
    gradient_memory = GradientMemory()  # each .grad born in backward, freed by zero_grad()
    #: Takes the same step as single-device training.  False for the designs the lessons set beside DDP
    #: and ZeRO to show what breaks it (stale gradients, local steps): compare measures how far they go.
    equivalent = True
    #: A design set beside DDP and ZeRO to contrast with them (lesson 13: parameter server, async, local SGD),
    #: not one of the stages the summary weighs against each other.
    contrast = False
    options = (PRECISION,)
    averages_with = "all_reduce"  # the collective its gradients are averaged with: the wires it fits
    #: Why this stage's state is not what one device would hold (its ranks hold different models), or None:
    #: every stage that takes single-device training's step can be saved.
    why_not_checkpointable: str | None = None

    _syncing = False  # does the backward now running (else: of the latest forward) synchronise?
    _sync_queued = False
    _failed_backward = False
    _loss_scaled = False

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, comm: Comm | None = None,
                 precision: str | Precision = "fp32"):
        if comm is None and type(self) is not Stage:
            raise ValueError(f"stage {self.name!r} communicates: pass a Comm (minizero.comm.make_comm)")
        check_keepable(optimizer, module, comm.rank if comm else 0)  # before anything changes: a refusal leaves all
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.comm = comm
        self.rank = comm.rank if comm else 0
        self.world_size = comm.world_size if comm else 1
        self.require_backward_grad_sync = True  # torch DDP's name for "not inside no_sync()"
        self.find_unused_parameters = False  # the stages that take the option set it
        self.precision = Precision.of(precision)
        self.master: MasterWeights | None = None  # mixed precision: the fp32 masters and the loss scaler
        self._frozen: dict[int, torch.Tensor] = {}  # mixed precision: frozen parameters' values before the cast
        self._optimizer_step = optimizer.step if optimizer is not None else None
        self._optimizer_zero_grad = optimizer.zero_grad if optimizer is not None else None
        self.steps_taken = 0  # optimizer steps so far
        self.backwards = 0  # backward passes through the stage's output since the last step
        self.synchronised = 0  # synchronising backward passes so far
        self._local_grads = False  # a backward ran inside no_sync(), and no synchronising one since
        self._forwarding = False  # inside the stage's own forward
        self._used: set[int] = set()  # parameters that got a gradient here since the last synchronisation
        self._has_grad: set[int] = set()  # parameters with a gradient anywhere since zero_grad(): stepped
        self.pipeline = None  # the BucketPipeline of a stage that overlaps its collectives with backward
        if self.precision.mixed:
            self._check_mixed_precision()
        if comm is None:  # the reference; a stage that communicates keeps masters after its broadcast
            self.keep_masters()
            return
        claim(module, self)
        check_wrappable(module, self.rank)
        refuse_direct_calls(module, self)
        route_model(module, self)
        if optimizer is not None:
            route(optimizer, self)

    # ------------------------------------------------------------------ mixed precision (minizero.stages.mixed)
    _check_mixed_precision = mixed.check_mixed_precision
    keep_masters = mixed.keep_masters
    master_class = MasterWeights  # what keeps the fp32 masters: the package's, or a lab's own (as ZeRO-3's unit_class)
    _settle_wire = mixed.settle_wire
    _cast_call = mixed.cast_call  # the forward in 16 bits

    @property
    def masters_outside(self) -> bool:
        """Mixed precision with the optimizer built after wrapping: it steps the fp32 masters itself."""
        return self.master is not None and self.master.optimizer_outside

    loss_scale = property(mixed.loss_scale)
    skipped_steps = property(mixed.skipped_steps)
    named_parameters = mixed.named_parameters

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale: what to call ``backward()`` on (torch's ``GradScaler.scale``)."""
        return mixed.scale_loss(self, loss) if self.precision.scaled else loss

    # ------------------------------------------------------------------ facts (minizero.stages.facts)
    option_names = classmethod(options_module.option_names)  # the keywords of the declared options
    sent_bytes_per_step = classmethod(facts.sent_bytes_per_step)
    after_backward_elements = classmethod(facts.after_backward_elements)
    busiest_sent_bytes_per_step = classmethod(facts.busiest_sent_bytes_per_step)
    sent_bytes_by_link = classmethod(facts.sent_bytes_by_link)
    state_terms = classmethod(facts.state_terms)
    state_bytes = classmethod(facts.state_bytes)
    host_state_bytes = classmethod(facts.host_state_bytes)
    shard_count = classmethod(facts.shard_count)
    shard_symbol = "N"  # what divides the sharded state in the formula's notation (HSDP: G)
    state_formula = classmethod(facts.state_formula)
    schedule = classmethod(facts.schedule)
    reduction = classmethod(facts.reduction)
    check_command_line = classmethod(facts.check_command_line)
    check_combination = classmethod(facts.check_combination)

    # ------------------------------------------------------------------ the lifecycle
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():  # a no_grad forward (a quick eval) has no backward to plan for
            self._syncing = self.require_backward_grad_sync  # decided at forward, as torch does
            if self._sync_queued:  # a backward that raised never ran its queued synchronisation
                let_go_of_a_failed_backward(self)
            self._loss_scaled = False  # until the loss of this forward's backward is scaled (fp16: scale_loss)
        if self.masters_outside:
            self.master.refresh()  # the user's optimizer stepped the fp32 masters: round them into the model
        self.pre_forward()
        output = self.call_module(*args, **kwargs)
        if torch.is_grad_enabled():
            if self.precision.scaled:  # fp16: a backward of a loss never scaled is refused
                mixed.watch_loss_scaling(self, output)
            self._hook_backward(output, self._syncing)
        return output

    def pre_forward(self) -> None:
        """Before the wrapped model computes, with or without autograd.  Nothing, for most stages."""

    def pre_backward(self) -> None:
        """A backward reached the output, before its gradients (one run again without a forward too).  Nothing, mostly."""

    def post_accumulate_grad(self, param: nn.Parameter) -> None:
        """``param.grad`` holds this backward's final value (registered by the stages that act on it)."""

    def post_backward(self) -> None:
        """The whole backward has finished, and it synchronises: nothing to average on one device."""

    def agree_on_overflow(self) -> None:
        """Where ranks decode different pieces of one sum, all raise or none (:mod:`minizero.compress.overflow`)."""

    def call_module(self, *args, **kwargs):
        """The wrapped model's forward, as the stage's own (:func:`~minizero.stages.hooks.refuse_direct_calls`)."""
        self._forwarding = True
        try:
            return self._cast_call(*args, **kwargs) if self.precision.mixed else self.module(*args, **kwargs)
        finally:
            self._forwarding = False

    def _hook_backward(self, output, syncing: bool) -> None:
        def on_backward(grad):
            self.backwards += 1
            self._syncing = syncing or self._sync_queued  # this backward's forward decided, not the latest forward
            self.pre_backward()
            if not syncing:
                self._local_grads = True
            elif not self._sync_queued:  # two forwards, one backward: synchronise once
                self._sync_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._run_post_backward)

        for tensor in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(on_backward)
                return

    def _run_post_backward(self) -> None:
        self._sync_queued = False
        try:
            self.post_backward()
            self.agree_on_overflow()
        except BaseException:
            self._failed_backward = True  # its gradients are partly averaged, or not finite: no step until zero_grad()
            raise
        self.synchronised += 1
        if self.masters_outside:
            self.master.hand_over()  # the averaged gradients, in fp32, on the masters the user's optimizer steps
        self._local_grads = False

    def tag(self, what: str) -> Tag:  # what a collective is for, and where in training: fingerprinted
        return Tag(what, self.steps_taken, self.backwards, int(self._syncing))

    def used_anywhere(self, params: list[nn.Parameter]) -> set[int]:
        """Which of ``params`` now have a gradient anywhere -- called after every collective of this
        backward was issued, so the bitmap queues behind them in the same place on every rank."""
        used = [id(p) in self._used for p in params]
        self._used.clear()
        if self.find_unused_parameters:
            used = agree_on_use(self.comm, used, self.tag("used-parameter bitmap"))
        anywhere = {id(p) for p, u in zip(params, used, strict=True) if u}
        self._has_grad.update(anywhere)
        return anywhere

    no_sync = accumulation.no_sync  # (in a file of its own: lesson 6's lab answer, which base's helpers must not show)

    # ------------------------------------------------------------------ the optimizer
    def step(self) -> None:
        with self.stepping():
            self.optimizer_step()

    @contextmanager
    def stepping(self):
        """Around every stage's step: refuse to step on gradients never (or partly) averaged; then count the step."""
        if self._sync_queued or self._failed_backward or self._local_grads:
            if let_go_of_a_failed_backward(self):
                self._failed_backward = True  # stays set until zero_grad(), whatever backward runs meanwhile
            refuse_unsynchronised_step(self)
        self._require_optimizer("step")
        yield
        self.steps_taken += 1
        self.backwards = 0

    def optimizer_step(self) -> None:
        """The user's optimizer step -- under mixed precision through the masters, skipped on overflow."""
        if self.master is None:
            self._optimizer_step()
        else:
            follow(self.master_optimizer, self.optimizer.param_groups)
            self.master.step(self.master_optimizer.step)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's zero_grad if the stage was given one, else the model's (as on nn.Module)."""
        self.forget_gradients(set_to_none)
        if self._optimizer_zero_grad is not None:
            self._optimizer_zero_grad(set_to_none=set_to_none)
        else:
            nn.Module.zero_grad(self.module, set_to_none=set_to_none)  # the model's own (its zero_grad is ours)

    def forget_gradients(self, set_to_none: bool) -> None:
        """What every zero_grad() does first: no local-only gradients; as in torch, a gradient set to None is not
        stepped (``set_to_none=False`` zeroes it, still stepped); mixed precision's unscaled gradients go too."""
        if self._sync_queued:  # before the buffers are zeroed: nothing may still write into them
            let_go_of_a_failed_backward(self)
        self._local_grads = self._failed_backward = False
        if set_to_none:
            self._has_grad.clear()
        if self.master is not None:
            self.master.reset()

    def _require_optimizer(self, what: str) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise no_optimizer_error(self.rank, what)
        return self.optimizer

    def trainable(self) -> list[tuple[str, nn.Parameter]]:  # tied ones once, in registration order
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    clip_grad_norm_ = clip.clip_grad_norm_

    def add_observer(self, observer) -> None:
        """``observer(event, nbytes, source)`` hears of memory taken and given back in a step (ZeRO-3's gathers)."""

    # ------------------------------------------------------------------ state dicts (minizero.stages.state)
    check_checkpointable = classmethod(state.check_checkpointable)
    full_state_dict = state.full_state_dict
    full_gradients = state.full_gradients
    held_tensors = state.held_tensors
    full_optimizer_state_dict = state.full_optimizer_state_dict
    sharded_names = state.sharded_names
    full_state_shapes = state.full_state_shapes
    owned_parts = state.owned_parts
    load_full_state_dict = state.load_full_state_dict
    load_full_optimizer_state_dict = state.load_full_optimizer_state_dict
    _master_values = state.master_values
    _with_masters = state.with_masters
    _full_shape = state.full_shape
    _load_module_tensors = state.load_module_tensors

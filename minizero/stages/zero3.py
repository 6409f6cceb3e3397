"""Stage ``zero3``: parameters sharded too (ZeRO paper, section 5.3, P_os+g+p; FSDP).  ZeRO++'s additions to it
(quantized weight gathers, hpZ) are stage ``zeropp`` (:mod:`.zeropp`).

After ZeRO-2 every rank still holds all the parameters.  ZeRO-3 keeps only the owned shard of each and materialises
a **unit**'s full parameters (:class:`~minizero.parts.units.Unit`, FSDP2's param group) only while that unit computes:

1. before a unit's forward: all-gather its parameters; after it: free them (``reshard_after_forward=True``, the
   default) -- in place, the buffer's storage resized to 0, because autograd saved views of it (a linear layer keeps
   ``weight.t()``; :class:`~minizero.parts.unit_groups.ShardedFlatGroup`);
2. before its backward (a hook on the unit's output fires just then): all-gather again into the same storage: the
   parameters and every view autograd saved see the gathered values;
3. when a flat group's gradients are all ready: pack them, free the full gradients and parameters, reduce-scatter
   into the pieces' ``.grad`` -- ZeRO-2's bucket pipeline, one bucket per unit, param group and dtype;
4. the optimizer steps the pieces; nothing is gathered until the next forward.

Bytes per step: all-gather twice + reduce-scatter = 3(N-1)/N * Psi * b, 1.5x DDP -- ZeRO-3 buys memory with
communication; without resharding after forward, 2(N-1)/N again, but the whole model stays gathered from forward to
backward.  Under gradient accumulation the micro-batches inside ``no_sync()`` keep parameters and gradients
unsharded and the last one reduces: still 3Psi per step, for the memory of unsharded state during accumulation --
the trade-off ZeRO-2 makes (FSDP2 exposes the same choice).  Memory: (4 + 4 + 8)Psi/N
for fp32 Adam, (2 + 2 + 12)Psi/N in mixed precision, plus the gathered working set: the root, the unit computing and
``prefetch`` units whose all-gather already runs on the communication thread, overlapping the computation.

Every all-gather is tagged with its unit ("unit 2 (blocks.1) forward all-gather"): with fingerprint checking on,
ranks that disagree -- a module called a different number of times on different ranks -- stop with an error naming
the units, instead of pairing one unit's bytes with another's.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from ..comm import AllOf, Comm, ReduceOp
from ..parts.buckets import MAX_IN_FLIGHT, BucketPipeline
from ..parts.unit_groups import FreedBuffer, ShardedFlatGroup
from ..parts.unit_plan import ReplicatedGroup, plan_units
from ..parts.units import Unit, replayed_by_backward
from . import zero3_facts, zero_state
from .facts import GradientMemory, Shards
from .options import OFFLOAD_OPTIMIZER, PREFETCH, REDUCE_SCATTER_BUFFERS, WIRE_AND_USE, Option, check_reduce_scatter_buffers
from .sharded_gradient import ShardedParameter
from .zero import ZeRO


class ZeRO3(ZeRO):
    name = "zero3"
    shards = Shards(optimizer_states=True, gradients=True, parameters=True)
    gradient_memory = GradientMemory(buckets="unit")
    options = (Option("units", None, "ZeRO-3's units: a list of submodules (default: each element of every "
                         "nn.ModuleList, as FSDP2 wraps each transformer block)", None),
               Option("reshard_after_forward", True, "free a unit's gathered parameters after its forward and "
                      "gather them again for backward (FSDP2's default; off: 2Ψ instead of 3Ψ, more memory)", None,
                      draw=lambda d: (True, False)), PREFETCH,
               Option("replicate", None, "submodules (or their names) kept whole on every rank and all-reduced, not "
                      "sharded, as DDP does (torch's composable replicate)", None, draw=lambda d: d.replicable),
               REDUCE_SCATTER_BUFFERS, *WIRE_AND_USE, OFFLOAD_OPTIMIZER)
    unit_class = Unit  # what gathers and frees a unit's parameters (lesson 9's lab writes its own)

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, comm: Comm | None = None,
                 units=None, reshard_after_forward: bool = True, prefetch: int = 1, replicate=None,
                 reduce_scatter_buffers: int = MAX_IN_FLIGHT, **common):
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a whole number of units >= 0, got {prefetch!r}")
        check_reduce_scatter_buffers(reduce_scatter_buffers)  # (before anything is sharded)
        super().__init__(module, optimizer, comm, **common)  # wire, find_unused_parameters, precision, offload
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self._observers: list = []
        unit_modules, plan, whole = plan_units(module, units, replicate, [g["params"] for g in self.param_groups()],
                                               self.rank)
        named = self.names()
        replicated = [ReplicatedGroup([(named[id(p)], p) for p in params], gi) for gi, params in whole]
        ranks = self.shard_comm
        self.shard([ShardedFlatGroup(named, ranks.rank, ranks.world_size, gi) for _, gi, named in plan] + replicated)
        names = {id(m): n for n, m in module.named_modules()}
        self.units = [self.unit_class(u, names[id(m)] or "root",
                                      [g for g, (owner, _, _) in zip(self.groups[:len(plan)], plan, strict=True) if owner == u],
                                      self.all_gather, self._observe)
                      for u, m in enumerate([module] + unit_modules)]
        self._unit_of = [self.units[owner] for owner, _, _ in plan] + [None] * len(replicated)  # group -> unit
        self.pipeline = BucketPipeline(comm, [[s.param for s in g.segments] for g in self.groups],
                                       self.deferred_reduction, max_in_flight=reduce_scatter_buffers)
        self._order: list[int] = []  # units in the order the last forward called them
        self._recording: list[int] = []
        self._called: set[int] = set()  # units called with autograd on since the last synchronisation
        self._skipped: set[int] = set()  # groups of units not called: not reduced, not stepped
        self.zero_grad()
        for u, unit_module in enumerate([module] + unit_modules):
            unit_module.register_forward_pre_hook(lambda m, args, u=u: self.unit_pre_forward(u))
            unit_module.register_forward_hook(lambda m, args, out, u=u: self.unit_post_forward(u, out))
        self.hook_grouped_parameters()

    def add_observer(self, observer) -> None:
        self._observers.append(observer)

    def _observe(self, event: str, nbytes: int, unit: int) -> None:
        for observer in self._observers:
            observer(event, nbytes, unit)

    # ------------------------------------------------------------ gather and free around a unit
    def all_gather(self, unit: Unit, why: str) -> AllOf:
        """Start ``unit``'s all-gather (now, or as a prefetch), ``async_op``: one full buffer per flat group, from every
        rank's shard -- not yet pointed to; :meth:`Unit.unshard` does that, once it waited for them."""
        fulls, tag = [g.full_buffer() for g in unit.groups], self.tag(f"{unit.label} {why} all-gather")  # on the main thread
        return AllOf([self.shard_comm.all_gather(full, group.shard, async_op=True, tag=tag)
                      for group, full in zip(unit.groups, fulls, strict=True)], fulls)

    # ------------------------------------------------------------ param.grad after backward, as FSDP2's
    def show_gradients(self, shown: bool) -> None:
        """Shown: each parameter with a gradient on some rank reads its ``.grad`` as FSDP2's (:mod:`.sharded_gradient`);
        not (before a forward with autograd on, at ``zero_grad()``): plain, its real ``.grad`` for backward to free."""
        for g, group in enumerate(self.groups):
            for s in group.segments:
                if shown and type(s.param) is nn.Parameter and id(s.param) in self._has_grad:
                    s.param.__class__, s.param.zero3_shown = ShardedParameter, (weakref.ref(self), g, s)
                elif not shown and type(s.param) is ShardedParameter:
                    s.param.__class__ = nn.Parameter

    def pre_forward(self) -> None:
        if torch.is_grad_enabled():
            self.show_gradients(False)

    def forget_gradients(self, set_to_none: bool) -> None:
        self.show_gradients(False)  # first: zero_grad(set_to_none=False) keeps the pieces' zeroed gradients
        super().forget_gradients(set_to_none)

    def unit_pre_forward(self, u: int) -> None:
        if replayed_by_backward():
            # A unit inside a checkpointed block, its forward replayed by backward (minizero.parts.activations): the
            # gather backward needs, once -- its pre-backward hook, later, finds it gathered -- and nothing else:
            # not recorded as a call, no forward prefetch, and (post-forward) no reshard, no new hooks.
            self._unit_moment(u, "backward's replay", self.units[u].pre_backward)
            return
        if u == 0:  # a new forward: this step's bookkeeping starts afresh
            self._recording, self._skipped = [], set()
            for unit in self.units:  # a prefetch from the last backward may predate a step (yours or the stage's)
                unit.drop_prefetch()
        if u not in self._recording:
            self._recording.append(u)
        if torch.is_grad_enabled():
            self._called.add(u)
        self._unit_moment(u, "forward", self.units[u].pre_forward, +1)

    def unit_post_forward(self, u: int, output) -> None:
        if replayed_by_backward():  # (see unit_pre_forward)
            return
        if u == 0:
            self._order = self._recording
        if torch.is_grad_enabled():
            for tensor in output if isinstance(output, (tuple, list)) else [output]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad, u=u: self.unit_pre_backward(u))
        # Inside no_sync() the parameters stay gathered until the synchronising micro-batch: the bytes of
        # one step for any K, the memory of unsharded parameters meanwhile (as ZeRO-2 keeps full gradients).
        self.units[u].post_forward(reshard=(self.reshard_after_forward and self._syncing)
                                    or not torch.is_grad_enabled())

    def unit_pre_backward(self, u: int) -> None:
        self._called.add(u)  # a backward run again without a forward (two forwards, two backwards) reduces it too
        self._unit_moment(u, "backward", self.units[u].pre_backward, -1)

    def _unit_moment(self, u: int, why: str, moment, direction: int = 0) -> None:
        """A unit's pre-forward or pre-backward moment, then a check that it left the unit gathered: its layers are
        about to compute, and what autograd saved of a freed buffer has no storage (the step named: the group can't).
        The next units' prefetch (``direction`` +1 forward, -1 backward) is queued first where this unit's own
        all-gather is on its way -- back to back on the wire while this rank waits (FSDP2's wait is a stream's) -- else after."""
        unit = self.units[u]
        if direction and unit._gathering is not None:  # (the work Unit.start_gather left in flight)
            self._prefetch_after(u, direction)
            direction = 0
        try:
            moment()
        except FreedBuffer as error:
            raise FreedBuffer(f"{error} (step {self.steps_taken}, the {why} of {unit.label})") from None
        for group in unit.groups:
            if not group.gathered:
                raise RuntimeError(f"rank {self.rank}'s {group.segments[0].name}: the {why} of {unit.label} in step "
                                  f"{self.steps_taken} is about to compute, and its flat group {group.group_index} is "
                                  f"not gathered -- its full buffer, freed at reshard, holds no values for the layers "
                                  f"(nor for what autograd saved of it). Gather the unit here (Unit.unshard).")
        if direction:
            self._prefetch_after(u, direction)

    def _prefetch_after(self, u: int, direction: int) -> None:
        """Start gathering the next ``prefetch`` units in (reverse, for backward) call order."""
        order = self._order or list(range(len(self.units)))
        if u in order:
            at = order.index(u)
            for k in range(1, self.prefetch + 1):
                if 0 <= at + direction * k < len(order):
                    self.units[order[at + direction * k]].start_gather("forward" if direction > 0 else "backward")

    # ------------------------------------------------------------ gradients
    def post_accumulate_grad(self, param: nn.Parameter) -> None:
        """With find_unused_parameters, a unit's gradients may be complete on some ranks and not on others;
        launching its reduce-scatter when they are would put it between different backward all-gathers on
        different ranks.  So then every reduce-scatter waits for the end of backward (memory: the units stay
        gathered until then), where they start in order on every rank."""
        self._used.add(id(param))
        if self._syncing and not self.find_unused_parameters:
            self.pipeline.mark(param)

    def deferred_reduction(self, index: int):
        """Group ``index`` is complete: pack and free its gradients and its full parameters; the
        reduce-scatter runs on the communication thread.  A skipped group is only freed."""
        group, unit = self.groups[index], self._unit_of[index]
        if group.replicated:  # whole on every rank: averaged as DDP averages, by an all-reduce
            full, tag = group.take_gradients(), self.tag(f"replicated gradients (group {index})")

            def all_reduce() -> torch.Tensor:
                self.average_whole(full, tag, index)
                return full
            return all_reduce
        if index in self._skipped:
            unit.post_backward(group)
            return lambda: None
        full, tag = group.take_gradients(), self.tag(f"{unit.label} gradients (group {index})")
        unit.post_backward(group)  # the full parameters go too

        def reduce_scatter() -> torch.Tensor:
            averaged = torch.empty_like(group.shard)
            self.average_shard(averaged, full, tag, index)
            return averaged
        return reduce_scatter

    def average_shard(self, averaged: torch.Tensor, full: torch.Tensor, tag, key) -> None:
        """This rank's shard of the mean of every rank's ``full`` gradient buffer: a reduce-scatter."""
        self.comm.reduce_scatter(averaged, full, ReduceOp.AVG, tag=tag, wire=self.wire, key=key)

    def average_whole(self, full: torch.Tensor, tag, key) -> None:
        """A replicated module's buffer, whole on every rank, averaged as DDP does: an all-reduce."""
        self.comm.all_reduce(full, ReduceOp.AVG, tag=tag, wire=self.wire, key=key)

    def post_backward(self) -> None:
        """Backward has finished: the last reduce-scatters launched, each piece given its averaged gradient.
        The groups of a unit neither called nor reached by a backward since the last synchronisation are skipped:
        not reduced, not stepped.  Every rank called the same units (the fingerprint check names a rank that did
        otherwise), so every rank skips the same groups; a unit called but left without a gradient on some rank is
        named (or, with find_unused_parameters, agreed on: then nothing is skipped), never skipped on some only."""
        self._skipped = set() if self.find_unused_parameters else {
            g for g, unit in enumerate(self._unit_of) if unit is not None and unit.index not in self._called}
        self._called = set()
        checked = [group for g, group in enumerate(self.groups) if g not in self._skipped]
        with self.pipeline.round():
            try:
                self.refuse_unused_here(checked)
                self.pipeline.launch_rest()
                used = self.used_anywhere([s.param for group in checked for s in group.segments])
                for index, averaged in self.pipeline.wait_all():
                    if averaged is not None:
                        self.accumulate(self.groups[index], averaged, used)
            finally:
                self._used.clear()
        self.show_gradients(True)

    # ------------------------------------------------------------ optimizer
    def step(self) -> None:
        """Step the pieces; nothing to share: the next forward gathers what it needs."""
        with self.stepping():
            for unit in self.units:
                unit.drop_prefetch()
            self.optimizer.step_owned()

    # ------------------------------------------------------------ accounting and state dicts
    held_tensors = zero_state.held_tensors_gathered  # the shards, and the full buffers of gathered units
    full_state_dict = zero_state.full_state_dict_of_units  # each unit gathered in turn, exactly
    state_dict = zero_state.state_dict_refused  # nn.Module's would hold the placeholders: 0-element tensors

    # ------------------------------------------------------------------ facts (minizero.stages.zero3_facts)
    sent_bytes_per_step = classmethod(zero3_facts.sent_bytes_per_step)
    sent_bytes_by_link = classmethod(zero3_facts.sent_bytes_by_link)
    shard_span = "world"  # the ranks the scaling model gathers and reduce-scatters among (HSDP: a node's)
    gather_span = classmethod(zero3_facts.gather_span)
    schedule_reduction = classmethod(zero3_facts.schedule_reduction)
    schedule = classmethod(zero3_facts.schedule)
    reduction = classmethod(zero3_facts.reduction)

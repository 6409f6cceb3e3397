"""Stage ``zero3``: parameters sharded too (ZeRO paper, section 5.3, P_os+g+p; FSDP).

After ZeRO-2 every rank still holds all the parameters.  ZeRO-3 keeps only
the owned shard of each and materialises a **unit**'s full parameters (see
:mod:`minizero.units`) only while that unit computes:

1. before a unit's forward: all-gather its parameters; after it: free them
   (``reshard_after_forward=True``, the default);
2. before its backward (a hook on the unit's output fires just then):
   all-gather again; autograd saved the *parameters*, which now point at the
   freshly gathered values;
3. when all of the unit's gradients are ready: reduce-scatter them into the
   owned gradient shard, free the full gradients and parameters -- ZeRO-2's
   machinery, one bucket per unit;
4. the optimizer steps the shards; nothing is gathered until the next forward.

Bytes per step: all-gather twice + reduce-scatter = 3(N-1)/N * Psi * b, 1.5x
DDP -- ZeRO-3 buys memory with communication; without resharding after
forward, 2(N-1)/N again, but the whole model stays gathered from forward to
backward.  Under gradient accumulation the micro-batches inside ``no_sync()``
keep parameters and gradients unsharded and the last one reduces: still 3Psi
per step, for the memory of unsharded state during accumulation -- the
trade-off ZeRO-2 makes (FSDP2 exposes the same choice).  Memory: (4 + 4 + 8)Psi/N for fp32 Adam, plus the gathered working
set: the root, the unit computing and ``prefetch`` units whose all-gather
already runs on the communication thread, overlapping the computation.

Every all-gather is tagged with its unit ("unit 2 (blocks.1) forward
all-gather"): with fingerprint checking on, ranks that disagree -- a module
called a different number of times on different ranks -- stop with an error
naming the units, instead of pairing one unit's bytes with another's.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layout import ShardedFlatGroup
from ..units import plan_unit_groups, resolve_units
from .zero2 import ZeRO2


class ZeRO3(ZeRO2):
    name = "zero3"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, comm, units=None,
                 reshard_after_forward: bool = True, prefetch: int = 1, compress: str | None = None,
                 error_feedback: bool = False, find_unused_parameters: bool = False):
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a whole number of units >= 0, got {prefetch!r}")
        self.unit_modules = resolve_units(module, units)
        names = {id(m): n for n, m in module.named_modules()}
        self.unit_names = ["root"] + [names[id(u)] for u in self.unit_modules]
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        super().__init__(module, optimizer, comm, compress=compress, error_feedback=error_feedback,
                         find_unused_parameters=find_unused_parameters)
        self._pending: dict[int, object] = {}  # unit -> running all-gather
        self._order: list[int] = []  # units in the order the last forward called them
        self._skipped: set[int] = set()  # groups with no gradient anywhere this step
        self.gathered_bytes = self.gathered_peak_bytes = 0
        for index, unit in enumerate([module] + self.unit_modules):
            unit.register_forward_pre_hook(lambda m, args, i=index: self._before_forward(i))
            unit.register_forward_hook(lambda m, args, out, i=index: self._after_forward(i, out))

    def _build_groups(self, optimizer):
        """One sharded group per unit, param group and dtype; the last unit first (backward's order)."""
        plan = plan_unit_groups(self.module, self.unit_modules, [g["params"] for g in optimizer.param_groups])
        groups = [ShardedFlatGroup(named, self.rank, self.world_size, gi) for _, gi, named in plan]
        self.unit_groups = [[g for g, (u, _, _) in enumerate(plan) if u == unit]
                            for unit in range(len(self.unit_modules) + 1)]
        return groups

    # ------------------------------------------------------------ gathering
    def _unit_label(self, unit: int) -> str:
        return f"unit {unit} ({self.unit_names[unit]})"

    def _start_gather(self, unit: int, why: str) -> None:
        if unit in self._pending or all(self.groups[g].gathered for g in self.unit_groups[unit]):
            return
        groups = [self.groups[g] for g in self.unit_groups[unit]]
        tag = self.tag(f"{self._unit_label(unit)} {why} all-gather")

        def gather():
            return [g.all_gather_into_new_buffer(self.comm, tag) for g in groups]

        self._pending[unit] = self.comm.submit(gather)
        # Counted from now: a prefetched buffer takes memory while its all-gather is still running.
        self.gathered_bytes += sum(g.full_bytes for g in groups)
        self.gathered_peak_bytes = max(self.gathered_peak_bytes, self.gathered_bytes)

    def _ensure_gathered(self, unit: int, why: str) -> None:
        self._start_gather(unit, why)
        if unit in self._pending:
            for g, full in zip(self.unit_groups[unit], self._pending.pop(unit).result()):
                self.groups[g].use(full)

    def _drop_prefetches(self) -> None:
        """Prefetches nobody used this step (the order came from the last forward): wait, then free them --
        after the optimizer step they would hold stale weights."""
        for unit in list(self._pending):
            self._pending.pop(unit).wait()
            self.gathered_bytes -= sum(self.groups[g].full_bytes for g in self.unit_groups[unit])

    def _reshard_group(self, g: int) -> None:
        group = self.groups[g]
        if group.gathered:
            self.gathered_bytes -= group.full_bytes
            group.reshard()

    def _prefetch_after(self, unit: int, step: int) -> None:
        """Start gathering the next ``prefetch`` units in (reverse, for backward) call order."""
        order = self._order or list(range(len(self.unit_groups)))
        if unit in order:
            at = order.index(unit)
            for k in range(1, self.prefetch + 1):
                if 0 <= at + step * k < len(order):
                    self._start_gather(order[at + step * k], "forward" if step > 0 else "backward")

    # ------------------------------------------------------------ forward and backward hooks
    def _before_forward(self, unit: int) -> None:
        if unit == 0:  # a new forward: this step's bookkeeping starts afresh
            self._recording, self._skipped = [], set()
        if unit not in self._recording:
            self._recording.append(unit)
        self._ensure_gathered(unit, "forward")
        self._prefetch_after(unit, +1)

    def _after_forward(self, unit: int, output) -> None:
        if unit == 0:
            self._order = self._recording
        outputs = output if isinstance(output, (tuple, list)) else [output]
        if torch.is_grad_enabled():
            for tensor in outputs:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad, u=unit: self._before_backward(u))
        # Inside no_sync() the parameters stay gathered until the synchronising micro-batch: the bytes of
        # one step for any K, the memory of unsharded parameters meanwhile (as ZeRO-2 keeps full gradients).
        if (self.reshard_after_forward and self._syncing) or not torch.is_grad_enabled():
            for g in self.unit_groups[unit]:
                self._reshard_group(g)

    def _before_backward(self, unit: int) -> None:
        self._ensure_gathered(unit, "backward")
        self._prefetch_after(unit, -1)

    def _group_label(self, index: int) -> str:
        unit = next(u for u, groups in enumerate(self.unit_groups) if index in groups)
        return f"{self._unit_label(unit)} gradients (group {index})"

    def _on_gradient_ready(self, param) -> None:
        """With find_unused_parameters, a unit's gradients may be complete on some ranks and not on others;
        launching its reduce-scatter when they are would put it between different backward all-gathers on
        different ranks.  So then every reduce-scatter waits for the end of backward (memory: the units stay
        gathered until then), where they start in order on every rank."""
        if self.find_unused_parameters:
            self._used.add(id(param))
        else:
            super()._on_gradient_ready(param)

    def _launch(self, index: int) -> None:
        if index not in self._skipped:
            super()._launch(index)  # pack, free the full gradients, reduce-scatter on the comm thread
        self._reshard_group(index)

    def sync_gradients(self) -> None:
        """A group no parameter of which got a gradient here -- a unit not called this step -- is skipped:
        not reduced, not stepped.  Every rank called the same units (ZeRO-3 gathers each as it is called;
        the fingerprint check names a rank that did otherwise), so every rank skips the same groups.
        With find_unused_parameters nothing is skipped: the bitmap says what has a gradient anywhere."""
        self._skipped = set() if self.find_unused_parameters else {
            g for g, group in enumerate(self.groups) if not any(id(s.param) in self._used for s in group.segments)}
        super().sync_gradients()

    def _checked_groups(self):
        return [group for g, group in enumerate(self.groups) if g not in self._skipped]

    # ------------------------------------------------------------ optimizer
    def _step(self) -> None:
        self._drop_prefetches()
        super()._step()

    def _share_updated_parameters(self) -> None:
        """Nothing to share: each rank keeps its shard, and the next forward gathers what it needs."""

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors()
        held["params"] = [g.shard for g in self.groups] + [g.data for g in self.groups if g.gathered]
        return held

    def full_state_dict(self) -> dict:
        """The unwrapped model's state_dict (every rank gets it; save it on rank 0).
        Loads into the plain model with ``load_state_dict``."""
        peak = self.gathered_peak_bytes  # an inspection, not part of a training step's working set
        for unit in range(len(self.unit_groups)):
            self._ensure_gathered(unit, "state_dict")
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for g in range(len(self.groups)):
            self._reshard_group(g)
        self.gathered_peak_bytes = peak
        return state

    def sharded_state_dict(self) -> dict:
        """This rank's parameter shards, by group: what a sharded checkpoint stores per rank."""
        return {f"group{g}:" + ",".join(s.name for s in group.segments): group.shard.detach().clone()
                for g, group in enumerate(self.groups)}

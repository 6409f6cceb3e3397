"""What ZeRO-3 states about its step for the course to read -- class methods of
:class:`~minizero.stages.zero3.ZeRO3`, written here so that its file reads as its step.

* :func:`schedule`: the step as the scaling model replays it (:mod:`minizero.costs.cost_model`), unit by unit;
* :func:`reduction`: the flat groups its gradients are reduced in, which the same-casts reference mirrors.
"""
from __future__ import annotations

from ..costs.formulas import all_gather_bytes, reduce_scatter_bytes
from ..parts.unit_plan import plan_units
from . import facts
from .facts import Reduction


def sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, nodes=None, **options) -> float:
    return sum(cls.sent_bytes_by_link(psi, world_size, grad_bytes, param_bytes, nodes, **options).values())


def sent_bytes_by_link(cls, psi, world_size, grad_bytes, param_bytes, nodes=None, hierarchical: bool = False,
                       reshard_after_forward: bool = True, **options) -> dict[str, float]:
    """All-gather before forward and (if resharded after it) again before backward; reduce-scatter -- split as rings
    split (:func:`minizero.stages.facts.sent_bytes_by_link`)."""
    gathers = 2 if reshard_after_forward else 1
    world = reduce_scatter_bytes(psi * grad_bytes, world_size) + gathers * all_gather_bytes(psi * param_bytes,
                                                                                            world_size)
    return facts.split_by_link(world, world_size, nodes, hierarchical)


def gather_span(cls, when: str, **options) -> str:
    """The ranks a unit's ``when`` (forward or backward) all-gather runs among, in the scaling model."""
    return cls.shard_span


def schedule_reduction(cls, s, key, numel: float) -> None:
    """A unit's gradients, averaged in the scaling model: one reduce-scatter."""
    s.launch(key, "reduce_scatter", numel, s.plan.grad_bytes)


def schedule(cls, s, prefetch: int = 1, reshard_after_forward: bool = True, **options) -> None:
    """Units in call order, as ZeRO3.unit_pre_forward and unit_pre_backward run them: a unit's all-gather, the next
    ``prefetch`` ones queued behind it, the wait for its own, then its compute.  The root (unit 0) is
    gathered first; its compute is half before the blocks (embeddings) and half after (the head), and
    in backward the reverse; its backward hook fires first and prefetches nothing; each unit's
    reduce-scatter leaves when its backward is done, the root's last.  (With find_unused_parameters
    every reduce-scatter waits for the end of backward: not modelled.)"""
    blocks, plan = s.plan.blocks, s.plan
    per_param_f, per_param_b = plan.forward_s / plan.psi, plan.backward_s / plan.psi

    def gather(u: int, when: str) -> None:
        if not s.launched((when, u)):
            s.launch((when, u), "all_gather", blocks[u], plan.param_bytes, span=cls.gather_span(when, **options))

    def run(order: list[int], when: str, compute, after=None) -> None:
        for i, u in enumerate(order):
            gather(u, when)
            for k in range(1, min(prefetch, len(order)) + 1):
                if i + k < len(order) and (u != 0 or when == "forward"):  # the root's hook prefetches only forward
                    gather(order[i + k], when)
            s.wait((when, u))
            compute(u)
            if after:
                after(u)

    half_root = blocks[0] * per_param_f / 2  # the embeddings before the blocks, the head after them
    run(list(range(len(blocks))), "forward", lambda u: s.compute(blocks[u] * per_param_f if u else half_root))
    s.compute(half_root)
    order = [0] + list(range(len(blocks) - 1, 0, -1))
    when = "backward" if reshard_after_forward else "forward"
    run(order, when, lambda u: s.compute(blocks[u] * per_param_b * (u > 0) + (u == 0) * blocks[0] * per_param_b / 2),
        lambda u: u and cls.schedule_reduction(s, ("rs", u), blocks[u]))
    s.compute(blocks[0] * per_param_b / 2)  # the embeddings' backward, last
    cls.schedule_reduction(s, ("rs", 0), blocks[0])
    s.wait_all()
    s.optimizer_step()


def reduction(cls, model, optimizer, world_size, units=None, replicate=None, **options) -> Reduction:
    """The groups ZeRO-3 reduces: one per unit, param group and dtype (padded), then the replicated modules' (whole)."""
    _, plan, whole = plan_units(model, units, replicate, [g["params"] for g in optimizer.param_groups])
    names = {id(p): n for n, p in model.named_parameters()}
    replicated = [[names[id(p)] for p in params] for _, params in whole]
    return Reduction([[n for n, _ in named] for _, _, named in plan] + replicated, padded=True,
                     whole=frozenset(range(len(plan), len(plan) + len(replicated))))

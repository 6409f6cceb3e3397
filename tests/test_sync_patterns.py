"""Backwards inside and outside ``no_sync()`` in every order (issue 45): a step whose K micro-batches synchronise
in any pattern that ends synchronising is single-device training's step -- the gradients of two synchronising
backwards add, as ``.grad`` does, on every stage.  (torch's idiom, the last micro-batch alone synchronising, is
what every other property draws; the labs draw these patterns too, and a ZeRO-2 that sets a piece's ``.grad``
instead of adding to it passes every other property.)"""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.comm import make_comm
from minizero.course.harness.experiment import Experiment
from minizero.run.orders import ORDERS, train_step_in_order
from minizero.run.train import Step, train_step
from minizero.stages import make_stage
from tests.equivalence import examples, experiments, run_and_check

#: The stages whose backward synchronises (local-sgd and ps-async are other algorithms: they have their own).
STAGES = ("ddp", "ddp-bucketed", "zero1", "zero2", "zero3", "zeropp", "hsdp", "ps")


@pytest.mark.parametrize("stage", STAGES)
@settings(max_examples=examples(4))
@given(data=st.data())
def test_any_order_of_synchronising_backwards_is_one_device_training(pools, stage, data):
    """Drawn as the suite draws (world sizes 1-4, models, batches, optimizers), with a pattern every time."""
    exp, world_size = data.draw(experiments(stage, max_accum=3, syncs=True).filter(lambda d: d[0].syncs is not None))
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("stage", STAGES)
@settings(max_examples=examples(3))
@given(data=st.data())
def test_backwards_in_other_orders_drawn_through_the_loop_are_one_device_training(pools, stage, data):
    """The orders of :mod:`minizero.run.orders` -- forwards then backwards, a backward twice on a retained graph,
    forwards inside and outside ``no_sync()`` before every backward, one backward of their sum -- drawn as the
    suite draws, through the loop ``verify --every-order`` runs."""
    exp, world_size = data.draw(experiments(stage, max_accum=3, orders=True).filter(lambda d: d[0].order is not None))
    run_and_check(pools, exp, world_size)


class _Recording:
    """A one-device stand-in for a stage: what the loop asks of one, the gradients kept at ``step()``."""

    world_size = 1

    def __init__(self):
        torch.manual_seed(0)
        self.model, self.inside, self.seen, self.forwards = torch.nn.Linear(3, 2).double(), [], [], 0

    def __call__(self, x):
        self.forwards += 1
        return self.model(x)

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)

    def scale_loss(self, loss):
        return loss

    @contextlib.contextmanager
    def no_sync(self):
        self.inside.append(self.forwards)  # the micro-batch whose forward runs inside (0-based)
        yield

    def step(self):
        self.seen.append([p.grad.clone() for p in self.model.parameters()])


@pytest.mark.parametrize("order", ORDERS)
def test_each_order_on_one_device_is_the_idioms_gradient_and_retained_counts_it_twice(order):
    """The loop's orders themselves, on one device, against torch's idiom (``train_step``): the same gradient,
    twice it for ``retained`` -- the reference runs the same loop, so a slip here would slip past it."""
    rows = torch.randn(7, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    step = Step([(rows[:2], rows[:2, :2]), (rows[2:5], rows[2:5, :2]), (rows[5:], rows[5:, :2])], global_count=14)
    idiom, ordered = _Recording(), _Recording()
    train_step(idiom, step)
    train_step_in_order(ordered, step, order)
    for want, got in zip(idiom.seen[0], ordered.seen[0], strict=True):
        assert torch.allclose(got, want * (2 if order == "retained" else 1), rtol=1e-12, atol=0), (order, got, want)
    # micro-batches 1..K-1 forward inside no_sync() (forwards then backwards: none); every forward once
    assert ordered.inside == ([] if order == "forwards then backwards" else [0, 1]), (order, ordered.inside)
    assert ordered.forwards == 3, ordered.forwards


def test_an_order_with_a_pattern_an_unknown_order_or_a_same_casts_reference_is_refused():
    """An order runs torch's idiom of synchronising, so a pattern beside it is refused; the same-casts reference rounds
    the idiom's one reduction, so an order under a wire has none; an order not in ORDERS is named."""
    from minizero.course.harness.experiment import reference_of
    from minizero.course.verify.declared_casts import declared_casts
    from minizero.course.verify.run import drawn_for
    with pytest.raises(ValueError, match="set one of the two"):
        Experiment(order="retained", syncs=(True, True), accum=2)
    with pytest.raises(ValueError, match="has no same-casts reference"):
        reference_of(Experiment(order="retained", options={"compress": "fp16"}), 2)
    with pytest.raises(ValueError, match="order='sideways': one of 'forwards then backwards'"):
        train_step_in_order(None, Step([], 1), "sideways")
    said = drawn_for("f.py:f", (1, 2), 3, False, declared_casts("fp16"), every_order=True)[1]
    assert "not in other orders: the same-casts reference rounds the idiom's one reduction" in said, said


@pytest.mark.parametrize("pattern", [(True, True), (True, False, True), (False, True, True), (True, True, True)])
@pytest.mark.parametrize("stage", STAGES)
def test_each_pattern_explicitly(pools, stage, pattern):
    """Every order at K <= 3, on the edge model (frozen, unused, tied parameters) at N = 3: named, not hoped for."""
    exp = Experiment(stage=stage, task="edge", optimizer="momentum", lr=0.05, steps=2, accum=len(pattern),
                     dtype="float64", syncs=pattern, options={"find_unused_parameters": True})
    run_and_check(pools, exp, 3)


def test_a_pattern_must_end_synchronising():
    with pytest.raises(ValueError, match=r"syncs=\(True, False\): one per micro-batch \(2\), the last True"):
        train_step(None, Step([(None, None)] * 2, 1), syncs=(True, False))
    with pytest.raises(ValueError, match=r"one per micro-batch \(3\)"):
        train_step(None, Step([(None, None)] * 3, 1), syncs=(True, True))


# ------------------------------------------------------------ backwards not each after its own forward
class _Blocks(torch.nn.Module):
    """Three units (a ModuleList's elements), a head, and a spare head used by nothing: frozen, or left to
    ``find_unused_parameters``."""

    def __init__(self, frozen_spare: bool):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 7), torch.nn.Linear(7, 5), torch.nn.Linear(5, 5)])
        self.head, self.spare = torch.nn.Linear(5, 2), torch.nn.Linear(5, 2)
        self.double()
        self.spare.requires_grad_(not frozen_spare)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _rows(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(3 + rank, 4, generator=torch.Generator().manual_seed(10 * micro + rank), dtype=torch.float64)


_WORLD, _TOTAL = 3, sum(3 + r for r in range(3))


def _backwards(model, batches: list, order: str, ranks: int = 1, no_sync=contextlib.nullcontext) -> None:
    """``forwards then backwards``: every micro-batch's forward, then each one's backward, oldest first;
    ``retained``: one forward, its backward twice (``retain_graph=True``) -- the gradient counted twice;
    ``inside, then outside``: the first forward inside ``no_sync()``, the second outside, then both backwards --
    the first accumulates, the second synchronises (decided at each one's forward, as torch does);
    ``both in one backward``: the same two forwards, one backward of their sum."""
    losses = []
    for k, x in enumerate(batches):
        with no_sync() if order in ("inside, then outside", "both in one backward") and k == 0 else contextlib.nullcontext():
            losses.append(model(x).pow(2).sum() / _TOTAL * ranks)  # a stage averages over the ranks
    if order == "both in one backward":
        losses = [sum(losses)]
    for loss in losses:
        loss.backward(retain_graph=order == "retained")
        if order == "retained":
            loss.backward()


def _single_device(order: str, frozen_spare: bool, micro: int) -> dict[str, torch.Tensor]:
    model = _Blocks(frozen_spare)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        optimizer.zero_grad()
        _backwards(model, [torch.cat([_rows(r, 10 * step + m) for r in range(_WORLD)]) for m in range(micro)], order)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _on_the_stage(me, stage_name: str, options: dict, order: str, frozen_spare: bool, micro: int) -> dict:
    model = _Blocks(frozen_spare)
    stage = make_stage(stage_name, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                       make_comm("ring", check=True), find_unused_parameters=not frozen_spare, **options)
    for step in range(2):
        stage.zero_grad()
        _backwards(stage, [_rows(me.rank, 10 * step + m) for m in range(micro)], order, _WORLD, stage.no_sync)
        stage.step()
    return {n: p.detach().clone() for n, p in stage.full_state_dict().items() if n in dict(model.named_parameters())}


#: Every stage, and the ones whose reductions leave during backward bucket by bucket (one parameter a bucket).
_STAGES = [(s, {}) for s in STAGES] + [("ddp-bucketed", {"bucket_mb": 1e-9}), ("zero2", {"bucket_mb": 1e-9}),
                                       ("zero1", {"overlap": True, "bucket_mb": 1e-9})]


@pytest.mark.parametrize("frozen_spare", [True, False], ids=["frozen", "find_unused"])
@pytest.mark.parametrize("order, micro", [("forwards then backwards", 2), ("retained", 1), ("inside, then outside", 2),
                                          ("both in one backward", 2)],
                         ids=["ffbb", "retained", "inside-then-outside", "both-in-one"])
@pytest.mark.parametrize("stage, options", _STAGES, ids=[s + ("-" + "-".join(o) if o else "") for s, o in _STAGES])
def test_backwards_run_after_all_forwards_or_again_on_a_retained_graph(pools, stage, options, order, micro,
                                                                       frozen_spare):
    """Two forwards and then their two backwards, or one backward run twice on a retained graph, are two
    synchronising backwards with no forward between: each adds its average, as ``.grad`` adds on one device.  A
    forward inside ``no_sync()`` and one outside, their backwards after both: the first accumulates, the second
    synchronises the sum.  (Once ZeRO-1 and the parameter server lost (N-1)/N of the first of two backwards -- the
    second reduction took the owner's average as its local gradient -- and ZeRO-3 skipped every unit in the
    second: no forward since the first.  And ZeRO-2 and ZeRO-3 reduced the backward of the forward inside
    ``no_sync()``, because the latest forward, not that one, decided whether a backward synchronises.)"""
    want = _single_device(order, frozen_spare, micro)
    for rank, got in enumerate(pools.run(_WORLD, _on_the_stage, stage, options, order, frozen_spare, micro)):
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert torch.isfinite(got[name]).all() and torch.allclose(got[name], value, rtol=0, atol=1e-12), (
                f"{stage} {options}, rank {rank}, {name}: off by {(got[name] - value).abs().max().item():.3g}")

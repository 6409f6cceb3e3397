"""Code written for FSDP2 runs on minizero: the idioms an FSDP2 user brings, each proven against one device.

* the optimizer built *after* wrapping under mixed precision (FSDP2's ``MixedPrecisionPolicy``): it steps
  fp32 parameters -- the masters -- and the model computes in 16 bits;
* every parameter's gradient in its full shape on request (FSDP2's ``param.grad.full_tensor()``), not only
  the 1-D pieces a ZeRO rank holds;
* modules left replicated inside a ZeRO-3 model (all-reduced, not sharded), as FSDP2 leaves the modules it
  does not wrap.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from minizero.comm import make_comm
from minizero.course.harness.experiment import run_experiment
from minizero.stages import make_stage
from tests.equivalence import WORLD_SIZES, covering_every_world_size, examples, experiments, replace, run_and_check

WORLD = 3
CORE = ["ddp", "ddp-bucketed", "zero1", "zero2", "zero3", "ps"]


class Blocks(nn.Module):
    """Three blocks (ZeRO-3 units: the ModuleList's elements) and a head used only when asked."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 7), nn.Linear(7, 5), nn.Linear(5, 5)]).double()
        self.head, self.spare = nn.Linear(5, 2).double(), nn.Linear(5, 2).double()

    def forward(self, x, spare=False):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x) + (self.spare(x) if spare else 0)


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(5 + rank, 4, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)


def _loss(output: torch.Tensor, total: int) -> torch.Tensor:
    """The global batch's mean, from this rank's part of it (ranks hold different numbers of samples)."""
    return output.pow(2).sum() / total


TOTAL = sum(5 + r for r in range(WORLD))


def _single_device_gradients() -> dict[str, torch.Tensor | None]:
    model = Blocks()
    x = torch.cat([_batch(r) for r in range(WORLD)])
    _loss(model(x), TOTAL).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _full_gradients(me, stage_name):
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stage = make_stage(stage_name, model, optimizer, make_comm("ring", check=True), find_unused_parameters=True)
    (_loss(stage(_batch(me.rank)), TOTAL) * WORLD).backward()
    return stage.full_gradients()


@pytest.mark.parametrize("stage", CORE)
def test_every_gradient_in_its_full_shape_is_the_single_device_gradient(pools, stage):
    want = _single_device_gradients()
    for got in pools.run(WORLD, _full_gradients, stage):
        assert got.keys() == want.keys()
        for name, grad in want.items():
            if grad is None:  # `spare` is used nowhere: no rank holds a gradient for it
                assert got[name] is None, name
            else:
                assert got[name].shape == grad.shape, name
                assert torch.allclose(got[name], grad, rtol=1e-12, atol=1e-15), (name, (got[name] - grad).abs().max())


# ---------------------------------------------------------------------------- param.grad after backward, as FSDP2's
def _read_as_fsdp2_users_do(me):
    """A course's FSDP test, unchanged: backward, then each of the *model's* parameters' ``.grad`` --
    ``full_tensor()``, ``to_local()`` -- and what a loop written for one device would do with them."""
    model = Blocks()
    stage = make_stage("zero3", model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring", check=True),
                       find_unused_parameters=True)
    (_loss(stage(_batch(me.rank)), TOTAL) * WORLD).backward()
    seen = {}
    for name, p in model.named_parameters():  # the same order on every rank: full_tensor() is a collective
        grad = p.grad
        seen[name] = None if grad is None else (tuple(grad.shape), grad.full_tensor(), grad.local_range,
                                                grad.to_local().clone(), repr(grad))
    refused = []
    for attempt in (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),  # foreach: a list of them
                    lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False),
                    lambda: next(p for p in model.parameters() if p.grad is not None).grad * 2):
        try:
            attempt()
            refused.append("")
        except RuntimeError as error:
            refused.append(str(error))
    name, first = next((n, p) for n, p in model.named_parameters() if p.grad is not None)
    first.grad = None  # FSDP2's: this rank's part is not stepped
    dropped = (first.grad, [piece.param.grad for piece in stage.pieces() if piece.segment.name == name])
    held = {piece.segment.name for piece in stage.pieces() if piece.param.grad is not None}
    stage.zero_grad(set_to_none=False)  # the pieces' gradients zeroed, kept: still stepped, as torch's
    kept = held == {piece.segment.name for piece in stage.pieces()
                    if piece.param.grad is not None and not piece.param.grad.any()}
    model.zero_grad()
    zeroed = [n for n, p in model.named_parameters() if p.grad is not None]
    (_loss(stage(_batch(me.rank)), TOTAL) * WORLD).backward()
    again = {n for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        stage(_batch(me.rank))  # an evaluation between backward and step leaves the gradients shown
    evaluated = {n for n, p in model.named_parameters() if p.grad is not None}
    stage(_batch(me.rank))
    forwarded = [n for n, p in model.named_parameters() if p.grad is not None]
    return seen, refused, dropped, kept, zeroed, again, evaluated, forwarded


def test_zero3_parameters_show_their_gradient_after_backward_as_fsdp2s_do(pools):
    """After backward, ``param.grad`` of each of the model's parameters is the sharded gradient: its
    ``full_tensor()`` the single-device gradient, the ranks' ``to_local()`` parts tiling it in rank order, None
    where no rank has one; torch operations on it are refused, naming the parameter and what to call; it goes at
    ``zero_grad()`` (``set_to_none=False`` keeping the pieces' zeroed gradients) and at the next forward with
    autograd on (ZeRO-3's backward reads the real one), not at an evaluation; ``param.grad = None`` drops this
    rank's part, as FSDP2's does."""
    want = _single_device_gradients()
    ranks = pools.run(WORLD, _read_as_fsdp2_users_do)
    for name, grad in want.items():
        if grad is None:
            assert all(seen[name] is None for seen, *_ in ranks), name
            continue
        parts = []
        for seen, *_ in ranks:
            shape, full, (lo, hi), local, text = seen[name]
            assert shape == tuple(grad.shape) and name in text, (name, shape, text)
            assert torch.allclose(full, grad, rtol=1e-12, atol=1e-15), (name, (full - grad).abs().max())
            assert local.numel() == hi - lo, (name, lo, hi, local.numel())
            parts.append((lo, hi, local))
        at = 0
        for lo, hi, local in sorted(parts, key=lambda part: part[:2]):  # the ranks' parts tile the flat gradient
            if hi > lo:
                assert lo == at, (name, parts)
                assert torch.allclose(local, grad.reshape(-1)[lo:hi], rtol=1e-12, atol=1e-15), name
                at = hi
        assert at == grad.numel(), (name, at)
    for _, refused, (first, pieces), kept, zeroed, again, evaluated, forwarded in ranks:
        assert kept  # zero_grad(set_to_none=False): every piece's gradient zeroed, none set to None
        for said in refused:  # a list operation, one tensor's, a Python operator: each told in words
            assert "sharded across the ranks" in said and "full_tensor()" in said, refused
        assert first is None and all(g is None for g in pieces), pieces
        assert zeroed == [] and forwarded == [], (zeroed, forwarded)
        assert again == evaluated == {n for n, g in want.items() if g is not None}, (again, evaluated)


def _shown_against_full_gradients(me, stage_name, options):
    model = Blocks()
    optimizer = None if options.get("precision") else torch.optim.SGD(model.parameters(), lr=0.1)
    stage = make_stage(stage_name, model, optimizer, make_comm("ring", check=True), find_unused_parameters=True,
                       **options)
    if optimizer is None:  # FSDP2's order under mixed precision: the optimizer over the fp32 masters, after wrapping
        optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    (_loss(stage(_batch(me.rank)), TOTAL) * WORLD).backward()
    shown = {n: None if p.grad is None else (p.grad.full_tensor(), p.grad.dtype) for n, p in model.named_parameters()}
    return shown, stage.full_gradients()


@pytest.mark.parametrize("stage, options", [("zero3", {"precision": "bf16"}), ("zero3", {"replicate": ["head"]}),
                                            ("hsdp", {}), ("zeropp", {})], ids=["zero3-bf16", "zero3-replicate",
                                                                               "hsdp", "zeropp"])
def test_the_gradient_shown_is_the_stages_full_gradient_in_every_zero3_form(pools, stage, options):
    """Under mixed precision (the masters' fp32 gradients, which the optimizer built after wrapping steps), with a
    replicated module (whose parameters keep their own, real ``.grad``), under HSDP and ZeRO++: each parameter's
    ``.grad.full_tensor()`` is, bit for bit, what ``full_gradients()`` gathers."""
    for shown, full in pools.run(WORLD, _shown_against_full_gradients, stage, options):
        assert shown.keys() == full.keys()
        for name, want in full.items():
            if want is None:
                assert shown[name] is None, name
            else:
                got, dtype = shown[name]
                assert dtype == want.dtype and torch.equal(got, want), (name, dtype, want.dtype)


def _backward_twice(me):
    model = Blocks()
    stage = make_stage("zero3", model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring", check=True))
    first, second = (_loss(stage(_batch(me.rank), spare=True), TOTAL) * WORLD for _ in range(2))  # two forwards
    first.backward()
    second.backward()  # a backward with no forward before it: the gradients are shown when it begins
    return stage.full_gradients()


def test_a_backward_run_again_while_gradients_are_shown_keeps_the_pieces(pools):
    """ZeRO-3 frees each real ``.grad`` after packing it (``param.grad = None``); with the gradient shown, that
    assignment must not be taken for FSDP2's "drop this rank's part" -- once it was, and every gradient was lost.
    (That the two backwards then give single-device training's gradients, on every stage, is
    ``tests/test_sync_patterns.py::test_backwards_run_after_all_forwards_or_again_on_a_retained_graph``.)"""
    for got in pools.run(WORLD, _backward_twice):
        assert got.keys() == {n for n, _ in Blocks().named_parameters()} and all(g is not None for g in got.values()), got


# ---------------------------------------------------------------------------- replicated modules inside ZeRO-3
REPLICATE = ["head", "blocks.1"]


def _single_device_training(steps: int, accum: int) -> dict[str, torch.Tensor]:
    model = Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        x = torch.cat([_batch(r + 10 * step) for r in range(WORLD)])
        _loss(model(x), x.shape[0]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero3_replicating(me, replicate, steps: int, accum: int):
    from minizero.comm import Ledger
    model = Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    comm = make_comm("ring", check=True)
    stage = make_stage("zero3", model, optimizer, comm, replicate=replicate, find_unused_parameters=True)
    ledger = Ledger()
    comm.add_observer(ledger)
    held = {n: p.numel() for n, p in model.named_parameters()}  # between steps: 0 where sharded
    for step in range(steps):
        stage.zero_grad()
        total = sum(5 + r + 10 * step for r in range(WORLD))
        chunks = _batch(me.rank + 10 * step).tensor_split(accum)
        for k, x in enumerate(chunks):
            with stage.no_sync() if k < accum - 1 else torch.enable_grad():
                (_loss(stage(x), total) * WORLD).backward()
        stage.clip_grad_norm_(0.5)
        stage.step()
        held = {n: p.numel() for n, p in model.named_parameters()}
    comm.remove_observer(ledger)
    sent = ledger.snapshot()
    sent.pop("check", None)  # the fingerprints: apart from the traffic the formulas describe
    return stage.full_state_dict(), sent, held


@pytest.mark.parametrize("replicate", [REPLICATE, ["blocks.0"]])
def test_replicated_modules_inside_zero3_train_like_one_device_and_all_reduce(pools, replicate):
    from minizero.costs.formulas import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
    steps, accum = 3, 2
    want = _single_device_training(steps, accum)
    whole = {n: p.numel() for n, p in Blocks().named_parameters()
             if any(n.startswith(m + ".") for m in replicate)}
    psi = sum(p.numel() for p in Blocks().parameters())
    for state, sent, held in pools.run(WORLD, _zero3_replicating, replicate, steps, accum):
        for name, value in want.items():
            assert torch.allclose(state[name], value, rtol=1e-10, atol=1e-12), (name, (state[name] - value).abs().max())
        assert {n for n, size in held.items() if size} == set(whole)  # replicated: whole on every rank; the rest sharded
        sharded = psi - sum(whole.values())
        # Per step, by collective: the sharded parameters' two all-gathers and reduce-scatter (plus padding:
        # fewer than N elements a group, 4 groups), the replicated ones' all-reduce -- DDP's bytes for them --
        # with one float for the clip norm, one per parameter for the used-parameter bitmap, and the ring's
        # uneven chunks (under 2N elements an all-reduce).  Sharding blocks.0 would all-gather 2 x 2/3 x 35 x 8
        # bytes a step more and all-reduce that much less: beyond either slack.
        padding = steps * 4 * (WORLD - 1) * 8
        gathered = steps * 2 * all_gather_bytes(sharded * 8, WORLD)
        assert gathered <= sent["all_gather"] <= gathered + 2 * padding, (sent, gathered)
        scattered = steps * reduce_scatter_bytes(sharded * 8, WORLD)
        assert scattered <= sent["reduce_scatter"] <= scattered + padding, (sent, scattered)
        reduced = steps * all_reduce_bytes(sum(whole.values()) * 8, WORLD)
        bookkeeping = steps * (all_reduce_bytes(8, WORLD) + all_reduce_bytes(len(want) * 4, WORLD) + 3 * 2 * WORLD * 8)
        assert reduced <= sent["all_reduce"] <= reduced + bookkeeping, (sent, reduced)


def _wrap_replicating(me, replicate):
    from minizero.course.harness.models import TinyGPT
    model = TinyGPT(vocab_size=11, d_model=8, n_layer=1, n_head=2, block_size=4).double()
    make_stage("zero3", model, None, make_comm("ring"), replicate=replicate)


@pytest.mark.parametrize("replicate, says", [
    (["head"], "parameter 'token_embedding.weight' of module 'token_embedding', which is sharded, is also a replicated "
               "module's \\('head.weight', a tied weight\\): it cannot be both. Replicate 'token_embedding' too"),
    ([""], "rank \\d: replicate names the whole model: that is ddp, not zero3")])
def test_a_replicated_module_that_cannot_be_is_refused_naming_why(pools, replicate, says):
    from minizero.run.launch import RankError
    with pytest.raises(RankError, match=says):
        pools.run(2, _wrap_replicating, replicate)


# ---------------------------------------------------------------------------- mixed precision, optimizer after wrapping
WRAP_FIRST = ["reference", "ddp", "ddp-bucketed", "zero1", "zero2", "zero3"]  # (ps keeps its optimizer on its servers)


@pytest.mark.parametrize("world_size", WORLD_SIZES)  # not drawn: see test_compression, the same test's seed
@pytest.mark.parametrize("stage", WRAP_FIRST[1:])
@covering_every_world_size
@settings(max_examples=examples(2), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mixed_precision_with_the_optimizer_built_after_wrapping_is_single_device_training(pools, stage, world_size,
                                                                                           data):
    """FSDP2's order under mixed precision -- wrap, then the optimizer over ``stage.parameters()`` (the fp32
    masters), ``optimizer.zero_grad()`` / ``optimizer.step()`` in the loop -- against the same-casts reference
    whose optimizer the stage owns: the same parameters after every step, fp16's skipped steps included (the ring
    backend, whose sums the reference replays bit for bit, as in test_precision)."""
    exp, n = data.draw(experiments(stage, world_sizes=(world_size,), precision=True, backends=("ring",), max_accum=3))
    run_and_check(pools, replace(exp, wrap_first=True, record_states=False), n)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", WRAP_FIRST[1:])
@covering_every_world_size
@settings(max_examples=examples(2), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_optimizer_built_after_wrapping_is_single_device_training(pools, stage, world_size, data):
    """FSDP2's and torch DDP's order in fp32: wrap, then the optimizer over ``stage.parameters()``, zeroed and stepped
    by the loop -- ``optimizer.zero_grad()`` sets every ``.grad`` to None behind the stage's back (a bucket's view
    lost, a piece's gradient gone) -- on every model the suite draws, the edge model included."""
    exp, n = data.draw(experiments(stage, world_sizes=(world_size,), max_accum=3, wrap_first=True))
    run_and_check(pools, replace(exp, wrap_first=True, record_states=False), n)


@settings(max_examples=examples(6), deadline=None, suppress_health_check=list(HealthCheck))
@given(drawn=experiments("reference", world_sizes=(1,), precision=True, max_accum=3))
def test_the_reference_with_its_optimizer_built_after_wrapping_is_bit_for_bit_the_one_that_owns_it(pools, drawn):
    """The reference averages nothing, so the same-casts reference (which replays a stage's reduction) does not
    apply: its two orders must agree bit for bit."""
    exp, n = drawn
    exp = replace(exp, options={k: v for k, v in exp.options.items() if k == "precision"}, record_states=False)
    got, want = (pools.run(n, run_experiment, e)[0] for e in (replace(exp, wrap_first=True), exp))
    for step, (a, b) in enumerate(zip(got.params, want.params, strict=True)):
        assert all(torch.equal(a[k], b[k]) for k in b), (step, exp)


# ---------------------------------------------------------------------------- a loop with no snapshot between steps
def _users_loop(me, stage_name: str, steps: int):
    """An FSDP2 user's loop, and nothing else: the optimizer over ``stage.parameters()``, ``model.zero_grad()``
    between its ``step()`` and the next forward -- no state dict read between steps (reading one shares the
    updated shards, which would hide a stage that never does)."""
    from minizero.comm import Ledger
    model = Blocks()
    comm = make_comm("ring", check=True)
    stage = make_stage(stage_name, model, None, comm, find_unused_parameters=True)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    ledger = Ledger()
    comm.add_observer(ledger)
    for step in range(steps):
        model.zero_grad()
        total = sum(5 + r + 10 * step for r in range(WORLD))
        (_loss(stage(_batch(me.rank + 10 * step)), total) * WORLD).backward()
        optimizer.step()
    sent = dict(ledger.sent)
    comm.remove_observer(ledger)
    return stage.full_state_dict(), sent


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_model_zero_grad_between_an_outside_step_and_the_next_forward_still_shares_the_step(pools, stage):
    """ZeRO-1/2 with the optimizer outside share the stepped shards at the next forward; a ``model.zero_grad()``
    in between once made them forget which groups had stepped: no all-gather at all, every rank training on its own
    stale copy of the others' shards -- hidden wherever a state dict was read between steps."""
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        optimizer.zero_grad()
        x = torch.cat([_batch(r + 10 * step) for r in range(WORLD)])
        _loss(model(x), x.shape[0]).backward()
        optimizer.step()
    for state, sent in pools.run(WORLD, _users_loop, stage, 3):
        assert sent.get("all_gather", 0) > 0, sent
        for name, want in model.named_parameters():
            assert torch.allclose(state[name], want, rtol=1e-10, atol=1e-12), (name, (state[name] - want).abs().max())

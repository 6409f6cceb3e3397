"""ZeRO++'s quantized weights (stage ``zeropp``, ``quantized_weights="int8"``: qwZ): the parameters all-gathered as codes,
every rank computing at the decoded weights, the optimizer stepping the exact shards.  Proven against a reference
that computes every rank's gradient at the same decoded weights, with the gathers' bytes equal to the codec's
formula; a state dict still holds the exact weights."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.compress import parse
from minizero.compress.weights import round_like_the_gather
from minizero.course.harness.equivalence import max_diff
from minizero.course.harness.experiment import Experiment, exact_reference_of, run_experiment
from minizero.course.harness.models import MLP
from minizero.stages import ZeRO3, ZeROPlusPlus
from tests.equivalence import covering_every_world_size, examples, experiments, run_and_check

WEIGHTS = ["int8", "int4", "int8:block=16", "int4:block=8,stochastic=1"]


@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
@pytest.mark.parametrize("stage", ["zeropp"])
@covering_every_world_size
@settings(max_examples=examples(4))
@given(data=st.data())
def test_quantized_weights_match_the_same_rounding_reference_and_their_byte_formula(pools, stage, world_size, data):
    """Drawn as the suite draws ZeRO-3 (units, prefetch, resharding, replicated modules, K up to 3, uneven
    batches, the edge model), with a quantized codec for the weights -- and sometimes one for the gradients too.
    (No clipping: ZeRO's clipping norm sums its shards in another order than the reference's whole gradient, a
    last-bit difference the tolerance allows; a weight that lands next to a rounding boundary can then round to
    the other level, which no tolerance on the reference can follow.)"""
    exp, world_size = data.draw(experiments(stage, world_sizes=(world_size,), compress=True, max_accum=3))
    weights = data.draw(st.sampled_from(WEIGHTS))
    gradients = data.draw(st.sampled_from([None, "int8", "topk:0.5"]))
    options = {k: v for k, v in exp.options.items() if k not in ("compress", "error_feedback", "hpz")}  # (hpz: refused)
    exp = replace(exp, clip=None, options={**options, "quantized_weights": weights,
                                           **({"compress": gradients} if gradients else {})})
    results = run_and_check(pools, exp, world_size)
    for r in results:  # every training gather is the codec's messages; the gradient codec's whole buffers too
        want = r.weight_sent_bytes_per_step + (r.wire_sent_by_kind_per_step or {}).get("all_gather", 0)
        assert r.sent_by_kind.get("all_gather", 0) == pytest.approx(exp.steps * want)


def _run(pools, n, **options):
    exp = Experiment(stage="zeropp", task="gpt", steps=2, dtype="float32", optimizer="adamw", options=options)
    return exp, pools.run(n, run_experiment, exp)


def test_int8_weights_send_about_a_quarter_and_change_training_a_little(pools):
    exp, exact = _run(pools, 3)
    qexp, quantized = _run(pools, 3, quantized_weights="int8")
    gathers = lambda rs: rs[0].sent_by_kind["all_gather"]  # noqa: E731
    assert 0.25 <= gathers(quantized) / gathers(exact) < 0.26  # a byte per value and a float32 scale per 256
    assert quantized[0].sent_by_kind["reduce_scatter"] == exact[0].sent_by_kind["reduce_scatter"]  # gradients: fp32
    change = max_diff(quantized, exact_reference_of(exp, 3))[0]
    assert 1e-6 < change < 1e-2  # trained at rounded weights: not single-device training, but close to it


def test_a_state_dict_holds_the_exact_weights_not_their_codes(pools):
    """After the last step the snapshot is the exact masters: rounding them again changes them (they were not
    the decoded values), and the stage's formula names the gathers' bytes."""
    _, quantized = _run(pools, 2, quantized_weights="int4")
    codec = parse("int4")
    for name, value in quantized[0].params[-1].items():
        flat = value.reshape(-1)
        size = -(-flat.numel() // 2) * 2
        padded = torch.cat([flat, flat.new_zeros(size - flat.numel())])
        if flat.numel() >= 8:
            assert not torch.equal(round_like_the_gather(padded, codec, 2)[:flat.numel()], flat), name


def test_the_stage_formula_counts_the_codes():
    psi, n = 1_000_000, 4
    plain = ZeRO3.sent_bytes_per_step(psi, n, 4, 4)
    coded = ZeROPlusPlus.sent_bytes_per_step(psi, n, 4, 4, quantized_weights="int8")
    gathers = plain - ZeRO3.sent_bytes_per_step(psi, n, 4, 0)
    assert coded == pytest.approx(plain - gathers + gathers * (1 + 4 / 256) / 4, rel=1e-3)


@pytest.mark.parametrize("spec, words", [("topk:0.1", "only a quantized codec fits"), ("fp16", "only a quantized"),
                                         ("int9", "compress must be one of")])
def test_what_cannot_carry_weights_is_refused(spec, words):
    """Before anything is built: no Comm needed to be refused."""
    assert words in _refused(quantized_weights=spec)


def test_mixed_precision_refuses_quantized_weights():
    assert "under mixed precision is not built" in _refused(quantized_weights="int8", precision="bf16")


def _refused(**options) -> str:
    model = MLP(seed=0, dtype=torch.float32)
    with pytest.raises(ValueError) as refused:
        ZeROPlusPlus(model, torch.optim.SGD(model.parameters(), lr=0.1), None, **options)
    return str(refused.value)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_gpt_with_int8_weights_matches_its_reference(pools, world_size):
    """A fixed case beside the drawn ones: the GPT's blocks as units, prefetch 1, K = 2, Adam."""
    exp = Experiment(stage="zeropp", task="gpt", steps=3, accum=2, dtype="float64", optimizer="adam",
                     options={"quantized_weights": "int8:block=64"})
    run_and_check(pools, exp, world_size)


def _state_inside_no_sync(me):
    """A micro-batch inside no_sync() keeps the units gathered -- as codes: the state dict must not hand those out."""
    from minizero.comm import make_comm
    from minizero.course.harness.tasks import TASKS
    from minizero.stages import make_stage
    model = TASKS["gpt"].make_model(0, torch.float64)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    comm = make_comm("ring")
    stage = make_stage("zeropp", model, torch.optim.SGD(model.parameters(), lr=0.1), comm, quantized_weights="int4",
                       reshard_after_forward=False)
    x, y = TASKS["gpt"].make_batch(2, 0, 0, torch.float64)
    with stage.no_sync():
        torch.nn.functional.cross_entropy(stage(x).flatten(0, 1), y.flatten()).backward()
    state = stage.full_state_dict()
    comm.close()
    return all(torch.equal(state[k], v) for k, v in before.items())


def test_a_state_dict_taken_while_units_are_gathered_as_codes_is_still_exact(pools):
    assert pools.run(2, _state_inside_no_sync) == [True, True]

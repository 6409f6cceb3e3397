"""Mixed precision on every stage: the same recipe as single-device training, loss scaling that skips
together, and the ZeRO paper's memory.

The tolerance.  Against the reference that applies the same casts
(:mod:`minizero.course.harness.casts_reference`: each rank's 16-bit gradient, the stage's
buffers summed in the ring's order in the wire's dtype, the same masters and
scaler), the stage does the same 16-bit arithmetic in the same order, so the
parameters agree bit for bit in practice; fp32's tolerance (1e-5, normwise)
leaves room only for fp32 sums taken in another order -- the sharded clipping
norm -- never for a 16-bit rounding (2^-8 for bf16, 2^-11 for fp16, 400 and
50 times larger), so a wrong cast, a missing unscale or a step on the wrong
tensor fails it.  Against *plain* single-device training in the same precision
the 16-bit sums differ in order and the bound would be a few 16-bit ulps; so
that comparison is made where the arithmetic is exact -- dyadic data, N=2 --
and must then be bit for bit.
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.__main__ import main as cli
from minizero.course.harness.experiment import Experiment, exact_reference_of, reference_of, run_experiment
from minizero.course.harness.models import MLP
from minizero.parts.masters import check_supported
from minizero.parts.precision import PRECISIONS, Precision
from minizero.stages import STAGES, make_stage
from tests.equivalence import (
    WORLD_SIZES,
    assert_equivalent,
    bit_identical,
    covering_every_world_size,
    examples,
    experiments,
    run_and_check,
)

DISTRIBUTED = ["ddp", "ddp-bucketed", "zero1", "zero2", "zero3", "ps"]  # ps: its workers hold no master at all


@pytest.mark.parametrize("world_size", WORLD_SIZES)  # not drawn: see test_compression, the same test's seed
@pytest.mark.parametrize("stage", DISTRIBUTED)
@covering_every_world_size
@settings(max_examples=examples(2))
@given(data=st.data())
def test_mixed_precision_matches_the_same_recipe_reference(pools, stage, world_size, data):
    """bf16/fp16, reduced in 16 bits or fp32, composed with compression; K >= 2, uneven shards, N = 1..4,
    unused parameters; the parameters *and* the optimizer states after every step (the masters' Adam)."""
    exp, world_size = data.draw(experiments(stage, world_sizes=(world_size,), precision=True, backends=("ring",),
                                            max_accum=3))
    results = run_and_check(pools, exp, world_size)
    assert len({r.skipped_steps for r in results}) == 1, "ranks skipped different steps"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_reference_is_mixed_precision_training_written_out(precision):
    """The recipe every stage is compared with is shared code (minizero.parts.precision), so it is anchored here
    against mixed-precision training written out by hand, independently: fp32 masters stepped by AdamW, a
    16-bit copy computing, the loss scaled (from 2^24, so that fp16's first steps overflow) and halved on
    overflow, unscaled in fp32.  Bit for bit, masters and optimizer states."""
    exp = Experiment(stage="reference", task="gpt", optimizer="adamw", lr=1e-2, steps=8, micro_batch=8,
                     dtype="float32", options={"precision": Precision(precision, loss_scale=2.0 ** 24)},
                     record_states=True)
    reference = exact_reference_of(exp, 1)
    masters, states, skipped = _by_hand(exp, PRECISIONS[precision])
    assert skipped == reference.skipped_steps and (skipped > 0) == (precision == "fp16")
    for step, (got, want) in enumerate(zip(reference.params, masters, strict=True)):
        assert all(torch.equal(got[n], want[n]) for n in want), f"step {step}"
    assert _same_states(reference.optimizer_states[-1], states)


def _by_hand(exp: Experiment, dtype: torch.dtype):
    from minizero.course.harness.tasks import TASKS
    from minizero.run.train import sum_loss
    task = TASKS[exp.task]
    model = task.make_model(exp.seed, torch.float32, **exp.model)
    names = [n for n, _ in model.named_parameters()]
    masters = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    optimizer = torch.optim.AdamW(masters, lr=exp.lr, weight_decay=0.1)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    scale, skipped, history = 2.0 ** 24 if dtype is torch.float16 else 1.0, 0, []
    for step in range(exp.steps):
        x, y = task.make_batch(exp.global_batch(1), exp.seed, step, torch.float32, **exp.model)
        model.zero_grad()
        loss = sum_loss(model(x).float(), y)
        (loss * (1 / y.numel()) * scale).backward()
        grads = [p.grad.float() / scale for p in model.parameters()]
        if all(torch.isfinite(g).all() for g in grads):
            for m, g in zip(masters, grads, strict=True):
                m.grad = g
            optimizer.step()
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters, strict=True):
                    p.copy_(m)
        else:
            scale, skipped = scale / 2, skipped + 1
        history.append({n: m.detach().clone() for n, m in zip(names, masters, strict=True)})
    return history, optimizer.state_dict(), skipped


@pytest.mark.parametrize("stage", DISTRIBUTED)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_dyadic_mixed_precision_is_bit_exact_against_plain_single_device(pools, stage, precision):
    """Dyadic weights and data with few significant bits: every 16-bit product and sum is exact, except the
    one rounding of a two-term sum, which N=2 ranks and the single device both round once -- so the stage
    must equal plain single-device training in the same precision bit for bit (masters, then 16-bit copy)."""
    exp = Experiment(stage=stage, task="dyadic", model={"sizes": (2, 2)}, optimizer="sgd", lr=0.25, steps=2,
                     micro_batch=1, dtype="float32",
                     options={"precision": Precision(precision, loss_scale=2.0 ** 8)})  # no overflow: nothing skipped
    results = pools.run(2, run_experiment, exp)
    reference = exact_reference_of(exp, 2)
    assert bit_identical(results, reference)
    assert any(not torch.equal(reference.params[-1][n], start_value) for n, start_value in _initial(exp).items())


@pytest.mark.parametrize("stage", DISTRIBUTED)
def test_an_overflow_on_one_rank_is_skipped_by_every_rank(pools, stage):
    """An inf in element 0 of one gradient on rank 1 at step 1 -- under ZeRO, after the reduce-scatter only
    rank 0's shard holds it: the MAX-combined flag makes every rank skip that step, halve the scale and touch
    no parameter and no optimizer state; training then goes on equal to the reference."""
    exp = Experiment(stage=stage, task="gpt", optimizer="adamw", steps=4, accum=2, dtype="float32",
                     options={"precision": Precision("fp16", loss_scale=2.0 ** 10)}, overflow_at=(1, 1),
                     record_states=True)
    results = pools.run(3, run_experiment, exp)
    reference = reference_of(exp, 3)
    assert_equivalent(results, reference, exp)
    for r in results:
        assert r.skipped_steps == reference.skipped_steps == 1
        assert r.loss_scales == reference.loss_scales == [1024.0, 512.0, 512.0, 512.0]
        assert all(torch.equal(r.params[1][n], r.params[0][n]) for n in r.params[0])  # untouched that step
        assert _same_states(r.optimizer_states[1], r.optimizer_states[0])
        assert any(not torch.equal(r.params[2][n], r.params[1][n]) for n in r.params[1])  # and then it moves


def _initial(exp: Experiment) -> dict:
    from minizero.course.harness.tasks import TASKS
    model = TASKS[exp.task].make_model(exp.seed, torch.float32, **exp.model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same_states(a: dict, b: dict) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


@pytest.mark.parametrize("world_size, precision", [(2, "fp16"), (3, "bf16"), (3, "fp16"), (4, "fp16")])
def test_measured_state_bytes_are_the_papers_formulas(pools, world_size, precision):
    """Live tensors of each stage within 2% of 16Psi, 4Psi+12Psi/N, 2Psi+14Psi/N, 16Psi/N (mixed-precision
    Adam, K = 12) -- what is left over is ZeRO's padding and Adam's step counters."""
    for stage in DISTRIBUTED:
        exp = Experiment(stage=stage, task="gpt", optimizer="adam", steps=2, dtype="float32",
                         options={"precision": precision})
        results = pools.run(world_size, run_experiment, exp)
        psi, held = results[0].psi, max(r.held_bytes["total"] for r in results)  # (a server holds the most)
        formula = STAGES[stage].state_bytes(psi, world_size, 4, 2, precision)
        assert abs(held - formula) <= 0.02 * formula, (stage, held, formula)
        assert max(r.held_bytes["master"] for r in results) >= 4 * psi / world_size  # fp32 masters, at least 1/N


def test_the_memory_command_reproduces_the_papers_table_1(capsys):
    """7.5B parameters, N = 64, mixed-precision Adam: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB (ZeRO paper, Table 1)."""
    assert cli(["memory", "--params", "7.5e9", "--world-size", "64", "--json"]) == 0
    rows = {row["stage"]: row["bytes_per_rank"] for row in json.loads(capsys.readouterr().out)}
    assert [round(rows[s] / 1e9, 1) for s in ("ddp", "zero1", "zero2", "zero3")] == [120.0, 31.4, 16.6, 1.9]
    assert cli(["memory", "--params", "7.5e9", "--world-size", "64", "--precision", "fp32"]) == 0
    assert "8Ψ + 8Ψ/N" in capsys.readouterr().out  # ZeRO-1 in one precision: not the paper's numbers


def test_the_memory_command_measures_a_live_gpt_and_separates_activations(capsys):
    assert cli(["memory", "--model", "gpt", "--world-size", "2", "--stages", "ddp,zero2"]) == 0
    out = capsys.readouterr().out
    assert "measured at N=2" in out and "Model states only" in out
    assert "The step's peak per rank at N=2" in out and "predicted / measured" in out  # activations beside the states


def _mlp():
    torch.manual_seed(0)
    return MLP((3, 4, 2))


def test_bad_precision_inputs_are_refused_with_what_to_do():
    model = _mlp()
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16; got 'fp8'"):
        make_stage("reference", model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp8")
    with pytest.raises(TypeError, match="(?s)is already torch.bfloat16, but precision='bf16' keeps fp32 master.*"
                                        "Hand the stage the fp32 model"):
        half = _mlp().to(torch.bfloat16)
        make_stage("reference", half, torch.optim.SGD(half.parameters(), lr=0.1), precision="bf16")
    lbfgs = _mlp()
    with pytest.raises(TypeError, match="LBFGS cannot step fp32 master weights"):
        make_stage("reference", lbfgs, torch.optim.LBFGS(lbfgs.parameters()), precision="bf16")
    with pytest.raises(ValueError, match="loss_scale must be a finite number >= min_loss_scale"):
        Precision("fp16", loss_scale=0.5)
    with pytest.raises(ValueError, match="min_loss_scale must be a finite number > 0"):
        Precision("fp16", min_loss_scale=-1.0)
    with pytest.raises(ValueError, match="loss_scale_window .* must be a whole number >= 1"):
        Precision("fp16", loss_scale_window=0)
    with pytest.raises(ValueError, match="reduce_dtype only applies to mixed precision"):
        Precision("fp32", reduce_dtype="fp32")


def test_a_device_that_cannot_compute_the_precision_is_named():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for a device without it")
    with pytest.raises(ValueError, match="Use precision='fp16' if the device computes it, or 'fp32'"):
        check_supported(torch.bfloat16, torch.device("cuda"), 0)


def test_compression_and_an_fp32_reduction_are_not_given_together(pools):
    exp = Experiment(stage="ddp", task="mlp", steps=1,
                     options={"precision": Precision("bf16", reduce_dtype="fp32"), "compress": "fp16"})
    with pytest.raises(Exception, match="both choose the dtype gradients are reduced in"):
        pools.run(2, run_experiment, exp)


def test_fp16_that_overflows_at_the_floor_stops_instead_of_skipping_forever(pools):
    """At the minimum loss scale an overflow is divergence, not a too-large scale: the run ends, naming it."""
    exp = Experiment(stage="zero2", task="mlp", steps=2, dtype="float32", overflow_at=(0, 0),
                     options={"precision": Precision("fp16", loss_scale=1.0)})
    with pytest.raises(Exception, match="inf or NaN even at the minimum loss scale"):
        pools.run(2, run_experiment, exp)


@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero3"])
def test_error_feedback_keeps_nothing_of_a_skipped_step_and_follows_the_loss_scale(pools, stage):
    """Compression's error feedback under fp16: a skipped step's residuals may hold inf - inf, and whether
    the step was skipped is the MAX verdict, not one rank's shard -- keep them only if it was taken; and the
    residuals, in units of the scaled gradients, follow the scale as it doubles and halves."""
    exp = Experiment(stage=stage, task="mlp", steps=6, dtype="float32", overflow_at=(1, 1),
                     options={"precision": Precision("fp16", loss_scale=2.0 ** 10, loss_scale_window=2),
                              "compress": "bf16", "error_feedback": True})
    results = pools.run(2, run_experiment, exp)
    reference = reference_of(exp, 2)
    assert_equivalent(results, reference, exp)
    assert [r.skipped_steps for r in results] == [1, 1] and results[0].loss_scales[-1] == 2048.0


def test_an_unscale_whose_step_never_came_is_forgotten_at_zero_grad():
    """Clip (which unscales), decide not to step, zero_grad, backward again: the step uses the new gradient."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    stage = make_stage("reference", model, torch.optim.SGD(model.parameters(), lr=1.0), precision="bf16")
    x = torch.ones(1, 1)
    stage(x).sum().backward()
    stage.clip_grad_norm_(10.0)
    stage.zero_grad()
    (-stage(x)).sum().backward()
    stage.step()
    assert stage.full_state_dict()["weight"].item() == 2.0


@pytest.mark.parametrize("stage", ["reference", "ddp", "zero2", "zero3"])
def test_a_frozen_parameter_keeps_its_full_precision_value_in_the_state_dict(pools, stage):
    """Frozen parameters compute in 16 bits like the rest, but have no master: the state dict must still
    give the value they were handed in with, not its 16-bit rounding widened back."""
    results = pools.run(1, _frozen_value_after_a_step, stage)
    assert results[0]


def _frozen_value_after_a_step(me, stage):
    from minizero.comm import make_comm
    model = _mlp()
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    original = frozen.detach().clone()
    wrapped = make_stage(stage, model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                         None if stage == "reference" else make_comm("ring"), precision="bf16")
    wrapped(torch.ones(2, 3)).sum().backward()
    wrapped.step()
    name = next(n for n, p in model.named_parameters() if p is frozen)
    return torch.equal(wrapped.full_state_dict()[name], original) and not torch.equal(original.bfloat16().float(),
                                                                                      original)



def _loop(me, stage_name: str, precision: str, outside: bool, first: str):
    """A loop as FSDP2's users write it (the optimizer built after wrapping, when ``outside``).  Its first step's
    backward is on ``stage.scale_loss(loss)`` (``first="scale"``), on the loss as computed (``"forget"``), or
    the step is not taken at all (``"skip"``)."""
    from minizero.comm import make_comm
    torch.manual_seed(0)
    model = MLP([4, 8, 2])
    optimizer = None if outside else torch.optim.SGD(model.parameters(), lr=0.1)
    stage = make_stage(stage_name, model, optimizer, make_comm("ring"), precision=precision)
    optimizer = optimizer or torch.optim.SGD(stage.parameters(), lr=0.1)
    refusal = None
    for step in range(1 if first == "skip" else 0, 3):
        (optimizer.zero_grad if outside else stage.zero_grad)(set_to_none=True)
        loss = stage(torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + me.rank))).pow(2).mean()
        try:
            (loss if first == "forget" and step == 0 else stage.scale_loss(loss)).backward()
        except RuntimeError as error:
            refusal = str(error)
            continue
        optimizer.step() if outside else stage.step()
    return refusal, stage.full_state_dict()


@pytest.mark.parametrize("stage", ["ddp-bucketed", "zero2", "zero3"])
@pytest.mark.parametrize("outside", [False, True])
def test_fp16_backward_of_a_loss_never_scaled_is_refused_and_loses_nothing(pools, stage, outside):
    """Unscaling a gradient whose loss was never scaled trains 2^16 times too slowly, silently: the backward is
    refused on every rank, naming the call to add; nothing was sent or kept, so the loop goes on as if that step
    had not been run.  bf16 scales nothing, and refuses nothing."""
    refused = pools.run(2, _loop, stage, "fp16", outside, "forget")
    for rank, (said, _) in enumerate(refused):
        assert said is not None and said.startswith(f"rank {rank}: backward in fp16 through a loss not scaled by "
                                                    f"stage.scale_loss(loss)") and "(65536)" in said, said
    for (_, state), (_, expected) in zip(refused, pools.run(2, _loop, stage, "fp16", outside, "skip"), strict=True):
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    assert [said for said, _ in pools.run(2, _loop, stage, "fp16", outside, "scale")] == [None, None]
    assert [said for said, _ in pools.run(2, _loop, stage, "bf16", outside, "forget")] == [None, None]

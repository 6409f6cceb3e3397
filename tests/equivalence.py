"""Helpers of the equivalence suite: draw an experiment, run it, check it."""
from __future__ import annotations

import os
from dataclasses import replace

import torch
from hypothesis import strategies as st

from minizero.experiment import RTOL, Experiment, reference_of, run_experiment
from minizero.train import OPTIMIZERS


#: ``make test-deep`` sets MINIZERO_DEEP: every property draws 20 times as many, fresh, examples.
DEEP = bool(os.environ.get("MINIZERO_DEEP"))


def examples(n: int) -> int:
    return 20 * n if DEEP else n


#: Bucket caps that force one parameter per bucket, a few buckets, or one bucket.
BUCKET_MB = [1e-9, 2e-4, 1e-3, 25.0]


@st.composite
def stage_options(draw, stage: str, task: str, compress: bool = False) -> dict:
    options = {}
    if stage.startswith("ddp-bucketed") or stage.startswith("zero2"):
        options["bucket_mb"] = draw(st.sampled_from(BUCKET_MB))
    if stage.startswith("zero3"):
        options["prefetch"] = draw(st.sampled_from([0, 1, 2]))
        options["reshard_after_forward"] = draw(st.booleans())
    if task == "edge":
        options["find_unused_parameters"] = True  # EdgeModel.unused never gets a gradient
    if compress:
        options["compress"] = draw(st.sampled_from(["fp16", "bf16"]))
        options["error_feedback"] = draw(st.booleans())
    return options


@st.composite
def experiments(draw, stage: str = "ddp", world_sizes=(1, 2, 3, 4), max_accum: int = 3, compress: bool = False,
                backends=("ring", "native")):
    """An experiment and its world size: model shape, batch split, optimizer, dtype..."""
    world_size = draw(st.sampled_from(world_sizes))
    task = draw(st.sampled_from(["mlp", "mlp", "edge", "gpt"]))
    model = {}
    if task == "mlp":
        model = {"sizes": tuple(draw(st.lists(st.integers(1, 9), min_size=2, max_size=4)))}
    elif task == "gpt":
        model = {"d_model": draw(st.sampled_from([8, 16])), "n_layer": draw(st.integers(1, 2)),
                 "n_head": 2, "block_size": draw(st.sampled_from([4, 8]))}
    accum = draw(st.integers(1, max_accum))
    rank_sizes = None
    if draw(st.booleans()):  # unequal samples per rank, some possibly empty
        rank_sizes = tuple(draw(st.lists(st.integers(0, 5), min_size=world_size, max_size=world_size)
                                .filter(lambda sizes: sum(sizes) > 0)))
    dtype = draw(st.sampled_from(["float64", "float32"]))
    # Adam's first steps are about lr * sign(g): a gradient element near zero flips sign under float32
    # rounding in any two summation orders, an O(lr) difference no tolerance on parameters can absorb.
    # So float32 draws the SGD family (1e-5 holds), and Adam/AdamW are proven in float64 (1e-9).
    optimizers = sorted(OPTIMIZERS) if dtype == "float64" else ["momentum", "nesterov", "sgd"]
    exp = Experiment(
        stage=stage, task=task, model=model,
        optimizer=draw(st.sampled_from(optimizers)),
        lr=draw(st.sampled_from([1e-3, 1e-2, 1e-1])),
        steps=draw(st.integers(1, 3)),
        micro_batch=draw(st.integers(1, 3)),
        accum=accum,
        dtype=dtype,
        seed=draw(st.integers(0, 2**16)),
        backend=draw(st.sampled_from(backends)),
        rank_sizes=rank_sizes,
        options=draw(stage_options(stage, task, compress)),
        clip=draw(st.sampled_from([None, None, (0.05, 2.0), (0.02, float("inf"))])),
        param_groups=draw(st.booleans()),
        record_states=True,
    )
    return exp, world_size


def assert_equivalent(results: list[dict], reference: dict, exp: Experiment, rtol: float | None = None) -> None:
    """After every step, every parameter on every rank matches the reference, and so does the loss.

    float64: relative to each tensor's largest element.  float32: relative to the model's largest
    parameter (normwise): a zero-initialised bias one step old is lr times a gradient that may be a
    cancellation, whose float32 rounding is large relative to *it* in any summation order."""
    rtol = RTOL[exp.dtype] if rtol is None else rtol
    for step, ref_params in enumerate(reference["params"]):
        model_scale = max((p.abs().max().item() for p in ref_params.values() if p.numel()), default=0.0)
        for rank, result in enumerate(results):
            for name, ref in ref_params.items():
                if ref.numel() == 0:
                    continue
                got = result["params"][step][name]
                err = (got - ref).abs().max().item()
                scale = max(ref.abs().max().item() if exp.dtype == "float64" else model_scale, 1e-300)
                assert err <= rtol * scale, (f"step {step}, rank {rank}, {name}: |Δ|={err:.3g} > "
                                             f"{rtol:g} x {scale:.3g}  ({exp})")
        total = sum(r["losses"][step] for r in results)
        ref_loss = reference["losses"][step]
        assert abs(total - ref_loss) <= rtol * max(abs(ref_loss), 1e-300), f"step {step}: loss {total} != {ref_loss}"
        if exp.record_states and reference.get("optimizer_states"):
            assert_same_optimizer_state(results[0]["optimizer_states"][step], reference["optimizer_states"][step],
                                        rtol, f"step {step}")


def assert_same_optimizer_state(got: dict, want: dict, rtol: float, where: str) -> None:
    """Every state tensor (Adam's exp_avg, exp_avg_sq, momentum buffers...) of every parameter;
    for ZeRO stages ``got`` is the concatenation of all ranks' shards.

    Normwise per kind of state, over the whole model: an element that is the
    small result of cancelling terms (a one-element bias gradient, say) has a
    large *relative* rounding error in any summation order, so per-tensor
    relative tolerance would flag float32 noise, not bugs."""
    assert set(got["state"]) == set(want["state"]), f"{where}: states for {set(got['state'])} != {set(want['state'])}"
    keys = {k for state in want["state"].values() for k, v in state.items() if torch.is_tensor(v) and v.numel()}
    for key in keys:
        pairs = [(index, got["state"][index][key], state[key]) for index, state in want["state"].items()
                 if key in state and state[key].numel()]
        scale = max(ref.abs().max().item() for _, _, ref in pairs)
        for index, value, ref in pairs:
            err = (value.to(ref.dtype) - ref).abs().max().item()
            # Adam's exp_avg_sq is a square: its relative error is twice the gradient's.
            assert err <= 4 * rtol * scale or err < 1e-30, (f"{where}: optimizer state {key} of parameter "
                                                          f"#{index}: |Δ|={err:.3g}, scale {scale:.3g}")


def run_and_check(pools, exp: Experiment, world_size: int, rtol: float | None = None) -> list[dict]:
    results = pools.run(world_size, run_experiment, exp)
    assert_equivalent(results, reference_of(exp, world_size), exp, rtol)
    return results


def bit_identical(results: list[dict], reference: dict) -> bool:
    import torch
    return all(torch.equal(r["params"][s][n], p) for r in results
               for s, params in enumerate(reference["params"]) for n, p in params.items())


__all__ = ["experiments", "assert_equivalent", "run_and_check", "bit_identical", "replace", "examples"]

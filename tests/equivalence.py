"""Helpers of the equivalence suite: draw an experiment, run it, check it."""
from __future__ import annotations

import os
from dataclasses import replace

from hypothesis import strategies as st

from minizero.lab.equivalence import bit_identical, judge, optimizer_state_violation
from minizero.lab.experiment import Experiment, reference_of, run_experiment
from minizero.lab.optimizers import OPTIMIZERS
from minizero.lab.registry import stage_class
from minizero.precision import Precision

#: ``make test-deep`` sets MINIZERO_DEEP: every property draws 20 times as many, fresh, examples.
DEEP = bool(os.environ.get("MINIZERO_DEEP"))


def examples(n: int) -> int:
    return 20 * n if DEEP else n


#: Bucket caps that force one parameter per bucket, a few buckets, or one bucket.
BUCKET_MB = [1e-9, 2e-4, 1e-3, 25.0]


@st.composite
def stage_options(draw, stage: str, task: str, compress: bool = False, stages: dict | None = None,
                  precision: bool = False) -> dict:
    """Options drawn for what the stage accepts (its constructor says)."""
    accepted, options = stage_class(stage, stages).options(), {}
    if "bucket_mb" in accepted:
        options["bucket_mb"] = draw(st.sampled_from(BUCKET_MB))
    if "prefetch" in accepted:
        options["prefetch"] = draw(st.sampled_from([0, 1, 2]))
    if "reshard_after_forward" in accepted:
        options["reshard_after_forward"] = draw(st.booleans())
    if task == "edge":
        options["find_unused_parameters"] = True  # EdgeModel.unused never gets a gradient
    if precision:
        options["precision"] = draw(st.sampled_from(PRECISION_POLICIES))
    if compress or (precision and options["precision"].reduce_dtype is None and draw(st.booleans())):
        options["compress"] = draw(st.sampled_from(["fp16", "bf16"]))  # under mixed precision: composed
        options["error_feedback"] = draw(st.booleans())
    return options


#: Mixed-precision policies drawn: each 16-bit dtype, reduced in it (the default) or in fp32, and fp16
#: with a loss scale low enough that no step overflows as well as the default 2^16 that makes the first
#: steps overflow and skip.
PRECISION_POLICIES = [Precision("bf16"), Precision("fp16"), Precision("bf16", reduce_dtype="fp32"),
                      Precision("fp16", reduce_dtype="fp32"), Precision("fp16", loss_scale=2.0 ** 4)]


@st.composite
def experiments(draw, stage: str = "ddp", world_sizes=(1, 2, 3, 4), max_accum: int = 3, compress: bool = False,
                backends=("ring", "native"), stages: dict | None = None, precision: bool = False):
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
    if precision:  # the reference applies the same casts in the same order: no sign for Adam to flip
        optimizers = sorted(OPTIMIZERS)
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
        options=draw(stage_options(stage, task, compress, stages, precision)),
        clip=draw(st.sampled_from([None, None, (0.05, 2.0), (0.02, float("inf"))])),
        param_groups=draw(st.booleans()),
        record_states=True,
        stages=stages,
    )
    return exp, world_size


def assert_equivalent(results: list, reference, exp: Experiment, rtol: float | None = None) -> None:
    """The one definition of equivalent (:func:`minizero.lab.equivalence.judge`), as an assertion."""
    verdict = judge(results, reference, exp.dtype, rtol, states=exp.record_states)
    assert verdict.ok, f"{verdict.nonfinite or verdict.violation}  ({exp})"


def assert_same_optimizer_state(got: dict, want: dict, rtol: float, where: str) -> None:
    violation = optimizer_state_violation(got, want, rtol, where)
    assert violation is None, violation


def run_and_check(pools, exp: Experiment, world_size: int, rtol: float | None = None) -> list[dict]:
    results = pools.run(world_size, run_experiment, exp)
    assert_equivalent(results, reference_of(exp, world_size), exp, rtol)
    return results


__all__ = ["experiments", "assert_equivalent", "run_and_check", "bit_identical", "replace", "examples"]

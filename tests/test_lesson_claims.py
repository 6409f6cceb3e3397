"""Claims the lessons make that no other test pins down.

* Lesson 8: reducing every micro-batch (``syncs`` all True, no ``no_sync()``) is the same update as
  accumulating locally, for K reduce-scatters per step; between micro-batches a ZeRO-2 rank then holds only
  its gradient shard.
* Lesson 6: minizero's split of the division by N around a 16-bit sum is not FSDP2's -- checked against
  torch's own ``_get_gradient_divide_factors`` -- and accumulation equals a large batch only without BatchNorm.
* Lesson 12: what a ZeRO-2 rank holds beyond the formula is Adam's ``step`` scalars, and a checkpoint's files
  load with ``torch.load``'s defaults.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from minizero.compress import split_division
from minizero.costs.formulas import all_gather_bytes, reduce_scatter_bytes
from minizero.course.harness.equivalence import max_diff
from minizero.course.harness.experiment import Experiment, reference_of, run_experiment
from minizero.observe.memory import held_bytes
from minizero.run.train import Step, shard_step, sum_loss, train_step
from minizero.stages import make_stage


@pytest.mark.parametrize("stage", ["ddp", "zero2"])
def test_reducing_every_micro_batch_is_the_same_update(pools, stage):
    exp = Experiment(stage=stage, task="gpt", optimizer="adamw", steps=2, accum=3, dtype="float64",
                     syncs=(True, True, True))
    results = pools.run(2, run_experiment, exp)
    assert max_diff(results, reference_of(exp, 2))[1] < 1e-12


def test_reducing_every_micro_batch_has_no_same_casts_reference():
    exp = Experiment(stage="zero2", accum=2, syncs=(True, True), options={"compress": "bf16"})
    with pytest.raises(ValueError, match=r"syncs=\(True, True\) has no same-casts reference"):
        reference_of(exp, 2)


def test_reducing_every_micro_batch_sends_k_reduce_scatters(pools):
    n, k = 2, 3
    once, every = (pools.run(n, run_experiment, Experiment(stage="zero2", task="gpt", steps=1, accum=k, dtype="float32",
                                                           syncs=(flag,) * (k - 1) + (True,)))
                   for flag in (False, True))
    psi = once[0].psi
    rs, ag = reduce_scatter_bytes(psi * 4, n), all_gather_bytes(psi * 4, n)
    # one bucket here (25 MiB), padded to a multiple of N: a few bytes over the formula
    assert once[0].sent_by_kind["reduce_scatter"] == pytest.approx(rs, abs=8)
    assert every[0].sent_by_kind["reduce_scatter"] == pytest.approx(k * rs, abs=8 * k)
    assert every[0].sent_by_kind["all_gather"] == once[0].sent_by_kind["all_gather"] == pytest.approx(ag, abs=8)


def _grads_between_micro_batches(me, every: bool) -> tuple[int, int]:
    """(gradient bytes held when the second micro-batch starts, Psi) on this rank, in the one training loop."""
    from minizero.comm import make_comm
    from minizero.course.harness.optimizers import make_optimizer
    from minizero.course.harness.tasks import TASKS
    model = TASKS["gpt"].make_model(0, torch.float32)
    stage = make_stage("zero2", model, make_optimizer("adamw", model, 1e-3), make_comm("ring"))
    x, y = TASKS["gpt"].make_batch(4 * me.world_size, 0, 0, torch.float32)
    seen = []

    def loss_fn(output, target):
        seen.append(held_bytes({"grads": stage.held_tensors()["grads"]})["grads"])
        return sum_loss(output, target)

    train_step(stage, shard_step(x, y, me.rank, me.world_size, 2), loss_fn, syncs=(every, True))
    return seen[1], sum(p.numel() for p in model.parameters())


def test_between_micro_batches_zero2_holds_full_gradients_or_only_its_shard(pools):
    n = 4
    (local, psi), = pools.run(n, _grads_between_micro_batches, False)[:1]
    (every, _), = pools.run(n, _grads_between_micro_batches, True)[:1]
    assert local == 4 * psi
    assert every == pytest.approx(4 * psi / n, abs=4 * n)  # the owned shard, padded to a multiple of N


def _fsdp2_factors(n: int) -> tuple[float, float]:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    class Group:
        def size(self):
            return n
    pre, post, _, _ = _get_gradient_divide_factors(Group(), None, torch.float16)
    return pre, post


def test_the_split_division_is_not_fsdp2s():
    """Lesson 6: both split N around the fp16 sum with a power of two near sqrt(N); FSDP2 rounds up."""
    same = [n for n in (2, 3, 4, 8, 16, 32, 64, 256) if split_division(n)[0] == _fsdp2_factors(n)[0]]
    assert same == [4, 16, 64, 256]
    assert _fsdp2_factors(2) == (2, 1.0) and split_division(2) == (1, 2.0)
    assert _fsdp2_factors(8) == (4, 2.0) and split_division(8) == (2, 4.0)


def _one_step(model: nn.Module, x, y, k: int) -> dict:
    """Parameters after one SGD step of the reference stage over ``k`` micro-batches of (x, y)."""
    stage = make_stage("reference", model, torch.optim.SGD(model.parameters(), lr=0.1))
    train_step(stage, Step(list(zip(x.tensor_split(k), y.tensor_split(k), strict=True)), global_count=y.numel()))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("batch_norm", [False, True])
def test_accumulation_equals_the_large_batch_only_without_batch_norm(batch_norm):
    torch.manual_seed(0)
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    build = lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8) if batch_norm else nn.Identity(),  # noqa: E731
                                  nn.ReLU(), nn.Linear(8, 2)).double()
    torch.manual_seed(1)
    large = _one_step(build(), x, y, 1)
    torch.manual_seed(1)
    accumulated = _one_step(build(), x, y, 4)
    diff = max((large[k] - accumulated[k]).abs().max().item() for k in large)
    assert (diff > 1e-3) if batch_norm else (diff < 1e-14)


def test_zero2_holds_the_formula_plus_adams_step_scalars_and_its_files_load_with_torch_load(pools, tmp_path):
    """Lesson 12: a ZeRO-2 rank holds 4Ψ + 12Ψ/N plus Adam's ``step``, a float32 scalar per parameter it holds
    part of (one per part of its checkpoint file) -- the whole excess when Ψ divides by N; and a checkpoint's
    files, sharded and consolidated, load with ``torch.load``'s defaults (``weights_only=True``)."""
    n = 2
    exp = Experiment(stage="zero2", task="gpt", optimizer="adamw", steps=1, dtype="float32", save=str(tmp_path / "s"))
    results = pools.run(n, run_experiment, exp)
    psi = results[0].psi
    assert psi % n == 0  # no padding
    for r, result in enumerate(results):
        parts = torch.load(tmp_path / "s" / "step-00000001" / f"rank-{r:05d}-of-{n:05d}.pt")["parts"]
        assert result.held_bytes["total"] - (4 * psi + 12 * psi // n) == 4 * len(parts)
    pools.run(n, run_experiment, replace(exp, save=str(tmp_path / "c"), consolidated=True))
    state = torch.load(tmp_path / "c" / "step-00000001" / "consolidated.pt")
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {1}


def test_the_summarys_course_table_is_todays_course():
    """Lesson 99 prints the course from the folder and the labs' registry (``course_index``): its committed output
    must be today's table -- a lesson or a lab added since, or a title changed, fails here until 99 is re-run."""
    import json

    from minizero.course.harness.course_index import LESSONS, course_table, lessons
    from minizero.course.labs import LABS
    printed = [o.get("data", {}).get("text/markdown", "") for c in json.loads((LESSONS / "99_summary.ipynb").read_text())[
        "cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    table = course_table()
    assert any("".join(p) == table for p in printed), "lesson 99's course table is not today's: re-run the lesson"
    assert [row.split(" | ")[0].strip("| ") for row in table.splitlines()[2:]] == [name[:2] for name, _ in lessons()]
    assert all(f"`{lab}`" in table for lab in LABS)

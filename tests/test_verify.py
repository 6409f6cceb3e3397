"""``minizero verify``: the property suite on someone else's wrapper -- torch's DDP and FSDP2 pass at N = 1-4, a
student's broken DDP fails with its smallest case named, and a factory that is not one is refused in words."""
from __future__ import annotations

import os

import pytest

from minizero.__main__ import main
from minizero.course.verify import verify

HERE = os.path.dirname(__file__)
TORCH = os.path.join(HERE, "..", "minizero", "course", "verify", "torch_wrappers.py")
OURS = os.path.join(HERE, "verify_wrappers.py")


@pytest.mark.parametrize("factory", ["ddp", "fsdp2_clipping_local_shards", "zero_redundancy"])
def test_torchs_own_wrappers_are_single_device_training(pools, factory):
    verdict = verify(f"{TORCH}:{factory}", examples=8, pools=pools)
    assert verdict.ok, verdict
    assert "world sizes 1, 2, 3, 4, K up to 3" in verdict.declared, verdict.declared


def test_fsdp2_with_torchs_clip_grad_norm_is_refused_where_a_shard_is_empty(pools):
    """torch's finding (docs/verify.md): ``clip_grad_norm_(..., norm_type=inf)`` raises on a rank whose FSDP2
    shard of some parameter is empty -- one Linear(1, 1) over two ranks -- and leaves the other rank waiting."""
    verdict = verify(f"{TORCH}:fsdp2", examples=8, pools=pools, deadline_s=5.0, shrink_s=2.0)
    assert not verdict.ok, verdict
    assert "_foreach_norm cannot compute the infinity norm on an empty tensor" in verdict.failed, verdict
    # an inf-norm clip where a shard is empty: never on one rank.  Shrinking is time-bounded (2 s here: each case
    # that raises restarts the pool, and verify's 20 s went to it all), so the case reported may keep a third rank
    # or another max_norm -- any inf-norm clip on several ranks is this finding
    assert ", inf)" in verdict.case and "world size 1," not in verdict.case, verdict


def test_fsdp2_on_a_2d_mesh_trains_as_one_device_and_meets_the_empty_shard_at_n_4(pools):
    """HSDP: ``fully_shard`` on a ``("replicate", "shard")`` mesh built in the factory.  Its drawn examples are
    single-device training; at N = 2 its rows are single ranks (no empty shard), so only the fixed case at N = 4,
    2 x 2, meets torch's finding -- which is why that case is tried at N = 4 too."""
    verdict = verify(f"{TORCH}:fsdp2_hybrid", examples=3, world_sizes=(2, 4), pools=pools, deadline_s=5.0)
    assert not verdict.ok, verdict
    assert "_foreach_norm cannot compute the infinity norm on an empty tensor" in verdict.failed, verdict
    assert verdict.case.startswith("world size 4,") and verdict.case.endswith("clip (0.02, inf)"), verdict.case


def test_a_students_right_ddp_passes_and_a_missing_division_is_named(pools):
    assert verify(f"{OURS}:student_ddp", examples=6, pools=pools).ok
    verdict = verify(f"{OURS}:sums_without_dividing", examples=6, pools=pools)
    assert not verdict.ok
    assert "K up to 1 (no no_sync()" in verdict.declared, verdict.declared  # nothing declared: not drawn
    # the smallest case is two ranks, and the gradient is N times too large: the words of the labs' verdicts
    assert "too large by N = " in verdict.failed and "the sum over ranks, not the mean?" in verdict.failed, verdict


def test_what_is_not_a_wrapper_is_refused_in_words(pools, tmp_path):
    verdict = verify(f"{OURS}:not_a_module", examples=2, pools=pools)
    assert "the factory returned list, not an nn.Module" in verdict.failed, verdict
    verdict = verify(f"{OURS}:raises_on_rank_1", examples=4, pools=pools, world_sizes=(2,))
    assert "rank 1 raised RuntimeError: rank 1 could not wrap" in verdict.failed, verdict
    verdict = verify(f"{OURS}:never_finishes", examples=2, pools=pools, world_sizes=(2,), deadline_s=3.0)
    assert verdict.final and "_spin" in verdict.failed, str(verdict)
    assert main(["verify", f"{OURS}:no_such_factory"]) == 2
    assert main(["verify", str(tmp_path / "missing.py")]) == 2


def test_a_students_sharded_optimizer_passes_and_one_broadcasting_from_rank_0_is_named(pools):
    """CS336's sharded optimizer behind the ``optimizer`` hook: right, it is single-device training; every parameter
    broadcast from rank 0 instead of its owner, the others' updates are lost -- and the verdict says so."""
    assert verify(f"{OURS}:student_ddp_sharded_optimizer", examples=6, pools=pools).ok
    verdict = verify(f"{OURS}:sharded_optimizer_broadcasts_from_rank_0", examples=6, pools=pools)
    # on several ranks (on one, rank 0 owns everything); shrinking is time-bounded: not necessarily two of them
    assert not verdict.ok and "world size 1," not in verdict.case, verdict
    assert "never moved" in verdict.failed or "its update was lost" in verdict.failed, verdict


MINIZERO = os.path.join(HERE, "..", "minizero", "course", "verify", "minizero_stages.py")


@pytest.mark.parametrize("factory", ["ddp_bucketed", "zero2", "zero3"])
def test_minizeros_own_stages_through_a_factory_are_single_device_training(pools, factory):
    """The same factory shape serves minizero's stages: made over the group a factory is given, the optimizer built
    over ``stage.parameters()`` (ZeRO's owned pieces), clipped and read back through the stage's own methods."""
    verdict = verify(f"{MINIZERO}:{factory}", examples=6, pools=pools)
    assert verdict.ok, verdict


def test_a_sharded_clip_left_uncapped_in_a_stage_verified_through_a_factory_is_named(pools):
    """verify clips a ZeRO stage through the stage's own ``clip_grad_norm_`` (its norm over every rank's pieces): a
    coefficient not capped at 1 there scales the gradients up, and the verdict shows it."""
    with pools.patched("clip: sharded coefficient not capped at 1"):
        verdict = verify(f"{MINIZERO}:zero2", examples=8, pools=pools)
    assert not verdict.ok and "clip" in verdict.case, verdict


def test_sharded_placeholders_read_as_full_parameters_are_named_not_a_traceback(pools):
    """ZeRO-3's module holds 0-element placeholders outside a forward: a factory that reads them as the full
    parameters is told so, naming the parameter and both shapes -- once a traceback from ``max()``."""
    verdict = verify(f"{OURS}:zero3_read_from_placeholders", examples=2, pools=pools, world_sizes=(2,))
    assert not verdict.ok, verdict
    assert "has shape (0,), the reference's" in verdict.failed and "placeholder" in verdict.failed, verdict


def test_a_ddp_that_averages_once_a_step_is_caught_only_by_synchronising_twice(pools):
    """Backwards inside and outside ``no_sync()`` are drawn in every order that ends synchronising: a DDP that
    averages each gradient at most once a step is right while the last micro-batch alone synchronises (torch's
    idiom), and wrong -- the ranks drift apart -- as soon as a step synchronises twice."""
    assert verify(f"{OURS}:hook_ddp", examples=12, pools=pools).ok
    verdict = verify(f"{OURS}:averages_once_per_step", examples=12, pools=pools)
    assert not verdict.ok, verdict
    assert "backwards synchronising: micro-batch(es) [" in verdict.case, verdict  # two or more of them
    assert "every order that ends synchronising" in verdict.declared, verdict.declared

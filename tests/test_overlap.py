"""Overlap as a property of the timeline, on a dialled network: backward keeps computing while a bucket's or a
unit's communication is in flight -- so a change that serialises communication with compute fails here.

The wire holds every message 10 ms (costing no CPU), far longer than the small model's backward: a
collective that overlaps backward shows as one whose span starts before the last gradient, and a backward
that waited for its collectives shows as a last gradient no earlier than the transfers' sum."""
import pytest

from minizero.course.harness.costs import overlap_problem
from minizero.course.harness.experiment import Experiment
from minizero.course.harness.overlap import backward_launches
from minizero.course.harness.timelines import timeline_on_rank
from minizero.run.launch import RankPool
from minizero.stages import BucketedDDP, ZeRO2, with_stages

WIRE = "alpha=10ms,bandwidth=100MB/s"
GPT = {"n_layer": 3, "d_model": 128, "block_size": 32}  # a block's forward takes milliseconds
MLP = {"sizes": (64, 768, 768, 768, 4)}  # backward ~10 ms: far longer than a GIL switch (5 ms)


class BlockingBuckets(BucketedDDP):
    """Each bucket's all-reduce runs inside the gradient hook: backward waits for every one."""
    name = "blocking-buckets"

    def deferred_all_reduce(self, index: int):
        done = super().deferred_all_reduce(index)()
        return lambda: done


class BucketsAfterBackward(ZeRO2):
    """No bucket leaves before backward ends (post_backward launches them all)."""
    name = "buckets-after-backward"

    def post_accumulate_grad(self, param) -> None:
        self._used.add(id(param))


STAGES = with_stages(BlockingBuckets, BucketsAfterBackward)


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as pool:
        yield pool


def _backward_overlap(pool, stage: str) -> list[str]:
    """Violations of: a bucket's collective is in flight while backward computes, and the last gradient is
    ready before the transfers could have run one after another."""
    exp = Experiment(stage=stage, task="mlp", model=MLP, steps=3, dtype="float32", optimizer="sgd", check=False,
                     network=WIRE, options={"bucket_mb": 1e-9}, stages=STAGES, micro_batch=64)
    problems, pairs = [], 0
    for r, steps in enumerate(pool.run(timeline_on_rank, exp)):
        for s, step in enumerate(steps[1:], start=1):  # step 0 starts the communication thread
            pairs += 1
            first_gradient, last_gradient = step.backward
            during = [c for c in step.comm if c[1] < last_gradient]
            transfers = sum(e - b for _, b, e in step.comm)
            if not during:
                problems.append(f"rank {r} step {s}: no collective started before backward's last gradient")
            # Serialised, backward lasts at least every transfer plus its compute; overlapped, its compute alone --
            # ~10 ms against ~240 ms of transfers here, and ~120 ms on a machine at load 30 (0.5x failed there).
            if last_gradient - first_gradient > transfers:
                problems.append(f"rank {r} step {s}: backward took {last_gradient - first_gradient:.3f} s of "
                                f"{transfers:.3f} s of transfers: it waited for them")
    # The margin: on a busy machine one rank's step can be descheduled through its whole ~10 ms backward (seen
    # once in about ten runs beside a busy loop); a stage that serialises fails in every step of every rank.
    return problems if len({p.split(":")[0] for p in problems}) > pairs // 2 else []


@pytest.mark.parametrize("stage", ["ddp-bucketed", "zero2"])
def test_buckets_communicate_while_backward_computes(pool, stage):
    assert _backward_overlap(pool, stage) == []


@pytest.mark.parametrize("stage, words", [("blocking-buckets", "waited for them"),
                                          ("buckets-after-backward", "no collective started")])
def test_a_serialising_stage_fails_the_property(pool, stage, words):
    """Every (rank, step) pair that fails, fails for the stage's own reason -- perhaps beside another: on a busy
    machine a descheduled backward may also look as if it waited (seen once with the buckets left to the end)."""
    problems = _backward_overlap(pool, stage)
    pairs = {p.split(":")[0] for p in problems}
    assert pairs and pairs == {p.split(":")[0] for p in problems if words in p}, problems


def _zero3_steps(pool, prefetch: int) -> list:
    exp = Experiment(stage="zero3", task="gpt", model=GPT, steps=3, dtype="float32", optimizer="sgd", check=False,
                     network=WIRE, options={"prefetch": prefetch}, micro_batch=16)
    return [step for steps in pool.run(timeline_on_rank, exp) for step in steps[1:]]


def _prefetch_overlap(steps: list) -> float:
    """The share of the blocks' forwards during which the next unit's all-gather was in flight at all (the blocks
    that have a next one, over ranks and steps).  A share of *time* would depend on the machine's load -- a
    descheduled communication thread wakes late, a stretched forward dilutes it (0.23 seen at a load of 14 on two
    cores, against 0.69-0.91 when idle) -- while whether the gather ran during the forward at all does not: with
    prefetch it does in nearly every block, without it never."""
    pairs = [step.overlap_s(f"forward unit {i}", f"all_gather unit {i + 2} ") > 0 for step in steps for i in range(2)]
    return sum(pairs) / len(pairs)


def test_zero3_prefetch_gathers_the_next_unit_while_this_one_computes(pool):
    assert _prefetch_overlap(_zero3_steps(pool, 1)) >= 0.5  # seen 1.0, at a load of 14 on two cores too; without
    # prefetch exactly 0
    without = _zero3_steps(pool, 0)
    assert _prefetch_overlap(without) == 0.0  # without prefetch the gather waits for the unit before it
    for step in without:  # and the waits for it are exposed: the step waited through most of its communication
        # (both sides are the dialled wire's time, which load does not shorten; forward's own compute is not
        # compared with them -- at a load of 10 on two cores it stretched past half the waits)
        waits = sum(e - b for b, e in step.waits)
        assert waits > 0.5 * step.comm_s(), (waits, step.comm_s())
        assert step.exposed_s() > 0.5 * step.comm_s()


@pytest.mark.parametrize("stage, k", [("ddp-bucketed", 1), ("ddp-bucketed", 2), ("zero2", 2)])
def test_overlap_as_a_structure_the_checker_judges_the_same_way(pool, stage, k):
    """The labs' checker's definition (:mod:`minizero.course.harness.overlap`,
    :func:`minizero.course.harness.costs.overlap_problem`),
    held by the package's stages -- and failed by both serialising stages, each for its own reason."""
    def probe(stage_name):
        exp = Experiment(stage=stage_name, task="mlp", model={"sizes": (8, 16, 16, 4)}, steps=2, accum=k,
                         dtype="float32", optimizer="sgd", options={"bucket_mb": 1e-9}, stages=STAGES)
        return overlap_problem(pool.run(backward_launches, exp), exp.steps)

    assert probe(stage) is None
    assert "ran on the main thread" in probe("blocking-buckets")
    assert "no bucket left while backward still had gradients" in probe("buckets-after-backward")

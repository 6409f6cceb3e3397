"""Stage ``ddp-bucketed``: buckets, views, overlap, accumulation, unused parameters."""
from __future__ import annotations

import contextlib
import time

import pytest
import torch
from hypothesis import given, settings
from torch import nn

from minizero.comm import make_comm
from minizero.course.harness.experiment import Experiment, run_experiment
from minizero.course.harness.models import MLP, EdgeModel
from minizero.run.launch import RankError
from minizero.run.train import shard_step, train_step
from minizero.stages import BucketedDDP, make_stage
from minizero.stages.ddp_bucketed import assign_buckets
from tests.equivalence import covering, examples, experiments, run_and_check


@covering
@settings(max_examples=examples(20))
@given(drawn=experiments("ddp-bucketed", max_accum=4, wrap_first=True))
def test_bucketed_matches_reference(pools, drawn):
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


def _mlp_bucket_cap(n_buckets: int, element_size: int = 4) -> float:
    """A cap (MiB) that splits MLP((8, 16, 4)) into exactly ``n_buckets``.  In reverse registration
    order its parameters hold 4, 64, 16 and 128 elements: 2 buckets = [4, 64, 16] [128],
    3 buckets = [4, 64] [16] [128], 4 = one parameter each."""
    elements = {1: 25 * 2**20 // element_size, 2: 128, 3: 68, 4: 1}[n_buckets]
    return elements * element_size / 2**20


@pytest.mark.parametrize("n_buckets", [1, 2, 3, 4])
@pytest.mark.parametrize("world_size", [2, 3])
def test_any_bucket_count_gives_the_same_parameters(pools, n_buckets, world_size):
    cap = _mlp_bucket_cap(n_buckets, element_size=8)
    named = list(MLP((8, 16, 4), dtype=torch.float64).named_parameters())
    assert len(assign_buckets(named, cap)) == n_buckets
    exp = Experiment(stage="ddp-bucketed", task="mlp", optimizer="adamw", steps=3, accum=2, dtype="float64",
                     options={"bucket_mb": cap})
    run_and_check(pools, exp, world_size)


def test_buckets_follow_reverse_registration_order():
    named = list(MLP((8, 16, 4)).named_parameters())
    buckets = assign_buckets(named, _mlp_bucket_cap(3))
    assert [b.names for b in buckets] == [["layers.1.bias", "layers.1.weight"], ["layers.0.bias"], ["layers.0.weight"]]


def _inspect_views(me):
    model = MLP((8, 16, 4), seed=me.rank)
    stage = make_stage("ddp-bucketed", model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"),
                       bucket_mb=_mlp_bucket_cap(2))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    launched_before_backward_ended = []  # per step: gradients still to come when the first bucket left
    original = stage.pipeline._order._launch

    def spy(index):
        if index == 0:
            launched_before_backward_ended.append(len(stage.trainable()) - len(stage._used))
        original(index)

    stage.pipeline._order._launch = spy
    for _ in range(2):  # the second step starts from zero_grad(): views must survive it
        train_step(stage, shard_step(x, y, me.rank, me.world_size))
    views_ok = all(
        p.grad.data_ptr() == view.data_ptr() and bucket.buffer.data_ptr() <= p.grad.data_ptr()
        < bucket.buffer.data_ptr() + bucket.buffer.numel() * bucket.buffer.element_size()
        for bucket in stage.buckets for p, view in zip(bucket.params, bucket.views, strict=True))
    # After optimizer.zero_grad() (set_to_none) the stage must take the new gradient in.
    stage.optimizer.zero_grad(set_to_none=True)
    train_step(stage, shard_step(x, y, me.rank, me.world_size))
    retaken = all(p.grad.data_ptr() == v.data_ptr() for b in stage.buckets for p, v in zip(b.params, b.views, strict=True))
    return views_ok, retaken, launched_before_backward_ended, len(stage.buckets)


def test_grads_are_views_into_buckets_and_buckets_start_during_backward(pools):
    for views_ok, retaken, launched, n_buckets in pools.run(2, _inspect_views):
        assert views_ok and retaken
        assert n_buckets == 2  # the cap is in MiB of gradient bytes
        # The first bucket (the last layer's) left while backward still had gradients to compute: overlap.
        assert launched and all(n >= 1 for n in launched), launched


def _unused_without_flag(me):
    model = EdgeModel(seed=0, dtype=torch.float64)
    stage = make_stage("ddp-bucketed", model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"))
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    train_step(stage, shard_step(x, y, me.rank, me.world_size))


def test_unused_parameter_without_flag_is_named(pools):
    with pytest.raises(RankError, match=r"parameter\(s\) \['unused'\] got no gradient.*find_unused_parameters=True"):
        pools.run(2, _unused_without_flag)


def test_unused_parameter_with_flag_completes_and_stays_put(pools):
    exp = Experiment(stage="ddp-bucketed", task="edge", optimizer="adamw", lr=0.05, steps=3, accum=3,
                     dtype="float64", options={"find_unused_parameters": True, "bucket_mb": 1e-9})
    results = run_and_check(pools, exp, 3)
    assert torch.equal(results[0].params[-1]["unused"], torch.ones(5))


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "25"])
def test_bucket_mb_must_be_positive(bad):
    with pytest.raises(ValueError, match=r"bucket_mb must be a finite number > 0, got .* \(torch DDP's default is 25\)"):
        assign_buckets(list(MLP().named_parameters()), bad)


@pytest.mark.parametrize("stage", ["ddp", "ddp-bucketed"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_accumulation_communicates_once_per_step(pools, stage, k):
    exp = Experiment(stage=stage, task="mlp", steps=2, accum=k, dtype="float64", options={"bucket_mb": 1e-9}
                     if stage == "ddp-bucketed" else {})
    results = pools.run(3, run_experiment, exp)
    assert sum(r.sent_bytes for r in results) == exp.steps * 2 * (3 - 1) * results[0].psi * 8


def _no_sync_forgotten(me, check):
    """K=2, two steps: rank r forgets no_sync() in step r.  Both ranks run three bucket all-reduces, so
    nothing hangs -- but rank 1's step-0 bucket is paired with rank 0's first micro-batch."""
    model = MLP((4, 4), seed=0)
    stage = make_stage("ddp-bucketed", model, torch.optim.SGD(model.parameters(), lr=0.1),
                       make_comm("ring", check=check))
    for step in range(2):
        stage.zero_grad()
        for k in range(2):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + k + 100 * me.rank))
            with stage.no_sync() if k == 0 and step != me.rank else contextlib.nullcontext():
                stage(x).pow(2).sum().backward()
        stage.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_no_sync_on_some_ranks_is_caught_at_the_first_bucket(pools):
    with pytest.raises(RankError) as info:
        pools.run(2, _no_sync_forgotten, True)
    message = str(info.value)
    assert "ranks disagree on the next collective" in message
    assert "rank 0: #3 all_reduce of 20 float32 (avg) for 'bucket 0', step 0, backward 1, synchronising" in message
    assert "rank 1: #3 all_reduce of 20 float32 (avg) for 'bucket 0', step 0, backward 2, synchronising" in message
    assert "no_sync() was entered on some ranks only" in message


def test_without_the_check_the_same_mistake_is_a_silent_wrong_answer(pools):
    """What the check prevents: no error anywhere, and the replicas no longer agree."""
    rank0, rank1 = pools.run(2, _no_sync_forgotten, False)
    assert not torch.allclose(rank0, rank1)


def _one_extra_synchronisation(me):
    model = MLP((4, 4), seed=0)
    stage = make_stage("ddp-bucketed", model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"))
    for k in range(2):
        with stage.no_sync() if me.rank == 0 and k == 0 else contextlib.nullcontext():
            stage(torch.randn(2, 4)).sum().backward()


def test_an_unmatched_synchronisation_is_named_not_hung(pools):
    """Rank 1 synchronises twice, rank 0 once and returns: the launcher names rank 0 within seconds."""
    with pytest.raises(RankError) as info:
        pools.run(2, _one_extra_synchronisation)
    assert "Stopped making progress: rank 0 -- it finished its task without joining this collective" in str(info.value)
    assert "rank 1: in all_reduce" in str(info.value)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes 50 ms: the layers after it finish their gradients long before the
    layers before it do."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.05)
        return grad


class _SlowMiddle(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = nn.Linear(4, 4).double(), nn.Linear(4, 2).double()

    def forward(self, x):
        return self.last(_SlowBackward.apply(torch.tanh(self.first(x))))


def _one_bucket_across_a_slow_layer(me):
    model = _SlowMiddle()
    stage = make_stage("ddp-bucketed", model, torch.optim.SGD(model.parameters(), lr=0.5), make_comm("ring"))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(me.rank), dtype=torch.float64)
    stage(x).pow(2).sum().backward()
    stage.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_bucket_is_sent_only_when_all_its_gradients_are_final(pools):
    """One bucket holds both layers.  Sent when the last layer's gradients arrive, it would be averaged
    before the first layer's are written: those would stay local, and the ranks would differ."""
    model = _SlowMiddle()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for rank in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        (model(x).pow(2).sum() / 2).backward()
    optimizer.step()
    want = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for got in pools.run(2, _one_bucket_across_a_slow_layer):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()


class _LaunchRunsTheCollective(BucketedDDP):
    """A bucket's launch that runs the all-reduce and returns its result -- None -- instead of a function."""
    name = "launch-runs-it"

    def deferred_all_reduce(self, index: int):
        super().deferred_all_reduce(index)()


def _launch_returns_none(me):
    from minizero.comm import make_comm
    from minizero.course.harness.models import MLP
    model = MLP((3, 4, 2), seed=0, dtype=torch.float64)
    stage = _LaunchRunsTheCollective(model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"))
    try:
        stage(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
    except TypeError as error:
        return str(error)
    return "no error"


def test_a_launch_that_returns_no_function_is_named(pools):
    said = pools.run(2, _launch_returns_none)[0]
    assert "launching bucket 0 returned None, not a function" in said and "must return the collective" in said, said


def test_a_ring_step_on_one_rank_is_refused_before_gloo_sees_it():
    from minizero.comm import RingComm
    ring = RingComm.__new__(RingComm)
    ring.rank, ring.world_size = 0, 1
    with pytest.raises(RuntimeError, match="a ring of N ranks takes N - 1 steps per phase, none at N = 1"):
        ring._send_right_recv_left(torch.ones(1), torch.empty(1), "all-gather", 0)


class _OneThread:
    """A Comm's part a BucketPipeline uses -- its rank and its communication thread -- without peers."""

    def __init__(self):
        from minizero.comm.thread import CommThread
        self.rank, self._thread = 0, CommThread("test-comm")

    def submit(self, fn):
        return self._thread.submit(fn)


@pytest.mark.parametrize("bound", [1, 2])
def test_zero_stages_hold_at_most_their_bound_of_buckets_in_flight(bound):
    """Backward marks five buckets at once and each reduce takes 10 ms: with the bound, a launch first waits until
    fewer than ``bound`` are in flight -- the memory of packed buckets is bounded however slow the network; without
    one (reduces held until every bucket is launched) they pile up."""
    import threading

    from minizero.parts.buckets import MAX_IN_FLIGHT, BucketPipeline
    assert MAX_IN_FLIGHT == 1  # ZeRO-2's and -3's, as FSDP2's
    params = [nn.Parameter(torch.zeros(1)) for _ in range(5)]
    comm, seen, gate = _OneThread(), {}, threading.Event()
    for limit in (bound, None):
        gate.clear()  # (set by the round before: each round's collectives wait for its own)

        def start(index, limit=limit):
            seen.setdefault(limit, []).append(len(pipeline.in_flight()))
            return (lambda: time.sleep(0.01)) if limit else gate.wait
        pipeline = BucketPipeline(comm, [[p] for p in params], start, max_in_flight=limit)
        with pipeline.round():
            for p in params:
                pipeline.mark(p)
            gate.set()
            pipeline.wait_all()
    comm._thread.close()
    assert max(seen[bound]) <= bound - 1, seen  # at most `bound` once this one is launched
    assert seen[None] == [0, 1, 2, 3, 4], seen  # without a bound: every one launched before it
    for bad in (0, 1.5, "1", True):
        with pytest.raises(ValueError, match="max_in_flight must be a whole number >= 1"):
            BucketPipeline(comm, [[p] for p in params], start, max_in_flight=bad)


@pytest.mark.parametrize("oldest", ["still running", "already failed"])
def test_a_failed_bucket_surfaces_in_wait_all_whatever_the_timing(oldest):
    """The bound makes a launch wait for the oldest bucket.  Whether that one is still running then is timing, so its
    error must not surface there: a rank that raised mid-backward would stop after another bucket than its peers, and
    the ranks would pair different collectives next (seen in CI: gloo's 'Received data size doesn't match')."""
    import threading

    from minizero.parts.buckets import BucketPipeline
    params = [nn.Parameter(torch.zeros(1)) for _ in range(3)]
    comm, gate, launched = _OneThread(), threading.Event(), []

    def overflows():
        gate.wait()
        raise FloatingPointError("bucket 0 overflowed")

    def start(index):
        launched.append(index)
        return overflows if index == 0 else (lambda: index)
    pipeline = BucketPipeline(comm, [[p] for p in params], start, max_in_flight=1)
    with pipeline.round():
        pipeline.mark(params[0])
        if oldest == "already failed":
            gate.set()
            while not pipeline._works[0].done():
                time.sleep(0.001)
        else:  # the launch of bucket 1 waits for bucket 0, which fails while it waits
            threading.Timer(0.05, gate.set).start()
        try:
            for p in params[1:]:
                pipeline.mark(p)  # never raises: every bucket is launched on every rank
        except FloatingPointError as error:
            pytest.fail(f"marking a parameter raised the oldest bucket's error, mid-backward: {error}")
        assert launched == [0, 1, 2]
        with pytest.raises(FloatingPointError, match="bucket 0 overflowed"):
            pipeline.wait_all()
    comm._thread.close()

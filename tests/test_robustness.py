"""Regressions from review: what happens around the happy path.

Each test drives a stage the way a user might -- catching an error and going
on, stepping a scheduler, evaluating between forward and backward, calling
optimizer.zero_grad() -- and checks the ranks stay equal and right.
"""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from minizero.comm import make_comm
from minizero.stages import make_stage


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 8).double(), nn.Linear(8, 2).double(), nn.Linear(8, 2).double()

    def forward(self, x, use_c=True):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.c(h) if use_c else self.b(h)


def _data(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 4, generator=g, dtype=torch.float64)


def _flat(model, stage=None):
    if hasattr(stage, "full_state_dict"):  # zero3: the model holds placeholders between uses
        state = stage.full_state_dict()
        return torch.cat([state[n].reshape(-1) for n, _ in model.named_parameters()])
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(me, stage_name, options, fault=None, steps=3):
    """``fault`` happens at step 0 and is caught; a clean run has none.  Returns the final parameters."""
    model = Branchy()
    stage = make_stage(stage_name, model, torch.optim.Adam(model.parameters(), lr=0.01), make_comm("ring"), **options)
    if fault is not None:
        stage.zero_grad()
        try:
            if fault == "unused":
                stage(_data(me.rank, 99), use_c=False).pow(2).mean().backward()
            elif fault == "overflow":
                (stage(_data(me.rank, 99)).pow(2).mean() * 1e9).backward()
            stage.step()
        except (RuntimeError, FloatingPointError):
            pass
    for s in range(steps):
        stage.zero_grad()
        stage(_data(me.rank, s)).pow(2).mean().backward()
        stage.step()
    return _flat(model, stage)


def _assert_same(results, clean):
    for r in results:
        assert torch.allclose(r, results[0], rtol=0, atol=1e-12), "ranks drifted apart"
        assert torch.allclose(r, clean[0], rtol=0, atol=1e-12), (r - clean[0]).abs().max()


@pytest.mark.parametrize("stage, options", [("ddp-bucketed", {"bucket_mb": 1e-9}), ("zero2", {"bucket_mb": 1e-9}),
                                            ("zero3", {}), ("zero1", {})])
def test_a_caught_unused_parameter_error_leaves_no_stale_state(pools, stage, options):
    clean = pools.run(2, _train, stage, options)
    _assert_same(pools.run(2, _train, stage, options, "unused"), clean)


@pytest.mark.parametrize("stage, options", [("ddp", {}), ("ddp-bucketed", {"bucket_mb": 1e-9}), ("zero1", {}),
                                            ("zero2", {"bucket_mb": 1e-9}), ("zero3", {})])
@pytest.mark.parametrize("error_feedback", [False, True])
def test_a_caught_fp16_overflow_skips_one_step_and_training_goes_on(pools, stage, options, error_feedback):
    options = {**options, "compress": "fp16", "error_feedback": error_feedback}
    clean = pools.run(2, _train, stage, options)
    _assert_same(pools.run(2, _train, stage, options, "overflow"), clean)


def _one_element_overflows(me, stage_name, options):
    """One element of one gradient is inf in the sum: under sharding only its owner decodes it."""
    model = Branchy()
    blow_up = torch.ones(model.a.weight.numel(), dtype=torch.float64)
    blow_up[0] = torch.inf
    hook = model.a.weight.register_hook(lambda grad: grad * blow_up.reshape(grad.shape))  # before ZeRO-3 reshapes it
    stage = make_stage(stage_name, model, torch.optim.Adam(model.parameters(), lr=0.01), make_comm("ring"), **options)
    said = None
    stage.zero_grad()
    try:
        stage(_data(me.rank, 99)).pow(2).mean().backward()
    except FloatingPointError as error:
        said = str(error)
        with pytest.raises(RuntimeError, match="step\\(\\) after a backward that raised"):
            stage.step()  # a user who goes on regardless is stopped: those gradients hold the inf
    raised = [None] * me.world_size  # (an exchange of its own, beside the stage's: did every rank refuse?)
    torch.distributed.all_gather_object(raised, said is not None)
    if len(set(raised)) > 1:  # going on would pair one rank's reduce-scatter with another's all-gather
        return f"only some ranks refused the step: {raised}", None
    hook.remove()
    for s in range(3):
        stage.zero_grad()
        stage(_data(me.rank, s)).pow(2).mean().backward()
        stage.step()
    return said, _flat(model, stage)


@pytest.mark.parametrize("stage, options, world_size", [
    ("zero1", {}, 2), ("zero1", {"overlap": True, "bucket_mb": 1e-9}, 3), ("zero2", {"bucket_mb": 1e-9}, 2),
    ("zero2", {}, 3), ("zero3", {}, 2), ("hsdp", {}, 4)])
@pytest.mark.parametrize("compress", ["fp16", "int8"])
def test_an_overflow_in_one_ranks_shard_is_refused_on_every_rank(pools, stage, options, world_size, compress):
    """A reduce-scatter gives each rank only its shard of the sum, so one rank alone sees the inf: the ranks agree
    before anyone raises (compress.overflow), every rank raises naming that one, and training goes on as if the
    step had not been tried.  Raising on the owner alone left its peers stepping (gloo: 'Received data size doesn't
    match expected size').  fp16 and a block-scaled codec: the 16-bit wire and the gathered one."""
    options = {**options, "compress": compress}
    results = pools.run(world_size, _one_element_overflows, stage, options)
    clean = pools.run(world_size, _train, stage, options)
    for said, flat in results:
        assert flat is not None and said is not None, said or "no rank refused the step"
        assert "the averaged gradients hold inf/NaN on rank(s) [" in said, said
        assert "every rank refuses this step together" in said, said
        named = said.split("rank(s) [")[1].split("]")[0].split(", ")  # the owner (HSDP: each node's replica of it)
        assert len(named) == (2 if stage == "hsdp" else 1), said
    _assert_same([flat for _, flat in results], clean)


def _two_synchronising_backwards(me, stage_name):
    model = Branchy()
    stage = make_stage(stage_name, model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"))
    stage.zero_grad()
    for k in range(2):  # accumulation without no_sync(): averaged twice, added
        stage(_data(me.rank, k)).pow(2).mean().backward()
    stage.step()
    return _flat(model, stage)


@pytest.mark.parametrize("stage", ["ddp-bucketed", "zero1", "zero2", "zero3"])
def test_two_synchronising_backwards_before_a_step_accumulate(pools, stage):
    _assert_same(pools.run(2, _two_synchronising_backwards, stage), pools.run(2, _two_synchronising_backwards, "ddp"))


def _user_clears_grads(me, user_zero_grad):
    model = Branchy()
    stage = make_stage("ddp-bucketed", model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"),
                       find_unused_parameters=True, bucket_mb=1e-9)
    for s in range(3):
        stage.optimizer.zero_grad(set_to_none=True) if user_zero_grad else stage.zero_grad()
        stage(_data(me.rank, s), use_c=me.rank == 0).pow(2).mean().backward()  # c is used on rank 0 only
        stage.step()
    return _flat(model, stage)


def test_unused_on_some_ranks_with_the_users_own_zero_grad(pools):
    _assert_same(pools.run(2, _user_clears_grads, True), pools.run(2, _user_clears_grads, False))


def _with_scheduler(me, stage_name):
    model = Branchy()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    stage = make_stage(stage_name, model, optimizer, make_comm("ring"))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)  # on the user's optimizer
    for s in range(3):
        stage.zero_grad()
        stage(_data(me.rank, s)).pow(2).mean().backward()
        stage.step()
        scheduler.step()
    return _flat(model, stage)


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_a_scheduler_on_the_users_optimizer_drives_the_sharded_one(pools, stage):
    _assert_same(pools.run(2, _with_scheduler, stage), pools.run(2, _with_scheduler, "ddp"))


def _eval_between(me, stage_name, twice):
    model = Branchy()
    stage = make_stage(stage_name, model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"),
                       **({"find_unused_parameters": True} if stage_name == "ddp-bucketed" else {}))
    for s in range(2):
        stage.zero_grad()
        loss = stage(_data(me.rank, s)).pow(2).mean()
        if twice:
            loss = loss + stage(_data(me.rank, s + 50)).pow(2).mean()  # two forwards, one backward
        with torch.no_grad():
            stage(_data(me.rank, 7))  # a quick evaluation between forward and backward
        loss.backward()
        stage.step()
    return _flat(model, stage)


@pytest.mark.parametrize("stage", ["ddp-bucketed", "zero1", "zero2"])
@pytest.mark.parametrize("twice", [False, True])
def test_eval_forward_between_and_two_forwards_one_backward(pools, stage, twice):
    _assert_same(pools.run(2, _eval_between, stage, twice), pools.run(2, _eval_between, "ddp", twice))


def _users_optimizer_clears(me, stage_name, user_zero_grad):
    model = Branchy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stage = make_stage(stage_name, model, optimizer, make_comm("ring"))
    for s in range(3):
        optimizer.zero_grad(set_to_none=True) if user_zero_grad else stage.zero_grad()
        stage(_data(me.rank, s)).pow(2).mean().backward()
        stage.step()
    return _flat(model, stage)


@pytest.mark.parametrize("stage", ["ddp-bucketed", "zero1"])
def test_the_users_optimizer_zero_grad_works_like_the_stages(pools, stage):
    """autograd allocates fresh .grad tensors; the stage takes them back into its buffers."""
    _assert_same(pools.run(2, _users_optimizer_clears, stage, True), pools.run(2, _users_optimizer_clears, stage, False))


class _FailsOnce(torch.autograd.Function):
    """Identity whose first backward raises -- an out-of-memory error in the middle of backward, say."""

    armed = True

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _FailsOnce.armed:
            _FailsOnce.armed = False
            raise RuntimeError("injected failure inside backward")
        return grad


def _error_inside_backward(me, stage_name, fail, options=None, step_after=False):
    _FailsOnce.armed = fail
    model = Branchy()
    stage = make_stage(stage_name, model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"),
                       **(options or {}))  # unchecked: a checked collective waits for its peers before it sends
    if fail:  # inside the model's backward, after the stage's hook on the output has queued the sync
        hook = model.a.register_forward_hook(lambda module, args, out: _FailsOnce.apply(out))
        stage.zero_grad()
        sent = threading.Event()  # rank 1 joins the collectives the failed backward launches late, so rank 0's
        stage.comm.add_observer(lambda *_, **__: sent.set())  # have sent its gradients and still wait when its
        if me.rank == 1:  # zero_grad() zeroes the buffers -- unless zero_grad() waits for them
            gate = threading.Event()
            stage.comm.submit(gate.wait)
            threading.Timer(0.5, gate.set).start()
        try:
            stage(_data(me.rank, 99)).pow(2).mean().backward()
        except RuntimeError:
            pass  # caught: the synchronisation queued for this backward never ran
        if me.rank == 0:
            sent.wait(timeout=5)
        hook.remove()
        if step_after:
            refusals = []
            for _ in range(2):
                try:
                    stage.step()
                except RuntimeError as error:
                    refusals.append(str(error))
            assert len(refusals) == 2 and all(f"rank {me.rank}: step() after a backward that raised part-way" in r
                                          and "Call zero_grad() and run the step's forward and backward again" in r
                                          for r in refusals), refusals
    for s in range(3):
        stage.zero_grad()
        stage(_data(me.rank, s)).pow(2).mean().backward()
        stage.step()
    return _flat(model, stage)


@pytest.mark.parametrize("stage, options", [("ddp", {}), ("ddp-bucketed", {}), ("ddp-bucketed", {"bucket_mb": 1e-9}),
                                            ("zero1", {}), ("zero2", {}), ("zero2", {"bucket_mb": 1e-9}), ("zero3", {})])
def test_an_error_inside_backward_leaves_no_synchronisation_pending(pools, stage, options):
    """The next backward synchronises again: the same training as without the error.  With one parameter
    a bucket, the buckets of the layers behind the failure were already launched: zero_grad() waits for them
    before it zeroes the buffers they write into (rank 0's had sent and were still running, in CI once)."""
    _assert_same(pools.run(2, _error_inside_backward, stage, True, options),
                 pools.run(2, _error_inside_backward, stage, False, options))


@pytest.mark.parametrize("stage", ["ddp-bucketed", "zero2"])
def test_a_step_after_a_backward_that_raised_is_refused_until_zero_grad(pools, stage):
    """Its gradients were only partly averaged: stepping on them would part the replicas."""
    _assert_same(pools.run(2, _error_inside_backward, stage, True, {"bucket_mb": 1e-9}, True),
                 pools.run(2, _error_inside_backward, stage, False, {"bucket_mb": 1e-9}))


def _step_twice_after_no_sync(me):
    model = Branchy()
    stage = make_stage("ddp", model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"))
    with stage.no_sync():
        stage(_data(me.rank, 0)).pow(2).mean().backward()
    refusals = 0
    for _ in range(2):
        try:
            stage.step()
        except RuntimeError:
            refusals += 1
    return refusals


def test_a_refused_step_stays_refused(pools):
    """Catching the refusal and calling step() again must not step on the local gradients."""
    assert pools.run(2, _step_twice_after_no_sync) == [2, 2]


def _retry_after_unused(me):
    model = Branchy()
    stage = make_stage("zero1", model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"))
    messages = []
    stage.zero_grad()
    for _ in range(2):  # a retry without zero_grad(): nothing was reduced, so nothing stands in its way
        try:
            stage(_data(me.rank, 0), use_c=False).pow(2).mean().backward()
        except RuntimeError as error:
            messages.append(str(error))
    return messages


def test_zero1_names_the_unused_parameter_again_on_a_retry(pools):
    """Nothing was reduced the first time, so the second error is the same one, not a 'second backward'."""
    for messages in pools.run(2, _retry_after_unused):
        assert len(messages) == 2 and all("got no gradient" in m for m in messages), messages


def _c_in_the_first_micro_batch_only(me, stage_name):
    model = Branchy()
    stage = make_stage(stage_name, model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring", check=True))
    for s in range(2):
        stage.zero_grad()
        with stage.no_sync():
            stage(_data(me.rank, 10 * s)).pow(2).mean().backward()  # c gets its gradient here...
        stage(_data(me.rank, 10 * s + 1), use_c=False).pow(2).mean().backward()  # ...and not here
        stage.step()
    return _flat(model, stage)


@pytest.mark.parametrize("stage", ["ddp-bucketed", "zero1", "zero2", "zero3"])
def test_a_gradient_from_an_earlier_micro_batch_counts(pools, stage):
    """c has a gradient -- accumulated in the no_sync() micro-batch -- though the synchronising one did
    not use it: no refusal, and the same training as ddp."""
    _assert_same(pools.run(2, _c_in_the_first_micro_batch_only, stage),
                 pools.run(2, _c_in_the_first_micro_batch_only, "ddp"))


# ---------------------------------------------------------------------------- a bucket that fails, caught, the step again
@pytest.mark.parametrize("stage, options", [("ddp-bucketed", {}), ("zero1", {"overlap": True}), ("zero2", {}),
                                            ("zero3", {}), ("zero3", {"prefetch": 0})])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_bucket_that_fails_on_every_rank_then_the_step_again_is_single_device_training(pools, stage, options,
                                                                                         world_size):
    """Step 2's first bucket raises on the communication thread in place of its collective, on every rank, before
    any message leaves (``Experiment.launch_fails_at``); the loop catches it and runs the step again from
    ``zero_grad()``.  The run must equal single-device training: the failed round's marks and launches forgotten
    (``BucketPipeline.round``), its packed gradients and queued synchronisation let go, nothing stepped twice."""
    from minizero.course.harness.experiment import Experiment
    from tests.equivalence import run_and_check
    units = stage == "zero3"  # a bucket a unit: the GPT's blocks; the others' buckets, one parameter each
    exp = Experiment(stage=stage, task="gpt" if units else "mlp", model={} if units else {"sizes": (3, 5, 4, 2)},
                     optimizer="adam", steps=3, accum=2, dtype="float64", launch_fails_at=1,
                     options=options if units else {**options, "bucket_mb": 1e-9})
    run_and_check(pools, exp, world_size)

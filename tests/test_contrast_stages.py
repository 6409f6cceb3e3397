"""The designs set beside DDP and ZeRO: the parameter server (equivalent), async and local SGD (not, by design).

``ps`` faces the same properties as every stage.  ``ps-async`` and ``local-sgd`` are tested where they *are*
single-device training (staleness 0; H = 1 with plain SGD) and to differ, finitely and reproducibly, where
they are not.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.course.harness.equivalence import DTYPES, judge
from minizero.course.harness.experiment import Experiment, reference_of, run_experiment
from minizero.course.harness.tasks import TASKS
from minizero.run.train import shard_step, sum_loss
from minizero.stages import STAGES
from minizero.stages.ps_async import delay
from tests.equivalence import covering, examples, experiments, run_and_check


def _with(exp: Experiment, stage: str, **options) -> Experiment:
    return replace(exp, stage=stage, options={**exp.options, **options})


def _same_parameters(a: list, b: list) -> bool:
    """Every rank, every step, every parameter: bit for bit."""
    return all(torch.equal(pa[k], pb[k]) for ra, rb in zip(a, b, strict=True)
               for pa, pb in zip(ra.params, rb.params, strict=True) for k in pa)


# ------------------------------------------------------------------ ps: a stage like any other
@covering
@settings(max_examples=examples(12))
@given(data=st.data())
def test_ps_matches_reference(pools, data):
    """Drawn world sizes 1-4, S from 1 to N (uneven shards, workers that own nothing), K up to 3, uneven
    and empty batches, frozen, unused and tied parameters, clipping, two param groups."""
    exp, world_size = data.draw(experiments("ps"))
    run_and_check(pools, exp, world_size)


@covering
@settings(max_examples=examples(6))
@given(data=st.data())
def test_ps_matches_the_same_casts_reference_under_compression_and_mixed_precision(pools, data):
    """The servers add the 16-bit contributions in the ring's order: the same-casts reference holds tightly."""
    exp, world_size = data.draw(experiments("ps", precision=True, world_sizes=(2, 3, 4)))
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ps_bytes_mean_is_the_rings_and_the_busiest_rank_is_a_server(pools, world_size):
    """The ledger: push and pull only.  The mean over ranks is ZeRO-1's; the busiest rank's load grows with N
    for one server and is the ring's per-rank load when every rank serves."""
    busiest = {}
    for servers in sorted({1, 2 if world_size > 2 else 1, world_size}):
        exp = Experiment(stage="ps", task="gpt", steps=2, accum=2, dtype="float32", options={"servers": servers})
        results = pools.run(world_size, run_experiment, exp)
        psi, cls = results[0].psi, STAGES["ps"]
        per_rank = [r.sent_bytes / exp.steps for r in results]
        assert set().union(*(r.sent_by_kind for r in results)) == {"push", "pull"}
        slack = 4 * servers * world_size  # padding to a multiple of S: < S elements per group, two groups at most
        mean = cls.sent_bytes_per_step(psi, world_size, 4, 4, servers=servers)
        assert mean <= sum(per_rank) / world_size <= mean + slack, (per_rank, mean)
        busiest[servers] = max(per_rank)
        formula = cls.busiest_sent_bytes_per_step(psi, world_size, 4, 4, servers=servers)
        assert formula <= busiest[servers] <= formula + slack, (servers, per_rank, formula)
        assert per_rank.index(max(per_rank)) < servers  # a server, not a worker
    assert busiest[1] >= (world_size - 1) * psi * 4  # one server sends every other rank the whole model
    assert busiest[world_size] <= 2 * psi * 4 + 4 * world_size ** 2  # every rank serving: the ring's 2(N-1)/N


@pytest.mark.parametrize("servers", [1, 2])
def test_ps_memory_matches_its_formula(pools, servers):
    exp = Experiment(stage="ps", task="gpt", steps=1, dtype="float32", optimizer="adamw", options={"servers": servers})
    results = pools.run(3, run_experiment, exp)
    formula = STAGES["ps"].state_bytes(results[0].psi, 3, 4, 2, servers=servers)
    assert abs(results[0].held_bytes["total"] - formula) <= 0.02 * formula, (results[0].held_bytes, formula)
    assert results[-1].held_bytes["optimizer"] == 0  # rank 2 is a pure worker: no optimizer state
    assert (results[0].held_bytes["optimizer"] > 0) and (results[1].held_bytes["optimizer"] > 0) == (servers == 2)


# ------------------------------------------------------------------ ps-async
def test_the_schedule_is_seeded_and_bounded():
    draws = [delay(7, step, rank, 3) for step in range(50) for rank in range(4)]
    assert set(draws) == {0, 1, 2, 3}  # every staleness up to the bound occurs, none beyond
    assert draws == [delay(7, step, rank, 3) for step in range(50) for rank in range(4)]  # replays
    assert draws != [delay(8, step, rank, 3) for step in range(50) for rank in range(4)]  # another seed, another run
    assert {delay(7, step, rank, 0) for step in range(50) for rank in range(4)} == {0}


@covering
@settings(max_examples=examples(8))
@given(data=st.data())
def test_ps_async_without_staleness_is_ps_bit_for_bit(pools, data):
    exp, world_size = data.draw(experiments("ps", precision=data.draw(st.booleans()), world_sizes=(2, 3, 4)))
    ps = pools.run(world_size, run_experiment, exp)
    stale0 = pools.run(world_size, run_experiment, _with(exp, "ps-async", staleness=0))
    assert _same_parameters(ps, stale0)
    assert [r.sent_bytes for r in ps] == [r.sent_bytes for r in stale0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_staleness_changes_the_result_and_the_schedule_replays_it(pools, world_size):
    exp = Experiment(stage="ps-async", task="mlp", optimizer="sgd", lr=0.1, steps=4, dtype="float64",
                     options={"staleness": 2, "schedule_seed": 1})
    runs = [pools.run(world_size, run_experiment, e) for e in (exp, exp, _with(exp, "ps-async", schedule_seed=2))]
    verdict = judge(runs[0], reference_of(exp, world_size), "float64")
    assert verdict.nonfinite is None and not verdict.ok and verdict.max_rel_diff > 1e-6, verdict
    assert _same_parameters(runs[0], runs[1])  # the same seed: the same run, bit for bit
    assert not _same_parameters(runs[0], runs[2])  # another schedule: another run
    ps = pools.run(world_size, run_experiment, replace(exp, stage="ps", options={}))
    assert [r.sent_bytes for r in runs[0]] == [r.sent_bytes for r in ps]  # stale, but the same bytes


def _stale_sgd(exp: Experiment, world_size: int) -> list[dict]:
    """One process, the arithmetic of an asynchronous server: rank r's gradient of step t taken at the
    parameters the schedule gives it, theta_(t - age), the N gradients averaged, one SGD step."""
    task, dtype, s, seed = TASKS[exp.task], DTYPES[exp.dtype], exp.options["staleness"], exp.options["schedule_seed"]
    model = task.make_model(exp.seed, dtype, **exp.model)  # rank 0's initialisation: what the wrap broadcasts
    names, params = zip(*model.named_parameters(), strict=True)
    versions = [[p.detach().clone() for p in params]]
    for t in range(exp.steps):
        x, y = task.make_batch(exp.global_batch(world_size), exp.seed, t, dtype, **exp.model)
        total = [torch.zeros_like(p) for p in params]
        for r in range(world_size):
            age = min(delay(seed, t, r, s), t, s)  # nothing older than the start, nor than the servers keep
            with torch.no_grad():
                for p, v in zip(params, versions[t - age], strict=True):
                    p.copy_(v)
            step = shard_step(x, y, r, world_size, exp.accum)
            model.zero_grad()
            for xb, yb in step.micro_batches:
                (sum_loss(model(xb), yb) * world_size / step.global_count).backward()
            total = [a + p.grad for a, p in zip(total, params, strict=True)]
        versions.append([v - exp.lr * g / world_size for v, g in zip(versions[t], total, strict=True)])
    return [dict(zip(names, v, strict=True)) for v in versions[1:]]


@pytest.mark.parametrize("world_size, servers", [(2, 1), (4, 2)])
def test_ps_async_computes_each_gradient_on_the_version_its_schedule_names(pools, world_size, servers):
    """Not only "differs": the run is the stale-gradient arithmetic, step by step -- an off-by-one in the
    versions kept or sent shows here."""
    exp = Experiment(stage="ps-async", task="mlp", optimizer="sgd", lr=0.1, steps=5, accum=2, dtype="float64",
                     options={"staleness": 2, "schedule_seed": 3, "servers": servers})
    want = _stale_sgd(exp, world_size)
    for result in pools.run(world_size, run_experiment, exp):
        for t, (got, expected) in enumerate(zip(result.params, want, strict=True)):
            for name, value in expected.items():
                scale = max(value.abs().max().item(), 1e-30)
                assert (got[name] - value).abs().max().item() <= 1e-12 * scale, (t, name)


def test_ps_async_memory_counts_the_kept_versions(pools):
    exp = Experiment(stage="ps-async", task="gpt", steps=3, dtype="float32", optimizer="adamw",
                     options={"staleness": 2, "servers": 2})
    results = pools.run(2, run_experiment, exp)
    formula = STAGES["ps-async"].state_bytes(results[0].psi, 2, 4, 2, servers=2, staleness=2)
    assert abs(results[0].held_bytes["total"] - formula) <= 0.02 * formula, (results[0].held_bytes, formula)


# ------------------------------------------------------------------ local-sgd
@covering
@settings(max_examples=examples(8))
@given(data=st.data())
def test_local_sgd_averaging_every_step_with_plain_sgd_is_single_device_training(pools, data):
    """mean_r(p - lr g_r) = p - lr mean_r(g_r): DDP's step -- uneven and empty batches and unused
    parameters included (clipping is per rank here, so none)."""
    exp, world_size = data.draw(experiments("local-sgd"))
    exp = replace(exp, optimizer="sgd", clip=None, options={"average_every": 1})
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("optimizer, average_every", [("sgd", 2), ("adam", 1)])
def test_local_sgd_departs_with_local_steps_or_adam(pools, optimizer, average_every):
    exp = Experiment(stage="local-sgd", task="mlp", optimizer=optimizer, lr=0.05, steps=4, dtype="float64",
                     options={"average_every": average_every})
    verdict = judge(pools.run(3, run_experiment, exp), reference_of(exp, 3), "float64")
    assert verdict.nonfinite is None and not verdict.ok and verdict.max_rel_diff > 1e-6, verdict


def test_local_sgd_replicas_agree_right_after_each_average_and_only_then(pools):
    exp = Experiment(stage="local-sgd", task="mlp", optimizer="adam", steps=6, dtype="float64",
                     options={"average_every": 3})
    results = pools.run(3, run_experiment, exp)
    for t in range(exp.steps):
        same = all(torch.equal(r.params[t][k], results[0].params[t][k]) for r in results for k in r.params[t])
        assert same == ((t + 1) % 3 == 0), t  # after steps 3 and 6


def _anchor_after_loading(me):
    from minizero.comm import make_comm
    from minizero.course.harness.models import MLP
    from minizero.stages import make_stage
    model = MLP((3, 2), dtype=torch.float64)
    stage = make_stage("local-sgd", model, torch.optim.Adam(model.parameters()), make_comm("ring"), outer_lr=0.7)
    loaded = {k: torch.full_like(v, 10.0) for k, v in model.state_dict().items()}
    stage.load_full_state_dict(loaded)
    return [a.detach().clone() for a in stage.anchor]


def test_a_resumed_diloco_run_anchors_at_the_loaded_parameters(pools):
    """The outer step moves the anchor by the averaged change: an anchor left at the wrap-time weights would
    pull a resumed run back towards its initialisation."""
    for anchors in pools.run(2, _anchor_after_loading):
        assert all(torch.equal(a, torch.full_like(a, 10.0)) for a in anchors)


def test_local_sgd_bytes_fall_as_one_over_h(pools):
    sent = {}
    for h in (1, 2, 4):
        exp = Experiment(stage="local-sgd", task="gpt", optimizer="adamw", steps=4, dtype="float32",
                         options={"average_every": h})
        results = pools.run(3, run_experiment, exp)
        sent[h] = sum(r.sent_bytes for r in results) / (3 * exp.steps)
        formula = STAGES["local-sgd"].sent_bytes_per_step(results[0].psi, 3, 4, 4, average_every=h)
        assert abs(sent[h] - formula) <= 0.01 * formula, (h, sent[h], formula)
        assert set(results[0].sent_by_kind) == {"all_reduce"}
    assert sent[1] == 2 * sent[2] == 4 * sent[4]


def test_diloco_with_unit_outer_lr_and_no_momentum_is_plain_averaging(pools):
    exp = Experiment(stage="local-sgd", task="mlp", optimizer="adam", steps=4, dtype="float64",
                     options={"average_every": 2})
    plain = pools.run(2, run_experiment, exp)
    unit = pools.run(2, run_experiment, _with(exp, "local-sgd", outer_lr=1.0, outer_momentum=0.0))
    diloco = pools.run(2, run_experiment, _with(exp, "local-sgd", outer_lr=0.7, outer_momentum=0.9))
    # rank by rank: between averages the ranks differ
    assert all(judge([u], p, "float64").ok for u, p in zip(unit, plain, strict=True))  # anchor - (anchor - mean) = mean
    assert not all(judge([d], p, "float64").ok for d, p in zip(diloco, plain, strict=True))
    outer = STAGES["local-sgd"].state_bytes(diloco[0].psi, 2, 8, 2, outer_lr=0.7)
    assert abs(diloco[0].held_bytes["total"] - outer) <= 0.02 * outer, (diloco[0].held_bytes, outer)


#: DiLoCo's run in the replay below: N workers, H inner Adam steps between outer steps, the paper's outer settings.
DILOCO = {"n": 3, "steps": 6, "average_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9, "lr": 0.05}


def _worker_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(5, 8, generator=generator, dtype=torch.float64),
            torch.randn(5, 4, generator=generator, dtype=torch.float64))


def _diloco_rank(me, outer: bool = True):
    from minizero.comm import make_comm
    from minizero.course.harness.models import MLP
    from minizero.stages import make_stage
    model = MLP(seed=0, dtype=torch.float64)
    comm = make_comm("ring")
    try:
        stage = make_stage("local-sgd", model, torch.optim.Adam(model.parameters(), lr=DILOCO["lr"]), comm,
                           average_every=DILOCO["average_every"],
                           **({"outer_lr": DILOCO["outer_lr"], "outer_momentum": DILOCO["outer_momentum"]} if outer
                              else {}))
        for step in range(DILOCO["steps"]):
            x, y = _worker_batch(me.rank, step)
            torch.nn.functional.mse_loss(stage(x), y).backward()
            stage.step()
            stage.zero_grad()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        comm.close()


def diloco_replay(outer: bool = True) -> list[list[torch.Tensor]]:
    """Douillard et al.'s Algorithm 1 in one process, written from the paper and not from the stage: each worker
    its own replica and its own Adam (never averaged); every H steps the outer gradient Delta = anchor -
    mean_w(replica_w), the outer Nesterov step by hand -- v = mu v + Delta (v = Delta at first), anchor -= lr (Delta
    + mu v) -- and every replica set to the anchor; without the outer optimizer (Stich's local SGD), set to the mean.
    Returns each worker's parameters at the end."""
    from minizero.course.harness.models import MLP
    workers = [MLP(seed=0, dtype=torch.float64) for _ in range(DILOCO["n"])]
    inner = [torch.optim.Adam(w.parameters(), lr=DILOCO["lr"]) for w in workers]
    anchor = [p.detach().clone() for p in workers[0].parameters()]
    velocity = None
    mu, outer_lr = DILOCO["outer_momentum"], DILOCO["outer_lr"]
    for step in range(DILOCO["steps"]):
        for rank, (worker, optimizer) in enumerate(zip(workers, inner, strict=True)):
            x, y = _worker_batch(rank, step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(worker(x), y).backward()
            optimizer.step()
        if (step + 1) % DILOCO["average_every"] == 0:
            replicas = [list(w.parameters()) for w in workers]
            mean = [torch.stack([r[i].detach() for r in replicas]).mean(0) for i in range(len(anchor))]
            delta = [a - m for a, m in zip(anchor, mean, strict=True)]
            velocity = delta if velocity is None else [mu * v + d for v, d in zip(velocity, delta, strict=True)]
            anchor = [a - outer_lr * (d + mu * v) for a, d, v in zip(anchor, delta, velocity, strict=True)] \
                if outer else mean
            with torch.no_grad():
                for replica in replicas:
                    for p, a in zip(replica, anchor, strict=True):
                        p.copy_(a)
    return [[p.detach().clone() for p in w.parameters()] for w in workers]


@pytest.mark.parametrize("outer", [True, False], ids=["diloco", "local-sgd"])
def test_diloco_equals_a_one_process_replay_of_the_papers_update(pools, outer):
    """Not only against itself at a degenerate setting (outer_lr = 1, no momentum): the stage's every rank, after
    three outer steps of Nesterov momentum 0.9 over Adam workers, equals the paper's update replayed in one process
    -- to float64 rounding (the mean is summed in another order).  Heavy-ball momentum instead of Nesterov's, an
    outer gradient of the wrong sign, or Adam states averaged, would each be off by far more.  Plain local SGD (no
    outer optimizer) against the same replay setting each replica to the mean."""
    replay = diloco_replay(outer)
    for rank, params in enumerate(pools.run(DILOCO["n"], _diloco_rank, outer)):
        for i, (mine, theirs) in enumerate(zip(params, replay[rank], strict=True)):
            assert torch.allclose(mine, theirs, rtol=0, atol=1e-12), (rank, i, (mine - theirs).abs().max().item())


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("stage, options, words", [
    ("ps", {"servers": 0}, "servers from 1 to the world size 2"),
    ("ps", {"servers": 3}, "servers from 1 to the world size 2"),
    ("ps-async", {"staleness": -1}, "staleness as a whole number of steps >= 0"),
    ("local-sgd", {"average_every": 0}, "average_every as a whole number of steps >= 1"),
    ("local-sgd", {"outer_lr": 0.7, "outer_momentum": 1.0}, "0 <= outer_momentum < 1"),
])
def test_bad_options_are_refused_with_the_rank_and_the_value(pools, stage, options, words):
    exp = Experiment(stage=stage, task="mlp", steps=1, options=options)
    with pytest.raises(Exception, match=r"rank \d: stage") as raised:
        pools.run(2, run_experiment, exp)
    assert words in str(raised.value)


@pytest.mark.parametrize("stage", ["ps-async", "local-sgd"])
def test_stages_whose_ranks_differ_refuse_a_checkpoint(pools, tmp_path, stage):
    exp = Experiment(stage=stage, task="mlp", steps=1, save=str(tmp_path / "ckpt"))
    with pytest.raises(Exception, match="cannot be checkpointed"):
        pools.run(2, run_experiment, exp)
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written


def _wrap_without_optimizer(me, stage):
    from minizero.comm import make_comm
    from minizero.course.harness.models import MLP
    from minizero.stages import make_stage
    make_stage(stage, MLP((3, 2)), comm=make_comm("ring"))


@pytest.mark.parametrize("stage, words", [("ps", "keeps the optimizer on its servers, so it must be given at wrap time"),
                                          ("local-sgd", "so it must own the optimizer")])
def test_a_stage_that_steps_on_its_own_terms_must_be_given_the_optimizer(pools, stage, words):
    with pytest.raises(Exception, match=r"rank \d: stage") as raised:
        pools.run(2, _wrap_without_optimizer, stage)
    assert words in str(raised.value)


@pytest.mark.parametrize("argv, words", [
    (["--stage", "ps-async", "--save", "ckpt"], "stage 'ps-async' cannot be checkpointed"),
    (["--stage", "local-sgd", "--save", "ckpt"], "stage 'local-sgd' cannot be checkpointed"),
    (["--stage", "ddp", "--servers", "2"], "--stage ddp takes no --servers"),
    (["--stage", "local-sgd", "--precision", "bf16"], "--stage local-sgd takes no --precision"),
])
def test_train_refuses_what_a_stage_cannot_do_before_it_trains(tmp_path, argv, words):
    from minizero.__main__ import parser
    from minizero.course.commands.train_command import make_run
    with pytest.raises(ValueError) as raised:
        make_run(parser().parse_args(["train", *argv]))
    assert words in str(raised.value)
    assert not (tmp_path / "ckpt").exists()


def test_the_scaling_model_puts_one_server_on_the_critical_path():
    """cost_model's push and pull: one server's time grows as N-1; every rank serving costs the ring's."""
    from minizero.comm import PRESETS
    from minizero.costs.cost_model import StepPlan, predict
    net = PRESETS["ethernet-100g"]

    def comm_s(stage, n, **options):
        return predict(STAGES[stage], StepPlan(n, net, 0.01, 0.02, (0.0, 1e8), options=options)).comm_s

    one = [comm_s("ps", n, servers=1) for n in (2, 4, 8)]
    assert one[2] / one[0] == pytest.approx(7, rel=0.05)  # (N-1) times the model, out of one port
    for n in (2, 4, 8):
        assert comm_s("ps", n, servers=n) == pytest.approx(comm_s("ddp", n), rel=0.05)
    assert comm_s("local-sgd", 8, average_every=4) == pytest.approx(comm_s("ddp", 8) / 4, rel=1e-9)

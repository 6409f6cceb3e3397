"""The roofline (minizero.costs.roofline): every figure equal to its formula -- 6 Psi FLOPs a token, the tokens a GPU
needs to hide a stage's bytes, McCandlish et al.'s noise-scale estimators -- and the noise scale measured on ranks
from the gradients a data-parallel step already has."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from minizero.comm import PRESETS
from minizero.costs.roofline import compute_s, mfu, noise_scale, step_flops, tokens_to_hide
from minizero.course.harness.noise_scale import gradient_norms, measure
from minizero.course.harness.tasks import TASKS
from minizero.stages import STAGES

PEAK, U, BETA = 989e12, 0.4, 50e9


def test_a_step_is_6_psi_flops_a_token_and_mfu_reads_it_back():
    assert step_flops(1e9, 2048) == 6 * 1e9 * 2048
    seconds = compute_s(7e9, 4096, PEAK, U)
    assert seconds == pytest.approx(6 * 7e9 * 4096 / (U * PEAK), rel=1e-15)
    assert mfu(7e9, 4096 / seconds, PEAK) == pytest.approx(U, rel=1e-12)


@pytest.mark.parametrize("b", [2, 4])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 1024])
def test_ddp_needs_n_minus_1_over_n_b_u_p_over_2_beta_tokens_whatever_psi(n, b):
    """The anchor's bound: DDP's 2(N-1)/N Psi b bytes behind 4 Psi T FLOPs of backward; Psi cancels."""
    want = (n - 1) / n * b * U * PEAK / (2 * BETA)
    for psi in (1.2e8, 7e9, 1.75e11):
        hide = tokens_to_hide(STAGES["ddp"], psi, n, BETA, PEAK, U, b, b)
        assert hide.sent_bytes == pytest.approx(2 * (n - 1) / n * psi * b, rel=1e-12)
        assert hide.backward == pytest.approx(want, rel=1e-12, abs=1e-9)
        assert hide.step == pytest.approx(want * 4 / 6, rel=1e-12, abs=1e-9)


@pytest.mark.parametrize("n", [2, 3, 64])
def test_zero3_sends_half_again_and_behind_the_whole_step_needs_ddps_tokens(n):
    ddp, zero3 = (tokens_to_hide(STAGES[s], 1e9, n, BETA, PEAK, U) for s in ("ddp-bucketed", "zero3"))
    assert zero3.sent_bytes == pytest.approx(1.5 * ddp.sent_bytes, rel=1e-12)
    assert zero3.backward == pytest.approx(1.5 * ddp.backward, rel=1e-12)
    assert zero3.step == pytest.approx(ddp.backward, rel=1e-12)
    for stage in ("zero1", "zero2"):  # a reduce-scatter and an all-gather: an all-reduce's bytes
        assert tokens_to_hide(STAGES[stage], 1e9, n, BETA, PEAK, U).backward == pytest.approx(ddp.backward, rel=1e-12)


def test_the_estimators_invert_the_expected_squared_norms():
    """E|G_B|^2 = |G|^2 + tr(Sigma)/B: fed the exact expectations at two batch sizes, both come back exactly."""
    g2, trace = 0.3, 12.0
    at = {b: g2 + trace / b for b in (2, 8)}
    scale = noise_scale(at[2], at[8], 2, 8)
    assert scale.true_norm2 == pytest.approx(g2, rel=1e-12) and scale.trace == pytest.approx(trace, rel=1e-12)
    assert scale.simple == pytest.approx(40.0, rel=1e-12)
    for small, big in ((8, 2), (2, 2), (0, 4)):
        with pytest.raises(ValueError, match="0 < small < big"):
            noise_scale(1.0, 0.5, small, big)


def test_sampled_gradients_of_a_known_noise_recover_its_scale():
    """Per-example gradients G + noise of covariance diag(s^2): tr(Sigma)/|G|^2 is known; the estimators, averaged
    over many steps as the paper averages them, land within 5% of it (a fixed seed: the same draws every run)."""
    gen = torch.Generator().manual_seed(0)
    dim, small, n = 50, 4, 8
    mean = torch.randn(dim, generator=gen, dtype=torch.float64) * 0.2
    spread = torch.rand(dim, generator=gen, dtype=torch.float64) + 0.5
    true = float(spread.square().sum() / mean.square().sum())
    small_norms, big_norms = [], []
    for _ in range(4000):
        examples = mean + torch.randn(n * small, dim, generator=gen, dtype=torch.float64) * spread
        per_rank = examples.view(n, small, dim).mean(1)
        small_norms.append(float(per_rank.square().sum(1).mean()))
        big_norms.append(float(per_rank.mean(0).square().sum()))
    got = noise_scale(sum(small_norms) / 4000, sum(big_norms) / 4000, small, n * small).simple
    assert got == pytest.approx(true, rel=0.05), (got, true)


@pytest.mark.parametrize("n", [2, 3])
def test_on_ranks_the_average_is_the_gradient_of_every_ranks_examples(pools, n):
    """The "big batch" is really N b examples: step 0's averaged squared norm equals one process's over the
    concatenated batch, and the mean of the ranks' own norms (batch b) is larger -- noise averages out."""
    model, per_rank = {"d_model": 16, "n_layer": 1, "n_head": 2, "block_size": 8}, 2
    norms = pools.run(n, gradient_norms, model, per_rank, 2)
    assert all(r == norms[0] for r in norms)  # every rank read the same two numbers
    gpt = TASKS["gpt"].make_model(0, torch.float32, **model)
    x, y = TASKS["gpt"].make_batch(n * per_rank, 0, 0, torch.float32, **model)
    logits = gpt(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    whole = sum(float(p.grad.square().sum()) for p in gpt.parameters())
    assert norms[0][0][1] == pytest.approx(whole, rel=1e-5)
    assert all(small > big for small, big, _ in norms[0])
    assert measure(norms[0], per_rank, n).simple > 0


def test_the_command_prints_the_bound_for_each_stage_and_refuses_what_it_cannot_read(capsys):
    from minizero.__main__ import main
    assert main(["roofline", "--world-size", "2,8", "--stages", "ddp-bucketed,zero3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    net = PRESETS["infiniband-ndr"]
    for row in rows:
        hide = tokens_to_hide(STAGES[row["stage"]], 1e9, row["world_size"], net.bandwidth, 989e12, 0.4)
        assert row["tokens_behind_backward"] == pytest.approx(hide.backward, rel=1e-12)
        assert row["global_tokens"] == pytest.approx(row["world_size"] * hide.backward, rel=1e-12)
    assert [(r["stage"], r["world_size"]) for r in rows] == [("ddp-bucketed", 2), ("ddp-bucketed", 8), ("zero3", 2),
                                                              ("zero3", 8)]
    for argv, said in ((["--mfu", "1.5"], "share of the peak"), (["--stages", "zero9"], "unknown zero9"),
                       (["--network", "nodes=2x4,intra=nvlink,inter=infiniband-ndr"], "one wire")):
        assert main(["roofline", *argv]) == 2
        assert said in capsys.readouterr().err

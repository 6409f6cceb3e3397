"""Lesson 15's simulations: tensor parallelism computes the same block, the pipeline replay gives the known
bubble, the ZeRO-3 / tensor-parallel crossover sits at 4.5·h tokens, the warm-up is torch's LinearLR."""
from __future__ import annotations

import pytest
import torch

from minizero.comm.network import PRESETS
from minizero.course.harness import parallelism as par
from minizero.course.harness.tasks import TASKS


@pytest.mark.parametrize("t", [1, 2, 4])
def test_tensor_parallel_block_matches_the_block(t):
    block = TASKS["gpt"].make_model(0, torch.float64).blocks[0]
    g = torch.Generator().manual_seed(1)
    x, probe = (torch.randn(2, 8, 32, dtype=torch.float64, generator=g) for _ in range(2))
    x_ref = x.clone().requires_grad_()
    out = block(x_ref)
    (out * probe).sum().backward()
    ranks, ledger = par.split_block(block, t), par.Ledger()
    xs = [x.clone().requires_grad_() for _ in range(t)]
    outs = par.tensor_parallel_block(xs, ranks, block.attn.n_head, ledger)
    sum((o * probe).sum() for o in outs).backward()
    for o, xi, w in zip(outs, xs, ranks, strict=True):
        torch.testing.assert_close(o, out, rtol=0, atol=1e-12)
        torch.testing.assert_close(xi.grad, x_ref.grad, rtol=0, atol=1e-12)
        torch.testing.assert_close(w["ln2_w"].grad, block.ln2.weight.grad, rtol=0, atol=1e-12)
    fc = torch.cat([w["fc"].grad for w in ranks])  # column-parallel: the slices stack into the whole
    torch.testing.assert_close(fc, block.fc.weight.grad, rtol=0, atol=1e-12)
    assert (ledger.count("forward"), ledger.count("backward")) == (2, 2)
    assert {n for _, n in ledger.all_reduces} == {x.numel() * 8}


def test_split_refuses_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="heads"):
        par.split_block(TASKS["gpt"].make_model(0, torch.float32).blocks[0], 3)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (4, 8), (3, 7)])
def test_pipeline_bubble_and_memory(kind, p, m):
    spans = par.replay_pipeline(kind, p, m)
    assert len(spans) == 2 * p * m
    assert par.bubble_fraction(spans, p) == pytest.approx((p - 1) / (m + p - 1))
    held = [par.peak_in_flight(spans, s) for s in range(p)]
    assert held == ([m] * p if kind == "gpipe" else [min(p - s, m) for s in range(p)])


def test_crossover_at_four_and_a_half_h():
    net, (layers, hidden) = PRESETS["nvlink"], (4, 256)
    zero3 = par.zero3_step(layers, hidden, 8, net)[0]
    assert par.tensor_parallel_step(layers, hidden, int(4.5 * hidden), 8, net)[0] == pytest.approx(zero3)


def test_activation_formulas_and_warmup():
    s, b, h, a = 2048, 1, 12288, 96
    assert par.activation_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert par.activation_bytes_per_layer(s, b, h, a, t=1, sequence_parallel=True) == par.activation_bytes_per_layer(
        s, b, h, a)
    assert par.goyal_lr(0) == pytest.approx(0.1) and par.goyal_lr(5) == pytest.approx(3.2)
    assert par.goyal_lr(2.5) == pytest.approx((0.1 + 3.2) / 2) and par.goyal_lr(85) == pytest.approx(0.0032)


def test_trust_ratios():
    w, g = torch.tensor([3.0, 4.0]), torch.tensor([0.6, -0.8])
    lars, lamb = par.trust_ratios(w, g)
    assert lars == pytest.approx(5.0) and lamb == pytest.approx(5 / 2 ** 0.5, rel=1e-5)

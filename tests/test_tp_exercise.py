"""Lesson 15's exercise is an exam: a right tensor-parallel MLP passes, the blank and each slip below fail, the
verdict naming the rank, the degree and the likely slip (each seen)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minizero.course.harness import parallelism as par
from minizero.course.harness.tp_exercise import judge_tensor_parallel_mlp


def right(xs, ranks, ledger):
    h = par.CopyToRanks.apply(ledger, *xs)
    partial = [F.gelu(h[r] @ w["fc"].T + w["fc_bias"]) @ w["out"].T for r, w in enumerate(ranks)]
    return [y + w["out_bias"] for y, w in zip(par.ReduceFromRanks.apply(ledger, *partial), ranks, strict=True)]


def bias_on_every_rank(xs, ranks, ledger):
    h = par.CopyToRanks.apply(ledger, *xs)
    return list(par.ReduceFromRanks.apply(ledger, *(F.gelu(h[r] @ w["fc"].T + w["fc_bias"]) @ w["out"].T + w["out_bias"]
                                                     for r, w in enumerate(ranks))))


def no_all_reduce(xs, ranks, ledger):
    h = par.CopyToRanks.apply(ledger, *xs)
    return [F.gelu(h[r] @ w["fc"].T + w["fc_bias"]) @ w["out"].T + w["out_bias"] for r, w in enumerate(ranks)]


def summed_by_hand(xs, ranks, ledger):
    h = par.CopyToRanks.apply(ledger, *xs)
    total = sum(F.gelu(h[r] @ w["fc"].T + w["fc_bias"]) @ w["out"].T for r, w in enumerate(ranks))
    return [total + w["out_bias"] for w in ranks]


class OwnG(torch.autograd.Function):
    """g written again, right -- but not the lesson's, so the ledger never hears of its all-reduce."""

    @staticmethod
    def forward(ctx, *partials):
        total = sum(partials)
        return tuple(total.clone() for _ in partials)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def plain_sum_per_rank(xs, ranks, ledger):
    h = par.CopyToRanks.apply(ledger, *xs)
    partial = [F.gelu(h[r] @ w["fc"].T + w["fc_bias"]) @ w["out"].T for r, w in enumerate(ranks)]
    return [y + w["out_bias"] for y, w in zip(OwnG.apply(*partial), ranks, strict=True)]


def no_f(xs, ranks, ledger):
    partial = [F.gelu(xs[r] @ w["fc"].T + w["fc_bias"]) @ w["out"].T for r, w in enumerate(ranks)]
    return [y + w["out_bias"] for y, w in zip(par.ReduceFromRanks.apply(ledger, *partial), ranks, strict=True)]


def concatenated(xs, ranks, ledger):
    h = par.CopyToRanks.apply(ledger, *xs)
    return [torch.cat([F.gelu(h[r] @ w["fc"].T + w["fc_bias"]) for r, w in enumerate(ranks)], -1)] * len(ranks)


def blank(xs, ranks, ledger):
    raise NotImplementedError


def test_a_right_tensor_parallel_mlp_passes():
    ok, verdict = judge_tensor_parallel_mlp(right)
    assert ok and "one all-reduce forward (g) and one backward (f)" in verdict, verdict


def alone_without_communication(xs, ranks, ledger):
    """Right: at t = 1 there is no one to all-reduce with, so f and g are skipped there."""
    if len(ranks) == 1:
        w = ranks[0]
        return [F.gelu(xs[0] @ w["fc"].T + w["fc_bias"]) @ w["out"].T + w["out_bias"]]
    return right(xs, ranks, ledger)


def test_a_right_mlp_that_skips_communication_alone_passes():
    assert judge_tensor_parallel_mlp(alone_without_communication)[0]


@pytest.mark.parametrize("fn, words", [
    (blank, "write my_tensor_parallel_mlp"),
    (bias_on_every_rank, "t = 2: rank 0's output holds out's bias 2 times"),
    (no_all_reduce, "t = 2: rank 0's output is its own partial sum"),
    (summed_by_hand, "t = 2: rank 0's input gradient is 2 times the whole one: the ranks' outputs share one summed"),
    (plain_sum_per_rank, "t = 2: the values are right, but 0 all-reduce(s) were counted forward"),
    (no_f, "t = 2: rank 0's input gradient is not the whole one -- hand the input to the ranks with CopyToRanks"),
    (concatenated, "t = 1: rank 0's output has shape (2, 3, 32)"),
])
def test_each_slip_fails_naming_it(fn, words):
    ok, verdict = judge_tensor_parallel_mlp(fn)
    assert not ok and words in verdict, verdict

"""1-bit Adam as lesson 16 shows it (``minizero/course/harness/one_bit_adam.py``), against a one-process replay of the
paper's update (Tang et al. 2021, arXiv:2102.02888, Algorithm 1): the warm-up is Adam, the frozen phase is momentum
with Adam's variance fixed, and error feedback loses nothing of the momentum it compresses."""
from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from minizero.compress import parse
from minizero.course.harness.one_bit_adam import METHODS, compressed_mean, train
from minizero.course.harness.tasks import TASKS
from minizero.run.train import sum_loss

MODEL = {"sizes": (3, 6, 2)}
BETAS, EPS, LR = (0.9, 0.999), 1e-8, 0.01


def single_device_replay(steps: int, warmup: int, batch: int = 12) -> torch.Tensor:
    """One model on the whole batch: torch's Adam for ``warmup`` steps, then the paper's frozen-variance update written
    out from its formula -- no workers, no shares, no code of the module under test."""
    task = TASKS["mlp"]
    model = task.make_model(0, torch.float64, **MODEL)
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS)
    m = v = None
    for t in range(1, steps + 1):
        x, y = task.make_batch(batch, 0, t - 1, torch.float64, **MODEL)
        model.zero_grad()
        (sum_loss(model(x), y) / y.numel()).backward()  # the mean over every loss term, as the loop takes it
        if t <= warmup:
            optimizer.step()
            continue
        g = torch.cat([p.grad.reshape(-1) for p in params])
        if m is None:
            m = torch.cat([optimizer.state[p]["exp_avg"].reshape(-1) for p in params])
            v = torch.cat([optimizer.state[p]["exp_avg_sq"].reshape(-1) for p in params])
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        with torch.no_grad():
            x_new = parameters_to_vector(params) - LR * (m / (1 - BETAS[0] ** t)) / (
                (v / (1 - BETAS[1] ** warmup)).sqrt() + EPS)
            vector_to_parameters(x_new, params)
    return parameters_to_vector(params).detach()


@pytest.mark.parametrize("n", [1, 3, 4])
def test_uncompressed_one_bit_adam_is_adam_then_momentum_with_the_variance_frozen(n):
    """With nothing compressed, the workers' mean of their local momenta is the momentum of the mean gradient: 1-bit
    Adam is the replay, to float64's rounding (N = 3 splits 12 samples 4/4/4, N = 1 is no split at all)."""
    got = train("1-bit adam", steps=9, n=n, warmup=4, lr=LR, wire=None, task="mlp", model_kw=MODEL, batch=12,
                dtype=torch.float64).params
    want = single_device_replay(9, 4)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14), (got - want).abs().max()
    warm_only = train("1-bit adam", steps=4, n=n, warmup=4, lr=LR, wire=None, task="mlp", model_kw=MODEL, batch=12,
                      dtype=torch.float64).params
    adam = train("adam", steps=4, n=n, lr=LR, task="mlp", model_kw=MODEL, batch=12, dtype=torch.float64).params
    assert torch.equal(warm_only, adam)  # the warm-up is Adam, bit for bit


def test_error_feedback_delivers_every_momentum_it_compressed():
    """Over any number of rounds, what the sign wire delivered plus what each worker still carries is everything the
    workers had to send: sum(means) + mean(residuals) = sum of the inputs' means."""
    codec, torch_gen = parse("sign"), torch.Generator().manual_seed(0)
    residuals = [torch.zeros(37, dtype=torch.float64) for _ in range(3)]
    delivered = torch.zeros(37, dtype=torch.float64)
    owed = torch.zeros(37, dtype=torch.float64)
    for _ in range(6):
        vectors = [torch.randn(37, generator=torch_gen, dtype=torch.float64) for _ in range(3)]
        owed += torch.stack(vectors).mean(0)
        delivered += compressed_mean(vectors, residuals, codec)
        assert not torch.allclose(delivered, owed)  # the wire did drop something this round
    assert torch.allclose(delivered + torch.stack(residuals).mean(0), owed, rtol=0, atol=1e-12)


def test_each_method_sends_its_bytes_and_only_1_bit_adam_warms_up_uncompressed():
    curves = {m: train(m, steps=5, n=2, warmup=2, task="mlp", model_kw=MODEL, batch=4) for m in METHODS}
    numel = sum(p.numel() for p in TASKS["mlp"].make_model(0, torch.float32, **MODEL).parameters())
    sign = parse("sign").message_bytes(numel, torch.float32)
    assert curves["adam"].sent == [4 * numel] * 5
    assert curves["adam, sign + EF on gradients"].sent == [sign] * 5
    assert curves["1-bit adam"].sent == [4 * numel] * 2 + [sign] * 3
    with pytest.raises(ValueError, match="unknown method 'lamb'; one of adam"):
        train("lamb", steps=1)

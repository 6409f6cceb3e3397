"""Data: a small real text that ships with the package, and synthetic tasks.

Every batch is a pure function of ``(seed, step)``, so each rank can draw
the *global* batch itself and keep its own share -- no data needs sending,
and the reference sees exactly the concatenation of the ranks' shares.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .models import MLP, EdgeModel, MixedDtypeModel, ReuseModel, RoutedModel, TinyGPT


@lru_cache(maxsize=1)
def sonnets() -> str:
    """Ten of Shakespeare's sonnets (public domain), shipped in ``minizero/data``."""
    return (Path(__file__).parents[1] / "data" / "sonnets.txt").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def vocabulary() -> str:
    return "".join(sorted(set(sonnets())))


@lru_cache(maxsize=1)
def encoded_text() -> torch.Tensor:
    index = {c: i for i, c in enumerate(vocabulary())}
    return torch.tensor([index[c] for c in sonnets()], dtype=torch.int64)


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


@dataclass(frozen=True)
class Task:
    """A model family and the batches it trains on."""

    name: str
    make_model: Callable[..., nn.Module]  # (seed, dtype, **model_kwargs) -> module
    make_batch: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (samples, seed, step, dtype, **model_kwargs)


#: The lab's GPT, unless an experiment says otherwise.
GPT_DEFAULTS = {"d_model": 32, "n_head": 4, "n_layer": 2, "block_size": 16}


def _gpt_model(seed, dtype, **kw):
    kw = {**GPT_DEFAULTS, **kw}
    return TinyGPT(vocab_size=len(vocabulary()), seed=seed, dtype=dtype, **kw)


def _gpt_batch(samples, seed, step, dtype, block_size=16, **_):
    text = encoded_text()
    starts = torch.randint(0, len(text) - block_size - 1, (samples,), generator=_generator(seed, step))
    x = torch.stack([text[s:s + block_size] for s in starts.tolist()]) if samples else torch.empty(0, block_size, dtype=torch.int64)
    y = torch.stack([text[s + 1:s + block_size + 1] for s in starts.tolist()]) if samples else x.clone()
    return x, y


def _mlp_model(seed, dtype, sizes=(8, 16, 4)):
    return MLP(tuple(sizes), seed=seed, dtype=dtype)


def _regression_batch(samples, seed, step, dtype, sizes=(8, 16, 4), d_in=None, d_out=None, **_):
    g = _generator(seed, step)
    d_in, d_out = d_in or sizes[0], d_out or sizes[-1]
    return torch.randn(samples, d_in, generator=g, dtype=dtype), torch.randn(samples, d_out, generator=g, dtype=dtype)


def _edge_model(seed, dtype, **kw):
    return EdgeModel(seed=seed, dtype=dtype, **kw)


def _edge_batch(samples, seed, step, dtype, d_in=6, d_out=3, **_):
    return _regression_batch(samples, seed, step, dtype, d_in=d_in, d_out=d_out)


def _dyadic_model(seed, dtype, sizes=(4, 3)):
    """A linear model on multiples of 1/8: every sum is exact in float64, so
    only a wrong *formula* -- never summation order -- can change a bit."""
    model = MLP(tuple(sizes), seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-8, 9, p.shape, generator=g).to(dtype) / 8)
    return model


def _dyadic_batch(samples, seed, step, dtype, sizes=(4, 3), **_):
    g = _generator(seed, step)
    x = torch.randint(-4, 5, (samples, sizes[0]), generator=g).to(dtype) / 4
    y = torch.randint(-4, 5, (samples, sizes[-1]), generator=g).to(dtype) / 4
    return x, y


def _mixed_model(seed, dtype, **kw):
    return MixedDtypeModel(seed=seed, **kw)


def _mixed_batch(samples, seed, step, dtype, d_in=5, d_out=3, **_):
    return _regression_batch(samples, seed, step, torch.float64, d_in=d_in, d_out=d_out)


def _reuse_model(seed, dtype, **kw):
    return ReuseModel(seed=seed, dtype=dtype, **kw)


def _reuse_batch(samples, seed, step, dtype, d=6, **_):
    return _regression_batch(samples, seed, step, dtype, d_in=d, d_out=d)


def _routed_model(seed, dtype, **kw):
    return RoutedModel(seed=seed, dtype=dtype, **kw)


def _routed_batch(samples, seed, step, dtype, d_in=4, d_out=3, **_):
    return _regression_batch(samples, seed, step, dtype, d_in=d_in, d_out=d_out)


TASKS = {
    "gpt": Task("gpt", _gpt_model, _gpt_batch),
    "mlp": Task("mlp", _mlp_model, _regression_batch),
    "edge": Task("edge", _edge_model, _edge_batch),
    "dyadic": Task("dyadic", _dyadic_model, _dyadic_batch),
    "mixed": Task("mixed", _mixed_model, _mixed_batch),
    "reuse": Task("reuse", _reuse_model, _reuse_batch),
    "routed": Task("routed", _routed_model, _routed_batch),  # used parameters differ by rank and micro-batch
}

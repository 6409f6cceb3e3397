"""Small deterministic models: the same weights for the same seed, everywhere.

* :class:`MLP` -- the smallest thing with several layers of gradients.
* :class:`TinyGPT` -- a GPT-style transformer (pre-LayerNorm blocks, causal
  self-attention, no dropout) whose input embedding is *tied* to the output
  head: one ``Parameter`` used twice, the classic trap for sharding.
* :class:`EdgeModel` -- every awkward parameter at once: frozen, created with
  ``requires_grad=False``, unused in forward, tied, and zero-size.

No dropout and no BatchNorm anywhere: per-rank RNG and per-rank batch
statistics make data-parallel training differ from single-device training
on purpose, which would hide real bugs in the equivalence suite.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _init(module: nn.Module, seed: int, dtype: torch.dtype) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.numel() == 0:
                continue
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # LayerNorm weight
                p.fill_(1.0)
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(fan_in))
    return module.to(dtype)


class MLP(nn.Module):
    def __init__(self, sizes=(8, 16, 4), seed: int = 0, dtype=torch.float32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=True))
        _init(self, seed, dtype)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        # No bias: the key bias shifts every score of a row equally, softmax ignores
        # it, so its true gradient is 0 and Adam would turn rounding noise in it
        # into full-size +-lr steps -- a parameter no two summation orders agree on.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """One transformer block: the natural ZeRO-3 / FSDP unit."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size: int = 48, d_model: int = 32, n_head: int = 4, n_layer: int = 2,
                 block_size: int = 32, seed: int = 0, dtype=torch.float32):
        super().__init__()
        self.block_size = block_size
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: one Parameter, two uses
        _init(self, seed, dtype)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.token_embedding(idx) + self.position_embedding(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class EdgeModel(nn.Module):
    """An MLP carrying every kind of parameter a data-parallel wrapper can get wrong.

    ``with_unused=False`` leaves out the parameter forward never touches:
    ZeRO stages refuse it (a flat shard cannot skip one parameter)."""

    def __init__(self, d_in: int = 6, d_hidden: int = 8, d_out: int = 3, seed: int = 0, dtype=torch.float32,
                 with_unused: bool = True):
        super().__init__()
        self.inp = nn.Linear(d_in, d_hidden)
        self.frozen = nn.Linear(d_hidden, d_hidden)  # frozen after creation, like a fine-tuning base
        self.mid = nn.Linear(d_hidden, d_hidden)
        self.scale = nn.Parameter(torch.ones(d_hidden), requires_grad=False)  # born without gradient
        if with_unused:
            self.unused = nn.Parameter(torch.ones(5))  # never touched by forward: its .grad stays None
        self.empty = nn.Parameter(torch.ones(0))  # zero-size, and used
        self.out = nn.Linear(d_hidden, d_out)
        self.out_again = self.out  # the same module under two names
        self.tied = nn.Linear(d_hidden, d_hidden, bias=False)
        self.tied.weight = self.mid.weight  # the same Parameter in two layers
        _init(self, seed, dtype)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.frozen(h)) * self.scale
        h = torch.tanh(self.mid(h)) + self.empty.sum()
        h = torch.tanh(self.tied(h))
        return self.out_again(h)


def count_params(model: nn.Module) -> int:
    """Ψ: distinct trainable parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class MixedDtypeModel(nn.Module):
    """A float32 layer feeding a float64 layer: flat buffers must be split by dtype."""

    def __init__(self, d_in: int = 5, d_hidden: int = 7, d_out: int = 3, seed: int = 0, dtype=torch.float64):
        super().__init__()
        self.low = _init(nn.Linear(d_in, d_hidden), seed, torch.float32)
        self.high = _init(nn.Linear(d_hidden, d_out), seed + 1, torch.float64)

    def forward(self, x):
        return self.high(torch.tanh(self.low(x.float())).double())


class ReuseModel(nn.Module):
    """Hard cases for ZeRO-3 units: ``layers[0]`` runs twice in one forward, and ``extra`` runs only
    on every other forward call (``skip_every_other=True``) -- a unit not called in some steps.
    Every rank calls forward equally often, so every rank skips the same steps."""

    def __init__(self, d: int = 6, seed: int = 0, dtype=torch.float32, skip_every_other: bool = True):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)])
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, d))
        self.skip_every_other = skip_every_other
        self.calls = 0
        _init(self, seed, dtype)
        self.shift = self.shift.to(dtype)

    def forward(self, x):
        self.calls += 1
        shared, middle, extra = self.layers
        h = torch.tanh(shared(x) + self.shift)
        h = torch.tanh(shared(h))  # the same unit again, in the same forward
        if not self.skip_every_other or self.calls % 2 == 1:
            h = torch.tanh(extra(h))
        return middle(h)


#: The benchmarks' GPT: big enough that a step is mostly compute and communication, small enough for 2 CPU cores.
BENCH_GPT = {"d_model": 128, "n_layer": 4, "n_head": 4, "block_size": 32}


#: GPT sizes ``train`` and ``bench all`` know, by name (``--model``); Psi is printed by ``count_params``.
#: From the lab's GPT (tiny) through the benchmarks' (small) to ones where communication and memory
#: dominate a step (large, 100m).
GPT_SIZES = {
    "tiny": {"d_model": 32, "n_layer": 2, "n_head": 4, "block_size": 16},
    "small": BENCH_GPT,
    "medium": {"d_model": 384, "n_layer": 6, "n_head": 6, "block_size": 64},
    "large": {"d_model": 512, "n_layer": 12, "n_head": 8, "block_size": 128},
    "100m": {"d_model": 768, "n_layer": 14, "n_head": 12, "block_size": 256},
}


class RoutedModel(nn.Module):
    """Each sample goes through one of two branches, chosen by its own first feature -- a mixture of experts'
    routing, made deterministic.  A branch no sample of a micro-batch chose is not called, so gets no gradient
    from it: which parameters were used differs by rank *and* by micro-batch, and only their agreement across
    both is one device's (a branch used by one micro-batch of one rank has a gradient; used by none, it has none
    and is not stepped).  Routing each sample on its own makes one device's forward on the whole batch the same
    computation as the ranks' on their shares (issue 45)."""

    def __init__(self, d_in: int = 4, d_hidden: int = 5, d_out: int = 3, seed: int = 0, dtype=torch.float32,
                 threshold: float = 0.5):
        super().__init__()
        self.inp = nn.Linear(d_in, d_hidden)
        self.left = nn.Linear(d_hidden, d_out)  # about 31% of N(0, 1) samples: often none in a micro-batch
        self.right = nn.Linear(d_hidden, d_out)
        self.threshold = threshold
        _init(self, seed, dtype)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        left = x[:, 0] > self.threshold
        out = h.new_zeros(h.shape[0], self.left.out_features)
        for branch, chosen in ((self.left, left), (self.right, ~left)):
            if chosen.any():  # not called at all otherwise: no gradient, not a zero one
                out = out.index_put((chosen.nonzero().squeeze(1),), branch(h[chosen]))
        return out

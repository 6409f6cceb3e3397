"""Beyond data parallelism, small enough to run in one process (lesson 15).

Data parallelism splits the batch; the other axes of "3-D parallelism" split the model.  minizero builds none
of them as a stage.  This module holds what lesson 15 runs to make each one concrete without spawning ranks:

* **tensor parallelism** (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053): a transformer block's matrices
  split across ``t`` simulated ranks -- column-parallel then row-parallel -- with Megatron's two operators,
  ``f`` (identity forward, all-reduce backward) and ``g`` (all-reduce forward, identity backward), counted;
* **pipeline parallelism**: the GPipe and 1F1B orders of forward and backward per stage, replayed on unit
  times to get the bubble and the micro-batches each stage holds;
* **bytes and time per step** of ZeRO-3 against tensor parallelism, from the project's own formulas
  (:mod:`minizero.costs.formulas`, ``ZeRO3.sent_bytes_per_step``) and the alpha-beta ring model
  (:func:`minizero.costs.cost_model.ring_s`);
* **large-batch rules**: the linear scaling rule with gradual warm-up (Goyal et al. 2017, arXiv:1706.02677)
  and the layer-wise trust ratios of LARS (arXiv:1708.03888) and LAMB (arXiv:1904.00962).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...comm.network import Network
from ...costs.cost_model import ring_s
from ...costs.formulas import all_reduce_bytes


# ---------------------------------------------------------------- tensor parallelism, t ranks in one process
class Ledger:
    """Every all-reduce the simulated tensor-parallel group makes: ``(phase, bytes per rank's tensor)``."""

    def __init__(self):
        self.all_reduces: list[tuple[str, int]] = []

    def count(self, phase: str) -> int:
        return sum(1 for p, _ in self.all_reduces if p == phase)


class CopyToRanks(torch.autograd.Function):
    """Megatron's ``f``: forward, each rank goes on with its own (identical) input; backward, the ranks'
    gradients are all-reduced -- each rank saw only its part of the layer that used the input."""

    @staticmethod
    def forward(ctx, ledger, *xs):
        ctx.ledger = ledger
        return tuple(x.clone() for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        total = sum(grads)  # the all-reduce
        ctx.ledger.all_reduces.append(("backward", total.numel() * total.element_size()))
        return (None, *(total.clone() for _ in grads))


class ReduceFromRanks(torch.autograd.Function):
    """Megatron's ``g``: forward, the ranks' partial outputs are all-reduced into the layer's output;
    backward, each rank's copy of that output already holds the whole gradient -- identity."""

    @staticmethod
    def forward(ctx, ledger, *partials):
        total = sum(partials)  # the all-reduce
        ledger.all_reduces.append(("forward", total.numel() * total.element_size()))
        return tuple(total.clone() for _ in partials)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


def split_block(block, t: int) -> list[dict[str, torch.Tensor]]:
    """Rank r's weights of a minizero ``Block`` under tensor parallelism of degree ``t``: its heads' rows of
    ``qkv`` and ``fc`` (column-parallel), the matching columns of ``proj`` and ``out`` (row-parallel); the
    layer norms and the two output biases whole on every rank.  Fresh leaves: a rank owns its slices."""
    d, heads = block.fc.in_features, block.attn.n_head
    if heads % t:
        raise ValueError(f"{heads} heads do not split over t={t} ranks")
    hd, hidden = d // t, block.fc.out_features // t
    ranks = []
    for r in range(t):
        cols = slice(r * hd, (r + 1) * hd)
        qkv = block.attn.qkv.weight.view(3, d, d)[:, cols].reshape(3 * hd, d)  # this rank's q, k and v rows
        w = {"qkv": qkv, "proj": block.attn.proj.weight[:, cols], "proj_bias": block.attn.proj.bias,
             "fc": block.fc.weight[r * hidden:(r + 1) * hidden], "fc_bias": block.fc.bias[r * hidden:(r + 1) * hidden],
             "out": block.out.weight[:, r * hidden:(r + 1) * hidden], "out_bias": block.out.bias,
             "ln1_w": block.ln1.weight, "ln1_b": block.ln1.bias, "ln2_w": block.ln2.weight, "ln2_b": block.ln2.bias}
        ranks.append({k: v.detach().clone().requires_grad_() for k, v in w.items()})
    return ranks


def _attention_part(h: torch.Tensor, w: dict, heads: int) -> torch.Tensor:
    """One rank's heads, and its columns of the output projection: a partial sum of the attention's output."""
    b, s, _ = h.shape
    q, k, v = (h @ w["qkv"].T).split(w["proj"].shape[1], dim=2)
    q, k, v = (z.view(b, s, heads, -1).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(b, s, -1) @ w["proj"].T


def tensor_parallel_block(xs: list[torch.Tensor], ranks: list[dict], heads: int, ledger: Ledger) -> list[torch.Tensor]:
    """The block's forward on every rank: two ``f``/``g`` pairs, one around attention, one around the MLP."""
    t, d = len(ranks), xs[0].shape[-1]
    h = CopyToRanks.apply(ledger, *(F.layer_norm(x, (d,), w["ln1_w"], w["ln1_b"]) for x, w in zip(xs, ranks, strict=True)))
    y = ReduceFromRanks.apply(ledger, *(_attention_part(h[r], ranks[r], heads // t) for r in range(t)))
    xs = [x + y[r] + w["proj_bias"] for r, (x, w) in enumerate(zip(xs, ranks, strict=True))]
    h = CopyToRanks.apply(ledger, *(F.layer_norm(x, (d,), w["ln2_w"], w["ln2_b"]) for x, w in zip(xs, ranks, strict=True)))
    y = ReduceFromRanks.apply(ledger, *(F.gelu(h[r] @ w["fc"].T + w["fc_bias"]) @ w["out"].T
                                        for r, w in enumerate(ranks)))
    return [x + y[r] + w["out_bias"] for r, (x, w) in enumerate(zip(xs, ranks, strict=True))]


# ---------------------------------------------------------------- pipeline parallelism: the schedules
def stage_order(kind: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order in which one stage runs forwards ``F`` and backwards ``B`` of its micro-batches.
    GPipe: every forward, then every backward.  1F1B: ``stages - stage - 1`` forwards to fill the pipe,
    then one forward and one backward in turn, then the backwards left."""
    m = micro_batches
    if kind == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    warm = min(stages - stage - 1, m)
    order = [("F", j) for j in range(warm)]
    for j in range(m - warm):
        order += [("F", warm + j), ("B", j)]
    return order + [("B", j) for j in range(m - warm, m)]


def replay_pipeline(kind: str, stages: int, micro_batches: int, forward: float = 1.0, backward: float = 2.0):
    """Each stage runs its :func:`stage_order`; an op starts when its stage is free and its input is there
    (a forward after the stage before finished it, a backward after the stage after finished its backward).
    Returns ``[(stage, "F"|"B", micro-batch, start, end)]``."""
    orders = [stage_order(kind, s, stages, micro_batches) for s in range(stages)]
    done: dict[tuple[int, str, int], float] = {}
    spans, nxt, free = [], [0] * stages, [0.0] * stages
    while len(spans) < 2 * stages * micro_batches:
        progressed = False
        for s in range(stages):
            if nxt[s] == len(orders[s]):
                continue
            op, j = orders[s][nxt[s]]
            need = [(s - 1, "F", j)] if op == "F" and s else []
            need += [(s + 1, "B", j)] if op == "B" and s < stages - 1 else [(s, "F", j)] if op == "B" else []
            if all(n in done for n in need):
                start = max([free[s]] + [done[n] for n in need])
                free[s] = done[(s, op, j)] = start + (forward if op == "F" else backward)
                spans.append((s, op, j, start, free[s]))
                nxt[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{kind}: the stages wait for each other -- the order deadlocks")
    return spans


def bubble_fraction(spans, stages: int) -> float:
    """Idle stage-time over all stage-time, from a replay."""
    busy = sum(end - start for *_, start, end in spans)
    return 1 - busy / (stages * max(end for *_, end in spans))


def peak_in_flight(spans, stage: int) -> int:
    """Most micro-batches whose forward has started and whose backward has not ended: the activations the
    stage holds at once."""
    events = sorted((start if op == "F" else end, 1 if op == "F" else -1) for s, op, _, start, end in spans if s == stage)
    alive = peak = 0
    for _, change in events:
        alive += change
        peak = max(peak, alive)
    return peak


# ---------------------------------------------------------------- ZeRO-3 against tensor parallelism
def transformer_params(layers: int, hidden: int) -> int:
    """The blocks' parameters, 12·L·h² (attention 4h², MLP 8h²; embeddings and biases left out)."""
    return 12 * layers * hidden ** 2


def zero3_step(layers: int, hidden: int, ranks: int, network: Network, element: int = 2) -> tuple[float, float]:
    """(bytes each rank sends, seconds of ring collectives) per step: ZeRO-3 over ``ranks``, one unit per
    block, all-gathered before forward and again before backward, gradients reduce-scattered."""
    from ...stages import ZeRO3
    psi = transformer_params(layers, hidden)
    sent = ZeRO3.sent_bytes_per_step(psi, ranks, element, element)
    unit = psi / layers * element
    return sent, layers * (2 * ring_s("all_gather", unit, ranks, network) + ring_s("reduce_scatter", unit, ranks, network))


def tensor_parallel_step(layers: int, hidden: int, tokens: int, ranks: int, network: Network,
                         element: int = 2) -> tuple[float, float]:
    """The same for tensor parallelism over ``ranks`` on ``tokens`` tokens in one pass: 4 all-reduces of the
    activations (tokens × hidden) per block, 2 in forward and 2 in backward."""
    activations = tokens * hidden * element
    return 4 * layers * all_reduce_bytes(activations, ranks), 4 * layers * ring_s("all_reduce", activations, ranks,
                                                                                  network)


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Korthikanti et al. 2022 (arXiv:2205.05198), 16-bit activations one layer keeps for backward: none
    ``sbh(34 + 5as/h)``; tensor parallel ``sbh(10 + 24/t + 5as/(ht))``; with sequence parallelism too,
    ``sbh/t·(34 + 5as/h)``."""
    if sequence_parallel:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


# ---------------------------------------------------------------- large-batch rules
def goyal_lr(epoch: float, base_lr: float = 0.1, batch: int = 8192, base_batch: int = 256, warmup: float = 5,
             decays=(30, 60, 80)) -> float:
    """Goyal et al.'s ResNet-50 schedule: the linear scaling rule ``base_lr · batch/base_batch``, reached by a
    gradual warm-up from ``base_lr`` (linear in iterations over ``warmup`` epochs), then ÷10 at each decay."""
    k = batch / base_batch
    if epoch < warmup:
        return base_lr * (1 + (k - 1) * epoch / warmup)
    return base_lr * k * 0.1 ** sum(epoch >= d for d in decays)


def trust_ratios(w: torch.Tensor, g: torch.Tensor, eps: float = 1e-6) -> tuple[float, float]:
    """(LARS, LAMB) for one layer, weight decay 0.  LARS: ‖w‖/‖g‖, the paper's local rate before its trust
    coefficient.  LAMB: ‖w‖/‖r‖ with r Adam's update m̂/(√v̂+ε); at the first step m̂ = g and v̂ = g²."""
    r = g / (g.abs() + eps)
    return (w.norm() / g.norm()).item(), (w.norm() / r.norm()).item()

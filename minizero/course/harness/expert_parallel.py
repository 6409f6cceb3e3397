"""Expert parallelism on real ranks (lesson 15): a mixture-of-experts layer, one expert per rank, its tokens sent
to their expert and back by the package's ``all_to_all``.

A mixture-of-experts layer replaces one MLP by E of them and a *gate* that sends each token to one (top-1 routing:
the Switch Transformer, Fedus et al. 2021, arXiv:2101.03961).  The experts' weights are E times an MLP's, but each
token pays for one.  Expert parallelism puts expert ``e`` on rank ``e`` (GShard, Lepikhin et al. 2020,
arXiv:2006.16668): every rank routes its own tokens, and an **all-to-all** carries each expert's tokens to its rank;
a second one brings the outputs back.  The gate is replicated, like data parallelism's weights.

An all-to-all needs equal chunks, so each expert takes at most ``capacity`` tokens from each rank, in token order
(``capacity = ceil(factor * tokens / E)``); a token past it is *dropped*: the layer outputs zero for it (the
residual around the layer carries it on, in Switch).  The chunk a rank sends expert ``e`` is ``capacity`` rows,
full or padded with zeros -- the bytes do not depend on the routing.

Backward is the same exchange the other way round (:class:`AllToAll`): the gradient of what rank ``j`` received
from this rank goes back to this rank.  Each expert's weight gradient is whole on its own rank; the gate's must
still be all-reduced, as DDP does.
"""
from __future__ import annotations

import math

import torch

from ...comm import make_comm
from ...comm.ledger import Ledger


class AllToAll(torch.autograd.Function):
    """``comm.all_to_all`` as an autograd operation; its backward is another all-to-all of the gradients."""

    @staticmethod
    def forward(ctx, comm, x):
        ctx.comm = comm
        out = torch.empty_like(x)
        comm.all_to_all(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad.contiguous())
        return None, out


def capacity_of(tokens: int, experts: int, factor: float) -> int:
    return math.ceil(factor * tokens / experts)


def route(x: torch.Tensor, gate: torch.Tensor, capacity: int):
    """Top-1 routing: each token's expert (the gate's argmax), its gate probability, and its slot in that
    expert's chunk -- -1 past the capacity (dropped)."""
    probs = (x @ gate).softmax(-1)
    choice = probs.argmax(-1)
    slot = torch.full_like(choice, -1)
    for e in range(gate.shape[1]):
        mine = (choice == e).nonzero().flatten()[:capacity]  # the first ``capacity`` in token order
        slot[mine] = torch.arange(len(mine))
    return choice, probs.gather(1, choice[:, None]).squeeze(1), slot


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w1) @ w2


def weights(experts: int, d_model: int, hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The gate and every expert's two matrices, float64, the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(seed)
    return {"gate": torch.randn(d_model, experts, generator=g, dtype=torch.float64),
            "w1": torch.randn(experts, d_model, hidden, generator=g, dtype=torch.float64) / math.sqrt(d_model),
            "w2": torch.randn(experts, hidden, d_model, generator=g, dtype=torch.float64) / math.sqrt(hidden)}


def tokens_of(rank: int, tokens: int, d_model: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens and the target its loss weighs the layer's output by."""
    g = torch.Generator().manual_seed(seed * 1009 + rank + 1)
    return (torch.randn(tokens, d_model, generator=g, dtype=torch.float64),
            torch.randn(tokens, d_model, generator=g, dtype=torch.float64))


def moe_on_rank(me, tokens: int, d_model: int, hidden: int, factor: float, seed: int = 0) -> dict:
    """One forward and backward of the layer with expert ``me.rank`` here: this rank's output, its gradients
    (the gate's before any all-reduce) and the bytes the ledger counted, by kind."""
    n = me.world_size
    comm, ledger = make_comm("ring", check=True), Ledger()
    full = weights(n, d_model, hidden, seed)
    gate = full["gate"].clone().requires_grad_()
    w1, w2 = full["w1"][me.rank].clone().requires_grad_(), full["w2"][me.rank].clone().requires_grad_()
    x, target = tokens_of(me.rank, tokens, d_model, seed)
    x.requires_grad_()  # as a layer's input is: its gradient goes back to the ranks the tokens came from
    capacity = capacity_of(tokens, n, factor)
    with ledger.attached(comm):
        choice, prob, slot = route(x, gate, capacity)
        kept = slot >= 0
        chunks = x.new_zeros(n, capacity, d_model).index_put((choice[kept], slot[kept]), x[kept])  # chunk e: expert e's
        arrived = AllToAll.apply(comm, chunks.reshape(-1)).view(n, capacity, d_model)  # chunk i: from rank i
        done = AllToAll.apply(comm, expert_mlp(arrived, w1, w2).reshape(-1)).view(n, capacity, d_model)
        y = x.new_zeros(tokens, d_model).index_put((kept.nonzero().flatten(),),
                                                  prob[kept, None] * done[choice[kept], slot[kept]])
        (y * target).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "gate_grad": gate.grad, "w1_grad": w1.grad, "w2_grad": w2.grad,
            "dropped": int((~kept).sum()), "capacity": capacity, "sent": ledger.snapshot()}


def moe_in_one_process(world_size: int, tokens: int, d_model: int, hidden: int, factor: float, seed: int = 0) -> dict:
    """The same layer with every expert in one process, each rank's tokens routed as that rank routes them (the
    capacity is per expert per rank): every rank's output, and the gradients of the sum of their losses."""
    full = {k: v.clone().requires_grad_() for k, v in weights(world_size, d_model, hidden, seed).items()}
    capacity, ys, xs, loss = capacity_of(tokens, world_size, factor), [], [], 0
    for r in range(world_size):
        x, target = tokens_of(r, tokens, d_model, seed)
        xs.append(x.requires_grad_())
        choice, prob, slot = route(x, full["gate"], capacity)
        y = torch.stack([prob[t] * expert_mlp(x[t], full["w1"][choice[t]], full["w2"][choice[t]])
                         if slot[t] >= 0 else x.new_zeros(d_model) for t in range(tokens)])
        ys.append(y.detach())
        loss = loss + (y * target).sum()
    loss.backward()
    return {"y": ys, "x_grad": [x.grad for x in xs], "gate_grad": full["gate"].grad, "w1_grad": full["w1"].grad,
            "w2_grad": full["w2"].grad}

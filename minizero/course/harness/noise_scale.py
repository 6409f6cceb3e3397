"""The gradient noise scale, measured the way a data-parallel run can for free (McCandlish et al. 2018, Appendix
A.1): each rank's own gradient is a gradient over b examples, the all-reduced one over N b -- two batch sizes in one
step, at no extra compute.  The estimators are :func:`minizero.costs.roofline.noise_scale`'s.

A rank here trains the sonnets GPT as DDP does (its share of the global batch, the gradients averaged by an
all-reduce, the same step on every rank), reading two squared norms before and after the average.  The norms are
noisy step to step; the paper averages each estimate over steps before their ratio, and so does :func:`measure`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...comm import ReduceOp, make_comm
from ...costs.roofline import NoiseScale, noise_scale
from ...parts.flat import pack, unpack
from .tasks import TASKS


def gradient_norms(me, model: dict, per_rank: int, steps: int, lr: float = 3e-3, seed: int = 0) -> list[tuple]:
    """Each step's ``(mean over ranks of |g_rank|^2, |g_average|^2, the loss)``: g_rank over this rank's
    ``per_rank`` sequences, g_average the ranks' mean (over all N ``per_rank``), the loss the ranks' mean too.
    AdamW steps with the average."""
    comm = make_comm("ring")
    gpt = TASKS["gpt"].make_model(seed, torch.float32, **model)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=lr)
    params = [p for p in gpt.parameters() if p.requires_grad]
    norms = []
    for step in range(steps):
        x, y = TASKS["gpt"].make_batch(me.world_size * per_rank, seed, step, torch.float32, **model)
        mine = slice(me.rank * per_rank, (me.rank + 1) * per_rank)
        logits = gpt(x[mine])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[mine].reshape(-1))
        loss.backward()
        flat = pack([p.grad for p in params])
        own = torch.stack([flat.square().sum(), loss.detach()])
        comm.all_reduce(own, ReduceOp.AVG)  # the mean over ranks of each rank's |g|^2, and of its loss
        comm.all_reduce(flat, ReduceOp.AVG)  # DDP's average: the gradient over every rank's examples
        norms.append((own[0].item(), flat.square().sum().item(), own[1].item()))
        unpack(flat, [p.grad for p in params])
        optimizer.step()
        optimizer.zero_grad()
    return norms


def measure(norms: list[tuple], per_rank: int, world_size: int, skip: int = 0) -> NoiseScale:
    """B_simple (in sequences) from :func:`gradient_norms`' steps after the first ``skip``: each squared norm
    averaged over the steps, then the two estimators."""
    kept = norms[skip:]
    small = sum(step[0] for step in kept) / len(kept)
    big = sum(step[1] for step in kept) / len(kept)
    return noise_scale(small, big, per_rank, world_size * per_rank)

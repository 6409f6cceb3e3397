"""1-bit Adam (Tang et al. 2021, arXiv:2102.02888), shown: why error feedback alone does not make Adam's gradients
compressible, and what freezing the variance changes.

Error feedback lets a biased compressor deliver everything eventually: what one step's message drops is added to
the next one's, so over T steps the *sum* of what arrived equals the sum of what was to be sent.  That is what
momentum SGD needs, whose update is linear in the gradients.  Adam's is not: its second moment v averages g^2,
and the squares of what arrived are not the squares of the gradients -- the sign wire sends +-mean|g| for every
coordinate of a buffer, so v sees one magnitude where the gradients had many.  1-bit Adam's answer: run plain
Adam for a warm-up while v settles, then **freeze v** -- Adam becomes momentum SGD with a fixed step per
coordinate -- and compress the **momentum** with error feedback, where linearity holds again.

Simulated in one process: N workers, each with its share of every global batch (``shard_step``), each sending
one message a step that every worker decodes and sums in rank order, as minizero's sign wire averages them
(:mod:`minizero.compress.gathered`: one error per worker).  The paper's compressed all-reduce compresses the sum
again on its way back, with a second error on the server side; that second hop is left out here.  The warm-up
is torch's Adam on the exact mean; after it, with ``t`` counting every step:

    m_i = beta1 m + (1 - beta1) g_i                    (each worker, from the shared m)
    m   = mean_i decode(C(m_i + e_i)),  e_i <- m_i + e_i - decode(C(m_i + e_i))
    x  <- x - lr (m / (1 - beta1^t)) / (sqrt(v_w / (1 - beta2^w)) + eps)      (v_w: v after the w warm-up steps)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ...compress import parse
from ...run.train import shard_step, sum_loss
from .tasks import TASKS

METHODS = ("adam", "adam, sign + EF on gradients", "1-bit adam")


@dataclass
class Curve:
    method: str
    losses: list[float] = field(default_factory=list)  # the global mean loss of each step
    sent: list[int] = field(default_factory=list)  # bytes of each worker's message, each step
    params: torch.Tensor | None = None  # the flat parameters after the last step


def worker_gradients(model, params, x, y, n: int) -> tuple[list[torch.Tensor], float]:
    """Each worker's flat gradient -- of its share of the loss, times N, as the training loop takes it: their mean
    is the gradient of the global mean loss -- and that loss."""
    grads, total = [], 0.0
    for r in range(n):
        step = shard_step(x, y, r, n)
        model.zero_grad(set_to_none=False)
        for xb, yb in step.micro_batches:
            loss = sum_loss(model(xb), yb)
            (loss * (n / step.global_count)).backward()
            total += loss.item() / step.global_count
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
    return grads, total


def compressed_mean(vectors: list[torch.Tensor], residuals: list[torch.Tensor] | None, codec) -> torch.Tensor:
    """The mean of each worker's ``C(vector + residual)``, decoded and added in rank order; each residual becomes what
    its worker's message left out (``codec`` None: the exact mean, nothing left out)."""
    if codec is None:
        return torch.stack(vectors).sum(0) / len(vectors)
    total = torch.zeros_like(vectors[0])
    for i, v in enumerate(vectors):
        carried = v + residuals[i]
        decoded = codec.decode(codec.encode(carried), carried.numel(), carried.dtype)
        residuals[i] = carried - decoded
        total += decoded
    return total / len(vectors)


def train(method: str, steps: int = 120, n: int = 4, warmup: int = 20, lr: float = 3e-3, wire: str | None = "sign",
          task: str = "gpt", model_kw: dict | None = None, batch: int = 16, seed: int = 0,
          dtype: torch.dtype = torch.float32, betas=(0.9, 0.999), eps: float = 1e-8) -> Curve:
    """``method`` (one of :data:`METHODS`) for ``steps`` on ``n`` simulated workers; ``wire`` None compresses nothing
    (1-bit Adam then is Adam with v frozen after the warm-up)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; one of {', '.join(METHODS)}")
    codec = parse(wire) if wire is not None else None
    task_, model_kw = TASKS[task], model_kw or {}
    model = task_.make_model(seed, dtype, **model_kw)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr, betas=betas, eps=eps)
    numel = sum(p.numel() for p in params)
    residuals = [torch.zeros(numel, dtype=dtype) for _ in range(n)]
    curve, frozen = Curve(method), None
    full_bytes = numel * torch.finfo(dtype).bits // 8
    for t in range(1, steps + 1):
        x, y = task_.make_batch(batch, seed, t - 1, dtype, **model_kw)
        grads, loss = worker_gradients(model, params, x, y, n)
        curve.losses.append(loss)
        compressing = codec is not None and method != "adam" and (method != "1-bit adam" or t > warmup)
        curve.sent.append(codec.message_bytes(numel, dtype) if compressing else full_bytes)
        if method == "1-bit adam" and t > warmup:
            if frozen is None:  # the warm-up's end: v and the bias correction of its w steps, fixed from now on
                state = [optimizer.state[p] for p in params]
                m = torch.cat([s["exp_avg"].reshape(-1) for s in state])
                v = torch.cat([s["exp_avg_sq"].reshape(-1) for s in state]) / (1 - betas[1] ** warmup)
                frozen = (m, v.sqrt().add_(eps))
            m, denominator = frozen
            local = [betas[0] * m + (1 - betas[0]) * g for g in grads]
            m.copy_(compressed_mean(local, residuals, codec))
            with torch.no_grad():
                flat = parameters_to_vector(params) - lr * (m / (1 - betas[0] ** t)) / denominator
                vector_to_parameters(flat, params)
            continue
        mean = compressed_mean(grads, residuals, codec if compressing else None)
        with torch.no_grad():
            offset = 0
            for p in params:
                p.grad.copy_(mean[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        optimizer.step()
    curve.params = parameters_to_vector(params).detach().clone()
    return curve

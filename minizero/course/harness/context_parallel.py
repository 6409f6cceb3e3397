"""Context parallelism, small enough to run in one process (lesson 15): ring attention.

Lesson 18's activation wall is the attention scores, a s^2 per sample: quadratic in the sequence.  Context
parallelism splits the *sequence* across ``t`` ranks, each holding its own block of queries, keys and values.
Attention needs every key, so the key/value blocks travel round a ring: in step ``s`` rank ``i`` holds the block of
rank ``i - s``, scores its queries against it, and passes it on (Liu et al. 2023, "Ring Attention with Blockwise
Transformers", arXiv:2310.01889).

The scores of one block are never all there at once, so the softmax cannot be taken over a whole row.  It is kept
*online* instead (Milakov and Gimelshein 2018, arXiv:1805.02867; FlashAttention, arXiv:2205.14135): a running
maximum ``m``, a running sum ``l`` of exp(score - m), and the running weighted values ``o``; a block with a larger
maximum rescales what came before by exp(m_old - m_new).  After ``t`` steps each rank holds its queries' exact
attention -- equal to the unsplit one up to rounding, with scores of (s/t) x (s/t) per step instead of s x s.

Each rank's first block is its own, the diagonal: under a causal mask every query sees at least itself there, so
the running maximum is finite before any fully masked block (a block from later in the sequence) comes round.
"""
from __future__ import annotations

import math

import torch


def blocks(length: int, ranks: int) -> list[slice]:
    """The sequence's contiguous blocks, one per rank, sizes differing by at most one (the first ones longer)."""
    base, extra = divmod(length, ranks)
    bounds, start = [], 0
    for r in range(ranks):
        stop = start + base + (r < extra)
        bounds.append(slice(start, stop))
        start = stop
    return bounds


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranks: int, causal: bool = True,
                   passed: list | None = None) -> torch.Tensor:
    """Attention of ``q``, ``k``, ``v`` (batch, heads, sequence, dim) computed as ``ranks`` ranks of a ring would:
    each rank's query block against every key/value block in turn, the softmax kept online.  ``passed``, if given,
    collects ``(rank, step, bytes)`` of every key/value block a rank receives from its left neighbour."""
    scale = 1 / math.sqrt(q.shape[-1])
    split = blocks(q.shape[-2], ranks)
    out = torch.empty_like(q)
    for i, mine in enumerate(split):
        qi = q[..., mine, :]
        m = torch.full(qi.shape[:-1], -math.inf, dtype=q.dtype)
        l = torch.zeros(qi.shape[:-1], dtype=q.dtype)  # noqa: E741 -- the paper's name
        o = torch.zeros_like(qi)
        for step in range(ranks):
            theirs = split[(i - step) % ranks]  # the block that arrived from the left this step
            kj, vj = k[..., theirs, :], v[..., theirs, :]
            if passed is not None and step > 0:
                passed.append((i, step, (kj.numel() + vj.numel()) * kj.element_size()))
            if theirs.stop == theirs.start or causal and theirs.start >= mine.stop:
                continue  # no keys, or every key after every query here: nothing to add (the block still moves on)
            scores = qi @ kj.transpose(-2, -1) * scale
            if causal:
                later = torch.arange(theirs.start, theirs.stop) > torch.arange(mine.start, mine.stop)[:, None]
                scores = scores.masked_fill(later, -math.inf)
            m_new = torch.maximum(m, scores.amax(-1))
            weights = torch.exp(scores - m_new[..., None])
            rescale = torch.exp(m - m_new)
            l = l * rescale + weights.sum(-1)  # noqa: E741
            o = o * rescale[..., None] + weights @ vj
            m = m_new
        out[..., mine, :] = o / l[..., None]
    return out


def ring_bytes(batch: int, heads: int, length: int, dim: int, ranks: int, element: int) -> list[int]:
    """Bytes each rank receives in a ring attention's forward: every other rank's key and value blocks, once."""
    split = blocks(length, ranks)
    return [sum(2 * batch * heads * (s.stop - s.start) * dim * element for j, s in enumerate(split) if j != i)
            for i in range(ranks)]

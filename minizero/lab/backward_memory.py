"""What a rank holds moment by moment through backward, beyond what it keeps between steps: the activations not yet
freed, the gradients born so far, the buckets being reduced.  Walked parameter by parameter in the order backward
makes their gradients, so the peak is found at the moment it happens, not added up from parts that never coexist.

Backward runs the blocks last to first.  While block j's backward runs, blocks 0..j-1 keep their activations
(checkpointed: only their inputs), and block j keeps what its backward has not freed yet -- taken as the share of its
parameters whose gradients were not born before this one (checkpointed: of its replay): all of it as its first
gradient is born, the MLP's output layer's, whose inputs backward needs for it.  On top, the gradient flowing through the
block's MLP: two s*b*4h tensors, of GeLU's output and of its input -- backward's working memory, which the
activation formula (what forward keeps) leaves out.  The head's gradient, made first, waits in autograd for the tied
embedding's share, so it is held through every block.

The gradients, by what the stage states (:class:`~minizero.stages.facts.GradientMemory`):
  kept    -- in buffers that outlive ``zero_grad()``: nothing on top of the model states;
  born    -- each ``.grad`` is made as backward reaches its parameter, and stays (``packed``: after backward, copied
             whole into one flat buffer for one all-reduce);
  buckets -- ZeRO-2 and -3: a bucket whose gradients are all born waits for the reduce-scatter before it
             (:data:`~minizero.buckets.MAX_IN_FLIGHT`), is packed into a new buffer -- its gradients and their copy
             both alive for that moment -- and its gradients freed; each reduce-scatter leaves this rank its 1/N.
"""
from __future__ import annotations

from ..stages.facts import GradientMemory


def block_gradients(hidden: int) -> list[int]:
    """Elements of a transformer block's parameters in the order backward makes their gradients (reverse
    registration: the MLP's output and input layers, the second LayerNorm, the attention's projection and QKV, the
    first LayerNorm): 12h^2 + 13h."""
    h = hidden
    return [4 * h * h + h, 4 * h * h + 4 * h, 2 * h, h * h + h, 3 * h * h + 3 * h, 2 * h]


def gradient_order(layers: int, hidden: int, seq: int, vocab: int) -> list[tuple[int | None, int]]:
    """``(block, elements)`` of every parameter in backward's order: the final LayerNorm, the blocks last to first,
    the position embedding, the token embedding tied to the head (``None``: the root unit's, outside the blocks)."""
    blocks = [(j, n) for j in reversed(range(layers)) for n in block_gradients(hidden)]
    return [(None, 2 * hidden)] + blocks + [(None, seq * hidden), (None, vocab * hidden)]


def buckets_of(order: list[tuple[int | None, int]], memory: GradientMemory, cap: float) -> list[int]:
    """Each parameter's bucket, in ``order``: at most ``cap`` elements each, filled in order (a larger parameter gets
    its own: :func:`minizero.layout.plan_groups`), or ZeRO-3's units -- a block's parameters, then the root's."""
    if memory.buckets == "unit":
        return [len(order) if block is None else block for block, _ in order]
    index, filled, out = 0, 0, []
    for _, n in order:
        if filled and filled + n > cap:
            index, filled = index + 1, 0
        filled += n
        out.append(index)
    return out


def backward_peak(memory: GradientMemory, layers: int, hidden: int, seq: int, vocab: int, per_block: float,
                  kept_per_block: float, micro_batch: int, working: int, world_size: int,
                  bucket_mb: float = 25.0) -> dict:
    """The most a rank holds during backward beyond its model states less the gradients ``zero_grad()`` freed, as
    ``{"total", "activations", "gradients", "buckets"}`` at that moment.  ``per_block``: a block's activations
    (replayed, when checkpointed); ``kept_per_block``: what each block keeps until its backward (all of them, or
    its input); ``working``: bytes per element of the model's working copy."""
    order = gradient_order(layers, hidden, seq, vocab)
    bucket = buckets_of(order, memory, bucket_mb * 2 ** 20 / working)
    last_of = {b: i for i, b in enumerate(bucket)}  # the parameter completing each bucket
    flowing = 2 * seq * micro_batch * 4 * hidden * working  # the gradient through the MLP, in and out of GeLU
    head = vocab * hidden * working  # the head's gradient, held until the tied embedding's is added to it
    per_block_params = sum(block_gradients(hidden))
    born = unpacked = in_flight = reduced = 0.0
    done, peak = 0, {"total": 0.0}
    for i, (block, n) in enumerate(order):
        if block is not None:  # the block's activations its backward has not freed before this parameter's gradient
            done = done if order[i - 1][0] == block else 0
            activations = block * kept_per_block + (1 - done / per_block_params) * per_block + flowing
            done += n
        else:  # the final LayerNorm's, before any block's backward; the embeddings', after every one's
            activations = layers * kept_per_block if i == 0 else 0.0
        waiting = head if i < len(order) - 1 else 0.0
        born += n * working
        unpacked += n * working
        complete = memory.buckets is not None and last_of[bucket[i]] == i
        # A complete bucket waits for the one in flight, then is copied: its gradients beside either in turn.
        buckets = max(in_flight, unpacked) if complete else in_flight
        gradients = 0.0 if memory.kept else reduced + unpacked if memory.buckets else born
        total = activations + waiting + gradients + buckets
        if total > peak["total"]:
            peak = {"total": total, "activations": activations + waiting, "gradients": gradients, "buckets": buckets}
        if complete:  # packed and launched; its gradients freed; its 1/N will come back
            in_flight, reduced, unpacked = unpacked, reduced + unpacked / world_size, 0.0
    return peak

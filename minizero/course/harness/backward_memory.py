"""What a rank holds moment by moment through backward, beyond what it keeps between steps: the activations not yet
freed, the gradients born so far, the buckets being reduced.  Walked parameter by parameter in the order backward
makes their gradients, so the peak is found at the moment it happens, not added up from parts that never coexist.

Backward runs the blocks last to first.  While block j's backward runs, blocks 0..j-1 keep their activations
(checkpointed: only their inputs), and block j what its backward has not freed yet (checkpointed: of its replay) --
each layer's inputs go once its gradients are made (:func:`block_gradients`).  On top, the gradient flowing through the
block's MLP: two s*b*4h tensors, of GeLU's output and of its input -- backward's working memory, which the
activation formula (what forward keeps) leaves out.  The head's gradient, made first, waits in autograd for the tied
embedding's share, so it is held through every block.

The gradients, by what the stage states (:class:`~minizero.stages.facts.GradientMemory`):
  kept    -- in buffers that outlive ``zero_grad()``: nothing on top of the model states;
  born    -- each ``.grad`` is made as backward reaches its parameter, and stays (DDP then copies them all into one
             flat buffer after backward: the stage's ``after_backward_elements``, another moment);
  buckets -- ZeRO-2 and -3: a bucket whose gradients are all born waits until fewer than ``reduce_scatter_buffers``
             (default :data:`~minizero.parts.buckets.MAX_IN_FLIGHT`, FSDP2's 1) packed buckets are in flight, is
             packed into a new buffer -- its gradients and their copy both alive for that moment -- and its gradients
             freed; each reduce-scatter leaves this rank its 1/N.  A slow wire is assumed: every packed bucket is
             held until the bound makes backward wait for it (the most the timing can keep).
"""
from __future__ import annotations

from ...parts.buckets import MAX_IN_FLIGHT
from ...stages.facts import GradientMemory
from ...stages.options import check_reduce_scatter_buffers


def block_gradients(shape) -> list[tuple[list[int], float]]:
    """A transformer block's layers in the order backward reaches them, each as ``(elements of its parameters in
    reverse registration order -- the order buckets take them, bias first --, activations freed once its gradients
    are made)``, the latter in Korthikanti et al.'s 16-bit units of s*b*h bytes, summing to the block's 34 + 5as/h
    (32 + 2as/h without dropout):
      the MLP's output layer frees its input, GeLU's output (8; and the dropout mask, 1);
      its input layer, its own input (2) and GeLU's input (8);  the second LayerNorm, its input (2);
      the attention's projection, its input (2; its dropout mask, 1);
      QKV, the attention core's (Q and K 4, V 2, the softmax's output 2as/h; with dropout 5as/h) and its input (2);
      the first LayerNorm, its input (2).
    12h^2 + 13h elements in all."""
    h, scores, mask = shape.hidden, (5 if shape.dropout else 2) * shape.heads * shape.seq / shape.hidden, shape.dropout
    return [([h, 4 * h * h], 8 + mask), ([4 * h, 4 * h * h], 10), ([h, h], 2), ([h, h * h], 2 + mask),
            ([3 * h, 3 * h * h], 8 + scores), ([h, h], 2)]


def gradient_order(shape) -> list[tuple[int | None, int, float]]:
    """``(block, elements, share of the block's activations freed before its gradient is made)`` of every parameter
    in backward's order: the final LayerNorm's two, the blocks' last to first, the position embedding, the token
    embedding tied to the head (``None``: the root unit's, outside the blocks)."""
    layers = block_gradients(shape)
    total = sum(freed for _, freed in layers)
    before = [sum(freed for _, freed in layers[:i]) / total for i in range(len(layers))]
    blocks = [(j, n, share) for j in reversed(range(shape.layers))
              for (params, _), share in zip(layers, before, strict=True) for n in params]
    h = shape.hidden
    return [(None, h, 0.0), (None, h, 0.0)] + blocks + [(None, shape.seq * h, 0.0), (None, shape.vocab * h, 0.0)]


def buckets_of(order: list[tuple[int | None, int, float]], memory: GradientMemory, cap: float) -> list[int]:
    """Each parameter's bucket, in ``order``: at most ``cap`` elements each, filled in order (a larger parameter gets
    its own: :func:`minizero.parts.layout.plan_groups`), or ZeRO-3's units -- a block's parameters, then the root's."""
    if memory.buckets == "unit":
        return [len(order) if block is None else block for block, _, _ in order]
    index, filled, out = 0, 0, []
    for _, n, _ in order:
        if filled and filled + n > cap:
            index, filled = index + 1, 0
        filled += n
        out.append(index)
    return out


def backward_peak(memory: GradientMemory, shape, per_block: float, kept_per_block: float, micro_batch: int,
                  working: int, world_size: int, bucket_mb: float = 25.0,
                  reduce_scatter_buffers: int = MAX_IN_FLIGHT) -> dict:
    """The most a rank holds during backward beyond its model states less the gradients ``zero_grad()`` freed, as
    ``{"total", "activations", "gradients", "buckets"}`` at that moment, for a GPT of ``shape``
    (:class:`~.step_memory.Shape`).  ``per_block``: a block's activations (replayed, when checkpointed);
    ``kept_per_block``: what each block keeps until its backward (all of them, or its input); ``working``: bytes per
    element of the model's working copy."""
    check_reduce_scatter_buffers(reduce_scatter_buffers)
    order = gradient_order(shape)
    bucket = buckets_of(order, memory, bucket_mb * 2 ** 20 / working)
    last_of = {b: i for i, b in enumerate(bucket)}  # the parameter completing each bucket
    flowing = 2 * shape.seq * micro_batch * 4 * shape.hidden * working  # the gradient into and out of GeLU
    head = shape.vocab * shape.hidden * working  # the head's gradient, held until the tied embedding's joins it
    born = unpacked = reduced = 0.0
    in_flight: list[float] = []  # packed buckets, oldest first, whose reduce-scatter may not have finished
    peak = {"total": 0.0}
    for i, (block, n, freed) in enumerate(order):
        if block is not None:  # blocks below this one keep theirs; this one what its backward has not freed yet
            activations = block * kept_per_block + (1 - freed) * per_block + flowing
        else:  # the final LayerNorm's gradient, before any block's backward; the embeddings', after every one's
            activations = shape.layers * kept_per_block if i < 2 else 0.0
        waiting = head if i < len(order) - 1 else 0.0
        born += n * working
        unpacked += n * working
        complete = memory.buckets is not None and last_of[bucket[i]] == i
        # A complete bucket waits for the oldest in flight until fewer than the bound are, then is copied: its
        # gradients beside the waited-for ones, then beside their copy; the newest (bound - 1) stay throughout.
        staying = sum(in_flight[max(0, len(in_flight) - reduce_scatter_buffers + 1):])
        buckets = staying + max(sum(in_flight) - staying, unpacked) if complete else sum(in_flight)
        gradients = 0.0 if memory.kept else reduced + unpacked if memory.buckets else born
        total = activations + waiting + gradients + buckets
        if total > peak["total"]:
            peak = {"total": total, "activations": activations + waiting, "gradients": gradients, "buckets": buckets}
        if complete:  # packed and launched, its gradients freed; its output, this rank's 1/N, made as it starts
            in_flight = (in_flight + [unpacked])[-reduce_scatter_buffers:]
            reduced, unpacked = reduced + unpacked / world_size, 0.0
    return peak

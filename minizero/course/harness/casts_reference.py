"""The reference for compressed runs: single-device training that applies the same casts.

Comparing a compressed run with exact training only bounds the error.  To
keep the tolerance *tight*, this reference reproduces the rounding itself:
one process computes each simulated rank's gradient on that rank's
micro-batches, lays the gradients out in the stage's buffers (dtype groups
for ``ddp``, buckets for ``ddp-bucketed``, padded flat groups for ZeRO --
a reduce-scatter sums each chunk just as the all-reduce's first half does),
divides by ``pre``, casts to the
wire dtype, sums in exactly the order the send/recv ring does (chunk ``c``
starts at rank ``c+1`` and travels right, rounded to 16 bits at every hop),
and divides by ``post``.  Any mistake in the stage's casts, divisions,
buffers or error feedback then shows as a difference far above float
round-off.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from ...comm import TwoLevel, chunk_bounds, parse_network
from ...compress import Codec, check_compress, split_division
from ...compress import parse as parse_compress
from ...compress.gathered import mean_in_rank_order, split, stream
from ...compress.powersgd import PowerSGD, PowerState, power_step
from ...compress.powersgd_layout import lay_out
from ...compress.weights import parse_weights, round_like_the_gather
from ...parts.flat import pack, unpack
from ...parts.layout import padded_size
from ...parts.precision import REDUCE_DTYPES, Precision
from ...run.train import shard_step, sum_loss
from ...stages import Stage
from .equivalence import DTYPES
from .optimizers import make_optimizer
from .poison import poison_gradient
from .result import RankResult
from .tasks import TASKS


def ring_sum(wires: list[torch.Tensor], shards: int | None = None) -> torch.Tensor:
    """What the ring all-reduce leaves on every rank, bit for bit, in the wires' dtype.  With ``shards``
    (a parameter server's S), what the servers' push leaves: shard ``c`` summed in the same order."""
    n = len(wires)
    out = torch.empty_like(wires[0])
    for c, (a, b) in enumerate(chunk_bounds(out.numel(), shards or n)):
        partial = wires[(c + 1) % n][a:b].clone()
        for k in range(2, n + 1):
            partial = partial + wires[(c + k) % n][a:b]
        out[a:b] = partial
    return out


def round_weights(reduction, params_by_name: dict, codec, n: int) -> dict:
    """Set every sharded parameter to what ZeRO-3's quantized gather decodes it to (each flat group padded to N
    shards, shard i encoded by rank i: :func:`minizero.compress.weights.round_like_the_gather`); returns the
    exact values, to put back before the step.  Replicated parameters are not gathered: left as they are."""
    exact = {}
    with torch.no_grad():
        for key, names in enumerate(reduction.buffers):
            if key in reduction.whole:
                continue
            params = [params_by_name[name] for name in names]
            flat = pack([p.detach() for p in params])
            full = torch.cat([flat, flat.new_zeros(padded_size(flat.numel(), n) - flat.numel())])
            rounded = round_like_the_gather(full, codec, n)[:flat.numel()]
            exact.update({name: p.detach().clone() for name, p in zip(names, params, strict=True)})
            unpack(rounded, params)
    return exact


def powersgd_average(state: PowerState, key, flats: list[torch.Tensor], layout, residuals: dict | None):
    """What the PowerSGD wire leaves on every rank (:mod:`minizero.compress.powersgd`): its own steps, on every
    rank's buffer at once, with the all-reduces emulated in the ring's order; ``residuals`` per (rank, key)."""
    n = len(flats)
    if not state.compresses(key):  # divided first, as the wire does
        return ring_sum([flat / n for flat in flats])
    carried = [flat + residuals[(r, key)] if residuals is not None and (r, key) in residuals else flat.clone()
               for r, flat in enumerate(flats)]
    plan = lay_out(layout, state.settings)
    q = state.starting_q(key, plan, flats[0].dtype, flats[0].device, "the reference")
    out, q = power_step(carried, plan, q, ring_sum, n, state.settings.epsilon, "the reference")
    state.keep(key, q)
    if residuals is not None:
        for r, c in enumerate(carried):
            residuals[(r, key)] = c - out
    return out


def two_levels(flats: list[torch.Tensor], padded: bool, average, replicas: int, inner_wire, wire, codec) -> torch.Tensor:
    """HSDP's reduction: each node's ``G`` buffers averaged as its reduce-scatter (or all-reduce) does, exactly or in
    the precision's reduce dtype; then each shard of the nodes' means averaged across the ``M`` nodes by the ranks at
    its place -- on the wire, or through the codec.  ``average(flats, ranks, padded, shards, wire, codec)`` is one
    level."""
    g = len(flats) // replicas
    nodes = [list(range(k * g, (k + 1) * g)) for k in range(replicas)]
    means = [average([flats[r] for r in ranks], ranks, padded, g, inner_wire, None) for ranks in nodes]
    if not padded:  # a replicated module, whole on every rank: every place's all-reduce across is the same one
        return average(means, [ranks[0] for ranks in nodes], False, None, wire, codec)
    size = means[0].numel() // g
    return torch.cat([average([m[j * size:(j + 1) * size] for m in means], [ranks[j] for ranks in nodes], False, None,
                              wire, codec) for j in range(g)])


def run_casts_reference(exp, world_size: int, stage_class) -> RankResult:
    """Like :func:`minizero.course.harness.experiment.reference_of`, with the stage's compression emulated.

    Runs single-threaded, as each rank does: a float32 gradient summed in another
    order can land on the other side of a 16-bit rounding boundary."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_casts_reference(exp, world_size, stage_class)
    finally:
        torch.set_num_threads(threads)


def _run_casts_reference(exp, world_size: int, stage_class) -> RankResult:
    task, dtype, n = TASKS[exp.task], DTYPES[exp.dtype], world_size
    precision = Precision.of(exp.options.get("precision"))
    wire = check_compress(exp.options.get("compress"))
    if wire is None and precision.reduce_dtype is not None:
        wire = REDUCE_DTYPES[precision.reduce_dtype]  # a wider wire: 16-bit gradients summed in fp32
    error_feedback = exp.options.get("error_feedback", False)
    parsed = parse_compress(exp.options.get("compress"))
    codec = parsed if isinstance(parsed, Codec) else None
    power = PowerState(parsed) if isinstance(parsed, PowerSGD) else None  # Q and its seeds: alike on every rank
    # HSDP sums inside a node exactly, or in its precision's reduce dtype; compression is the slow hop's
    inner_wire = REDUCE_DTYPES[precision.reduce_dtype] if precision.reduce_dtype is not None else None
    model = task.make_model(exp.seed, dtype, **exp.model)
    optimizer = make_optimizer(exp.optimizer, model, exp.lr, exp.param_groups)
    # The same precision recipe as the stage -- masters, loss scaler, skipped steps -- is the reference
    # stage's own (minizero.parts.precision); what is emulated here is the distribution: per-rank gradients
    # and the stage's reduction of them.
    stage = Stage(model, optimizer, precision=precision)
    params_by_name = dict(model.named_parameters())
    # The stage's own buffers -- laid out by the optimizer's param groups, or, with the optimizer built after
    # wrapping, by one group of every trainable parameter (what the stage had to lay out before it existed).
    laid_out = SimpleNamespace(param_groups=[{"params": [p for p in model.parameters() if p.requires_grad]}]) \
        if exp.wrap_first else optimizer
    network = parse_network(exp.network)  # where the ranks sit: HSDP's two levels are its nodes
    reduction = stage_class.reduction(model, laid_out, n, nodes=network.nodes if isinstance(network, TwoLevel) else None,
                                      **exp.options)
    residuals: dict = {}
    averages: dict = {}  # (rank, key) -> how many times that buffer was averaged: a stochastic codec's stream
    settling: dict = {}  # under loss scaling, residuals are kept only if the step is taken (Wire.settle)
    weights = parse_weights(exp.options.get("quantized_weights"))  # ZeRO++'s qwZ (zeropp): compute at the decoded weights
    record = RankResult(params=[], losses=[])
    def average(flats: list[torch.Tensor], ranks: list[int], padded: bool, shards, wire, codec) -> torch.Tensor:
        """The mean of ``flats`` (the buffers of ``ranks``) as the stage's collective leaves it, on ``wire`` or
        through ``codec`` (or neither); residuals kept by rank and buffer (``key``, the loop's)."""
        count = len(flats)
        if codec is not None:  # every rank's messages decoded and added in rank order (compress.gathered)
            messages = []
            for i, (r, flat) in enumerate(zip(ranks, flats, strict=True)):  # (i: the rank in the collective's group)
                carried = flat.clone()
                if error_feedback and (r, key) in residuals:
                    carried += residuals[(r, key)]
                # a reduce-scatter encodes each shard on its own (qgZ's all-to-all); an all-reduce the whole
                pieces = split(carried, count if padded else 1)
                seen = averages[(r, key)] = averages.get((r, key), -1) + 1
                messages.append([codec.encode(p, stream(i, seen, j) if codec.stochastic else None)
                                 for j, p in enumerate(pieces)])
                if error_feedback:
                    residuals[(r, key)] = carried - torch.cat([codec.decode(m, p.numel(), p.dtype)
                                                               for m, p in zip(messages[-1], pieces, strict=True)])
            size = flats[0].numel() // (count if padded else 1)  # each shard's mean: the one its owner decodes
            return torch.cat([mean_in_rank_order(codec, [sent[j] for sent in messages], flats[0].new_empty(size))
                              for j in range(len(messages[0]))])
        if wire is None:
            return ring_sum(flats, shards if padded else None) / count
        # divide by pre and post in the wider of the two dtypes (minizero.compress.Wire)
        wide = torch.promote_types(flats[0].dtype, wire)
        pre, post = split_division(count)
        wires, pending = [], {}
        for r, flat in zip(ranks, flats, strict=True):
            scaled = flat.to(wide) / pre
            if error_feedback and (r, key) in residuals:
                scaled += residuals[(r, key)]
            wires.append(scaled.to(wire))
            pending[(r, key)] = scaled - wires[-1].to(wide)
        summed = ring_sum(wires, shards if padded else None)
        if error_feedback and precision.scaled:
            settling.update(pending)
        elif error_feedback and bool(torch.isfinite(summed).all()):  # an overflow keeps the old error
            residuals.update(pending)
        return (summed.to(wide) / post).to(flats[0].dtype)

    for s in range(exp.steps):
        x, y = task.make_batch(exp.global_batch(n), exp.seed, s, dtype, **exp.model)
        per_rank, loss_total = [], 0.0
        exact = round_weights(reduction, params_by_name, weights, n) if weights is not None else {}
        for r in range(n):
            step = shard_step(x, y, r, n, exp.accum, list(exp.rank_sizes) if exp.rank_sizes else None)
            model.zero_grad(set_to_none=True)
            with poison_gradient(model, exp, s, r, n):
                for xb, yb in step.micro_batches:
                    loss = sum_loss(stage(xb), yb)
                    stage.scale_loss(loss * (n / step.global_count)).backward()
                    loss_total += loss.item()
            per_rank.append({name: None if p.grad is None else p.grad.clone() for name, p in params_by_name.items()})
        model.zero_grad(set_to_none=True)
        with torch.no_grad():  # the optimizer steps the exact weights: only their copies in flight were rounded
            for name, value in exact.items():
                params_by_name[name].copy_(value)
        for key, names in enumerate(reduction.buffers):
            # ddp packs the gradients that exist on some rank; the others pack every slot of their buffer.
            packed = [name for name in names if reduction.packs_unused or any(g[name] is not None for g in per_rank)]
            if not any(g[name] is not None for g in per_rank for name in packed) and not (
                    power and reduction.packs_unused):  # (a bucket is reduced anyway: PowerSGD counts it)
                continue  # no gradient anywhere: the parameters keep .grad = None
            flats = [pack([g[name] if g[name] is not None else torch.zeros_like(params_by_name[name])
                           for name in packed]) for g in per_rank]
            padded = reduction.padded and key not in reduction.whole  # (a replicated buffer is all-reduced whole)
            if padded:  # a reduce-scatter of a buffer padded to a multiple of N (or of S, a push)
                size = padded_size(flats[0].numel(), reduction.shards or n)
                flats = [torch.cat([f, f.new_zeros(size - f.numel())]) for f in flats]
            if reduction.replicas is not None:  # HSDP: each node's mean, exactly (or in its reduce dtype); then across
                averaged = two_levels(flats, padded, average, reduction.replicas, inner_wire, wire, codec)
            elif power is not None:
                layout = [(name, params_by_name[name].shape) for name in packed]
                averaged = powersgd_average(power, key, flats, layout, residuals if error_feedback else None)
            else:
                averaged = average(flats, list(range(n)), padded, reduction.shards, wire, codec)
            grads = [torch.empty_like(params_by_name[name]) for name in packed]
            unpack(averaged[:sum(g.numel() for g in grads)], grads)
            for name, grad in zip(packed, grads, strict=True):
                if any(g[name] is not None for g in per_rank):  # unused everywhere: no gradient, no update
                    params_by_name[name].grad = grad
        if exp.clip is not None:
            stage.clip_grad_norm_(*exp.clip)
        scale, skipped = stage.loss_scale, stage.skipped_steps
        stage.step()
        if stage.skipped_steps == skipped:
            residuals.update(settling)
        settling.clear()
        for residual in residuals.values():  # the residuals are in units of the scaled gradients
            residual.mul_(stage.loss_scale / scale)
        record.losses.append(loss_total)
        state = stage.full_state_dict()
        record.params.append({name: state[name] for name in params_by_name})
        record.loss_scales.append(stage.loss_scale)
        if exp.record_states:
            record.optimizer_states.append(copy.deepcopy(stage.full_optimizer_state_dict()))
    record.skipped_steps = stage.skipped_steps
    return record

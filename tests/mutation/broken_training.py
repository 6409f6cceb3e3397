"""Broken copies of training code -- buckets, compression, layout, stages, the loop, the comparison -- each one
realistic bug (registered in ``register.py``).  A copy that calls the real code for the rest finds it with
:func:`~tests.mutation.original_of` when it runs."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from minizero.comm import ReduceOp
from minizero.run.train import Step, sum_loss
from tests.mutation import original_of


# ------------------------------------------------------------------------------- buckets
def buckets_in_registration_order(named_params, bucket_mb):
    """Right values; the first bucket now holds the first layer, whose gradient comes last: no overlap."""
    return original_of(buckets_in_registration_order)(list(reversed(named_params)), bucket_mb)


def cap_in_elements(named_params, bucket_mb):
    """The cap compared with element counts, not bytes: 4x (float32) or 8x (float64) too few buckets."""
    element_size = named_params[0][1].element_size() if named_params else 4
    return original_of(cap_in_elements)(named_params, bucket_mb * element_size)


def launch_when_any_ready(self, param):
    b, i = self._slot[id(param)]
    self._ready[b].add(i)
    while self._next < len(self._sizes) and self._ready[self._next]:  # some, not all
        self._launch(self._next)
        self._next += 1


# ------------------------------------------------------------------------------- compression
def divide_by_n_first(world_size):
    return world_size, 1.0  # fp16_compress_hook's order: small gradients sink into subnormals


def feedback_of_wrong_sign(self, flat, key=None):
    scaled = flat / self.pre
    if self.error_feedback and self.residuals.get(key) is not None:
        scaled += self.residuals[key]
    wire = scaled.to(self.wire_dtype)
    if self.error_feedback:
        self._pending[key] = wire.to(flat.dtype) - scaled
    return wire


def no_overflow_check(self, wire, out, key=None, where=""):
    pending = self._pending.pop(key, None)
    if pending is not None:
        self.residuals[key] = pending
    out.copy_(wire)
    out.div_(self.post)


def no_cast(self, flat, key=None):
    return (flat / self.pre).to(self.wire_dtype).to(flat.dtype)  # rounded like fp16, sent as fp32


# ------------------------------------------------------------------------------- layout, sharded optimizer
def pieces_one_short(self):
    """Every piece ends one element early: that element of each parameter is never stepped."""
    pieces = original_of(pieces_one_short)(self)
    for piece in pieces:
        if piece.stop - piece.start > 1:
            piece.stop -= 1
            piece.param = torch.nn.Parameter(self.shard[piece.offset:piece.offset + piece.stop - piece.start])
    return pieces


def zero_grads_for_unused(self, group, averaged, used):
    for piece in group.pieces:  # a zero gradient instead of None: weight decay and momentum still move it
        part = averaged[piece.offset:piece.offset + piece.stop - piece.start]
        piece.param.grad = part if piece.param.grad is None else piece.param.grad.add_(part)


def state_at_the_parameters_offset(sharded, group, key, dtype, comm, tag, stepped):
    """The consolidated state: each piece's state written at its offset within the *parameter*, not within the
    rank's shard."""
    mine = torch.zeros(group.shard_size, dtype=dtype, device=group.shard.device)
    for piece in group.pieces:
        piece_state = sharded.state.get(stepped(piece))
        if piece_state and key in piece_state:
            at = piece.start % max(group.shard_size, 1)  # the offset within the parameter, not within the shard
            mine[at:at + piece.stop - piece.start] = piece_state[key][: group.shard_size - at]
    full = mine.new_empty(group.shard_size * comm.world_size)
    comm.all_gather(full, mine, tag=tag)
    return full[:group.shard_size * group.world_size]


# ------------------------------------------------------------------------------- stages
def ddp_packs_what_exists(self):
    """The old ddp: whatever has a gradient here -- rank 0's b meets rank 1's c in the buffer."""
    return [p for _, p in self.trainable() if p.grad is not None]


def zero1_gathers_before_stepping(self):
    with self.stepping():
        self.all_gather_parameters()  # everyone gets the old values...
        self.optimizer.step_owned()  # ...and each rank keeps only its own update


def zero2_keeps_full_gradients(self, index):
    """Right values, ZeRO-1's memory: the full gradients are packed but never freed."""
    group, tag = self.groups[index], self.tag(f"bucket {index}")
    full = group.pack_grads()

    def reduce_scatter():
        averaged = torch.empty_like(group.shard)
        self.comm.reduce_scatter(averaged, full, ReduceOp.AVG, tag=tag, wire=self.wire, key=index)
        return averaged
    return reduce_scatter


def zero3_never_reshards(self, unit, output):
    """Right values, DDP's bytes and memory: units stay gathered from forward to backward."""
    keep, self.reshard_after_forward = self.reshard_after_forward, False
    try:
        original_of(zero3_never_reshards)(self, unit, output)
    finally:
        self.reshard_after_forward = keep


def zero3_keeps_prefetches(self):  # Unit.drop_prefetch
    pass  # prefetched buffers outlive the step: the next forward may compute with stale weights


def tied_weight_in_first_unit(model, units):
    """A parameter used by two units goes to the first of them, not to the root."""
    unit_of = {id(m): i for i, unit in enumerate(units, start=1) for m in unit.modules()}
    assigned = [[] for _ in range(len(units) + 1)]
    for name, p in model.named_parameters():
        if p.requires_grad:
            owners = sorted({unit_of.get(id(m), 0) for m in model.modules() for q in m._parameters.values()
                             if q is p} - ({0} if len(units) else set()) or {0})
            assigned[owners[0]].append((name, p))
    return assigned


def agrees_on_nothing(self, params):
    here = {id(p) for p in params if id(p) in self._used}  # no bitmap: this rank's view only
    self._has_grad.update(here)
    self._used.clear()
    return here


def steps_on_local_gradients(self):
    self._local_grads = False  # the no_sync-only check, gone
    original_of(steps_on_local_gradients)(self)


# ------------------------------------------------------------------------------- the loop, the comparison
def loop(scale_of: Callable, sync_every: bool = False, clear: bool = True, clip_after: bool = False):
    """``minizero.run.train.train_step`` with one thing changed (its signature kept: the experiment calls it so)."""
    def train_step(stage, step: Step, loss_fn: Callable = sum_loss, clip=None, syncs=None, optimizer=None,
                   zero_grad=None):
        if clear:
            (zero_grad or (optimizer or stage).zero_grad)()
        total, last = 0.0, len(step.micro_batches) - 1
        for k, (x, y) in enumerate(step.micro_batches):
            syncing = k == last or sync_every or (syncs is not None and syncs[k])
            with contextlib.nullcontext() if syncing else stage.no_sync():
                loss = loss_fn(stage(x), y)
                stage.scale_loss(loss * scale_of(stage, step)).backward()
            total += loss.item()
        if clip is not None and not clip_after:
            stage.clip_grad_norm_(*clip)
        (optimizer or stage).step()
        if clip is not None and clip_after:
            stage.clip_grad_norm_(*clip)
        return total
    return train_step


right_scale = lambda stage, step: stage.world_size / step.global_count  # noqa: E731


def shard_step_off_by_one(x, y, rank, world_size, accum_steps=1, rank_sizes=None):
    step = original_of(shard_step_off_by_one)(x, y, rank, world_size, accum_steps, rank_sizes)
    if world_size > 1 and rank_sizes is not None and rank > 0:  # the slice starts one sample early
        start = sum(rank_sizes[:rank]) - 1
        mine = slice(start, start + rank_sizes[rank])
        step = Step(list(zip(x[mine].tensor_split(accum_steps), y[mine].tensor_split(accum_steps), strict=True)),
                    step.global_count)
    return step


def max_diff_ignores_nan(results, reference):
    worst_abs, worst_rel = 0.0, 0.0
    for result in results:
        for mine, ref in zip(result.params, reference.params, strict=True):
            for name, r in ref.items():
                if r.numel():
                    diff = (mine[name] - r).abs().max().item()
                    worst_abs = max(worst_abs, diff)  # max(0.0, nan) is 0.0
                    worst_rel = max(worst_rel, diff / max(r.abs().max().item(), 1e-300))
    return worst_abs, worst_rel


def nan_errors_pass_through(params, ref_params, dtype):
    for name, ref in ref_params.items():
        if ref.numel():
            err = (params[name] - ref).abs().max().item()  # NaN goes on as NaN: max(0.0, nan) is 0.0
            yield name, err, max(ref.abs().max().item(), 1e-300)


def nothing_is_nonfinite(results, reference):
    return None


# ------------------------------------------------------------------------------- PowerSGD
def powersgd_q_not_averaged(carried, layout, q, sum_over_ranks, n, epsilon, where):
    """Q summed over the ranks and never divided by N: every compressed matrix N times too large."""
    from minizero.compress.powersgd_layout import back_project, matrix, orthogonalize, p_of, project, q_of, rest_of
    out = torch.empty_like(carried[0])
    rest = sum_over_ranks([rest_of(c, layout) for c in carried]) / n
    at = 0
    for a, k in layout.rest:
        out[a:a + k] = rest[at:at + k]
        at += k
    if not layout.matrices:
        return out, q
    p = sum_over_ranks([project(c, layout, q) for c in carried])
    for mx in layout.matrices:
        orthogonalize(p_of(p, mx), epsilon, where)
    q = sum_over_ranks([back_project(c, layout, p) for c in carried])  # (the division by N left out)
    for mx in layout.matrices:
        torch.mm(p_of(p, mx), q_of(q, mx).t(), out=matrix(out, mx))
    return out, q


def powersgd_cold_start(self, key, q):
    """Warm start forgotten: each step starts from a fresh random Q (and draws another seed)."""


def powersgd_nothing_summed(self, tensors, tag):
    """The all-reduces left out: each rank averages, orthogonalizes and expands its own factors alone."""
    return tensors[0]


def qwz_own_shard_exact(self, full, shard, tag):
    """qwZ with the owner keeping its own shard exact: each rank computes with slightly different weights."""
    n, rank = self.comm.world_size, self.comm.rank
    on_host = shard.detach().reshape(-1).cpu()
    message = self.codec.encode(on_host, None)
    gathered = message.new_empty(n * message.numel())
    self.comm.all_gather(gathered, message, tag=tag)
    self.formula_by_kind["all_gather"] += (n - 1) * message.numel()
    full.copy_(torch.cat([self.codec.decode(m, shard.numel(), shard.dtype) for m in gathered.chunk(n)]))
    full[rank * shard.numel():(rank + 1) * shard.numel()] = on_host


def split_rotated(flat, pieces):
    """The shards cut one place off: shard j's message goes to rank j + 1 (an all-to-all's classic slip)."""
    size = flat.numel() // pieces
    parts = [flat[i * size:(i + 1) * size] for i in range(pieces)]
    return parts[1:] + parts[:1]


def switch_read_loosely(value: str) -> bool:
    """A codec spec's switch as it was once read: anything but 1/true/yes is off -- ``stochastic=on`` built
    nearest rounding, silently."""
    return value.lower() in ("1", "true", "yes")


def diloco_heavy_ball(self):
    """DiLoCo's outer step with heavy-ball momentum, not the paper's Nesterov: plain averaging (outer_lr = 1, no
    momentum) is unchanged, so only a replay of the paper's update sees it."""
    if self.outer is not None:
        for group in self.outer.param_groups:
            group["nesterov"] = False
    return original_of(diloco_heavy_ball)(self)


def checkpoint_forgets_the_rng(forward, *args, **kwargs):
    """Activation checkpointing that does not restore the random state for its replay: dropout draws a new mask
    inside backward, and the gradients are those of a forward that never ran."""
    import torch
    from torch.utils.checkpoint import checkpoint
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

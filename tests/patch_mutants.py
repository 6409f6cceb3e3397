"""Single realistic bugs in every module, and the part of the suite that must catch each.

A mutant replaces one function or method (``"module:Class.attr"``) by a broken
copy -- in the test process and in every rank (see ``Pools.patched``).  Some
are wrong in value; others right in value but wrong in *cost* -- bytes sent,
memory held, overlap lost -- and only a test that measures the cost can catch
them.  ``test_mutants.py`` applies each and requires its catch to fail.
Broken *stages* (classes) live in ``mutants.py``.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from equivalence import experiments, run_and_check


@dataclass
class Mutant:
    target: str  # "package.module:Name.attribute"
    replacement: Callable
    catch: Callable  # catch(pools) must raise while the mutant is in place
    cost: bool = False  # right in value, wrong in bytes, memory or overlap


def _resolve(target: str):
    module, path = target.split(":")
    owner = importlib.import_module(module)
    *parents, attr = path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    if not hasattr(owner, attr):
        raise AttributeError(f"mutant target {target} does not exist")  # a harness error, never "caught"
    return owner, attr


_ORIGINALS: dict[str, object] = {}


def apply(name: str) -> None:
    owner, attr = _resolve(MUTANTS[name].target)
    _ORIGINALS[name] = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    setattr(owner, attr, MUTANTS[name].replacement)


def undo(name: str) -> None:
    owner, attr = _resolve(MUTANTS[name].target)
    setattr(owner, attr, _ORIGINALS.pop(name))


# ------------------------------------------------------------------------------- catches
def property_catch(stage: str, examples: int = 40, **draw) -> Callable:
    """The equivalence property of ``stage``, generate phase only (no shrinking: we only need a failure)."""
    def catch(pools):
        @settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(drawn=experiments(stage, **{"world_sizes": (2, 3, 4), "max_accum": 4, **draw}))
        def equivalence(drawn):
            run_and_check(pools, *drawn)
        equivalence()
    return catch


def comm_catch(pools):
    """The collectives' check on a grid -- every kind, op, dtype and backend, N = 2..4, an uneven
    length -- rather than a random draw, so no combination is left to chance."""
    import itertools

    from test_comm import DTYPES, test_collectives_match_math_and_ledger

    inner = test_collectives_match_math_and_ledger.hypothesis.inner_test
    kinds = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "root_all_reduce"]
    for world_size, kind, op, dtype, backend in itertools.product(
            (2, 3, 4), kinds, list(ReduceOp), (torch.float32, torch.float64, DTYPES[0]), ("ring", "native")):
        inner(pools, world_size, (kind, 7, dtype, op, backend, 1, world_size - 1))


_CATCH_MODULES = {"test_comm"}


def test_catch(module: str, name: str, *args) -> Callable:
    """An ordinary test of the suite, called with ``pools`` if it takes it."""
    _CATCH_MODULES.add(module)

    def catch(pools):
        fn = getattr(importlib.import_module(module), name)
        return fn(pools, *args) if "pools" in fn.__code__.co_varnames[:fn.__code__.co_argcount] else fn(*args)
    return catch


def all_of(*catches: Callable) -> Callable:
    def catch(pools):
        failures = 0
        for c in catches:
            try:
                c(pools)
            except Exception:  # noqa: BLE001 -- any of them failing catches the mutant
                failures += 1
        assert failures == 0, f"{failures} of {len(catches)} checks failed"
    return catch


# ------------------------------------------------------------------------------- comm
from minizero.comm import ReduceOp, ring  # noqa: E402
from minizero.comm.base import Comm, collective  # noqa: E402


def _rs_forgets_own_chunk(self, chunks, out, op):
    """Reduce-scatter whose last step keeps the neighbour's partial sum, forgetting this rank's part."""
    n, r = self.world_size, self.rank
    if n == 1:
        if out is not chunks[r]:
            out.copy_(chunks[r])
        return
    buffers = self._scratch(max(c.numel() for c in chunks), out)
    send = chunks[(r - 1) % n]
    for step in range(n - 1):
        index = (r - step - 2) % n
        incoming = buffers[step % 2][: chunks[index].numel()]
        self._send_right_recv_left(send, incoming, "reduce-scatter", step)
        if index == r:
            out.copy_(incoming)
        else:
            send = op.combine(incoming, chunks[index], out=incoming)


def _ag_forwards_wrong_chunk(self, chunks):
    n, r = self.world_size, self.rank
    for step in range(n - 1):
        self._send_right_recv_left(chunks[(r - step + 1) % n], chunks[(r - step - 1) % n], "all-gather", step)


@collective("reduce_scatter")
def _rs_avg_not_divided(self, output, input, op=ReduceOp.SUM):
    self._ring_reduce_scatter(self._chunks(input), output.view(-1), op)  # AVG: forgot to divide


_original_broadcast = ring.RingComm.broadcast.__wrapped__
_original_root = ring.RingComm.root_all_reduce.__wrapped__


@collective("broadcast")
def _broadcast_from_zero(self, tensor, src=0):
    _original_broadcast(self, tensor, 0)  # every broadcast starts at rank 0, whatever src says


@collective("all_reduce")
def _all_reduce_through_root(self, tensor, op=ReduceOp.SUM):
    """Right values, the parameter-server bytes: the root sends (N-1) x S."""
    _original_root(self, tensor, op)


def _p2p_unreported(self, send, recv, part, step):
    right, left = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
    request = dist.isend(send, self.peer(right), group=self.group) if send is not None and send.numel() else None
    if recv is not None and recv.numel():
        dist.recv(recv, self.peer(left), group=self.group)
    if request is not None:
        request.wait()  # bytes left, but nobody told the ledger


from minizero.comm import fingerprint as _fingerprint  # noqa: E402
from minizero.comm import native as _native  # noqa: E402

_original_model = _native.ring_bytes_sent
_original_encode = _fingerprint.encode
_original_run = Comm._run


def _modelled_bytes_ignore_uneven_chunks(kind, numel, element_size, world_size, rank, src=0):
    if kind == "all_reduce" and world_size > 1:
        return 2 * (world_size - 1) * (numel // world_size) * element_size
    return _original_model(kind, numel, element_size, world_size, rank, src)


def _fingerprint_without_tag(call):
    return _original_encode(replace(call, tag=_fingerprint.Tag()))  # kind, size and dtype only


def _keeps_going_after_failure(self, kind, method, arguments, tag):
    self._failed = None  # forgets that a collective failed part-way
    return _original_run(self, kind, method, arguments, tag)


# ------------------------------------------------------------------------------- launcher
from minizero import launch as _launch  # noqa: E402
from minizero.comm import progress as _progress  # noqa: E402
from minizero.comm import stall as _stall  # noqa: E402

_original_blame = _stall.blame
_original_pool_run = _launch.RankPool.run


def _blames_the_waiter(first, records, finished):
    culprits, reason = _original_blame(first, records, finished)
    return [first["rank"]], reason


_original_set = _progress.ProgressBoard._set


def _progress_only_at_entry(self, **fields):
    """The stall clock starts when the collective starts and never restarts: a slow one is 'stalled'."""
    if "state" not in fields:  # only enter() and leave() set the state
        fields.pop("progress", None)
    _original_set(self, **fields)


def _run_with_a_deadline(self, fn, *args, **kwargs):
    """The old launcher: the timeout bounds the whole run, not a stall."""
    deadline = time.monotonic() + 1.25 * self.timeout_s + 2.0
    original_watch = self._watch

    def watch(finished):
        original_watch(finished)
        if time.monotonic() > deadline:
            self.close(kill=True)
            raise _launch.RankError("ranks did not finish within the timeout")
    self._watch = watch
    try:
        return _original_pool_run(self, fn, *args, **kwargs)
    finally:
        del self._watch


def _swallows_errors(self, fn, *args, **kwargs):
    try:
        return _original_pool_run(self, fn, *args, **kwargs)
    except _launch.RankError as error:
        if "raised" in str(error):
            return [None] * self.world_size
        raise


# ------------------------------------------------------------------------------- buckets
from minizero import buckets as _buckets  # noqa: E402

_original_assign = _buckets.assign_buckets


def _buckets_in_registration_order(named_params, bucket_mb):
    """Right values; the first bucket now holds the first layer, whose gradient comes last: no overlap."""
    return _original_assign(list(reversed(named_params)), bucket_mb)


def _cap_in_elements(named_params, bucket_mb):
    """The cap compared with element counts, not bytes: 4x (float32) or 8x (float64) too few buckets."""
    element_size = named_params[0][1].element_size() if named_params else 4
    return _original_assign(named_params, bucket_mb * element_size)


def _launch_when_any_ready(self, param):
    b, i = self._slot[id(param)]
    self._ready[b].add(i)
    while self._next < len(self._sizes) and self._ready[self._next]:  # some, not all
        self._launch(self._next)
        self._next += 1


# ------------------------------------------------------------------------------- compression
def _divide_by_n_first(world_size):
    return world_size, 1.0  # fp16_compress_hook's order: small gradients sink into subnormals


def _feedback_of_wrong_sign(self, flat, key):
    scaled = flat / self.pre
    if self.error_feedback and self.residuals.get(key) is not None:
        scaled += self.residuals[key]
    wire = scaled.to(self.wire_dtype)
    if self.error_feedback:
        self._pending[key] = wire.to(flat.dtype) - scaled
    return wire


def _no_overflow_check(self, wire, out, names, key):
    pending = self._pending.pop(key, None)
    if pending is not None:
        self.residuals[key] = pending
    out.copy_(wire)
    out.div_(self.post)


def _no_cast(self, flat, key):
    return (flat / self.pre).to(self.wire_dtype).to(flat.dtype)  # rounded like fp16, sent as fp32


# ------------------------------------------------------------------------------- layout, sharded optimizer
from minizero import layout as _layout  # noqa: E402
from minizero import sharded_optimizer as _sharded  # noqa: E402
from minizero.stages import base as _base, ddp as _ddp, zero1 as _zero1, zero2 as _zero2, zero3 as _zero3  # noqa: E402

_original_cut = _layout.FlatGroup._cut_pieces


def _pieces_one_short(self):
    """Every piece ends one element early: that element of each parameter is never stepped."""
    pieces = _original_cut(self)
    for piece in pieces:
        if piece.stop - piece.start > 1:
            piece.stop -= 1
            piece.param = torch.nn.Parameter(self.shard[piece.offset:piece.offset + piece.stop - piece.start])
    return pieces


def _zero_grads_for_unused(groups, grad_shards, has_grad):
    for group, shard in zip(groups, grad_shards):
        for piece in group.pieces:  # a zero gradient instead of None: weight decay and momentum still move it
            piece.param.grad = shard[piece.offset:piece.offset + piece.stop - piece.start]


def _state_at_the_parameters_offset(sharded, group, key, dtype, comm, tag):
    mine = torch.zeros(group.shard_size, dtype=dtype, device=group.shard.device)
    for piece in group.pieces:
        piece_state = sharded.state.get(piece.param)
        if piece_state and key in piece_state:
            at = piece.start % max(group.shard_size, 1)  # the offset within the parameter, not within the shard
            mine[at:at + piece.stop - piece.start] = piece_state[key][: group.shard_size - at]
    full = mine.new_empty(group.shard_size * group.world_size)
    comm.all_gather(full, mine, tag=tag)
    return full


# ------------------------------------------------------------------------------- stages
def _ddp_packs_what_exists(self):
    """The old ddp: whatever has a gradient here -- rank 0's b meets rank 1's c in the buffer."""
    return [p for _, p in self.trainable() if p.grad is not None]


def _zero1_gathers_before_stepping(self):
    self._follow_user_optimizer()
    for g, group in enumerate(self.groups):
        self.comm.all_gather(group.data, group.shard.detach().clone(), tag=self.tag(f"group {g} parameters"))
    _sharded.attach_gradients(self.groups, self.grad_shards(), self._has_grad)
    self.optimizer.step()


def _zero2_keeps_full_gradients(self, index):
    """Right values, ZeRO-1's memory: the full gradients are packed but never freed."""
    group = self.groups[index]
    full = group.pack_grads()
    names, tag = [s.name for s in group.segments], self.tag(self._group_label(index))

    def reduce_scatter():
        averaged = torch.empty_like(self.shards[index])
        self.averager.reduce_scatter(full, averaged, index, names, tag)
        self.shards[index].add_(averaged)
    self._works[index] = self.comm.submit(reduce_scatter)


_original_after_forward = _zero3.ZeRO3._after_forward


def _zero3_never_reshards(self, unit, output):
    """Right values, DDP's bytes and memory: units stay gathered from forward to backward."""
    keep, self.reshard_after_forward = self.reshard_after_forward, False
    try:
        _original_after_forward(self, unit, output)
    finally:
        self.reshard_after_forward = keep


def _zero3_keeps_prefetches(self):
    pass  # prefetched buffers outlive the step: the next forward may compute with stale weights


from minizero import units as _units  # noqa: E402


def _tied_weight_in_first_unit(model, units):
    """A parameter used by two units goes to the first of them, not to the root."""
    unit_of = {id(m): i for i, unit in enumerate(units, start=1) for m in unit.modules()}
    assigned = [[] for _ in range(len(units) + 1)]
    for name, p in model.named_parameters():
        if p.requires_grad:
            owners = sorted({unit_of.get(id(m), 0) for m in model.modules() for q in m._parameters.values()
                             if q is p} - ({0} if len(units) else set()) or {0})
            assigned[owners[0]].append((name, p))
    return assigned


def _agrees_on_nothing(self):
    params = [s.param for g in self._checked_groups() for s in g.segments]
    self._has_grad.update(id(p) for p in params if id(p) in self._used)  # no bitmap: this rank's view only
    self._used.clear()


_original_sync_step = _base.Synchronised.step


def _steps_on_local_gradients(self):
    self._local_grads = False  # the no_sync-only check, gone
    _original_sync_step(self)


# ------------------------------------------------------------------------------- the loop, the comparison
import minizero.experiment as _experiment  # noqa: E402
from minizero.train import Step, train_step as _train_step  # noqa: E402


def _loop(scale_of: Callable, sync_every: bool = False, clear: bool = True, clip_after: bool = False):
    """A train_step with one thing changed."""
    def train_step(stage, step: Step, loss_fn=None, clip=None):
        from minizero.models import sum_loss
        if clear:
            stage.zero_grad()
        total, last = 0.0, len(step.micro_batches) - 1
        for k, (x, y) in enumerate(step.micro_batches):
            with stage.no_sync() if k < last and not sync_every else contextlib.nullcontext():
                loss = sum_loss(stage(x), y)
                (loss * scale_of(stage, step)).backward()
            total += loss.item()
        if clip is not None and not clip_after:
            stage.clip_grad_norm_(*clip)
        stage.step()
        if clip is not None and clip_after:
            stage.clip_grad_norm_(*clip)
        return total
    return train_step


_right_scale = lambda stage, step: stage.world_size / step.global_count  # noqa: E731
_original_shard_step = _experiment.shard_step


def _shard_step_off_by_one(x, y, rank, world_size, accum_steps=1, rank_sizes=None):
    step = _original_shard_step(x, y, rank, world_size, accum_steps, rank_sizes)
    if world_size > 1 and rank_sizes is not None and rank > 0:  # the slice starts one sample early
        start = sum(rank_sizes[:rank]) - 1
        mine = slice(start, start + rank_sizes[rank])
        step = Step(list(zip(x[mine].tensor_split(accum_steps), y[mine].tensor_split(accum_steps))), step.global_count)
    return step


def _max_diff_ignores_nan(results, reference):
    worst_abs, worst_rel = 0.0, 0.0
    for result in results:
        for mine, ref in zip(result["params"], reference["params"]):
            for name, r in ref.items():
                if r.numel():
                    diff = (mine[name] - r).abs().max().item()
                    worst_abs = max(worst_abs, diff)  # max(0.0, nan) is 0.0
                    worst_rel = max(worst_rel, diff / max(r.abs().max().item(), 1e-300))
    return worst_abs, worst_rel


def _nothing_is_nonfinite(results, reference):
    return None


# ------------------------------------------------------------------------------- the register
FAULTS = "test_faults"
B, Z, Z3, SEM, BAD, L = "test_bucketed", "test_zero", "test_zero3", "test_optimizer_semantics", "test_bad_input", \
    "test_launch"

MUTANTS: dict[str, Mutant] = {
    # comm: the collectives, their bytes, their fingerprints
    "ring: reduce-scatter forgets its own chunk": Mutant("minizero.comm.ring:RingComm._ring_reduce_scatter",
                                                         _rs_forgets_own_chunk, comm_catch),
    "ring: all-gather forwards the wrong chunk": Mutant("minizero.comm.ring:RingComm._ring_all_gather",
                                                        _ag_forwards_wrong_chunk, comm_catch),
    "ring: AVG reduce-scatter not divided": Mutant("minizero.comm.ring:RingComm.reduce_scatter",
                                                   _rs_avg_not_divided, comm_catch),
    "ring: broadcast ignores src": Mutant("minizero.comm.ring:RingComm.broadcast", _broadcast_from_zero, comm_catch),
    "ring: all-reduce through a root": Mutant("minizero.comm.ring:RingComm.all_reduce", _all_reduce_through_root,
                                              test_catch("test_comm", "test_ring_all_reduce_sends_2_n_minus_1_over_n", 3),
                                              cost=True),
    "ring: sends unreported to the ledger": Mutant("minizero.comm.ring:RingComm._send_right_recv_left",
                                                   _p2p_unreported, comm_catch, cost=True),
    "native: byte model ignores uneven chunks": Mutant("minizero.comm.native:ring_bytes_sent",
                                                       _modelled_bytes_ignore_uneven_chunks, comm_catch, cost=True),
    "fingerprint: tag left out": Mutant("minizero.comm.fingerprint:encode", _fingerprint_without_tag,
                                        test_catch(B, "test_no_sync_on_some_ranks_is_caught_at_the_first_bucket")),
    "comm: goes on after a collective failed part-way": Mutant(
        "minizero.comm.base:Comm._run", _keeps_going_after_failure,
        test_catch(FAULTS, "test_a_failed_rank_ends_the_run_naming_it", "raise", "bucket")),
    # the launcher and the watchdog
    "stall: blames the rank that waits": Mutant("minizero.comm.stall:blame", _blames_the_waiter,
                                                test_catch(L, "test_stall_names_the_rank_that_stopped_not_the_one_that_waits")),
    "board: progress only at entry": Mutant("minizero.comm.progress:ProgressBoard._set", _progress_only_at_entry,
                                            test_catch(L, "test_a_slow_collective_that_keeps_moving_is_not_a_stall")),
    "pool: the timeout bounds the run": Mutant("minizero.launch:RankPool.run", _run_with_a_deadline,
                                               test_catch(L, "test_a_healthy_run_longer_than_the_timeout_completes")),
    "pool: swallows a rank's exception": Mutant("minizero.launch:RankPool.run", _swallows_errors,
                                                test_catch(L, "test_exception_names_rank_and_carries_traceback")),
    # buckets
    "buckets: registration order": Mutant("minizero.stages.ddp_bucketed:assign_buckets", _buckets_in_registration_order,
                                          test_catch(B, "test_grads_are_views_into_buckets_and_buckets_start_during_backward"),
                                          cost=True),
    "buckets: cap in elements": Mutant("minizero.stages.ddp_bucketed:assign_buckets", _cap_in_elements,
                                       test_catch(B, "test_grads_are_views_into_buckets_and_buckets_start_during_backward"),
                                       cost=True),
    "buckets: launched when any gradient is ready": Mutant("minizero.buckets:ReadyOrder.mark", _launch_when_any_ready,
                                                           property_catch("ddp-bucketed")),
    # compression
    "compress: divide by N before the cast": Mutant("minizero.compress:split_division", _divide_by_n_first,
                                                    property_catch("ddp", compress=True, backends=("ring",))),
    "compress: error feedback of the wrong sign": Mutant(
        "minizero.compress:GradientAverager._to_wire", _feedback_of_wrong_sign,
        property_catch("ddp-bucketed", compress=True, backends=("ring",), examples=60)),
    "compress: no overflow check": Mutant("minizero.compress:GradientAverager._from_wire", _no_overflow_check,
                                          test_catch("test_compression", "test_fp16_overflow_is_reported_and_weights_untouched")),
    "compress: sends fp32": Mutant("minizero.compress:GradientAverager._to_wire", _no_cast,
                                   test_catch("test_compression", "test_compressed_bytes_are_half", "ddp", "fp16")),
    # layout and the sharded optimizer
    "layout: pieces one element short": Mutant("minizero.layout:FlatGroup._cut_pieces", _pieces_one_short,
                                               property_catch("zero1")),
    "optimizer: zero gradient instead of None": Mutant("minizero.stages.zero1:attach_gradients", _zero_grads_for_unused,
                                                       test_catch(SEM, "test_step_without_backward_moves_nothing", "zero1")),
    "optimizer: state consolidated at the wrong offset": Mutant("minizero.sharded_optimizer:_gather_element_state",
                                                                _state_at_the_parameters_offset, property_catch("zero2")),
    # the stages
    "ddp: packs whatever has a gradient": Mutant("minizero.stages.ddp:DDP._with_gradient", _ddp_packs_what_exists,
                                                 test_catch(BAD, "test_parameters_used_on_some_ranks_only_are_named",
                                                            "ddp", 2)),
    "zero1: all-gathers before stepping": Mutant("minizero.stages.zero1:ZeRO1._step", _zero1_gathers_before_stepping,
                                                 property_catch("zero1")),
    "zero2: keeps the full gradients": Mutant("minizero.stages.zero2:ZeRO2._launch", _zero2_keeps_full_gradients,
                                              test_catch(Z, "test_measured_memory_matches_the_formula", 3, "zero2"),
                                              cost=True),
    "zero3: never reshards after forward": Mutant("minizero.stages.zero3:ZeRO3._after_forward", _zero3_never_reshards,
                                                  test_catch(Z3, "test_bytes_are_one_and_a_half_ddps_with_resharding",
                                                             3, True), cost=True),
    "zero3: keeps prefetches across the step": Mutant("minizero.stages.zero3:ZeRO3._drop_prefetches",
                                                      _zero3_keeps_prefetches,
                                                      test_catch(Z3, "test_a_prefetch_left_from_the_last_forward_is_dropped_at_the_step")),
    "zero3: tied weight in the first unit": Mutant("minizero.units:assign_parameters", _tied_weight_in_first_unit,
                                                   test_catch(Z3, "test_weights_tied_across_units_under_uneven_sharding", 3)),
    "zero: no bitmap for unused parameters": Mutant("minizero.stages.zero1:ZeRO1._agree_on_use", _agrees_on_nothing,
                                                    test_catch(SEM, "test_a_parameter_without_a_gradient_is_not_stepped",
                                                               "zero1", "c on rank 0", "stage.zero_grad()")),
    "stage: steps on local gradients after no_sync": Mutant("minizero.stages.base:Synchronised.step",
                                                            _steps_on_local_gradients,
                                                            test_catch(SEM, "test_step_after_no_sync_only_is_refused", "ddp")),
    # the one training loop
    "loop: scaled by 1 / global count": Mutant("minizero.experiment:train_step",
                                               _loop(lambda stage, step: 1 / step.global_count), property_catch("ddp")),
    "loop: no zero_grad between steps": Mutant("minizero.experiment:train_step", _loop(_right_scale, clear=False),
                                               test_catch("test_train_loop", "test_the_reference_is_plain_torch_training")),
    "loop: every micro-batch synchronises": Mutant("minizero.experiment:train_step", _loop(_right_scale, sync_every=True),
                                                   test_catch("test_ddp_equivalence",
                                                              "test_ddp_syncs_once_per_optimizer_step_under_accumulation"),
                                                   cost=True),
    "loop: clips after the step": Mutant("minizero.experiment:train_step", _loop(_right_scale, clip_after=True),
                                         test_catch("test_train_loop", "test_the_reference_is_plain_torch_training")),
    "loop: rank slice off by one": Mutant("minizero.experiment:shard_step", _shard_step_off_by_one,
                                          property_catch("ddp")),
    # the comparison itself
    "compare: NaN counted as no difference": Mutant("minizero.compare:max_diff", _max_diff_ignores_nan,
                                                    test_catch("test_cli",
                                                               "test_a_diverging_run_is_a_failure_never_a_zero_difference")),
    "equivalence: NaN counted as no difference": Mutant("minizero.experiment:max_diff", _max_diff_ignores_nan,
                                                        test_catch("test_cli", "test_a_nan_difference_is_an_infinite_one")),
    "compare: non-finite values not looked for": Mutant("minizero.compare:first_nonfinite", _nothing_is_nonfinite,
                                                        test_catch("test_cli",
                                                                   "test_a_diverging_run_is_a_failure_never_a_zero_difference")),
}

# Import every module a catch runs code from *now*, before any pool forks: a rank that had to import one
# later would do it inside the @given the pool was forked from, and trip hypothesis's nested-given check.
for _module in sorted(_CATCH_MODULES):
    importlib.import_module(_module)

"""One experiment: a task, an optimizer and a stage, trained for a few steps.

The same :func:`run_experiment` runs on every rank of a stage and, with
``stage="reference"``, in a single process on the global batch.  The caller
(``compare``, the property suite, the lessons) then holds both sets of
results -- one :class:`RankResult` per rank -- and judges them with
:func:`minizero.course.harness.equivalence.judge`.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import time
from dataclasses import dataclass, field, replace

import torch

from ... import checkpoint
from ...comm import Ledger, make_comm
from ...comm.nodes import assumed_nodes
from ...compress import check_compress
from ...compress import parse as parse_compress
from ...observe.memory import CudaStepPeaks, GatheredMemory, HostStepPeaks, held_bytes
from ...parts.activations import checkpoint_blocks
from ...parts.precision import Precision
from ...run.launch import Rank
from ...run.orders import train_step_in_order
from ...run.train import shard_step, train_step
from ...stages import DEFAULT_STAGE, REFERENCE, Stage
from .casts_reference import run_casts_reference
from .equivalence import DTYPES
from .models import count_params
from .optimizers import make_optimizer
from .poison import LaunchFailed, failing_launch, poison_gradient
from .registry import build_stage, stage_class
from .result import RankResult
from .tasks import TASKS


@dataclass(frozen=True)
class Experiment:
    stage: str = DEFAULT_STAGE
    task: str = "gpt"
    model: dict = field(default_factory=dict)  # keyword arguments of the task's model
    optimizer: str = "adam"
    lr: float = 1e-3
    steps: int = 3
    micro_batch: int = 4  # samples per rank per micro-batch
    accum: int = 1  # K micro-batches per optimizer step
    syncs: tuple | None = None  # which micro-batches' backwards synchronise (None: the last; all: lesson 8)
    order: str | None = None  # backwards not each after its own forward (minizero.run.orders; syncs None)
    dtype: str = "float64"
    seed: int = 0
    backend: str = "ring"  # ring (send/recv) or native (torch collectives)
    rank_sizes: tuple | None = None  # samples per rank per step, if not micro_batch * accum each
    clip: tuple | None = None  # (max_norm, norm_type): clip the global gradient norm
    param_groups: bool = False  # two optimizer param groups with different lr and weight decay
    record_states: bool = False  # return the (consolidated) optimizer state after every step
    check: bool = True  # fingerprint every collective (minizero.comm.fingerprint)
    network: str | None = None  # a dialled network: "alpha=2ms,bandwidth=50MB/s" or a preset (minizero.comm.network)
    device: str = "cpu"  # where the model and batches live ("cuda": the rank's current CUDA device)
    overflow_at: tuple | None = None  # (step, rank): an inf in one gradient element there (see poison_gradient)
    launch_fails_at: int | None = None  # that step's first bucket fails on every rank; the step is run again
    options: dict = field(default_factory=dict)  # stage options
    first_step: int = 0  # the data position: step s trains on batch s (a resumed run starts where it stopped)
    resume: str | None = None  # a checkpoint to load before the first step (minizero.checkpoint)
    save: str | None = None  # save a checkpoint here after the last step
    consolidated: bool = False  # ... consolidated (one torch.load-able file) instead of sharded
    stages: dict | None = field(default=None, repr=False)  # a registry other than the lab's (mutants, new stages)
    wrap_first: bool = False  # the optimizer built after wrapping, over stage.parameters(), stepped by the loop (FSDP2)
    zero_grad: str = "optimizer"  # what the loop zeroes with: the optimizer's (or stage's) zero_grad, or "model"'s
    checkpoint_activations: bool = False  # the ranks replay each block's forward in backward (the reference never)
    host_step_peaks: bool = False  # on the CPU, malloc's bytes as each step begins and the most during it (sampled)
    eager_launch: bool = False  # each submitted collective run at once, its submitter waiting: an order race shows always

    def __post_init__(self):
        if self.order is not None and self.syncs is not None:
            raise ValueError(f"order={self.order!r} with syncs={self.syncs}: an order runs torch's idiom of "
                             f"synchronising (the last micro-batch); set one of the two")

    def global_batch(self, world_size: int) -> int:
        return sum(self.rank_sizes) if self.rank_sizes else self.micro_batch * self.accum * world_size


def build(me: Rank | None, exp: Experiment):
    """``(stage, model, comm, psi)`` of this rank, or of the reference (``me`` None, no comm).  Ranks
    initialise from *different* seeds, so that the wrap-time broadcast is exercised; the reference
    uses rank 0's."""
    stage_class(exp.stage, exp.stages)  # an unknown name is refused before anything is built
    model = TASKS[exp.task].make_model(exp.seed + 1000 * (me.rank if me else 0), DTYPES[exp.dtype], **exp.model)
    model.to(exp.device)
    if exp.checkpoint_activations and me is not None:  # before wrapping, as FSDP2 wants it
        checkpoint_blocks(model)
    optimizer = None if exp.wrap_first else make_optimizer(exp.optimizer, model, exp.lr, exp.param_groups)
    psi = count_params(model)  # before wrapping: ZeRO-3 leaves only placeholders in the model
    comm = make_comm(exp.backend, check=exp.check, network=network_of(exp, me.world_size)) if me else None
    if comm is not None and exp.eager_launch:
        comm.submit = eager(comm.submit)
    return build_stage(exp.stage, model, optimizer, comm, exp.stages, **exp.options), model, comm, psi


def eager(submit):
    """``Comm.submit`` that waits for what it submitted: a bucket launched before its last gradient was copied in
    is then reduced without it on every run, not only when the communication thread wins the race (issue 45)."""
    def submit_and_wait(fn):
        work = submit(fn)
        work.wait()
        return work
    return submit_and_wait


def network_of(exp: Experiment, world_size: int):
    """The run's network.  A stage whose mesh is the nodes (HSDP), run without any, sits on the nodes it would
    assume (:func:`~minizero.comm.nodes.assumed_nodes`), placed on the Comm, so the ledger counts per link
    class and the native backend has the nodes' process groups."""
    cls = stage_class(exp.stage, exp.stages)
    if exp.network is not None or not (getattr(cls, "needs_nodes", False) or exp.options.get("hpz")):
        return exp.network
    nodes = assumed_nodes(world_size)
    return f"nodes={nodes.count}x{nodes.per_node}"


def run_experiment(me: Rank | None, exp: Experiment, world_size: int | None = None) -> RankResult:
    """Train; return this rank's per-step parameters, losses, bytes sent and step times.

    ``me`` is None for the single-process reference, which then needs the
    ``world_size`` of the run it stands for (to draw the same global batch).
    """
    rank, n = (me.rank, me.world_size) if me else (0, world_size or 1)
    task, dtype = TASKS[exp.task], DTYPES[exp.dtype]
    cuda = exp.device.startswith("cuda")
    if cuda:  # a pool's rank runs one experiment after another: the last one's cycles (stage <-> hooks) go first,
        gc.collect()  # or its tensors would still be allocated in this one's figures
        torch.cuda.reset_peak_memory_stats()
    stage, model, comm, psi = build(me, exp)
    # FSDP2's order: the optimizer over the stage's parameters (ZeRO's pieces; fp32 masters under mixed precision),
    # its param groups picked by name from the model's shapes (a piece is 1-D whatever its parameter was).
    optimizer = make_optimizer(exp.optimizer, model, exp.lr, exp.param_groups, over=stage) if exp.wrap_first else None
    try:  # the communication thread is closed even when training raised: nothing it ran outlives the run
        ledger, gathered = Ledger(), GatheredMemory()
        stage.add_observer(gathered)
        if comm:
            comm.add_observer(ledger)  # after wrapping: count training traffic only
        params, losses, times, states, scales, per_step = [], [], [], [], [], []
        if exp.resume:
            checkpoint.load(stage, exp.resume)
        peaks = CudaStepPeaks(exp.device) if cuda else HostStepPeaks() if exp.host_step_peaks \
            else contextlib.nullcontext()
        if cuda or exp.host_step_peaks:  # the step peaks collect garbage before each step (the last one's cycles):
            gc.freeze()  # set what exists aside, so each walks what this run makes, not a forked parent's heap
        for s in range(exp.first_step, exp.first_step + exp.steps):
            with peaks:  # what was allocated as the step began, and the most during it (the batch's too)
                x, y = (t.to(exp.device) for t in task.make_batch(exp.global_batch(n), exp.seed, s, dtype, **exp.model))
                step = shard_step(x, y, rank, n, exp.accum, list(exp.rank_sizes) if exp.rank_sizes else None) if me \
                    else shard_step(x, y, 0, 1, 1)
                start = time.perf_counter()
                with poison_gradient(model, exp, s, rank, n if me else None):
                    def once() -> float:
                        zero_grad = model.zero_grad if exp.zero_grad == "model" else None
                        if exp.order:  # the reference too: .grad adds whatever the order
                            return train_step_in_order(stage, step, exp.order, clip=exp.clip, optimizer=optimizer,
                                                       zero_grad=zero_grad)
                        return train_step(stage, step, clip=exp.clip, optimizer=optimizer,
                                          syncs=exp.syncs if me else None,  # the reference: one batch
                                          zero_grad=zero_grad)
                    try:
                        with failing_launch(stage, exp, s):
                            losses.append(once())
                    except LaunchFailed:
                        losses.append(once())  # caught, as a loop may: the step again, from zero_grad()
                times.append(time.perf_counter() - start)
            # Right after the step, before any inspection gathers and frees: the observer's count of what is
            # gathered, and what the parameters point into as allocated -- a unit freed (or gathered) without
            # telling the observer leaves the two apart.
            after_step = gathered.now, pointed_bytes(stage, model)
            per_step.append(sum(v for k, v in ledger.snapshot().items() if k != "check") - sum(per_step))
            scales.append(getattr(stage, "loss_scale", 1.0))
            if comm:
                comm.remove_observer(ledger)  # what follows is inspection, not training traffic
            params.append({k: v.cpu() for k, v in snapshot_parameters(stage, model).items()})  # off the GPU
            if exp.record_states and optimizer is None:  # (the loop's own optimizer holds pieces' states)
                states.append(off_the_device(stage.full_optimizer_state_dict()))
            if comm:
                comm.add_observer(ledger)
        held = held_bytes(stage.held_tensors())
        wire = getattr(stage, "wire", None)  # a codec's bytes depend on each buffer: the wire adds up its formula
        wire_formula = {kind: b / exp.steps for kind, b in wire.formula_by_kind.items()} \
            if hasattr(wire, "formula_by_kind") else None
        weights = getattr(stage, "weight_wire", None)  # ZeRO++'s quantized weights (qwZ, zeropp): the gathers' formula
        weight_formula = weights.formula_by_kind["all_gather"] / exp.steps if weights is not None else None
        cuda_peak = max(peaks.run_peak, torch.cuda.max_memory_allocated()) if cuda else 0
        if comm:
            comm.remove_observer(ledger)
        if exp.save:  # not training traffic either
            checkpoint.save(stage, exp.save, exp.first_step + exp.steps, consolidated=exp.consolidated)
        optimizer_state = off_the_device(stage.full_optimizer_state_dict()) if optimizer is None else {}
    finally:
        if comm:
            comm.close()
        if cuda or exp.host_step_peaks:
            gc.unfreeze()
    sent, links = ledger.snapshot(), ledger.links()
    check_bytes = sent.pop("check", 0)  # fingerprints: apart from the traffic the formulas describe
    return RankResult(params=params, losses=losses, global_count=step.global_count, step_s=times,
                      sent_bytes=sum(sent.values()), sent_by_kind=sent, sent_per_step=per_step,
                      sent_by_link=links,
                      check_bytes=check_bytes, psi=psi,
                      grad_bytes=wire_bytes(exp), param_bytes=precision_of(exp).working_bytes(element_size(exp)),
                      held_bytes=held, gathered_peak_bytes=gathered.peak, gathered_after_bytes=after_step[0],
                      parameter_storage_bytes=after_step[1], optimizer_state=optimizer_state,
                      wire_sent_bytes_per_step=sum(wire_formula.values()) if wire_formula is not None else None,
                      wire_sent_by_kind_per_step=wire_formula, weight_sent_bytes_per_step=weight_formula,
                      optimizer_states=states, loss_scales=scales, cuda_peak_bytes=cuda_peak,
                      cuda_steps=peaks.steps if cuda else [],
                      host_steps=peaks.steps if exp.host_step_peaks and not cuda else [],
                      skipped_steps=getattr(stage, "skipped_steps", 0),
                      host_copied=stage.host_copies.counted() if getattr(stage, "host_copies", None) else {})


def element_size(exp: Experiment) -> int:
    """Bytes per element of the model as built (fp32 or fp64): the masters' under mixed precision."""
    return torch.empty(0, dtype=DTYPES[exp.dtype]).element_size()


def precision_of(exp: Experiment) -> Precision:
    return Precision.of(exp.options.get("precision"))


def wire_bytes(exp: Experiment) -> int:
    """Bytes per gradient element in the reduction: compression's wire, else the precision's."""
    wire = check_compress(exp.options.get("compress"))
    return torch.empty(0, dtype=wire).element_size() if wire else precision_of(exp).reduce_bytes(element_size(exp))


def off_the_device(state):
    """A copy of a nest of dicts and lists whose tensors are in host memory: what a rank returns holds no GPU memory
    (nor device handles for the caller to open)."""
    if torch.is_tensor(state):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: off_the_device(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(off_the_device(v) for v in state)
    return copy.deepcopy(state)


def snapshot_parameters(stage, model) -> dict:
    """Every parameter's full value (ZeRO-3 gathers them; everyone else holds them)."""
    state = stage.full_state_dict()
    return {name: state[name] for name, _ in model.named_parameters()}


def rounds(exp: Experiment) -> bool:
    """Whether ``exp`` rounds on purpose -- a compressed wire, mixed precision, quantized weights -- so that its
    reference is the one applying the same roundings, not exact single-device training."""
    return (parse_compress(exp.options.get("compress")) is not None or precision_of(exp).mixed
            or exp.options.get("quantized_weights") not in (None, "none"))


def reference_of(exp: Experiment, world_size: int) -> RankResult:
    """Single-device training on the global batch -- or, for a compressed run, the
    reference that applies the same casts (:mod:`minizero.course.harness.casts_reference`)."""
    if rounds(exp):
        if exp.order is not None:  # it rounds the idiom's one reduction, each backward after its own forward
            raise ValueError(f"order={exp.order!r} has no same-casts reference; compare it with exact_reference_of")
        if exp.syncs is not None and sum(exp.syncs) > 1:  # the same-casts reference rounds one reduction a step
            raise ValueError(f"syncs={exp.syncs} has no same-casts reference: it rounds {sum(exp.syncs)} reductions "
                             f"per step; compare it with exact_reference_of")
        return run_casts_reference(exp, world_size, stage_class(exp.stage, exp.stages))
    return exact_reference_of(exp, world_size)


def exact_reference_of(exp: Experiment, world_size: int) -> RankResult:
    """Single-device training on the global batch, in the stage's precision (the same recipe)."""
    options = {k: v for k, v in exp.options.items() if k in Stage.option_names()}
    return run_experiment(None, replace(exp, stage=REFERENCE, options=options), world_size)


def pointed_bytes(stage, model) -> int:
    """What the parameters of a stage with units (minizero's ZeRO-3 family) point into as allocated -- nothing,
    between uses; 0 for any other stage, which keeps them whole (and torch's FSDP2 holds DTensors, whose storage
    is its own business)."""
    if not hasattr(stage, "units"):
        return 0
    return held_bytes({"params": [p.data for p in model.parameters()]})["total"]


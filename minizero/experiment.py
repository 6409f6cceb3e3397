"""One experiment: a task, an optimizer and a stage, trained for a few steps.

The same :func:`run_experiment` runs on every rank of a stage and, with
``stage="reference"``, in a single process on the global batch.  The caller
(``compare``, the property suite, the lessons) then holds both sets of
results and can check equivalence step by step.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, replace

import torch

from .casts_reference import run_casts_reference
from .comm import Ledger, make_comm
from .compress import check_compress
from .data import TASKS
from .launch import Rank
from .memory import held_bytes
from .models import count_params
from .oracle import ORACLES
from .stages import check_stage_names, make_stage
from .train import make_optimizer, shard_step, train_step

DTYPES = {"float64": torch.float64, "float32": torch.float32}
#: Relative tolerance (infinity-norm, per tensor) for "numerically equivalent".
RTOL = {"float64": 1e-9, "float32": 1e-5}


@dataclass(frozen=True)
class Experiment:
    stage: str = "ddp"
    task: str = "gpt"
    model: dict = field(default_factory=dict)  # keyword arguments of the task's model
    optimizer: str = "adam"
    lr: float = 1e-3
    steps: int = 3
    micro_batch: int = 4  # samples per rank per micro-batch
    accum: int = 1  # K micro-batches per optimizer step
    dtype: str = "float64"
    seed: int = 0
    backend: str = "ring"  # ring (send/recv) or native (torch collectives)
    rank_sizes: tuple | None = None  # samples per rank per step, if not micro_batch * accum each
    clip: tuple | None = None  # (max_norm, norm_type): clip the global gradient norm
    param_groups: bool = False  # two optimizer param groups with different lr and weight decay
    record_states: bool = False  # return the (consolidated) optimizer state after every step
    check: bool = True  # fingerprint every collective (minizero.comm.fingerprint)
    options: dict = field(default_factory=dict)  # stage options

    def global_batch(self, world_size: int) -> int:
        return sum(self.rank_sizes) if self.rank_sizes else self.micro_batch * self.accum * world_size


def build(me: Rank | None, exp: Experiment):
    """``(stage, model, comm, psi)`` of this rank, or of the reference (``me`` None, no comm).  Ranks
    initialise from *different* seeds, so that the wrap-time broadcast is exercised; the reference
    uses rank 0's."""
    if exp.stage not in ORACLES:
        check_stage_names([exp.stage])
    model = TASKS[exp.task].make_model(exp.seed + 1000 * (me.rank if me else 0), DTYPES[exp.dtype], **exp.model)
    optimizer = make_optimizer(exp.optimizer, model, exp.lr, exp.param_groups)
    psi = count_params(model)  # before wrapping: ZeRO-3 leaves only placeholders in the model
    comm = make_comm(exp.backend, check=exp.check) if me else None
    if exp.stage in ORACLES:  # torch's own implementation, through the same loop
        return ORACLES[exp.stage](model, optimizer, **exp.options), model, comm, psi
    return make_stage(exp.stage, model, optimizer, comm, **exp.options), model, comm, psi


def run_experiment(me: Rank | None, exp: Experiment, world_size: int | None = None) -> dict:
    """Train; return per-step parameters, losses, bytes sent and step times of this rank.

    ``me`` is None for the single-process reference, which then needs the
    ``world_size`` of the run it stands for (to draw the same global batch).
    """
    rank, n = (me.rank, me.world_size) if me else (0, world_size or 1)
    task, dtype = TASKS[exp.task], DTYPES[exp.dtype]
    stage, model, comm, psi = build(me, exp)
    ledger = Ledger()
    if comm:
        comm.add_observer(ledger)  # after wrapping: count training traffic only
    consolidate = getattr(stage, "full_optimizer_state_dict", stage.optimizer.state_dict)
    params, losses, times, states = [], [], [], []
    for s in range(exp.steps):
        x, y = task.make_batch(exp.global_batch(n), exp.seed, s, dtype, **exp.model)
        step = shard_step(x, y, rank, n, exp.accum, list(exp.rank_sizes) if exp.rank_sizes else None) if me \
            else shard_step(x, y, 0, 1, 1)
        start = time.perf_counter()
        losses.append(train_step(stage, step, clip=exp.clip))
        times.append(time.perf_counter() - start)
        if comm:
            comm.remove_observer(ledger)  # what follows is inspection, not training traffic
        params.append(snapshot_parameters(stage, model))
        if exp.record_states:
            states.append(copy.deepcopy(consolidate()))
        if comm:
            comm.add_observer(ledger)
    held = held_bytes(stage.held_tensors()) if hasattr(stage, "held_tensors") else {}
    if comm:
        comm.remove_observer(ledger)
    optimizer_state = copy.deepcopy(consolidate())
    if comm:
        comm.close()
    wire = check_compress(exp.options.get("compress"))
    sent = ledger.snapshot()
    check_bytes = sent.pop("check", 0)  # fingerprints: apart from the traffic the formulas describe
    return {"params": params, "losses": losses, "global_count": step.global_count, "step_s": times,
            "sent_bytes": sum(sent.values()), "sent_by_kind": sent, "check_bytes": check_bytes, "psi": psi,
            "gathered_peak_bytes": getattr(stage, "gathered_peak_bytes", None),
            "grad_bytes": torch.empty(0, dtype=wire or dtype).element_size(),
            "param_bytes": torch.empty(0, dtype=dtype).element_size(),
            "held_bytes": held, "optimizer_state": optimizer_state, "optimizer_states": states}


def snapshot_parameters(stage, model) -> dict:
    """Every parameter's full value (ZeRO-3 gathers them; everyone else holds them)."""
    names = [name for name, _ in model.named_parameters()]
    if hasattr(stage, "full_state_dict"):
        state = stage.full_state_dict()
        return {name: state[name] for name in names}
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def reference_of(exp: Experiment, world_size: int) -> dict:
    """Single-device training on the global batch -- or, for a compressed run, the
    reference that applies the same casts (:mod:`minizero.casts_reference`)."""
    if check_compress(exp.options.get("compress")) is not None:
        return run_casts_reference(exp, world_size)
    return run_experiment(None, replace(exp, stage="reference", options={}), world_size)


def exact_reference_of(exp: Experiment, world_size: int) -> dict:
    return run_experiment(None, replace(exp, stage="reference", options={}), world_size)


def max_diff(results: list[dict], reference: dict) -> tuple[float, float]:
    """(max |param - reference|, max relative error per tensor) over all ranks and steps.
    A NaN or inf difference is an infinite difference, never a small one."""
    worst_abs, worst_rel = 0.0, 0.0
    for result in results:
        for mine, ref in zip(result["params"], reference["params"]):
            for name, r in ref.items():
                if r.numel() == 0:
                    continue
                diff = (mine[name] - r).abs().max().item()
                scale = r.abs().max().item()
                if not (math.isfinite(diff) and math.isfinite(scale)):
                    return math.inf, math.inf
                worst_abs = max(worst_abs, diff)
                worst_rel = max(worst_rel, diff / max(scale, 1e-300))
    return worst_abs, worst_rel


def first_nonfinite(results: list[dict], reference: dict) -> str | None:
    """Where the first NaN or inf is -- in a loss, a parameter or an optimizer state, of any rank or of
    the reference (single-device training that diverged proves nothing either) -- or None."""
    for who, result in [("the reference", reference)] + [(f"rank {r}", res) for r, res in enumerate(results)]:
        for step, loss in enumerate(result["losses"]):
            if not math.isfinite(loss):
                return f"{who}: the loss of step {step} is {loss}"
        for step, params in enumerate(result["params"]):
            for name, value in params.items():
                if not bool(torch.isfinite(value).all()):
                    return f"{who}: parameter {name!r} after step {step} is not finite"
        for index, entry in (result.get("optimizer_state") or {}).get("state", {}).items():
            for key, value in entry.items():
                if torch.is_tensor(value) and not bool(torch.isfinite(value).all()):
                    return f"{who}: optimizer state {key!r} of parameter #{index} is not finite"
    return None


def loss_error(results: list[dict], reference: dict) -> float:
    """Max relative error of the global mean loss over steps (infinite if either is not finite)."""
    worst = 0.0
    for s, ref in enumerate(reference["losses"]):
        total = sum(r["losses"][s] for r in results)
        error = abs(total - ref) / max(abs(ref), 1e-300)
        worst = max(worst, error if math.isfinite(error) else math.inf)
    return worst

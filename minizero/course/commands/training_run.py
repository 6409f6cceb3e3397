"""``python -m minizero train``: a real run of any stage -- here on N local ranks, or under torchrun on GPU
nodes -- with progress lines, checkpoints that resume (on any number of ranks, by any stage) and a summary
that puts every measurement beside its formula.

The loop is :func:`minizero.run.train.train_step`, the one every test and lesson drives, on the shipped text.
``--batch-size`` is the *global* batch (samples per optimizer step, over all ranks and micro-batches): it
stays the same when a run resumes on another number of ranks, so the run continues the same training.
Step ``s`` always trains on batch ``s`` (a pure function of seed and step), which is the data position a
checkpoint keeps.
"""
from __future__ import annotations

import json
import math
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from ... import checkpoint
from ...comm import Ledger, Tag, make_comm
from ...observe.memory import GatheredMemory, held_bytes
from ...parts.activations import checkpoint_blocks
from ...parts.offload import HOST_KIND
from ...run.train import shard_step, train_step
from ..harness.experiment import Experiment, precision_of, wire_bytes
from ..harness.models import GPT_SIZES, count_params
from ..harness.optimizers import STATE_TENSORS, make_optimizer
from ..harness.registry import build_stage, stage_class
from ..harness.tasks import TASKS

MODELS = [*GPT_SIZES, "mlp"]
MLP_SIZES = (64, 256, 256, 64)


@dataclass(frozen=True)
class Run:
    """One training run, as the command line gives it (every rank gets the same)."""

    stage: str
    model: str = "small"
    steps: int = 100
    batch_size: int = 16  # global: samples per optimizer step, all ranks and micro-batches
    accum: int = 1
    lr: float = 1e-3
    optimizer: str = "adamw"  # (the train command's; a study may choose another, minizero.course.harness.optimizers)
    schedule: str = "constant"  # or cosine, after a linear warmup
    warmup: int = 0
    seed: int = 0
    options: tuple = ()  # the stage's options by keyword: precision, and those given as flags (option_flags)
    collectives: str = "native"  # torch's collectives, or minizero's send/recv ring
    device: str = "cpu"
    save: str | None = None
    save_every: int = 0
    consolidated: bool = False
    resume: str | None = None
    log_every: int = 10
    check: bool = False  # fingerprint every collective (costs a message per collective)
    checkpoint_activations: bool = False  # replay each block's forward in backward (minizero.parts.activations)
    progress_to: str = "stdout"  # or stderr, when stdout carries the JSON summary; or none (a study's many runs)
    network: str | None = None  # where the ranks sit ("nodes=2x2"), and how long messages wait (minizero.comm.network)

    def say(self, text: str) -> None:
        if self.progress_to != "none":
            print(text, file=sys.stderr if self.progress_to == "stderr" else sys.stdout, flush=True)

    @property
    def task(self):
        return TASKS["mlp" if self.model == "mlp" else "gpt"]

    @property
    def model_kwargs(self) -> dict:
        return {"sizes": MLP_SIZES} if self.model == "mlp" else GPT_SIZES[self.model]

    def make_model(self) -> torch.nn.Module:
        model = self.task.make_model(self.seed, torch.float32, **self.model_kwargs)
        if self.checkpoint_activations:
            checkpoint_blocks(model)
        return model

    def lr_at(self, step: int) -> float:
        """Linear warmup, then constant or cosine down to a tenth: a pure function of the step, so a resumed
        run needs no scheduler state."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.schedule == "constant":
            return self.lr
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    def data(self) -> dict:
        """What a resumed run must agree with: for step ``s`` to mean batch ``s`` again, and the learning rate at
        ``s`` to be the one the saved run would have used (a cosine schedule's length is ``--steps``)."""
        kept = {"model": self.model, "seed": self.seed, "batch_size": self.batch_size, "lr": self.lr,
                "schedule": self.schedule, "warmup": self.warmup}
        return {**kept, "steps": self.steps} if self.schedule == "cosine" else kept


def rank_sizes(batch_size: int, world_size: int) -> list[int]:
    """The global batch over the ranks, as evenly as it goes (the loop weights uneven ranks correctly)."""
    return [batch_size // world_size + (r < batch_size % world_size) for r in range(world_size)]


def train_on_rank(me, run: Run) -> dict:
    """Every rank runs this; rank 0 prints progress.  Returns this rank's measurements."""
    device = torch.device("cpu")
    if run.device == "cuda":  # NCCL: a GPU per rank; gloo: ranks may share one
        device = torch.device("cuda", me.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = run.make_model().to(device)
    psi = count_params(model)
    comm = make_comm(run.collectives, check=run.check, network=run.network)
    try:
        stage = build_stage(run.stage, model, make_optimizer(run.optimizer, model, run.lr), comm, **dict(run.options))
        first, history = 0, []
        if run.resume:
            info = checkpoint.load(stage, run.resume)
            first, history = info["step"], info["data"].get("losses", [])
            if me.rank == 0:
                run.say(f"resumed from {info['directory']}: {info['stage']} on {info['world_size']} rank(s), step "
                    f"{first}" + "".join(f"\n  note: {n}" for n in info["notes"]))
        return _loop(me, run, stage, comm, device, psi, first, history)
    finally:
        comm.close()


def parameters_finite(stage, comm) -> bool:
    """Every rank's parameters (and fp32 masters) are finite -- its own shard under ZeRO; agreed over the ranks."""
    held = stage.held_tensors()  # the masters under "master", or "host_master" when offloaded (counted apart there)
    masters = held.get("master", []) + held.get(HOST_KIND + "master", [])
    bad = sum(int(not torch.isfinite(t).all()) for t in held["params"] + masters if t.numel())
    flag = torch.tensor([float(bad)], dtype=torch.float64)
    comm.all_reduce(flag, tag=Tag("parameters finite?"))
    return flag.item() == 0


def _loop(me, run: Run, stage, comm, device, psi: int, first: int, history: list) -> dict:
    """Train steps ``first .. run.steps - 1``.  A loss that is not finite, or parameters that are not at a save or
    at the end, stop the run there: every rank sees the same all-reduced numbers, so all stop at the same step,
    and nothing non-finite is ever saved.  ``diverged``: the verdict, or None."""
    ledger, gathered, times, losses = Ledger(), GatheredMemory(), [], list(history)
    diverged = None
    stage.add_observer(gathered)
    sizes = rank_sizes(run.batch_size, me.world_size)
    tokens = run.batch_size * run.model_kwargs.get("block_size", 1)
    for s in range(first, run.steps):
        for group in stage.optimizer.param_groups:
            group["lr"] = run.lr_at(s)
        x, y = (t.to(device) for t in run.task.make_batch(run.batch_size, run.seed, s, torch.float32,
                                                          **run.model_kwargs))
        start = time.perf_counter()
        comm.add_observer(ledger)
        step = shard_step(x, y, me.rank, me.world_size, run.accum, sizes)
        loss = train_step(stage, step)
        comm.remove_observer(ledger)  # what follows is reporting, not training traffic
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's kernels, not just their launch, inside the timing
        times.append(time.perf_counter() - start)
        total = torch.tensor([loss], dtype=torch.float64)
        comm.all_reduce(total, tag=Tag("loss for the log"))
        losses.append(total.item() / step.global_count)  # the mean over the global batch
        if not math.isfinite(losses[-1]):
            diverged = f"the loss became {losses[-1]} at step {s + 1}"
        saving = run.save and ((run.save_every and (s + 1) % run.save_every == 0) or s + 1 == run.steps)
        if diverged is None and (saving or s + 1 == run.steps) and not parameters_finite(stage, comm):
            diverged = f"the parameters became inf or NaN at step {s + 1} (its loss was {losses[-1]:.4g})"
        if me.rank == 0 and ((s + 1) % run.log_every == 0 or s + 1 == run.steps or s == first or diverged):
            run.say(progress_line(run, s, losses[-1], tokens / times[-1], ledger.total / len(times), stage))
        if diverged:
            break
        if saving:
            where = checkpoint.save(stage, run.save, s + 1, consolidated=run.consolidated,
                                    data={**run.data(), "losses": losses})
            if me.rank == 0:
                run.say(f"saved {where}")
    return {"rank": me.rank, "losses": losses, "first_step": first, "step_s": times, "psi": psi,
            "sent_bytes": ledger.total, "held_bytes": held_bytes(stage.held_tensors()),
            "gathered_peak_bytes": gathered.peak, "skipped_steps": stage.skipped_steps,
            "loss_scale": stage.loss_scale, "peak_bytes": peak_memory(device), "tokens_per_step": tokens,
            "diverged": diverged}


def progress_line(run: Run, step: int, loss: float, tokens_per_s: float, sent_per_step: float, stage) -> str:
    scale = f" | scale {stage.loss_scale:g}" if stage.master and stage.master.scaler else ""
    return (f"step {step + 1:>{len(str(run.steps))}}/{run.steps} | loss {loss:.4f} | {tokens_per_s:,.0f} tok/s | "
            f"sent {sent_per_step / 1e6:,.2f} MB/step | lr {run.lr_at(step):.2e} | skipped "
            f"{stage.skipped_steps}{scale}")


def peak_memory(device: torch.device) -> dict:
    """The allocator's peak on a GPU; on CPU the process's peak resident set (everything: torch, Python, data)."""
    if device.type == "cuda":
        return {"kind": "cuda max_memory_allocated", "bytes": torch.cuda.max_memory_allocated(device)}
    return {"kind": "max RSS", "bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def summary(run: Run, ranks: list[dict], world_size: int, backend: str) -> dict:
    """Everything measured, beside the stage's own formulas."""
    cls, options = stage_class(run.stage), dict(run.options)
    first, psi = ranks[0], ranks[0]["psi"]
    steps = len(first["step_s"])
    exp = Experiment(dtype="float32", options=options)  # the lab's one definition of the bytes per element
    precision = precision_of(exp)
    formula_bytes = cls.sent_bytes_per_step(psi, world_size, wire_bytes(exp), precision.working_bytes(4), **options)
    median = statistics.median(max(r["step_s"][i] for r in ranks) for i in range(steps)) if steps else math.nan
    state_formula = cls.state_bytes(psi, world_size, 4, STATE_TENSORS["adamw"], **options)
    return {"stage": run.stage, "world_size": world_size, "backend": backend, "device": run.device,
            "model": run.model, "psi": psi, "precision": precision.name, "steps": [first["first_step"], run.steps],
            "loss_first": first["losses"][-steps] if steps else None,  # this run's, after a checkpoint's history
            "loss_last": first["losses"][-1] if steps else None, "losses": first["losses"],
            "step_s_median": median, "tokens_per_s": first["tokens_per_step"] / median if steps else None,
            "sent_bytes_per_step": [r["sent_bytes"] / max(steps, 1) for r in ranks],
            "sent_bytes_formula": formula_bytes,
            "model_state_bytes": [r["held_bytes"]["total"] for r in ranks],
            "model_state_formula": state_formula,
            "model_state_formula_text": cls.state_formula(4, STATE_TENSORS["adamw"], **options),
            "gathered_peak_bytes": [r["gathered_peak_bytes"] for r in ranks],
            "peak_memory": [r["peak_bytes"] for r in ranks], "skipped_steps": first["skipped_steps"],
            "diverged": first.get("diverged"),
            "run": {k: v for k, v in asdict(run).items() if k != "options"} | {"options": options}}


def format_summary(s: dict) -> str:
    per_rank = lambda values: ", ".join(f"{v:,.0f}" for v in values)  # noqa: E731
    stopped = f", stopped at step {len(s['losses'])}" if s.get("diverged") else ""
    lines = [f"trained {s['stage']} on {s['world_size']} rank(s) ({s['backend']}, {s['device']}): "
             f"{s['model']} model, Psi = {s['psi']:,}, {s['precision']}, steps {s['steps'][0]} -> {s['steps'][1]}"
             f"{stopped}"]
    if s["loss_first"] is not None:
        lines.append(f"  loss              {s['loss_first']:.4f} -> {s['loss_last']:.4f} (mean over the global "
                     f"batch, first -> last step of this run)")
        lines.append(f"  throughput        {s['tokens_per_s']:,.0f} tokens/s (median step {s['step_s_median'] * 1e3:,.1f} "
                     f"ms, slowest rank)")
    lines += [f"  sent per step     {per_rank(s['sent_bytes_per_step'])} B per rank; formula {s['sent_bytes_formula']:,.0f}",
              f"  model states      {per_rank(s['model_state_bytes'])} B per rank; formula "
              f"{s['model_state_formula_text']} = {s['model_state_formula']:,.0f}",
              f"  peak memory       {per_rank(p['bytes'] for p in s['peak_memory'])} B per rank "
              f"({s['peak_memory'][0]['kind']})",
              f"  skipped steps     {s['skipped_steps']}"]
    if any(s["gathered_peak_bytes"]):
        lines.insert(-1, f"  gathered peak     {per_rank(s['gathered_peak_bytes'])} B per rank (ZeRO-3's working set)")
    return "\n".join(lines)


def plot_losses(s: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(s["losses"]) + 1), s["losses"])
    ax.set(xlabel="step", ylabel="loss (mean over the global batch)",
           title=f"{s['stage']}, N={s['world_size']}, {s['model']} model, {s['precision']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def as_json(s: dict) -> str:
    return json.dumps(s, indent=2, default=str)

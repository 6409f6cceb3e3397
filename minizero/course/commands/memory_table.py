"""``python -m minizero memory``: the model-state bytes per rank of every stage -- the ZeRO paper's Table 1.

``--params 7.5e9 --world-size 64`` (mixed-precision Adam, the paper's setting)
prints 120 GB, 31.4 GB, 16.6 GB and 1.9 GB: each stage's own formula
(:meth:`Stage.state_bytes`, from what it shards).  ``--model gpt`` takes Psi
from a model minizero knows, and beside the formula runs every stage live at a
small N and reports the bytes it really held (:mod:`minizero.observe.memory`).

Model states are not all of a rank's memory: activations come on top and do not
shrink with N under any ZeRO stage.  So a second table gives the step's peak per
rank by component (:mod:`minizero.course.harness.step_memory`): for ``--params``, predicted, and with
``--gpu 80GB`` whether each stage fits and the smallest change that makes it fit;
for ``--model``, the peak predicted beside each rank's whole step as the allocator
saw it (malloc's bytes on the CPU, torch.cuda's on a GPU), with the components that
can be measured apart -- model states from the live tensors, activations from a
profiled step, ZeRO-3's gathered units from its observer.
"""
from __future__ import annotations

import argparse
import json

import torch

from ...observe.memory import profiled_step
from ...parts.activations import checkpoint_blocks
from ...parts.buckets import MAX_IN_FLIGHT
from ...parts.precision import Precision
from ...run.launch import RankPool
from ...stages import REFERENCE, STAGES, distributed, make_stage
from ..harness.experiment import Experiment, run_experiment
from ..harness.models import BENCH_GPT, GPT_SIZES
from ..harness.optimizers import STATE_TENSORS
from ..harness.step_memory import MASTER_BYTES, Shape, backward_activation_bytes, offloads, step_bytes
from ..harness.tasks import GPT_DEFAULTS, TASKS, vocabulary
from .memory_fit import gb, predicted_step_lines, predicted_step_rows

#: Models ``--model`` knows: the lab's GPT, the benchmarks' larger one, and ``train``'s sizes (on a GPU, ``large``
#: and ``100m`` are where activations outweigh what CUDA's libraries keep).
MODELS = {"gpt": {}, "bench-gpt": BENCH_GPT, **{name: GPT_SIZES[name] for name in ("medium", "large", "100m")}}
STEPS = 4  # steps of a live measurement
LIVE_WORLD_SIZE = 4  # the most ranks a live measurement starts (the bytes then follow the formula in N)


def formula_rows(psi: float, world_size: int, precision: str, optimizer: str, offload: bool = False,
                 stages: list[str] | None = None) -> list[dict]:
    """Every stage's (``stages``': these only) model-state bytes per rank from its own formula (on the device;
    ``offload``: the stages that take it keep their optimizer states in host memory, ``host_bytes_per_rank``)."""
    k, rows = STATE_TENSORS[optimizer], []
    for name in stages or distributed():
        options = {"offload_optimizer": True} if offload and offloads(name) else {}
        args = (MASTER_BYTES, k, precision)
        rows.append({"stage": name, "bytes_per_rank": STAGES[name].state_bytes(psi, world_size, *args, **options),
                     "host_bytes_per_rank": STAGES[name].host_state_bytes(psi, world_size, *args, **options),
                     "formula": STAGES[name].state_formula(*args, **options)})
    return rows


def measured_rows(model: str, world_size: int, precision: str, optimizer: str, timeout_s: float,
                  offload: bool = False, stages: list[str] | None = None, steps: int = STEPS, device: str = "cpu",
                  micro_batch: int = 4, checkpointed: bool = False, bucket_mb: float = 25.0,
                  reduce_scatter_buffers: int = MAX_IN_FLIGHT) -> list[dict]:
    """Every stage trained for a few steps on ``world_size`` ranks: the most model-state bytes any rank held.
    (Adam creates its states at its first step, and fp16's first steps may be skipped while the loss scale
    comes down from 2^16: a run with no step taken would show no optimizer states.)  ``stages``: these only.
    Each row has the allocator's figures too, of the last step of the rank that held the most in it -- on the CPU
    malloc's, sampled after every operator (``host_``: :class:`~minizero.observe.memory.HostStepPeaks`), on ``"cuda"``
    torch.cuda's (``cuda_``; the ranks share the current GPU over gloo): ``<prefix>_resident`` as the step began,
    ``<prefix>_peak`` during it, ``<prefix>_held`` its model states, ``<prefix>_steps`` every rank's every step."""
    options = {"precision": precision} if Precision.of(precision).mixed else {}
    prefix, rows = "cuda" if device == "cuda" else "host", []
    # Fresh ranks (spawned, not forked): a rank forked from a long-lived process inherits its heap, and glibc's
    # mallinfo2(), which HostStepPeaks reads after every operator, walks every free chunk of it -- a fragmented
    # parent's made one memory command take minutes.  (CUDA needs spawned ranks anyway.)
    with RankPool(world_size, timeout_s=timeout_s, start_method="spawn") as pool:
        for name in stages or distributed():
            taken = {**options, "bucket_mb": bucket_mb, "reduce_scatter_buffers": reduce_scatter_buffers,
                     **({"offload_optimizer": True} if offload and offloads(name) else {})}
            exp = Experiment(stage=name, task="gpt", model=MODELS[model], optimizer=optimizer, steps=steps,
                             dtype="float32", options={k: v for k, v in taken.items() if k in STAGES[name].option_names()},
                             device=device, micro_batch=micro_batch, checkpoint_activations=checkpointed,
                             host_step_peaks=device != "cuda")
            results = pool.run(run_experiment, exp)
            if results[0].skipped_steps == steps:
                raise ValueError(f"{name}: every one of {steps} fp16 steps overflowed; no optimizer state to measure")
            rows.append({"stage": name, "measured_bytes_per_rank": max(r.held_bytes["total"] for r in results),
                         "measured_host_bytes_per_rank": max(r.held_bytes["host"] for r in results),
                         "gathered_peak": max(r.gathered_peak_bytes for r in results), "psi": results[0].psi})
            per_rank = [r.cuda_steps if device == "cuda" else r.host_steps for r in results]
            # The last step (the steady state) of the rank whose step held the most beside what the process keeps
            # anyway (a parameter server's server, not a worker whose Python heap happens to be larger).
            last = max(range(len(results)), key=lambda i: results[i].held_bytes["total"] + per_rank[i][-1][1]
                       - per_rank[i][-1][0])
            rows[-1].update({f"{prefix}_resident": per_rank[last][-1][0], f"{prefix}_peak": per_rank[last][-1][1],
                             f"{prefix}_held": results[last].held_bytes["total"], f"{prefix}_steps": per_rank})
    return rows


def stage_list(text: str) -> list[str]:
    """``--stages zero2,zero3``: distributed stages, by name."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in distributed()]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(unknown) or 'no stage'} is not a distributed stage; "
                                         f"choose from {', '.join(distributed())}")
    return names


def gpt_config(model: str) -> dict:
    """The GPT's shape: the lab task's defaults (minizero.course.harness.tasks), overridden by the model's."""
    return {**GPT_DEFAULTS, **MODELS[model]}


def gpt_shape(model: str) -> Shape:
    """The lab GPT's shape for :mod:`minizero.course.harness.step_memory`: no dropout, the sonnets' vocabulary."""
    config = gpt_config(model)
    return Shape(config["n_layer"], config["d_model"], config["n_head"], config["block_size"], len(vocabulary()),
                 dropout=False)


def gpt_activation_bytes(model: str, micro_batch: int, precision: str, checkpointed: bool = False) -> float:
    """The most activations one GPT micro-batch holds at any moment of backward, per rank
    (:func:`minizero.course.harness.step_memory.backward_activation_bytes`: Korthikanti et al. 2022, eq. 1, for
    this dropout-free GPT, and what backward adds to it).  Any ZeRO stage leaves it as it is."""
    working = Precision.of(precision).working_bytes(MASTER_BYTES)
    return backward_activation_bytes(gpt_shape(model), micro_batch, working, checkpointed)


def measured_activation_bytes(model: str, micro_batch: int, checkpointed: bool, precision: str = "fp32") -> int:
    """What the allocator saw of one training step of the GPT on one rank's micro-batch, run by the single-device
    stage in ``precision`` (its casts: a 16-bit working copy, the logits back in fp32), profiled
    (:func:`minizero.observe.memory.profiled_step`): the most it held at any moment besides its parameters (masters and
    working copy), optimizer states, gradients and input -- the activations and autograd's own buffers.  Activations
    are the same under every stage: each rank computes its micro-batch whole.  (The second step is profiled: Adam's
    states exist.)"""
    shape = gpt_shape(model)
    net = TASKS["gpt"].make_model(0, torch.float32, **MODELS[model])
    if checkpointed:
        checkpoint_blocks(net)
    options = {"precision": precision} if Precision.of(precision).mixed else {}
    stage = make_stage(REFERENCE, net, torch.optim.Adam(net.parameters(), lr=1e-3), **options)
    x, y = TASKS["gpt"].make_batch(micro_batch, 0, 0, torch.float32, **MODELS[model])

    def step():
        stage.zero_grad(set_to_none=True)
        stage.scale_loss(torch.nn.functional.cross_entropy(stage(x).reshape(-1, shape.vocab), y.reshape(-1))).backward()
        stage.step()

    step()
    return profiled_step(step)["most_besides_kept"]


def main(args) -> tuple[int, str]:
    precision = args.precision
    if args.device == "cuda" and not args.model:
        raise ValueError("memory --device cuda measures a --model's ranks on the GPU; --params is a prediction "
                         "only: leave --device out, or give --model")
    if args.model:
        live_n = min(args.world_size, LIVE_WORLD_SIZE)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"memory --device cuda: torch {torch.__version__} sees no CUDA GPU here "
                             f"(torch.cuda.is_available() is False); leave --device out to measure on the CPU")
        measured = measured_rows(args.model, live_n, precision, args.optimizer, args.timeout, args.offload_optimizer,
                                 stages=args.stages, device=args.device, micro_batch=args.micro_batch,
                                 checkpointed=args.checkpoint_activations, bucket_mb=args.bucket_mb,
                                 reduce_scatter_buffers=args.reduce_scatter_buffers)
        psi = measured[0]["psi"]
    else:
        psi = args.params
    offload = args.offload_optimizer
    rows = formula_rows(psi, args.world_size, precision, args.optimizer, offload, args.stages)
    if args.model:
        at_live_n = formula_rows(psi, live_n, precision, args.optimizer, offload, args.stages)
        for row, live, at_live in zip(rows, measured, at_live_n, strict=True):
            formula_at_live = at_live["bytes_per_rank"]
            row.update(measured_world_size=live_n, measured_bytes_per_rank=live["measured_bytes_per_rank"],
                       measured_host_bytes_per_rank=live["measured_host_bytes_per_rank"],
                       gathered_peak=live["gathered_peak"],
                       host_formula_bytes_at_measured_world_size=at_live["host_bytes_per_rank"],
                       formula_bytes_at_measured_world_size=formula_at_live,
                       activation_bytes_estimate=gpt_activation_bytes(args.model, args.micro_batch, precision,
                                                                      args.checkpoint_activations),
                       step_predicted=predicted_step(args, row["stage"], psi, live_n, foreach=args.device == "cuda"),
                       **{k: v for k, v in live.items() if k.startswith(("cuda_", "host_"))})
    if args.json:  # the step's table too: predicted and measured (--model), or predicted with the fit (--params)
        steps = (measured_step_rows(args, psi, measured, live_n, args.device == "cuda") if args.model
                 else predicted_step_rows(args, psi))
        by_stage = {r["stage"]: r for r in steps}
        for row in rows:
            row["step"] = by_stage.get(row["stage"])  # None: a contrast stage, whose own buffers are not modelled
        return 0, json.dumps(rows, indent=2)
    k = (MASTER_BYTES if Precision.of(precision).mixed else 0) + MASTER_BYTES * STATE_TENSORS[args.optimizer]
    lines = [f"Model-state bytes per rank: Psi = {psi:,.4g} parameters, N = {args.world_size} ranks, precision "
             f"{precision}, {args.optimizer} (K = {k} optimizer bytes per parameter)"]
    width = max([14] + [len(row["formula"]) + 2 for row in rows])
    header = f"{'stage':<14}{'formula':<{width}}{'bytes/rank':>14}" + (f"{'host/rank':>12}" if offload else "")
    if args.model:
        header += f"{f'measured at N={live_n}':>20}{'formula':>12}" + (f"{'host':>12}{'formula':>12}" if offload else "")
    lines += [header, "-" * len(header)]
    for row in rows:
        line = f"{row['stage']:<14}{row['formula']:<{width}}{gb(row['bytes_per_rank']):>14}"
        line += f"{gb(row['host_bytes_per_rank']) if row['host_bytes_per_rank'] else '-':>12}" if offload else ""
        if args.model:
            line += f"{row['measured_bytes_per_rank']:>20,}{row['formula_bytes_at_measured_world_size']:>12,.0f}"
            line += (f"{row['measured_host_bytes_per_rank']:>12,}{row['host_formula_bytes_at_measured_world_size']:>12,.0f}"
                     if offload else "")
        lines.append(line)
    lines.append("Model states only (parameters, gradients, optimizer states; ZeRO's padding in 'measured')"
                 + ("; --offload-optimizer: the ZeRO stages' optimizer states in host memory ('host')." if offload
                    else "."))
    if args.model:
        step = measured_step_lines(args, psi, measured, live_n,
                                   torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    else:
        step = predicted_step_lines(args, psi)
    lines += [""] + step
    return 0, "\n".join(lines)


def measured_step_rows(args, psi: float, measured: list[dict], live_n: int, cuda: bool = False) -> list[dict]:
    """Each equivalent stage's last step: the prediction's components beside what was measured of them (what
    :func:`measured_step_lines` prints, and ``--json`` holds)."""
    prefix = "cuda" if cuda else "host"
    act_measured = None if cuda else measured_activation_bytes(args.model, args.micro_batch,
                                                               args.checkpoint_activations, args.precision)
    rows = []
    for row in measured:
        stage = row["stage"]
        if not STAGES[stage].equivalent:  # its own buffers (stale copies, anchors) are not modelled
            continue
        predicted = predicted_step(args, stage, psi, live_n, foreach=cuda)  # torch's default: foreach on a GPU only
        held, resident, seen = row[f"{prefix}_held"], row[f"{prefix}_resident"], step_peak(row, prefix)
        rows.append({"stage": stage, "predicted": predicted,
                     "measured": {"model_states": held, "activations": act_measured,
                                  "gathered_units": row.get("gathered_peak"), "peak": seen},
                     "off": seen / predicted["total"] - 1, "rest": resident - held})
    return rows


def measured_step_lines(args, psi: float, measured: list[dict], live_n: int, where: str = "cpu") -> list[str]:
    """Each stage's last step on the CPU (``where="cpu"``: malloc's bytes, sampled after every operator) or on a GPU
    (``where``: its name; torch.cuda's allocator): the step's peak beside the prediction, and the components that
    can be measured apart -- model states (the live tensors), activations (a profiled single-device step, on the CPU),
    ZeRO-3's gathered units (its observer).  What the process keeps between steps besides the model states -- Python's
    and the libraries' heap on the CPU, cuBLAS's workspaces on a GPU -- is no part of the model's step: measured, as
    the bytes allocated when the step began less the model states held, and printed apart ('rest')."""
    shape, ck, cuda = gpt_shape(args.model), args.checkpoint_activations, where != "cpu"
    lines = [f"The step's peak per rank at N={live_n}{f' on one {where}' if cuda else ''}, a micro-batch of "
             f"{args.micro_batch} x {shape.seq} tokens{', blocks checkpointed' if ck else ''}: predicted / measured "
             f"(bytes; the last of {STEPS} steps)",
             f"{'stage':<14}{'model states':>28}{'activations':>26}{'gathered units':>24}{'buckets':>12}{'peak':>28}"
             f"{'off':>7}{'rest':>13}"]
    for r in measured_step_rows(args, psi, measured, live_n, cuda):
        p, m = r["predicted"], r["measured"]
        lines.append(f"{r['stage']:<14}{pair(p['model_states'], m['model_states'], 12)}"
                     f"{pair(p['activations'], m['activations'], 10)}"
                     f"{pair(p['gathered_units'], m['gathered_units'], 9)}{p['buckets']:>12,.0f}"
                     f"{pair(p['total'], m['peak'], 12)}{r['off']:>+7.1%}{r['rest']:>13,}")
    lines += ["peak: model states and the most of four moments -- backward's start, backward (activations freed block "
              "by block as gradients are born, ZeRO-2's and -3's packed buckets: 'buckets'), after it (DDP's flat copy of "
              "the gradients), the step (fp32 gradients, the foreach optimizer's intermediates) -- minizero.course."
              "step_memory / " + ("torch.cuda's allocator" if cuda else "malloc's bytes (glibc's mallinfo2) sampled "
                                  "after every operator") + ", less 'rest': allocated as the step began less the model "
              "states held. activations: Korthikanti et al. 2022, eq. 1, for this dropout-free GPT" +
              ("" if cuda else " / a profiled single-device step less its parameters, optimizer states, gradients and "
                               "input (torch.profiler's memory categories)") +
              "; gathered units: ZeRO-3's root unit and 1 + prefetch blocks / the gathered peak its observer saw."]
    return lines


def step_peak(row: dict, prefix: str = "host") -> int:
    """A measured row's step peak, set beside the prediction: the model states held plus what the step added over the
    bytes allocated as it began (the rest of the process's heap -- Python's, the libraries' -- is no part of it)."""
    return row[f"{prefix}_held"] + row[f"{prefix}_peak"] - row[f"{prefix}_resident"]


def predicted_step(args, stage: str, psi: float, world_size: int, foreach: bool) -> dict:
    """:func:`minizero.course.harness.step_memory.step_bytes` of ``--model``'s GPT as the command's flags describe
    it, for ``stage``."""
    return step_bytes(stage, psi, gpt_shape(args.model), world_size, args.micro_batch, args.precision, args.optimizer,
                      args.checkpoint_activations, args.offload_optimizer and offloads(stage), foreach=foreach,
                      bucket_mb=args.bucket_mb, reduce_scatter_buffers=args.reduce_scatter_buffers)


def pair(predicted: float, measured: float | None, width: int = 11) -> str:
    """``predicted / measured``; ``-`` where nothing measured it."""
    return f"{predicted:>{width + 2},.0f} /" + (f"{'-':>{width}}" if measured is None else f"{measured:>{width},.0f}")

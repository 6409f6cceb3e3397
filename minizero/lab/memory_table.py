"""``python -m minizero memory``: the model-state bytes per rank of every stage -- the ZeRO paper's Table 1.

``--params 7.5e9 --world-size 64`` (mixed-precision Adam, the paper's setting)
prints 120 GB, 31.4 GB, 16.6 GB and 1.9 GB: each stage's own formula
(:meth:`Stage.state_bytes`, from what it shards).  ``--model gpt`` takes Psi
from a model minizero knows, and beside the formula runs every stage live at a
small N and reports the bytes it really held (:mod:`minizero.memory`).

Model states are not all of a rank's memory: activations come on top and do not
shrink with N under any ZeRO stage.  For the GPT an activation estimate is
printed on a line of its own, so nobody reads "1.9 GB" as "fits in 2 GB".
"""
from __future__ import annotations

import json

from ..launch import RankPool
from ..precision import Precision
from ..stages import STAGES, distributed
from .experiment import Experiment, run_experiment
from .models import BENCH_GPT
from .optimizers import STATE_TENSORS
from .tasks import GPT_DEFAULTS

#: Models ``--model`` knows: the lab's GPT, and the benchmarks' larger one.
MODELS = {"gpt": {}, "bench-gpt": BENCH_GPT}
MASTER_BYTES = 4  # fp32: the masters under mixed precision, everything in plain fp32 training
STEPS = 4  # steps of a live measurement
LIVE_WORLD_SIZE = 4  # the most ranks a live measurement starts (the bytes then follow the formula in N)


def formula_rows(psi: float, world_size: int, precision: str, optimizer: str) -> list[dict]:
    """Every stage's model-state bytes per rank from its own formula."""
    k = STATE_TENSORS[optimizer]
    return [{"stage": name, "bytes_per_rank": STAGES[name].state_bytes(psi, world_size, MASTER_BYTES, k, precision),
             "formula": STAGES[name].state_formula(MASTER_BYTES, k, precision)} for name in distributed()]


def measured_rows(model: str, world_size: int, precision: str, optimizer: str, timeout_s: float) -> list[dict]:
    """Every stage trained for a few steps on ``world_size`` ranks: the most model-state bytes any rank held.
    (Adam creates its states at its first step, and fp16's first steps may be skipped while the loss scale
    comes down from 2^16: a run with no step taken would show no optimizer states.)"""
    options = {"precision": precision} if Precision.of(precision).mixed else {}
    rows = []
    with RankPool(world_size, timeout_s=timeout_s) as pool:
        for name in distributed():
            exp = Experiment(stage=name, task="gpt", model=MODELS[model], optimizer=optimizer, steps=STEPS,
                             dtype="float32", options={k: v for k, v in options.items() if k in STAGES[name].option_names()})
            results = pool.run(run_experiment, exp)
            if results[0].skipped_steps == STEPS:
                raise ValueError(f"{name}: every one of {STEPS} fp16 steps overflowed; no optimizer state to measure")
            rows.append({"stage": name, "measured_bytes_per_rank": max(r.held_bytes["total"] for r in results),
                         "psi": results[0].psi})
    return rows


def gpt_config(model: str) -> dict:
    """The GPT's shape: the lab task's defaults (minizero.lab.tasks), overridden by the model's."""
    return {**GPT_DEFAULTS, **MODELS[model]}


def gpt_activation_bytes(model: str, micro_batch: int, precision: str) -> float:
    """Activations one GPT forward keeps for backward, per rank and micro-batch: Korthikanti et al. (2022),
    "Reducing Activation Recomputation in Large Transformer Models", eq. 1 -- s*b*h*(34 + 5*a*s/h) bytes per
    layer with 16-bit activations, no recomputation -- doubled for fp32.  Any ZeRO stage leaves it as it is."""
    config = gpt_config(model)
    s, b, h, a = config["block_size"], micro_batch, config["d_model"], config["n_head"]
    per_layer = s * b * h * (34 + 5 * a * s / h)
    return config["n_layer"] * per_layer * (1 if Precision.of(precision).mixed else 2)


def gb(nbytes: float) -> str:
    """The paper's unit: GB = 1e9 bytes (Table 1); small models in kB."""
    return f"{nbytes / 1e9:,.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e3:,.1f} kB"


def main(args) -> tuple[int, str]:
    precision = args.precision
    if args.model:
        live_n = min(args.world_size, LIVE_WORLD_SIZE)
        measured = measured_rows(args.model, live_n, precision, args.optimizer, args.timeout)
        psi = measured[0]["psi"]
    else:
        psi = args.params
    rows = formula_rows(psi, args.world_size, precision, args.optimizer)
    if args.model:
        for row, live in zip(rows, measured, strict=True):
            formula_at_live = STAGES[row["stage"]].state_bytes(psi, live_n, MASTER_BYTES,
                                                                STATE_TENSORS[args.optimizer], precision)
            row.update(measured_world_size=live_n, measured_bytes_per_rank=live["measured_bytes_per_rank"],
                       formula_bytes_at_measured_world_size=formula_at_live,
                       activation_bytes_estimate=gpt_activation_bytes(args.model, args.micro_batch, precision))
    if args.json:
        return 0, json.dumps(rows, indent=2)
    k = (MASTER_BYTES if Precision.of(precision).mixed else 0) + MASTER_BYTES * STATE_TENSORS[args.optimizer]
    lines = [f"Model-state bytes per rank: Psi = {psi:,.4g} parameters, N = {args.world_size} ranks, precision "
             f"{precision}, {args.optimizer} (K = {k} optimizer bytes per parameter)"]
    width = max([14] + [len(row["formula"]) + 2 for row in rows])
    header = f"{'stage':<14}{'formula':<{width}}{'bytes/rank':>14}"
    if args.model:
        header += f"{f'measured at N={live_n}':>20}{'formula':>12}"
    lines += [header, "-" * len(header)]
    for row in rows:
        line = f"{row['stage']:<14}{row['formula']:<{width}}{gb(row['bytes_per_rank']):>14}"
        if args.model:
            line += f"{row['measured_bytes_per_rank']:>20,}{row['formula_bytes_at_measured_world_size']:>12,.0f}"
        lines.append(line)
    lines.append("Model states only (parameters, gradients, optimizer states; ZeRO's padding in 'measured'). Not "
                 "included: activations, communication buffers, ZeRO-3's gathered units, allocator overhead.")
    if args.model:
        act = rows[0]["activation_bytes_estimate"]
        lines.append(f"Activations of one micro-batch of {args.micro_batch} x {gpt_config(args.model)['block_size']} "
                     f"tokens, per rank, any stage: about {act:,.0f} bytes ({gb(act)}) -- Korthikanti et al. 2022, "
                     f"eq. 1, no recomputation; they do not shrink with N.")
    return 0, "\n".join(lines)

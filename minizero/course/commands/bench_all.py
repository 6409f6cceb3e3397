"""``python -m minizero bench all``: every stage beside torch's implementation of its kind, in one run.

The per-kind benches (``bench ddp``, ``zero``, ``zero3``) each start their own ranks; their ratios cannot be
set side by side, because the machine changes between runs.  Here one pool of ranks runs every torch
counterpart and every stage in rounds (:mod:`minizero.course.harness.rounds`: each round all of them, in a shuffled
order), so each ratio is the median of per-round ratios, with its interval and a verdict only where the
interval allows one.  A stage's counterpart follows from its own ``shards`` fact, never from its name: a new
stage is benchmarked against the right torch wrapper without anyone listing it here.

Beside the step time, each row sets what the stage sent (the ledger) against its own formula and against
torch's modelled bytes (the ledger cannot see torch's collectives), and the model state each rank held
(counted from live tensors, :mod:`minizero.observe.memory`) against the formula and against torch's, counted the
same way.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from ...run.launch import RankPool
from ...stages import STAGES, Shards, distributed
from ..harness.equivalence import agrees
from ..harness.experiment import Experiment, element_size, run_experiment
from ..harness.models import GPT_SIZES
from ..harness.optimizers import STATE_TENSORS
from ..harness.oracle import TorchDDP, TorchFSDP2, TorchZeRO
from ..harness.preflight import check_plot
from ..harness.registry import stage_class
from ..harness.rounds import METHOD, check_rounds, compare, describe, measure_rounds

WARMUP = 2  # steps skipped before timing, as the other benches do: first-touch allocations, connections
ONLY_HERE = ("model", "device", "plot", "collectives", "steps", "stages")  # options only ``bench all`` takes...
ALSO_TAKEN = {"gpu-efficiency": ("model",), "codecs": ("model",)}  # ...but for these, which another bench reads too (a GPT's size)


def counterpart(shards: Shards) -> str:
    """torch's implementation of the same kind: what a stage divides among ranks decides it."""
    if shards.parameters:
        return TorchFSDP2.name  # fully_shard: parameters, gradients and optimizer states sharded
    if shards.optimizer_states or shards.gradients:
        return TorchZeRO.name  # ZeroRedundancyOptimizer over DDP: optimizer states sharded
    return TorchDDP.name  # every rank holds everything


def torch_sent_bytes(name: str, psi: int, world_size: int, element: int) -> float:
    """torch's bytes per rank per step, *modelled* (its collectives bypass our ledger), ring costs:
    DDP's all-reduce 2(N-1)/N Psi b; ZeroRedundancyOptimizer adds each owner's broadcast of its updated
    parameters, (N-1)/N Psi b per rank on average; FSDP2 all-gathers in forward and again in backward
    (reshard_after_forward) and reduce-scatters, 3(N-1)/N Psi b (it keeps the root gathered between the
    two, so a little less in truth)."""
    passes = 2 if name == TorchDDP.name else 3
    return passes * (world_size - 1) / world_size * psi * element


# Counterparts torch cannot run where bench all's ranks run (gloo between them, on ``device``): the row then
# shows the stage measured and says why its counterpart was not, rather than a crash or a made-up ratio.
UNMEASURABLE = {
    ("cuda", TorchFSDP2.name): "torch's FSDP2 over gloo with CUDA tensors dies with a segmentation fault "
                               "(torch 2.11 on an H200, docs/gpu-results.md); bench all's ranks talk gloo -- "
                               "measure FSDP2 under NCCL, one GPU per rank",
}


def check_device(device: str) -> None:
    """Refused before any rank starts: a CUDA run on a machine without CUDA would fail in every rank."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench all --device cuda: torch sees no CUDA device here (torch.cuda.is_available() is "
                         "False); run it on a machine with a GPU and a CUDA build of torch, or leave out --device")


def refuse_elsewhere(args) -> None:
    """Options that only ``bench all`` reads are refused by the other benches, rather than silently ignored."""
    given = [f"--{o}" for o in ONLY_HERE if getattr(args, o, None) is not None
             and o not in ALSO_TAKEN.get(args.what, ())]
    if given and args.what != "all":
        raise ValueError(f"bench {args.what} does not take {', '.join(given)}; only bench all does")


def _run_lean(me, exp: Experiment):
    """:func:`run_experiment` without the per-step parameters in its reply: a bench judges no equivalence,
    and pickling the large GPT's 150 MB of parameters per step back to the parent tripled its run time."""
    return replace(run_experiment(me, exp), params=[], optimizer_state=None)


def _measure(pool, exp: Experiment, world_size: int) -> dict:
    """One experiment on every rank: the slowest rank's median step, and what each rank sent and held."""
    per_rank = pool.run(_run_lean, exp)
    return {"step_ms": max(statistics.median(r.step_s[WARMUP:]) for r in per_rank) * 1e3,
            "sent": sum(r.sent_bytes for r in per_rank) / (world_size * exp.steps),
            "held": max(r.held_bytes["total"] for r in per_rank),
            "cuda_peak": max(r.cuda_peak_bytes for r in per_rank), "psi": per_rank[0].psi}


def bench_all(world_size: int, model: str = "small", device: str = "cpu", collectives: str = "native",
              steps: int = 4, micro_batch: int = 8, pool=None, rounds: int = 5,
              stages: list[str] | None = None) -> list[dict]:
    """One row per stage: its step time, bytes and memory beside its torch counterpart's, one pool,
    ``rounds`` rounds (each run's first steps are its untimed warm-up).

    ``pool``: a live pool of ``world_size`` ranks to run on (the tests'); else one is started here.  ``stages``:
    these only (each still beside its counterpart), for more rounds where an interval is wide."""
    check_device(device)
    check_rounds(rounds)
    if model not in GPT_SIZES:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(GPT_SIZES)}")
    if steps <= WARMUP:
        raise ValueError(f"bench all needs more than {WARMUP} steps: the first {WARMUP} warm up and are not timed")
    base = Experiment(task="gpt", model=GPT_SIZES[model], optimizer="adamw", steps=steps, micro_batch=micro_batch,
                      dtype="float32", check=False, backend=collectives, device=device)
    stages = distributed() if stages is None else stages
    kinds = {stage: counterpart(STAGES[stage].shards) for stage in stages}
    missing = {kind: UNMEASURABLE[(device, kind)] for kind in set(kinds.values()) if (device, kind) in UNMEASURABLE}
    names = [n for n in dict.fromkeys(name for stage in stages for name in (kinds[stage], stage)) if n not in missing]
    last = {}
    own = pool is None
    if own:  # CUDA does not survive a fork once the parent has touched it: spawn fresh ranks for a GPU run
        pool = RankPool(world_size, start_method="spawn" if device == "cuda" else None)
    try:
        def measure(name):
            last[name] = _measure(pool, replace(base, stage=name, options=like_for_like(name)), world_size)
            return last[name]["step_ms"]
        times = measure_rounds(measure, names, rounds, warmup=False)
    finally:
        if own:
            pool.close()
    return [row(stage, kinds[stage], {**last[stage], "round_ms": times[stage]},
                None if kinds[stage] in missing else {**last[kinds[stage]], "round_ms": times[kinds[stage]]},
                base, world_size, model, why_not=missing.get(kinds[stage]))
            for stage in stages]


def like_for_like(name: str) -> dict:
    """A stage that can overlap as its counterpart does runs so: zero1 with ``overlap`` (DeepSpeed stage 1's
    overlap_comm), since DDP under ``ZeroRedundancyOptimizer`` all-reduces its buckets during backward."""
    return {"overlap": True} if name in STAGES and "overlap" in STAGES[name].option_names() else {}


def row(stage: str, kind: str, mine: dict, theirs: dict | None, exp: Experiment, world_size: int, model: str,
        why_not: str | None = None) -> dict:
    """A stage's row from what it and its counterpart measured: the measurement is printed, and the
    formula beside it -- never in its place (at N=2 on the tiny GPT the two agree to the byte; with
    padding they do not).  The step times are the medians over the rounds; the ratio is the rounds'
    (:func:`minizero.course.harness.rounds.compare`).  ``theirs`` None: the counterpart could not run here
    (``why_not``); its cells are None and the verdict says why."""
    cls, psi = stage_class(stage), mine["psi"]
    element, states = element_size(exp), STATE_TENSORS[exp.optimizer]
    sent_formula = cls.sent_bytes_per_step(psi, world_size, element, element)
    held_formula = cls.state_bytes(psi, world_size, element, states)
    return {"stage": stage, "options": like_for_like(stage), "counterpart": kind, "world_size": world_size,
            "model": model, "psi": psi,
            "device": exp.device, "collectives": exp.backend, "steps": exp.steps, "micro_batch": exp.micro_batch,
            "step_ms": statistics.median(mine["round_ms"]),
            **(_compared(mine, theirs) if theirs else _not_compared(mine, why_not)),
            "sent_bytes_per_step": mine["sent"], "sent_bytes_formula": sent_formula,
            "bytes_match": agrees(mine["sent"], sent_formula),
            "counterpart_sent_bytes_modelled": torch_sent_bytes(kind, psi, world_size, element),
            "held_bytes": mine["held"], "held_bytes_formula": held_formula,
            "state_formula": cls.state_formula(element, states),
            "memory_match": agrees(mine["held"], held_formula), "cuda_peak_bytes": mine["cuda_peak"]}


def _compared(mine: dict, theirs: dict) -> dict:
    return {"counterpart_step_ms": statistics.median(theirs["round_ms"]),
            **compare(mine["round_ms"], theirs["round_ms"]),
            "round_ms": mine["round_ms"], "counterpart_round_ms": theirs["round_ms"],
            "counterpart_held_bytes": theirs["held"], "counterpart_cuda_peak_bytes": theirs["cuda_peak"]}


def _not_compared(mine: dict, why_not: str) -> dict:
    return {"counterpart_step_ms": None, "ratio": None, "interval": None, "verdict": f"not compared: {why_not}",
            "rounds": len(mine["round_ms"]), "round_ratios": [], "round_ms": mine["round_ms"],
            "counterpart_round_ms": [], "counterpart_held_bytes": None, "counterpart_cuda_peak_bytes": None}


def format_table(rows: list[dict]) -> str:
    """The rows as a table; bytes in MB (10^6), exact in ``--json``."""
    first, mb = rows[0], 1e6
    cuda = first["device"] == "cuda"
    lines = [f"bench all, N={first['world_size']} ranks, gpt {first['model']} (Ψ={first['psi']:,}), adamw, float32, "
             f"micro-batch {first['micro_batch']}, {first['collectives']} collectives, {first['device']}, "
             f"{first['steps']} steps per run ({WARMUP} warm-up untimed; median step of the slowest rank), "
             f"{first['rounds']} rounds",
             f"every stage and its torch counterpart ran in the same pool, in the same run: {METHOD}",
             "sent: per rank per step, as our ledger counted it | formula: the stage's own | torch: MODELLED "
             "(our ledger cannot see torch's collectives)",
             "held: model-state bytes per rank (parameters, gradients, optimizer states; live tensors, the most "
             "on any rank)"]
    lines += [f"{r['stage']} runs with {r['options']}: it overlaps as its counterpart does" for r in rows
              if r.get("options")]
    header = (f"{'stage':<14}{'vs':<13}{'step ms':>9}{'torch ms':>10}{'ratio [95% interval]':>21}  "
              f"{'sent MB':>9}{'formula':>9}"
              f"{'torch*':>9}  {'held MB':>9}{'formula':>9}  {'(paper)':<12}{'torch':>9}"
              + (f"{'peak MB':>10}{'torch':>9}" if cuda else ""))
    lines += [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['stage']:<14}{r['counterpart']:<13}{r['step_ms']:>9.1f}{_cell(r['counterpart_step_ms'], 10, 1)}"
            f"{_interval(r):>21}  {r['sent_bytes_per_step'] / mb:>9.3f}{r['sent_bytes_formula'] / mb:>9.3f}"
            f"{r['counterpart_sent_bytes_modelled'] / mb:>9.3f}  {r['held_bytes'] / mb:>9.3f}"
            f"{r['held_bytes_formula'] / mb:>9.3f}  {r['state_formula']:<12}"
            f"{_cell(r['counterpart_held_bytes'], 9, 3, mb)}"
            + (f"{r['cuda_peak_bytes'] / mb:>10.1f}{_cell(r['counterpart_cuda_peak_bytes'], 9, 1, mb)}" if cuda else ""))
    lines += [f"{r['stage']} vs {r['counterpart']}: {describe(r) if r['ratio'] is not None else r['verdict']}"
              for r in rows]
    lines += [f"{r['stage']}: the ledger's bytes differ from the formula's" for r in rows if not r["bytes_match"]]
    lines += [f"{r['stage']}: the held bytes differ from the formula's" for r in rows if not r["memory_match"]]
    return "\n".join(lines + ["* torch: modelled, ring costs (DDP 2(N-1)/N Ψ·4; ZeroRedundancyOptimizer and FSDP2 "
                              "3(N-1)/N Ψ·4)"])


def _cell(value, width: int, digits: int, unit: float = 1.0) -> str:
    """A number right-aligned, or a dash where the counterpart was not measured."""
    return f"{'-':>{width}}" if value is None else f"{value / unit:>{width}.{digits}f}"


def _interval(r: dict) -> str:
    if r["interval"] is None:
        return "not compared"
    low, high = r["interval"]
    return f"{r['ratio']:.2f}x [{low:.2f}, {high:.2f}]"


def plot(rows: list[dict], path: str) -> None:
    """One figure, two panels: each stage's step time as a multiple of its counterpart's, and the model
    state each rank held beside its counterpart's -- the speed and the memory of one run, side by side."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed, none opened
    from matplotlib import pyplot as plt

    names, at = [r["stage"] for r in rows], range(len(rows))
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    # A row whose counterpart could not run has no ratio: no bar, and its label says so.
    errors = [[r["ratio"] - r["interval"][0] if r["ratio"] is not None else 0 for r in rows],
              [r["interval"][1] - r["ratio"] if r["ratio"] is not None else 0 for r in rows]]
    speed.bar(at, [r["ratio"] or 0 for r in rows], color="tab:blue", yerr=errors, capsize=4, ecolor="black")
    speed.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    speed.set_xticks(list(at), [f"{r['stage']}\nvs {r['counterpart']}" + ("" if r["ratio"] is not None else
                                                                             "\n(not compared)") for r in rows],
                     fontsize=7, rotation=30, ha="right")
    speed.set_ylabel("step time / torch counterpart's")
    holds = next((r["held"] for r in rows if r.get("held") is not None), None)  # what each interval holds
    said = f"{holds:.1%} interval" if holds is not None else "no interval"
    speed.set_title(f"step time ratio, {said} over {rows[0]['rounds']} rounds (below 1: faster)")
    width = 0.4
    memory.bar([i - width / 2 for i in at], [r["held_bytes"] / 1e6 for r in rows], width, label="minizero")
    memory.bar([i + width / 2 for i in at], [(r["counterpart_held_bytes"] or 0) / 1e6 for r in rows], width,
               label="torch counterpart", color="tab:gray")
    memory.set_xticks(list(at), names, fontsize=8)
    memory.set_ylabel("model state per rank (MB)")
    memory.set_title("memory per rank")
    memory.legend(fontsize=8)
    first = rows[0]
    fig.suptitle(f"bench all: gpt {first['model']} (Ψ={first['psi']:,}), N={first['world_size']}, {first['device']}, "
                 f"{first['collectives']} collectives, {first['rounds']} interleaved rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> list[dict]:
    """``bench all`` from the command line's arguments; the plot, if asked for, written here."""
    if args.plot:
        check_plot(args.plot)  # (the commands' one check: minizero.course.harness.preflight)
    rows = bench_all(args.world_size, model=args.model or "small", device=args.device or "cpu",
                     collectives=args.collectives or "native", steps=args.steps or 4, rounds=args.rounds,
                     stages=args.stages)
    if args.plot:
        plot(rows, args.plot)
    return rows

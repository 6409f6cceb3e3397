"""``python -m minizero roofline``: the tokens per GPU per step each stage needs for its arithmetic to hide its
communication (:mod:`minizero.costs.roofline`), per world size -- and, with ``--noise``, the gradient noise scale
measured on the sonnets GPT with this machine's ranks (:mod:`minizero.course.harness.noise_scale`), the batch size
past which more data parallelism stops paying."""
from __future__ import annotations

import json

from ...comm.network import Network, parse_network
from ...costs.roofline import tokens_to_hide
from ...run.launch import run
from ...stages import STAGES
from ..harness.models import GPT_SIZES
from ..harness.noise_scale import gradient_norms, measure
from .scale import world_sizes

#: bf16 dense peak of an H100 SXM, NVIDIA's datasheet (989 TFLOP/s; "with sparsity" doubles it, not used here).
H100_BF16_TFLOPS = 989.0
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def table(stages: list[str], params: float, sizes: list[int], network: Network, peak_flops: float, mfu: float,
          precision: str = "bf16") -> list[dict]:
    """One row per stage and world size: bytes sent per rank per step and the tokens per GPU to hide them."""
    b = BYTES[precision]
    rows = []
    for name in stages:
        for n in sizes:
            hide = tokens_to_hide(STAGES[name], params, n, network.bandwidth, peak_flops, mfu, b, b)
            rows.append({"stage": name, "world_size": n, "sent_bytes": hide.sent_bytes,
                         "tokens_behind_backward": hide.backward, "tokens_behind_step": hide.step,
                         "global_tokens": n * hide.backward})
    return rows


def format_table(rows: list[dict], params: float, network: Network, peak_flops: float, mfu: float,
                 precision: str) -> str:
    lines = [f"the roofline: Psi = {params:.3g}, {precision} on the wire, {network.describe()}, a GPU of "
             f"{peak_flops / 1e12:g} TFLOP/s at MFU {mfu:g}; tokens per GPU per step for the arithmetic (6 Psi per "
             f"token: 4 Psi in backward) to take as long as the communication (bandwidth term)",
             f"{'stage':<14}{'N':>6}{'sent B/rank':>16}{'behind backward':>17}{'behind the step':>17}"
             f"{'global batch (tokens)':>23}"]
    lines += [f"{r['stage']:<14}{r['world_size']:>6}{r['sent_bytes']:>16,.0f}{r['tokens_behind_backward']:>17,.0f}"
              f"{r['tokens_behind_step']:>17,.0f}{r['global_tokens']:>23,.0f}" for r in rows]
    return "\n".join(lines)


def noise(world_size: int, model: str = "tiny", per_rank: int = 2, steps: int = 60) -> dict:
    """B_simple on the sonnets GPT over ``steps`` steps of DDP, from the last half's norms."""
    norms = run(gradient_norms, world_size, GPT_SIZES[model], per_rank, steps)[0]
    scale = measure(norms, per_rank, world_size, skip=steps // 2)
    block = GPT_SIZES[model]["block_size"]
    return {"model": model, "world_size": world_size, "per_rank": per_rank, "steps": steps,
            "true_norm2": scale.true_norm2, "trace": scale.trace, "b_simple_sequences": scale.simple,
            "b_simple_tokens": scale.simple * block}


def main(args) -> tuple[int, str]:
    network = parse_network(args.network)
    if not isinstance(network, Network):
        raise ValueError(f"--network {args.network!r}: give one wire (a preset or 'alpha=...,bandwidth=...'): the "
                         f"roofline reads one bandwidth per GPU")
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu {args.mfu:g}: model FLOPs utilisation is a share of the peak, more than 0 and at most 1")
    stages = [s.strip() for s in args.stages.split(",")]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"--stages: unknown {', '.join(unknown)}; from: {', '.join(STAGES)}")
    peak = args.peak_tflops * 1e12
    rows = table(stages, args.params, world_sizes(args.world_size), network, peak, args.mfu, args.precision)
    measured = noise(args.noise) if args.noise else None
    if args.json:
        return 0, json.dumps({"rows": rows, "noise": measured}, indent=2)
    text = format_table(rows, args.params, network, peak, args.mfu, args.precision)
    if measured:
        text += (f"\n\ngradient noise scale on the {measured['model']} sonnets GPT (N = {measured['world_size']}, "
                 f"{measured['per_rank']} sequences a rank, the last {measured['steps'] // 2} of {measured['steps']} "
                 f"steps): B_simple = {measured['b_simple_sequences']:.1f} sequences = "
                 f"{measured['b_simple_tokens']:.0f} tokens (McCandlish et al. 2018, Appendix A.1)")
    return 0, text


def add_parser(sub, positive_int, positive_float) -> None:
    p = sub.add_parser("roofline", help="tokens per GPU each stage needs to hide its communication; the noise scale")
    p.add_argument("--params", type=positive_float, default=1e9, help="Psi (it cancels in DDP's bound: see the docs)")
    p.add_argument("--world-size", default="8,64,1024", help="'8,64,1024' or '2..1024' (powers of two)")
    p.add_argument("--network", default="infiniband-ndr", help="one wire: a preset or 'alpha=10us,bandwidth=50GB/s'")
    p.add_argument("--stages", default="ddp-bucketed,zero1,zero2,zero3")
    p.add_argument("--peak-tflops", type=positive_float, default=H100_BF16_TFLOPS,
                   help=f"the GPU's dense peak in the working precision (default {H100_BF16_TFLOPS:g}: an H100's bf16)")
    p.add_argument("--mfu", type=positive_float, default=0.4, help="model FLOPs utilisation, 0-1 (default 0.4)")
    p.add_argument("--precision", choices=list(BYTES), default="bf16", help="bytes per element on the wire")
    p.add_argument("--noise", type=positive_int, default=None, metavar="N",
                   help="also measure the gradient noise scale on N ranks here (the tiny sonnets GPT, 60 steps)")
    p.add_argument("--json", action="store_true")

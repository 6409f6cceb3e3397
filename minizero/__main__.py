"""Command line: ``python -m minizero train|compare|soak|memory|bench|scale|roofline|lab|check|verify ...``.

Numbers are validated where they are parsed: a count must be a positive whole
number, a size or a rate a finite positive number -- argparse then names the
option and the value, instead of a traceback from deep inside a run.
"""
from __future__ import annotations

import argparse
import os
import sys

from .comm import BACKENDS, PRESETS
from .course.commands.bench import BENCHES
from .course.commands.bench import ROUNDS as BENCH_ROUNDS
from .course.commands.compress_study import add_parser as add_compress_study
from .course.commands.memory_table import MODELS as MEMORY_MODELS
from .course.commands.memory_table import stage_list
from .course.commands.roofline import add_parser as add_roofline
from .course.commands.train_command import add_parser as add_train_command
from .course.commands.verify import add_parser as add_verify
from .course.harness import preflight
from .course.harness.equivalence import DTYPES
from .course.harness.optimizers import OPTIMIZERS
from .course.harness.option_flags import add_flags
from .course.harness.rank_verdict import rank_error_verdict
from .course.harness.registry import LAB_STAGES
from .course.harness.tasks import TASKS
from .course.labs.cli import add_commands as add_lab_commands
from .parts.precision import PRECISIONS, REDUCE_DTYPES
from .run.launch import RankError
from .stages import DEFAULT_STAGE, STAGES, distributed
from .stages.options import REDUCE_SCATTER_BUFFERS, WIRE_AND_USE, natural_int, positive_float, positive_int


def _training_options(p: argparse.ArgumentParser, steps: int, dtype: str, stages: dict) -> None:
    """What ``compare`` and ``soak`` share: the run to compare with single-device training, and a flag for
    each option the ``stages`` declare (minizero.course.harness.option_flags; ``precision`` is built from its own flags)."""
    p.add_argument("--world-size", type=positive_int, default=2)
    p.add_argument("--stages", default=DEFAULT_STAGE, help=f"comma-separated, from: {', '.join(distributed(stages))}")
    p.add_argument("--dtype", choices=list(DTYPES), default=dtype)
    p.add_argument("--steps", type=positive_int, default=steps)
    p.add_argument("--task", choices=list(TASKS), default="gpt")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    p.add_argument("--lr", type=positive_float, default=1e-3,
                   help="learning rate (> 0: with 0 nothing moves and every stage would trivially agree)")
    p.add_argument("--micro-batch", type=positive_int, default=4, help="samples per rank per micro-batch")
    p.add_argument("--accum", type=positive_int, default=1, help="K micro-batches per optimizer step")
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                   help="bf16/fp16: compute in 16 bits, fp32 master weights (fp16 with dynamic loss scaling)")
    p.add_argument("--reduce-dtype", choices=list(REDUCE_DTYPES), default=None,
                   help="mixed precision: reduce gradients in fp32 (default: in the 16-bit working precision)")
    p.add_argument("--loss-scale", type=positive_float, default=None, help="fp16: the initial loss scale (2**16)")
    p.add_argument("--loss-scale-window", type=positive_int, default=None,
                   help="fp16: clean steps before the loss scale doubles (2000)")
    p.add_argument("--min-loss-scale", type=positive_float, default=None, help="fp16: the loss scale's floor (1)")
    p.add_argument("--clip", type=positive_float, default=None, help="clip the global L2 gradient norm to this")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="keep each block's input only and replay its forward in backward (torch.utils.checkpoint, "
                        "non-reentrant; minizero.parts.activations); the reference never does")
    p.add_argument("--backend", choices=list(BACKENDS), default="ring")
    p.add_argument("--seed", type=preflight.seed, default=0)
    p.add_argument("--timeout", type=preflight.timeout_s, default=300.0,
                   help=f"seconds a collective may go without progress before the run is ended as stalled "
                        f"(at least {preflight.MIN_TIMEOUT_S:g})")
    p.add_argument("--network", default=None, help="dial the network: 'alpha=2ms,bandwidth=50MB/s' or a preset ("
                   + ", ".join(PRESETS) + "); every message then waits alpha + bytes/bandwidth")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="fingerprint every collective, so ranks that disagree stop with an error (default: on)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--debug", action="store_true", help="a failure on the ranks: print every traceback, not only "
                                                        "the verdict")
    add_flags(p, stages, leave_out=("precision",), command=p.prog)
    p.set_defaults(registry=None if stages is LAB_STAGES else stages)


def parser(stages: dict | None = None) -> argparse.ArgumentParser:
    """The command line.  ``stages``: a registry for ``compare`` and ``soak`` other than the lab's (a test's
    ``with_stages(...)``): their ``--stages`` choose from it, and its stages' options are flags."""
    top = argparse.ArgumentParser(prog="python -m minizero", description=__doc__.split("\n")[0])
    sub = top.add_subparsers(dest="command", required=True)
    compare = sub.add_parser("compare", help="run stages against single-device training; exit 1 if any differs")
    _training_options(compare, steps=5, dtype="float32", stages=LAB_STAGES if stages is None else stages)
    soak = sub.add_parser("soak", help="every stage against the reference for many steps; the largest deviation")
    _training_options(soak, steps=500, dtype="float64", stages=LAB_STAGES if stages is None else stages)
    soak.set_defaults(stages=",".join(n for n in distributed(STAGES) if STAGES[n].equivalent))
    memory = sub.add_parser("memory", help="model-state bytes per rank of every stage (the ZeRO paper's Table 1)")
    size = memory.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=positive_float, help="Psi, the number of parameters (7.5e9 for Table 1)")
    size.add_argument("--model", choices=list(MEMORY_MODELS),
                      help="a model minizero knows: its Psi, and the bytes measured from a live run at N <= 4")
    memory.add_argument("--world-size", type=positive_int, default=64)
    memory.add_argument("--precision", choices=list(PRECISIONS), default="fp16",
                        help="fp16/bf16: the paper's mixed precision (default); fp32: one precision throughout")
    memory.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adam")
    memory.add_argument("--micro-batch", type=positive_int, default=4, help="samples per rank per micro-batch")
    memory.add_argument("--seq", type=positive_int, default=2048, help="--params: tokens per sample (a --model's "
                                                                        "are its own)")
    memory.add_argument("--checkpoint-activations", action="store_true",
                        help="each block keeps its input only and is replayed in backward (minizero.parts.activations)")
    memory.add_argument("--offload-optimizer", action="store_true",
                        help="the ZeRO stages keep their optimizer states in host memory (ZeRO-Offload, minizero.parts.offload)")
    memory.add_argument("--gpu", type=preflight.gpu, default=None,
                        help="a GPU's memory, e.g. 80GB: does each stage fit, and if not, the smallest change that does")
    memory.add_argument("--bucket-mb", type=positive_float, default=25.0,
                        help="the bucket cap of ddp-bucketed and ZeRO-2 in MiB (torch DDP's 25): ZeRO-2 holds two at a "
                             "time as it packs them")
    memory.add_argument("--reduce-scatter-buffers", type=REDUCE_SCATTER_BUFFERS.parse, default=REDUCE_SCATTER_BUFFERS.default,
                        help=f"ZeRO-2's and -3's {REDUCE_SCATTER_BUFFERS.help}")
    memory.add_argument("--stages", type=stage_list, default=None,
                        help="these stages only, comma-separated (default: every distributed stage)")
    memory.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="--model: where the ranks train (cuda: all on the current GPU, gloo between them; the "
                             "step's peak is then torch.cuda's max_memory_allocated)")
    memory.add_argument("--timeout", type=preflight.timeout_s, default=300.0)
    memory.add_argument("--json", action="store_true")
    bench = sub.add_parser("bench", help="speed against torch's own implementation, as ratios")
    bench.add_argument("what", choices=list(BENCHES))
    bench.add_argument("--world-size", type=positive_int, default=2)
    bench.add_argument("--repeats", type=positive_int, default=5,
                       help="collectives, overlap: calls per timing (the median); each round times once")
    bench.add_argument("--rounds", type=positive_int, default=BENCH_ROUNDS,
                       help="rounds in which each stage and its counterpart alternate (at least 3): the ratio is "
                            "their median, with the k-th smallest to k-th largest ratio as its interval -- 95%% "
                            f"from {BENCH_ROUNDS} rounds (a verdict needs it), narrower from 9")
    bench.add_argument("--network", default=None,
                       help="dial the network: 'alpha=2ms,bandwidth=50MB/s' or a preset (" + ", ".join(PRESETS) + "); "
                            "overlap, buckets, prefetch and compress measure on it (default for the last three: lesson)")
    from .course.harness.models import GPT_SIZES  # bench all's options, refused by the other benches (bench_all)
    bench.add_argument("--model", choices=list(GPT_SIZES), default=None, help="bench all: the GPT's size (small)")
    bench.add_argument("--device", choices=["cpu", "cuda"], default=None, help="bench all: where the ranks compute (cpu)")
    bench.add_argument("--collectives", choices=list(BACKENDS), default=None,
                       help="bench all: minizero's collectives, torch's (native, default) or the send/recv ring")
    bench.add_argument("--steps", type=positive_int, default=None,
                       help="bench all: steps per run, 2 untimed (4: a multiple of local-sgd's H = 4, so its bytes "
                            "meet the formula)")
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="bench all: step-time ratio and memory per rank per stage against torch, as a PNG")
    bench.add_argument("--stages", type=stage_list, default=None,
                       help="bench all: these stages only, each beside its counterpart (more rounds where one is wide)")
    bench.add_argument("--json", action="store_true")
    scale = sub.add_parser("scale", help="predicted step time, exposed communication and efficiency, N = 1 to 1024+")
    scale.add_argument("--stage", default="all", help=f"comma-separated, from: {', '.join(distributed())}; or all")
    scale.add_argument("--params", type=positive_float, required=True, help="Psi, the number of parameters")
    scale.add_argument("--world-size", default="1..1024", help="'1,2,4,8' or '1..1024' (powers of two)")
    scale.add_argument("--network", default="ethernet-100g", help="a preset (" + ", ".join(PRESETS) + ") or "
                       "'alpha=10us,bandwidth=12.5GB/s'; a cluster: 'nodes=128x8,intra=nvlink,inter=infiniband-ndr' "
                       "(nodes of 8; each world size fills N/8 of them)")
    scale.add_argument("--collectives", default="flat", help="'flat', 'hierarchical' or 'flat,hierarchical': the "
                       "world's rings as one ring, or in two levels (on a cluster)")
    scale.add_argument("--compress", default=None, metavar="WIRES",
                       help="'fp16,int8,topk:0.01,powersgd:rank=4': instead of the stages, when each compressor pays -- "
                            "its bytes, its time on --network, its compute, the break-even bandwidth per N")
    timing = scale.add_mutually_exclusive_group()
    timing.add_argument("--compute-ms", type=positive_float, help="forward+backward per rank per step, in ms")
    timing.add_argument("--measure", action="store_true", help="measure forward+backward here (the bench GPT, "
                        "scaled to --params)")
    scale.add_argument("--layers", type=positive_int, default=12, help="blocks the parameters are split into (ZeRO-3 units)")
    scale.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                       help="bytes per element on the wire: 4 (fp32) or 2 (bf16/fp16)")
    scale.add_argument("--json", action="store_true")
    # The options the cost model reads: the wire's (and --precision, above) are bytes per element, not options.
    add_flags(scale, {n: STAGES[n] for n in distributed()}, leave_out=[o.name for o in WIRE_AND_USE], command=scale.prog)
    add_train_command(sub, positive_int, natural_int, positive_float)
    add_compress_study(sub, positive_int, positive_float)
    add_roofline(sub, positive_int, positive_float)
    add_lab_commands(sub)
    add_verify(sub)
    return top


def main(argv=None, stages: dict | None = None) -> int:
    """Run a command; its ``main(args)`` returns ``(exit status, text for stdout)``.  ``stages``: see
    :func:`parser`."""
    args = parser(stages).parse_args(argv)
    try:
        if args.command == "compare":
            from .course.commands.compare import main as run
        elif args.command == "soak":
            from .course.commands.soak import main as run
        elif args.command == "memory":
            from .course.commands.memory_table import main as run
        elif args.command == "lab":
            from .course.labs.cli import lab_main as run
        elif args.command == "check":
            from .course.labs.cli import check_main as run
        elif args.command == "scale":
            from .course.commands.scale import main as run
        elif args.command == "train":
            from .course.commands.train_command import main as run
        elif args.command == "roofline":
            from .course.commands.roofline import main as run
        elif args.command == "compress-study":
            from .course.commands.compress_study import main as run
        elif args.command == "verify":
            from .course.commands.verify import main as run
        else:
            from .course.commands.bench import main as run
        status, text = run(args)
    except ValueError as error:  # refused before anything ran (a CheckpointError is one): bad input, exit 2
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RankError as error:  # the run failed on a rank: its verdict, not 40 lines of two processes' stacks
        print(rank_error_verdict(error, debug=getattr(args, "debug", False)), file=sys.stderr, flush=True)
        return 1
    try:
        if text:
            print(text, flush=True)
    except BrokenPipeError:
        # The reader went away (`... --json | head`): it has what it wanted, and the status stands.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``python -m minizero compare|bench ...``."""
from __future__ import annotations

import argparse
import sys

from .stages import STAGES


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m minizero", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)

    compare = sub.add_parser("compare", help="run stages against single-device training; exit 1 if any differs")
    compare.add_argument("--world-size", type=int, default=2)
    compare.add_argument("--stages", default="ddp", help=f"comma-separated, from: {', '.join(STAGES)}")
    compare.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    compare.add_argument("--steps", type=int, default=5)
    compare.add_argument("--task", choices=["gpt", "mlp", "edge", "dyadic"], default="gpt")
    compare.add_argument("--optimizer", choices=["sgd", "momentum", "nesterov", "adam", "adamw"], default="adamw")
    compare.add_argument("--lr", type=float, default=1e-3)
    compare.add_argument("--micro-batch", type=int, default=4, help="samples per rank per micro-batch")
    compare.add_argument("--accum", type=int, default=1, help="K micro-batches per optimizer step")
    compare.add_argument("--compress", choices=["none", "fp16", "bf16"], default="none",
                         help="send gradients in 16 bits")
    compare.add_argument("--error-feedback", action="store_true", help="carry the compression error to the next step")
    compare.add_argument("--bucket-mb", type=float, default=None, help="bucket size of ddp-bucketed, zero2 (default 25)")
    compare.add_argument("--clip", type=float, default=None, help="clip the global L2 gradient norm to this")
    compare.add_argument("--backend", choices=["ring", "native"], default="ring")
    compare.add_argument("--seed", type=int, default=0)
    compare.add_argument("--json", action="store_true")

    bench = sub.add_parser("bench", help="speed against torch's own implementation, as ratios")
    bench.add_argument("what", choices=["collectives", "ddp", "zero", "zero3", "overlap"])
    bench.add_argument("--world-size", type=int, default=2)
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--json", action="store_true")
    return top


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "compare":
            from .compare import main as run
        else:
            from .bench import main as run
        return run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

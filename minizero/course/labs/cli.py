"""``python -m minizero lab`` (start a lab) and ``python -m minizero check`` (judge it)."""
from __future__ import annotations

import functools

from ...parts.precision import PRECISIONS
from . import LABS, LEVELS, check, start
from .check import DEADLINE_S


def add_commands(sub) -> None:
    lab = sub.add_parser("lab", help="copy a lab's skeleton to a file of yours; --list: the labs")
    lab.add_argument("name", nargs="?", choices=list(LABS))
    lab.add_argument("to", nargs="?", help="where to copy it (default lab_<name>.py here; never overwritten)")
    lab.add_argument("--level", choices=list(LEVELS), default=LEVELS[0],
                     help="contract (default): each method's contract and the properties that judge it; "
                          "guided: also what to do and which parts of minizero exist for it")
    lab.add_argument("--list", action="store_true")
    judge = sub.add_parser("check", help="judge a lab with the package's own property tests; exit 1 if one fails")
    judge.add_argument("name", choices=list(LABS))
    judge.add_argument("--impl", help="your file (default: the package's own stage -- the answer key)")
    judge.add_argument("--examples", type=int, default=25, help="drawn examples per property (derandomized)")
    judge.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                       help="check the stage in mixed precision (bf16/fp16: fp32 masters, 16-bit working copy)")
    judge.add_argument("--deadline", type=float, default=DEADLINE_S, metavar="SECONDS",
                       help=f"stop a rank that spends this long in no collective -- your code looping, at import or "
                            f"in a method -- and say where it was (default {DEADLINE_S:g})")


def lab_main(args) -> tuple[int, str]:
    if args.list or args.name is None:
        width = max(map(len, LABS)) + 2
        return 0, "\n".join(f"{name:<{width}}{lab.title}  ({lab.lesson}; you write {', '.join(lab.todo)})"
                            for name, lab in LABS.items())
    try:
        path = start(args.name, args.to, args.level)
    except FileExistsError as error:
        raise ValueError(str(error)) from None
    other = next(level for level in LEVELS if level != args.level)
    return 0, (f"{path}: lab {args.name}'s skeleton, {args.level} level. Write {', '.join(LABS[args.name].todo)}, "
               f"then:\n  python -m minizero check {args.name} --impl {path}\n"
               f"{OTHER_LEVEL[other]}:\n  python -m minizero lab {args.name} ANOTHER_FILE --level {other}")


#: What the lab command says of the level not taken.
OTHER_LEVEL = {"guided": "Stuck? The guided level adds hints -- what to do, and which parts of minizero exist for it",
               "contract": "The contract level states only what each method must do and the properties that judge it"}


def check_main(args) -> tuple[int, str]:
    if args.examples < 1:
        raise ValueError(f"--examples must be at least 1, got {args.examples}")
    if not args.deadline > 0:
        raise ValueError(f"--deadline must be more than 0 seconds, got {args.deadline:g}")
    try:
        report = check(args.name, args.impl, examples=args.examples, out=functools.partial(print, flush=True),
                       precision=args.precision, deadline_s=args.deadline)
    except FileNotFoundError as error:
        raise ValueError(str(error)) from None
    return (0 if report.ok else 1), ""

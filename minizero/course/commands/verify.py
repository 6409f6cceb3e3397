"""``python -m minizero verify path.py:make_wrapper``: is this data-parallel wrapper single-device training?

Exit 0 when every drawn example equals single-device training; 1 with the smallest failing case, in words; 2 for
a factory that cannot be loaded (:mod:`minizero.course.verify`).
"""
from __future__ import annotations

from ...stages.options import positive_float, positive_int
from ..verify import verify
from ..verify.run import DEADLINE_S


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="run the equivalence suite on your data-parallel wrapper (a factory "
                                      "make_wrapper(module, group) in a file); exit 1 with the smallest failing case")
    p.add_argument("factory", help="path/to/file.py:make_wrapper (the name defaults to make_wrapper)")
    p.add_argument("--examples", type=positive_int, default=25, help="drawn examples (derandomized: a failure replays)")
    p.add_argument("--world-sizes", default="1,2,3,4", help="comma-separated world sizes to draw from")
    p.add_argument("--every-order", action="store_true",
                   help="also draw backwards that do not each follow their own forward: forwards then backwards, a "
                        "backward twice on a retained graph, forwards inside and outside no_sync() before both "
                        "backwards, one backward of their sum (torch's DDP fails three: docs/verify.md, finding 3)")
    p.add_argument("--deadline", type=positive_float, default=DEADLINE_S, metavar="SECONDS",
                   help=f"stop an example whose ranks run this long, and say where each was (default {DEADLINE_S:g})")


def world_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 or n > 8 for n in sizes):
        raise ValueError(f"--world-sizes {text!r}: comma-separated whole numbers from 1 to 8, as 1,2,3,4")
    return sizes


def main(args) -> tuple[int, str]:
    sizes = world_sizes(args.world_sizes)
    try:
        verdict = verify(args.factory, examples=args.examples, world_sizes=sizes, deadline_s=args.deadline,
                         every_order=args.every_order)
    except FileNotFoundError as error:
        raise ValueError(str(error)) from None
    return (0 if verdict.ok else 1), str(verdict)

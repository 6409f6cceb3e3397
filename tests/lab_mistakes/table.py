"""The checker run on every planted mistake, as a markdown table: ``python -m tests.lab_mistakes.table [LAB...]``.

One row per file: the lab, the mistake, whether it was caught, the property that failed (and whether it is the one
:data:`~tests.lab_mistakes.EXPECTED` names), the seconds to the verdict, and the verdict's first line -- what a
learner reads first.  Every file is searched as a learner's run searches (the checker's default number of drawn
examples), with the short shrink of ``tests/test_lab_mistakes.py``; one pool of ranks for the whole table.
"""
from __future__ import annotations

import sys
import time

from minizero.course.labs import check
from minizero.run.pools import RankPools

from . import CHECKERS_DEFAULT, SHRINK_S, expected, key_of, lab_of, planted


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def main(argv: list[str]) -> int:
    files = planted(argv or None)
    if not files:
        print(f"no planted mistakes for {' '.join(argv)}", file=sys.stderr)
        return 2
    print("| lab | mistake | caught | property failed | s | the verdict's first line |")
    print("|---|---|---|---|---|---|")
    caught = 0
    pools = RankPools(timeout_s=8.0)
    try:
        for path in files:
            start = time.monotonic()
            report = check(lab_of(path), impl=path, examples=CHECKERS_DEFAULT, pools=pools, out=lambda _: None,
                           shrink_s=SHRINK_S)
            seconds = time.monotonic() - start
            want = expected(key_of(path))
            failed = report.failed or "-"
            if report.failed and report.failed not in want:
                failed += f" (expected: {' or '.join(want)})"
            caught += not report.ok
            first = report.why.splitlines()[0] if report.why else ""
            print(f"| {lab_of(path)} | {path.stem} | {'no' if report.ok else 'yes'} | {_cell(failed)} | "
                  f"{seconds:.1f} | {_cell(first)} |", flush=True)
    finally:
        pools.close()
    print(f"\n{caught} of {len(files)} caught.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The library's reading targets (issue 44), measured and printed: ``python scripts/targets.py``.

* no library file over 300 lines;
* no run of six lines repeated in the library;
* the library lines a reader opens to follow one training step (the files the step runs a line of, traced on two
  ranks, outside comm/ and the training loop): zero2 at most 1,300, zero3 at most 1,600 -- and, for the record,
  every core stage's.

The measurements are :mod:`minizero.course.harness.reading_targets`'s; ``tests/test_targets.py`` holds them.
Exit status 1 if a target is missed.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minizero.course.harness.reading_targets import (  # noqa: E402
    MAX_FILE_LINES,
    MIN_RUN,
    STEP_LINES,
    library_files,
    long_files,
    repeated_runs,
    step_lines,
)
from minizero.course.harness.step_trace import step_files  # noqa: E402
from minizero.run.launch import RankPool  # noqa: E402

STAGES = ("ddp", "ddp-bucketed", "zero1", "zero2", "zero3", "hsdp")


def main() -> int:
    missed = []
    files = library_files()
    print(f"library: {len(files)} files, {sum(len(p.read_text().splitlines()) for p in files):,} lines")
    long = long_files()
    print(f"\nfiles over {MAX_FILE_LINES} lines: {len(long)}")
    for name, n in sorted(long.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<40} {n:>5}")
    missed += [f"{name} has {n} lines" for name, n in long.items()]
    runs = repeated_runs()
    print(f"\nruns of {MIN_RUN} or more lines repeated: {len(runs)}")
    for a, b in runs:
        print(f"  {a}  ~  {b}")
    missed += [f"{a} repeats {b}" for a, b in runs]
    print("\none training step (GPT, N = 2, traced): the library files it runs a line of, outside comm/ and run/train.py")
    with RankPool(2) as pool:
        for stage in STAGES:
            total, opened = step_lines(step_files(2, stage, pool=pool, task="gpt", dtype="float32"))
            target = STEP_LINES.get(stage)
            verdict = "" if target is None else f"   target {target:,}: {'met' if total <= target else 'MISSED'}"
            print(f"  {stage:<13} {len(opened):>2} files, {total:>5,} lines{verdict}")
            print("      " + ", ".join(f"{name} {n}" for name, n in sorted(opened.items(), key=lambda kv: -kv[1])))
            if target is not None and total > target:
                missed.append(f"{stage}'s step opens {total} lines (target {target})")
    print("\n" + ("every target met" if not missed else "missed:\n  " + "\n  ".join(missed)))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

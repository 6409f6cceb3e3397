"""The library reads in small pieces, and the suite holds it (issue 44; ``python scripts/targets.py`` prints it all).

* no library file over 300 lines;
* no run of six lines repeated anywhere in the library;
* one training step of zero2 opens at most 1,300 library lines, zero3 at most 1,600 (the whole files the step runs a
  line of, traced on two ranks, outside ``comm/`` and the training loop).

Each measure is shown able to fail: a repeat planted in two files is found, a file of 301 lines is named, and the
trace sees the stage's own file, the bucket pipeline and the collectives the communication thread runs.
"""
from __future__ import annotations

import pytest

from minizero.course.harness import reading_targets
from minizero.course.harness.reading_targets import STEP_LINES, long_files, repeated_runs, step_lines
from minizero.course.harness.step_trace import step_files


def test_no_library_file_is_over_300_lines():
    assert long_files() == {}, "split these by idea: " + ", ".join(f"{n} ({k} lines)" for n, k in long_files().items())


def test_a_long_file_is_named(tmp_path, monkeypatch):
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "long.py").write_text("x = 1\n" * 301)
    (tmp_path / "stages" / "short.py").write_text("x = 1\n" * 300)
    monkeypatch.setattr(reading_targets, "LIBRARY", tmp_path)
    assert long_files() == {"stages/long.py": 301}


def test_no_run_of_six_lines_is_repeated():
    assert repeated_runs() == [], "write these once and call them by name"


def test_a_repeated_run_is_found_and_a_shorter_one_is_not(tmp_path):
    body = [f"    total += step_{i}(value)" for i in range(6)]
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("\n".join(["def f(value):", "    total = 0", *body, "    return total"]) + "\n")
    b.write_text("\n".join(["import os", "", "def g(value):", "    # a comment", *body, "    return -total"]) + "\n")
    c.write_text("\n".join(["def h(value):", *body[:5], "    return total"]) + "\n")
    assert repeated_runs([a, b]) == [("a.py:3-8", "b.py:5-10")]  # the import and the comment are passed over
    assert repeated_runs([a, c]) == []  # five lines are not a run


@pytest.mark.parametrize("stage", sorted(STEP_LINES))
def test_one_step_opens_at_most_its_target(pools, stage):
    traced = step_files(2, stage, pool=pools.pool(2), task="gpt", dtype="float32")
    total, opened = step_lines(traced)
    assert total <= STEP_LINES[stage], (f"one {stage} step opens {total} library lines (target {STEP_LINES[stage]}): "
                                        f"{sorted(opened.items(), key=lambda kv: -kv[1])}")
    # the trace sees what a step runs: the stage's file, the bucket pipeline, and the collectives on the comm thread
    assert f"stages/{stage}.py" in opened and "parts/buckets.py" in opened, opened
    assert "comm/ring.py" in traced and "comm/thread.py" in traced, sorted(traced)

"""The efficiency bench's structure (no timing assertions): every stage has a row, its bound is at least its
compute and at least the wire time its schedule cannot overlap away, the fractions are positive and finite, and
bad input is refused before ranks are spawned."""
from __future__ import annotations

import math

import pytest

from minizero.comm.network import parse_network
from minizero.costs.cost_model import predict
from minizero.course.commands.efficiency import _base, bench_efficiency, bound, format_efficiency, stage_options
from minizero.course.commands.scale import measured_plan
from minizero.observe.timeline import StepTimeline
from minizero.stages import STAGES

TINY = {"d_model": 16, "n_layer": 2, "n_head": 2, "block_size": 8}


@pytest.fixture(scope="module")
def rows():
    return bench_efficiency(2, "lesson", steps=3, rounds=2, model=TINY)


def test_every_stage_has_a_row_with_one_measurement_per_round(rows):
    assert [r["name"] for r in rows] == ["ddp", "ddp-bucketed", "zero1", "zero2", "zero3", "zeropp", "hsdp"]
    assert all(len(r["measured_ms"]) == 2 and r["preset"].startswith("lesson (alpha=2ms") for r in rows)
    ahead = {"prefetch": 1, "reduce_scatter_buffers": 2}
    assert {r["name"]: r["options"] for r in rows} == {"ddp": {}, "ddp-bucketed": {"bucket_mb": 0.5},
                                                       "zero1": {"bucket_mb": 0.5, "overlap": True},
                                                       "zero2": {"bucket_mb": 0.5, "reduce_scatter_buffers": 2},
                                                       "zero3": ahead, "zeropp": ahead, "hsdp": ahead}
    # N=2: ddp's one all-reduce is 2 ring messages, zero1's reduce-scatter and all-gather 1 each
    assert {r["name"]: r["messages"] for r in rows if r["name"] in ("ddp", "zero1")} == {"ddp": 2, "zero1": 2}


def test_the_bound_holds_compute_and_the_unhideable_wire(rows):
    for r in rows:
        assert r["compute_ms"] > 0 and r["unhidden_ms"] > 0 and 0 < r["loopback_ms_per_message"] < math.inf, r
        assert r["bound_ms"] >= r["compute_ms"] and len(r["bounds_ms"]) == 2
        # the communication thread runs one collective at a time and every step waits for the last:
        # the step is never shorter than the wire's total
        assert r["bound_ms"] >= r["wire_ms"] - 1e-9, r


def test_fractions_are_positive_finite_and_ordered(rows):
    for r in rows:
        assert 0 < r["fraction_min"] <= r["fraction"] <= r["fraction_max"] and math.isfinite(r["fraction_max"]), r
        per_round = sorted(b / m for b, m in zip(r["bounds_ms"], r["measured_ms"], strict=True))
        assert [r["fraction_min"], r["fraction_max"]] == pytest.approx([per_round[0], per_round[-1]])


def test_the_time_beyond_the_bound_adds_up(rows):
    """+compute, +exposed and other sum to the measured step less the bound (medians of sums, one round)."""
    one = bench_efficiency(2, "lesson", steps=2, rounds=1, model=TINY, stages=["ddp"])[0]
    beyond = one["extra_compute_ms"] + one["extra_exposed_ms"] + one["other_ms"]
    assert beyond == pytest.approx(one["measured_ms"][0] - one["bound_ms"])


def test_the_table_names_every_stage_and_the_wire(rows):
    text = format_efficiency(rows)
    assert "lesson (alpha=2ms, bandwidth=50MB/s)" in text and "N=2" in text
    for name in stage_options():
        assert any(line.split()[0] == name for line in text.splitlines()[3:]), name


def test_the_bound_takes_the_slowest_ranks_median_and_drops_the_first_step():
    """Synthetic timelines: rank 1 is slower; the first step (warm-up) is huge and must not count."""
    def step(scale, first=False):
        k = 100 if first else scale
        return StepTimeline(compute=[("forward", 0, 0.001 * k), ("backward", 0.001 * k, 0.003 * k),
                                     ("optimizer step", 0.003 * k, 0.004 * k)])
    quiet = [[step(1, True), step(1)], [step(2, True), step(2)]]
    exp = _base("ddp", 3, TINY)
    got = bound(exp, 2, "lesson", quiet)
    want = predict(STAGES["ddp"], measured_plan(exp, 2, parse_network("lesson"), 0.002, 0.004, 0.002))
    assert got["compute_ms"] == pytest.approx(8.0)
    assert got["bound_ms"] == pytest.approx(want.step_s * 1e3) and got["wire_ms"] == pytest.approx(want.comm_s * 1e3)


@pytest.mark.parametrize("kwargs, words", [
    ({"network": "lessons"}, "unknown network preset 'lessons'"),
    ({"network": "alpha=2ms"}, "has no bandwidth"),
    ({"stages": ["ps"]}, "stage 'ps' has no efficiency row"),
    ({"world_size": 1}, "give 2 or more ranks"),
    ({"steps": 1}, "first step is warm-up"),
])
def test_bad_input_is_refused_by_name(kwargs, words):
    args = {"world_size": 2, **kwargs}
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        bench_efficiency(**args)

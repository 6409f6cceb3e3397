"""The benches' measurement method (minizero.course.harness.rounds) and the machine's record (minizero.course.harness.machine),
checked on synthetic times and texts: known ratios give the right verdict, a straddling interval gives
none, the seed makes it all repeatable, and a busy machine is flagged.  No timing is asserted."""
from __future__ import annotations

import pytest

from minizero.course.harness import machine, rounds
from minizero.course.harness.rounds import FEWEST_ROUNDS, compare, fewest_rounds, held, interval, measure_rounds, orders, verdict


def _times(ratios: list[float], base: float = 10.0) -> tuple[list[float], list[float]]:
    return [base * r for r in ratios], [base] * len(ratios)


@pytest.mark.parametrize("ratios, expected", [
    ([0.80, 0.82, 0.78, 0.81, 0.79, 0.80, 0.83], "faster"),
    ([1.30, 1.25, 1.28, 1.33, 1.27, 1.29, 1.31], "slower"),
    ([1.00, 1.01, 0.99, 1.02, 0.98, 1.00, 1.01], "same within 5%"),
])
def test_known_ratios_give_the_right_verdict(ratios, expected):
    result = compare(*_times(ratios))
    assert result["verdict"] == expected
    low, high = result["interval"]
    assert low <= result["ratio"] <= high
    assert min(ratios) <= low and high <= max(ratios)
    assert result["rounds"] == len(ratios) and result["round_ratios"] == pytest.approx(ratios)


def test_an_interval_that_straddles_the_band_gives_no_verdict():
    result = compare(*_times([0.7, 1.3, 0.9, 1.2, 0.8, 1.1, 1.0]))
    assert result["verdict"] == "inconclusive on this machine: run with more rounds"
    low, high = result["interval"]
    assert low < 0.95 and high > 1.0


def test_the_verdict_follows_the_interval_not_the_ratio():
    assert verdict(0.90, 0.949) == "faster" and verdict(0.90, 0.951).startswith("inconclusive")
    assert verdict(1.051, 1.2) == "slower" and verdict(1.049, 1.2).startswith("inconclusive")
    assert verdict(0.95, 1.05) == "same within 5%"
    assert verdict(0.97, 1.03, tolerance=0.02).startswith("inconclusive")


def test_the_median_is_the_median_of_per_round_ratios_not_of_times():
    # Per-round ratios 0.5, 0.5, 8: median 0.5.  The ratio of the medians would be 20/10 = 2.
    result = compare([5.0, 20.0, 80.0], [10.0, 40.0, 10.0])
    assert result["ratio"] == 0.5


def test_the_interval_is_the_kth_smallest_to_kth_largest_ratio_and_says_what_it_holds():
    """Each bound an order statistic, k chosen by the exact coverage 1 - 2 P(Binomial(n, 1/2) < k) >= 95%."""
    assert held(6, 1) == 1 - 2 / 64 and held(7, 2) == 1 - 2 * 8 / 128 and held(9, 2) == 1 - 2 * 10 / 512
    assert held(5, 1) < 0.95 <= held(6, 1) and FEWEST_ROUNDS == 6 == fewest_rounds(0.95) and fewest_rounds(0.99) == 8
    ratios = [0.9, 1.1, 1.0, 0.95, 1.2, 0.85]
    assert interval(ratios) == (0.85, 1.2, 1 - 2 / 64)  # 6 rounds: the smallest to the largest, 96.9%
    nine = [1.3, 0.7, 1.0, 0.9, 1.2, 0.8, 1.1, 0.95, 1.05]
    assert interval(nine) == (0.8, 1.2, 1 - 2 * 10 / 512)  # 9 rounds: the second ones, 96.1%
    twelve = [0.5 + 0.1 * i for i in range(12)]
    low, high, holds = interval(twelve)  # 12 rounds: the third ones, 96.1% (the fourth would hold 85.4%)
    assert (low, high) == (twelve[2], twelve[9]) and holds == held(12, 3) and held(12, 4) < 0.95 <= holds
    low, high, holds = interval([1.0, 2.0, 3.0])  # below 6 rounds: the widest, and what it holds
    assert (low, high, holds) == (1.0, 3.0, 0.75)
    assert compare(*_times([0.5, 0.6, 0.55]))["verdict"] == "inconclusive: a 75.0% interval; run with 6 rounds or more"
    assert compare(*_times([0.5, 0.6, 0.55, 0.52, 0.58, 0.57]))["verdict"] == "faster"


def test_the_same_seed_gives_the_same_schedule():
    assert orders("abcd", 6, seed=1) == orders("abcd", 6, seed=1)
    assert all(sorted(o) == list("abcd") for o in orders("abcd", 6))
    assert len({tuple(o) for o in orders("abcd", 20)}) > 1  # shuffled per round, not one fixed order


def test_rounds_interleave_every_name_once_per_round_after_an_untimed_warm_up():
    calls = []

    def measure(name):
        calls.append(name)
        return float(len(calls))

    times = measure_rounds(measure, ["a", "b"], 4, seed=0)
    assert calls[:2] == ["a", "b"]  # the warm-up, untimed
    timed = calls[2:]
    assert all(sorted(timed[i:i + 2]) == ["a", "b"] for i in range(0, 8, 2))  # A and B alternate, round by round
    assert sorted(times["a"] + times["b"]) == [float(i) for i in range(3, 11)]  # warm-up times are not kept
    assert len(measure_rounds(measure, ["a"], 3, warmup=False)["a"]) == 3


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_too_few_rounds_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=f"--rounds {bad}: a ratio's interval needs at least 3 rounds"):
        compare([1.0] * bad, [1.0] * bad)
    with pytest.raises(ValueError, match="at least 3 rounds"):
        orders("ab", bad)


def test_mismatched_or_zero_times_are_refused():
    with pytest.raises(ValueError, match="3 times for the stage but 4 for its counterpart"):
        compare([1.0] * 3, [1.0] * 4)
    with pytest.raises(ValueError, match="must be positive"):
        compare([1.0] * 3, [1.0, 0.0, 1.0])


def test_describe_prints_ratio_interval_and_verdict():
    text = rounds.describe({"ratio": 0.934, "interval": [0.881, 1.012], "verdict": "x"})
    assert text == "0.93x [0.88, 1.01] x"


PRESSURE_TEXT = "some avg10=12.50 avg60=3.00 avg300=1.00 total=123\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


def test_pressure_is_read_from_the_some_line():
    assert machine.parse_pressure(PRESSURE_TEXT) == 12.5
    assert machine.parse_pressure("full avg10=50.00 avg60=0 avg300=0 total=0") is None


def test_snapshot_without_a_pressure_file_has_none(tmp_path):
    shot = machine.snapshot(tmp_path / "absent")
    assert shot["cpu_pressure_some_avg10"] is None and shot["load1"] >= 0


def _shot(load1: float, pressure: float | None = None) -> dict:
    return {"load1": load1, "load5": load1, "load15": load1, "cpu_pressure_some_avg10": pressure}


def test_a_busy_machine_is_flagged_at_either_end_and_says_why():
    quiet = machine.state(_shot(0.2, 1.0), _shot(0.4), cores=2)
    assert not quiet["busy"] and "WARNING" not in machine.describe(quiet)
    loaded = machine.state(_shot(0.2), _shot(3.0), cores=2)
    assert loaded["busy"] and loaded["busy_reasons"] == ["after: load 3.00 on 2 cores (> 0.5 per core)"]
    own = machine.state(_shot(0.2), _shot(2.3, 40.0), cores=2, own=2)  # the bench's own 2 ranks: not "busy"
    assert not own["busy"], own["busy_reasons"]
    others = machine.state(_shot(0.2), _shot(3.4), cores=2, own=2)
    assert others["busy_reasons"] == ["after, beyond its 2 ranks: load 1.40 on 2 cores (> 0.5 per core)"]
    pressed = machine.state(_shot(0.1, 25.0), _shot(0.1), cores=2)
    assert pressed["busy_reasons"] == ["before: CPU pressure 25.0% (> 10%)"]
    text = machine.describe(pressed)
    assert text.startswith("WARNING: the machine was busy") and "2 cores" in text
    assert {"torch", "python", "cores", "before", "after"} <= set(pressed)


def test_the_95_percent_interval_holds_the_true_median_ratio_95_percent_of_the_time():
    """What the confidence level produces: per-round ratios drawn from a known distribution (lognormal, median
    exactly 1), the interval computed as every bench computes it, 400 times per round count: it must hold the
    true median as often as it says, within two standard errors of 400 draws -- 95% or more from 6 rounds, and what
    it prints below."""
    import math
    import random
    draws = random.Random(2)
    for n in (3, 5, 6, 7, 9, 12):
        hits, says = 0, None
        for _ in range(400):
            ratios = [math.exp(draws.gauss(0.0, 0.1)) for _ in range(n)]
            low, high, says = interval(ratios)
            hits += low <= 1.0 <= high
        margin = 2 * math.sqrt(says * (1 - says) / 400)
        assert abs(hits / 400 - says) <= margin, f"{n} rounds: says {says:.1%}, held the median {hits / 400:.1%}"
        assert says >= 0.95 or n < 6

"""One measurement method for every bench: interleaved rounds, a median ratio, a bootstrap interval, a verdict.

One run's ratio on a shared machine says little: a few seconds of someone else's work decide it.  So a
stage (A) and its counterpart (B) alternate in rounds -- the order shuffled each round by a seeded RNG, so
neither always runs first or right after the warm-up -- and each round gives one ratio A/B measured minutes,
not runs, apart.  The ratio reported is the median of the per-round ratios; its uncertainty a percentile
bootstrap 95% interval over those ratios (fixed seed: the same times give the same interval).  A verdict is
printed only when the interval allows one; otherwise the honest answer is "run with more rounds".

Everything here is a pure function of the times it is given (the measuring callable is the caller's), so
the statistics are tested on synthetic data, never on timings.
"""
from __future__ import annotations

import random
import statistics
from typing import Callable, Hashable, Sequence

MIN_ROUNDS = 3  # fewer per-round ratios than this and a bootstrap interval is a coin toss
TOLERANCE = 0.05  # x: "same within 5%" when the whole interval lies in [0.95, 1.05]
RESAMPLES = 2000
SEED = 0


def check_rounds(rounds: int) -> int:
    """A count of rounds the method can draw an interval from; else a clear error."""
    if not isinstance(rounds, int) or rounds < MIN_ROUNDS:
        raise ValueError(f"--rounds {rounds}: a ratio's interval needs at least {MIN_ROUNDS} rounds (each round "
                         f"runs the stage and its counterpart once); pass --rounds {MIN_ROUNDS} or more")
    return rounds


def orders(names: Sequence[Hashable], rounds: int, seed: int = SEED) -> list[list]:
    """The order the names run in, one shuffled list per round: the same seed gives the same schedule."""
    check_rounds(rounds)
    rng = random.Random(seed)
    schedule = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        schedule.append(order)
    return schedule


def measure_rounds(measure: Callable[[Hashable], float], names: Sequence[Hashable], rounds: int,
                   seed: int = SEED, warmup: bool = True) -> dict:
    """``measure(name)`` -> seconds, called once per name per round in each round's shuffled order;
    with ``warmup``, once per name first, untimed (connections, allocations, caches).  Returns each
    name's list of times, in round order."""
    schedule = orders(names, rounds, seed)
    if warmup:
        for name in names:
            measure(name)
    times = {name: [0.0] * rounds for name in names}
    for i, order in enumerate(schedule):
        for name in order:
            times[name][i] = measure(name)
    return times


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 1]."""
    at = q * (len(sorted_values) - 1)
    low = int(at)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (at - low)


def bootstrap(ratios: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED,
              confidence: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``ratios``."""
    check_rounds(len(ratios))
    rng, n = random.Random(seed), len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return _percentile(medians, tail), _percentile(medians, 1 - tail)


def verdict(low: float, high: float, tolerance: float = TOLERANCE) -> str:
    """What the interval [low, high] of A/B allows one to say about A against B."""
    if high < 1 - tolerance:
        return "faster"
    if low > 1 + tolerance:
        return "slower"
    if low >= 1 - tolerance and high <= 1 + tolerance:
        return f"same within {tolerance:.0%}"
    return "inconclusive on this machine: run with more rounds"


def compare(a_times: Sequence[float], b_times: Sequence[float], tolerance: float = TOLERANCE,
            seed: int = SEED, resamples: int = RESAMPLES) -> dict:
    """A's times against B's, round by round: the median per-round ratio A/B, its interval and verdict."""
    if len(a_times) != len(b_times):
        raise ValueError(f"{len(a_times)} times for the stage but {len(b_times)} for its counterpart: each round "
                         "must time both")
    check_rounds(len(a_times))
    if any(t <= 0 for t in b_times):
        raise ValueError(f"the counterpart's times must be positive to divide by; got {list(b_times)}")
    ratios = [a / b for a, b in zip(a_times, b_times, strict=True)]
    low, high = bootstrap(ratios, resamples, seed)
    return {"ratio": statistics.median(ratios), "interval": [low, high], "verdict": verdict(low, high, tolerance),
            "tolerance": tolerance, "rounds": len(ratios), "round_ratios": ratios}


def describe(result: dict) -> str:
    """``0.93x [0.88, 1.01] inconclusive ...``: the ratio, its interval and the verdict in one phrase."""
    low, high = result["interval"]
    return f"{result['ratio']:.2f}x [{low:.2f}, {high:.2f}] {result['verdict']}"


METHOD = (f"each stage and its counterpart alternate in rounds (order shuffled per round, seed {SEED}; warm-up "
          f"untimed); ratio = median of per-round ratios, [95% bootstrap interval, {RESAMPLES} resamples]; "
          f"'same' means within {TOLERANCE:.0%}")

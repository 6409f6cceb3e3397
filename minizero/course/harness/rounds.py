"""One measurement method for every bench: interleaved rounds, a median ratio, an exact interval, a verdict.

One run's ratio on a shared machine says little: a few seconds of someone else's work decide it.  So a
stage (A) and its counterpart (B) alternate in rounds -- the order shuffled each round by a seeded RNG, so
neither always runs first or right after the warm-up -- and each round gives one ratio A/B measured minutes,
not runs, apart.  The ratio reported is the median of the per-round ratios; its uncertainty the order-statistic
interval of that median: the k-th smallest to the k-th largest ratio.  Each round's ratio falls below the true
median with probability 1/2, so the number below it is Binomial(n, 1/2) and the interval holds the median with
probability exactly 1 - 2 P(Binomial(n, 1/2) < k), whatever the distribution.  (A percentile bootstrap, used
before, said 95% and held about 85% at 7 rounds: its resampled medians can only land on the ratios themselves.)
Six rounds are the fewest whose widest interval reaches 95% (96.9%); fewer give an interval that says what it
holds, and no verdict.  A verdict is printed only when the interval allows one; otherwise the honest answer is
"run with more rounds".

Everything here is a pure function of the times it is given (the measuring callable is the caller's), so
the statistics are tested on synthetic data, never on timings.
"""
from __future__ import annotations

import math
import random
import statistics
from typing import Callable, Hashable, Sequence

MIN_ROUNDS = 3  # fewer per-round ratios than this and even the widest interval holds the median at most 50%
TOLERANCE = 0.05  # x: "same within 5%" when the whole interval lies in [0.95, 1.05]
CONFIDENCE = 0.95  # what an interval must hold the true median with, for a verdict
SEED = 0  # the rounds' shuffled order


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


def held(n: int, k: int) -> float:
    """How often the k-th smallest to the k-th largest of ``n`` independent ratios holds their true median:
    1 - 2 P(Binomial(n, 1/2) < k) -- the median escapes only if fewer than k ratios fall on one side of it."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n


def fewest_rounds(confidence: float = CONFIDENCE) -> int:
    """The fewest rounds whose widest interval, the smallest to the largest ratio, holds the median ``confidence``
    of the time: 6 for 95% (96.9%; 5 hold 93.8%).  Fewer rounds give an interval, never a verdict."""
    n = MIN_ROUNDS
    while held(n, 1) < confidence:
        n += 1
    return n


FEWEST_ROUNDS = fewest_rounds()


def interval(ratios: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """``(low, high, held)``: the narrowest order-statistic interval of the median of ``ratios`` that holds it at
    least ``confidence`` of the time, and how often it does.  Below six rounds none reaches 95%: the smallest to
    the largest ratio is returned with what it holds (75% at 3, 87.5% at 4, 93.8% at 5)."""
    check_rounds(len(ratios))
    n, ordered = len(ratios), sorted(ratios)
    k = 1
    while k + 1 <= (n + 1) // 2 and held(n, k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], held(n, k)


def verdict(low: float, high: float, tolerance: float = TOLERANCE, holds: float = 1.0,
            confidence: float = CONFIDENCE) -> str:
    """What the interval [low, high] of A/B, holding the true ratio ``holds`` of the time, allows one to say."""
    if holds < confidence:
        return f"inconclusive: a {holds:.1%} interval; run with {FEWEST_ROUNDS} rounds or more"
    if high < 1 - tolerance:
        return "faster"
    if low > 1 + tolerance:
        return "slower"
    if low >= 1 - tolerance and high <= 1 + tolerance:
        return f"same within {tolerance:.0%}"
    return "inconclusive on this machine: run with more rounds"


def compare(a_times: Sequence[float], b_times: Sequence[float], tolerance: float = TOLERANCE) -> dict:
    """A's times against B's, round by round: the median per-round ratio A/B, its interval and verdict."""
    if len(a_times) != len(b_times):
        raise ValueError(f"{len(a_times)} times for the stage but {len(b_times)} for its counterpart: each round "
                         "must time both")
    check_rounds(len(a_times))
    if any(t <= 0 for t in b_times):
        raise ValueError(f"the counterpart's times must be positive to divide by; got {list(b_times)}")
    ratios = [a / b for a, b in zip(a_times, b_times, strict=True)]
    low, high, holds = interval(ratios)
    return {"ratio": statistics.median(ratios), "interval": [low, high], "held": holds,
            "verdict": verdict(low, high, tolerance, holds), "tolerance": tolerance, "rounds": len(ratios),
            "round_ratios": ratios}


def describe(result: dict) -> str:
    """``0.93x [0.88, 1.01] inconclusive ...``: the ratio, its interval and the verdict in one phrase."""
    low, high = result["interval"]
    return f"{result['ratio']:.2f}x [{low:.2f}, {high:.2f}] {result['verdict']}"


METHOD = (f"each stage and its counterpart alternate in rounds (order shuffled per round, seed {SEED}; warm-up "
          f"untimed); ratio = median of per-round ratios, [k-th smallest, k-th largest ratio: an interval holding the "
          f"true median at least {CONFIDENCE:.0%} of the time, from {FEWEST_ROUNDS} rounds]; 'same' means within {TOLERANCE:.0%}")

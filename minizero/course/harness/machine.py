"""The machine's state, recorded beside every bench result: was anything else running?

A ratio measured while other work held the cores is not the ratio of a quiet machine.  The load average
and (where the kernel has it) ``/proc/pressure/cpu`` -- the share of time runnable tasks waited for a CPU
-- are read before and after the run, with the core count and the versions; a run taken while the machine
was busy at either end is flagged, so a reader knows not to quote it as the machine's best.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

LOAD_PER_CORE = 0.5  # busy above this 1-minute load average per core
PRESSURE = 10.0  # busy above this many percent of the last 10 s spent waiting for a CPU
PRESSURE_FILE = Path("/proc/pressure/cpu")


def parse_pressure(text: str) -> float | None:
    """``some avg10=...`` from /proc/pressure/cpu's text, in percent; None if the line is not there."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "some":
            values = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
            if "avg10" in values:
                return float(values["avg10"])
    return None


def snapshot(pressure_file: Path = PRESSURE_FILE) -> dict:
    """The load averages and the CPU pressure now (pressure None where the kernel does not report it)."""
    load = os.getloadavg()
    try:
        pressure = parse_pressure(pressure_file.read_text())
    except OSError:
        pressure = None
    return {"load1": load[0], "load5": load[1], "load15": load[2], "cpu_pressure_some_avg10": pressure}


def busy_reasons(shot: dict, cores: int, load_per_core: float = LOAD_PER_CORE, pressure: float = PRESSURE) -> list[str]:
    """Why this snapshot counts as busy: empty when it does not."""
    reasons = []
    if shot["load1"] / cores > load_per_core:
        reasons.append(f"load {shot['load1']:.2f} on {cores} cores (> {load_per_core:g} per core)")
    if shot["cpu_pressure_some_avg10"] is not None and shot["cpu_pressure_some_avg10"] > pressure:
        reasons.append(f"CPU pressure {shot['cpu_pressure_some_avg10']:.1f}% (> {pressure:g}%)")
    return reasons


def state(before: dict, after: dict, cores: int | None = None, own: int = 0) -> dict:
    """Before and after, the core count, the versions, and whether the machine was busy at either end.

    ``own``: the processes the bench itself kept running (its ranks).  The 1-minute load average read just after
    the run still counts them, and their own contention shows in the pressure, so *after* is judged by the load
    beyond them alone -- else every bench on a small machine would flag itself."""
    import torch

    cores = cores or os.cpu_count() or 1
    beyond = dict(after, load1=max(after["load1"] - own, 0.0), cpu_pressure_some_avg10=None) if own else after
    reasons = [f"{when}: {r}" for when, shot in (("before", before), (f"after, beyond its {own} ranks" if own else
                                                                          "after", beyond))
               for r in busy_reasons(shot, cores)]
    return {"before": before, "after": after, "cores": cores, "own": own, "torch": torch.__version__,
            "python": platform.python_version(), "busy": bool(reasons), "busy_reasons": reasons}


def describe(machine: dict) -> str:
    """One line for the printed result; a warning first when the machine was busy."""
    def load(shot):
        pressure = shot["cpu_pressure_some_avg10"]
        return f"load {shot['load1']:.2f}" + ("" if pressure is None else f", cpu pressure {pressure:.1f}%")
    line = (f"machine: {machine['cores']} cores, torch {machine['torch']}, Python {machine['python']}; "
            f"before {load(machine['before'])}; after {load(machine['after'])}")
    if machine["busy"]:
        line = (f"WARNING: the machine was busy ({'; '.join(machine['busy_reasons'])}): these ratios are not a "
                f"quiet machine's\n{line}")
    return line


class Recorded:
    """``with Recorded(own=N) as rec: ...`` -- a snapshot on entry and on exit; ``rec.state`` after."""

    def __init__(self, own: int = 0):
        self.own = own

    def __enter__(self):
        self.before, self.state = snapshot(), None
        return self

    def __exit__(self, *exc):
        self.state = state(self.before, snapshot(), own=self.own)
        return False

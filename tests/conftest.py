"""Shared test machinery.

* Hypothesis runs derandomized (a fixed seed, no deadline) so a red CI run
  replays exactly; ``MINIZERO_DEEP=1`` (``make test-deep``) draws many more,
  fresh examples for hunting.
* Examples run on a persistent pool of ranks per world size: spawning a
  world costs seconds, running one example on a live pool a few ms.
* Pools use a short stall timeout (``TIMEOUT_S``): an example that hangs fails
  in seconds, naming the rank that stopped, instead of after minutes.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from minizero.launch import RankPools
from tests.faults import TIMEOUT_S as FAULT_TIMEOUT_S
from tests.faults import TORCHRUN_FAULTS

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=30, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("deep", derandomize=False, deadline=None, max_examples=600, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("deep" if os.environ.get("MINIZERO_DEEP") else "ci")


TIMEOUT_S = 8.0  # seconds a collective may go without progress in the suite


def _on_rank(me, action, name):
    from tests import patch_mutants
    getattr(patch_mutants, action)(name)


class Pools(RankPools):
    """The suite's pools, with mutants that can be put in place in every rank."""

    def __init__(self):
        super().__init__(timeout_s=TIMEOUT_S)

    @contextmanager
    def patched(self, name: str):
        """Mutant ``name`` in place here and in every rank -- live pools now, and pools forked while it
        is in place (they inherit it) -- then taken out everywhere."""
        from tests import patch_mutants
        patch_mutants.apply(name)
        try:
            for pool in self.live().values():
                pool.run(_on_rank, "apply", name)
            yield
        finally:
            patch_mutants.undo(name)
            for pool in self.live().values():
                pool.run(_on_rank, "undo", name)


#: Modules none of whose tests measures time: their results are the same on a busy CPU, only later, so
#: ``pytest -m "not alone"`` may run them beside other work (the lessons, say).  Every other module is marked
#: ``alone``: the dialled wire, overlap, the cost model, the launcher's and the faults' stall timeouts, the
#: mutants, test_robustness (it sleeps for launched work to finish), test_train_command (it shares test_launch's
#: torchrun launch) -- and any module not listed here.  List a new module only if none of its assertions
#: depends on how long anything takes.  (`make test` runs the suite, then the lessons, one after the other.)
BESIDE_THE_LESSONS = {
    "test_architecture", "test_bad_input", "test_bench_all", "test_bucketed", "test_checkpoint", "test_cli", "test_comm",
    "test_compression", "test_contrast_stages", "test_ddp_equivalence", "test_docs", "test_fingerprint", "test_labs",
    "test_lesson_claims", "test_new_stage", "test_optimizer_semantics", "test_oracle", "test_precision", "test_stall",
    "test_torch_conventions", "test_train_loop", "test_zero", "test_zero3",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: measures time; `make test` runs it after the lessons and the rest")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] not in BESIDE_THE_LESSONS:
            item.add_marker(pytest.mark.alone)


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()


# ------------------------------------------------------------------------------- torchrun
#: Commands that must run unchanged under torchrun, each checked by its own test (tests/test_launch.py: compare,
#: tests/test_train_command.py: train).  A launch costs seconds before the first line of the command (torchrun's
#: agent and two ranks, each importing torch), so they share one: both run, in turn, in the same two ranks.
TORCHRUN_COMMANDS = {
    "compare": ["compare", "--stages", "ddp,zero2", "--steps", "2", "--task", "mlp", "--timeout", "30",
                "--world-size", "3"],
    "train": ["train", "--model", "tiny", "--batch-size", "12", "--log-every", "2", "--stage", "zero2", "--backend",
              "gloo", "--steps", "3", "--timeout", "30", "--save", "ck"],
}

# What `python -m minizero COMMAND` runs, once per command; rank 0 marks where each one's output begins.
_IN_TURN = """
import os, runpy, sys
for name, *command in (line.split("\\x1f") for line in sys.argv[1:]):
    if os.environ["RANK"] == "0":
        print(f"=== {name}", flush=True)
    sys.argv = ["minizero", *command]
    try:
        runpy.run_module("minizero", run_name="__main__", alter_sys=True)
    except SystemExit as end:
        if end.code:
            raise
"""


@dataclass
class Launched:
    returncode: int
    stdout: str  # both ranks' (torchrun passes them on), unbuffered: in the order they were written
    stderr: str
    cwd: object  # the directory it ran in (a pathlib.Path)
    elapsed_s: float  # from the launch to torchrun's exit

    def section(self, name: str) -> str:
        """What was printed from rank 0's mark for command ``name`` to the next mark."""
        after = self.stdout.split(f"=== {name}\n", 1)[-1]
        return after.split("\n=== ", 1)[0]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


def _launches(tmp: Path) -> dict[str, tuple[list[str], Path]]:
    """Every torchrun launch of the suite: name -> (command, directory it runs in)."""
    (tmp / "in_turn.py").write_text(_IN_TURN)
    faults = Path(__file__).with_name("faults.py")
    return {"commands": (torchrun("in_turn.py", *("\x1f".join([name, *command])
                                                 for name, command in TORCHRUN_COMMANDS.items())), tmp),
            **{f"fault {fault} {place}": (torchrun(str(faults), fault, place, str(FAULT_TIMEOUT_S)), tmp)
               for fault, place in TORCHRUN_FAULTS}}


class Launches:
    """The torchrun launches, started together in the background as the session begins -- each is seconds of
    torchrun's agent and two ranks importing torch, mostly waiting -- and collected by the tests that check
    them.  Each writes to files (a pipe nobody reads would fill and stop it) and is timed by its own waiter."""

    def __init__(self, tmp: Path):
        self._running = {}
        for name, (cmd, cwd) in _launches(tmp).items():
            out, err = (open(tmp / f"{name}.{kind}", "w+") for kind in ("out", "err"))
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                         "PYTHONPATH": str(Path(__file__).parent.parent)})
            timing = {"start": time.monotonic()}
            waiter = threading.Thread(target=self._time, args=(proc, timing), daemon=True)
            waiter.start()
            self._running[name] = (proc, out, err, cwd, timing, waiter)

    @staticmethod
    def _time(proc: subprocess.Popen, timing: dict) -> None:
        proc.wait()
        timing["end"] = time.monotonic()

    def result(self, name: str, timeout_s: float = 180) -> Launched:
        proc, out, err, cwd, timing, waiter = self._running[name]
        waiter.join(max(0.0, timing["start"] + timeout_s - time.monotonic()))
        if waiter.is_alive():
            proc.kill()
            pytest.fail(f"torchrun launch {name!r} still running after {timeout_s:.0f} s")
        out.seek(0), err.seek(0)
        return Launched(proc.returncode, out.read(), err.read(), cwd, timing["end"] - timing["start"])

    def close(self):
        for proc, out, err, *_ in self._running.values():
            if proc.poll() is None:
                proc.kill()
            out.close(), err.close()


@pytest.fixture(scope="session")
def launches(tmp_path_factory):
    """Started by the first test that asks -- and, when any collected test asks, as the session begins."""
    started = Launches(tmp_path_factory.mktemp("torchrun"))
    yield started
    started.close()


def pytest_collection_finish(session):
    if any("launches" in item.fixturenames or "under_torchrun" in item.fixturenames for item in session.items):
        session.config._start_launches = True


@pytest.fixture(scope="session", autouse=True)
def _launch_early(request):
    """Start the torchrun launches before the first test, so they run while the rest of the suite does."""
    if getattr(request.config, "_start_launches", False):
        request.getfixturevalue("launches")


@pytest.fixture(scope="session")
def under_torchrun(launches) -> Launched:
    """Every command of :data:`TORCHRUN_COMMANDS`, in turn, in one ``torchrun --standalone --nproc-per-node 2``."""
    return launches.result("commands")

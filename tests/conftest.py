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

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from minizero.run.pools import RankPools

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=30, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("deep", derandomize=False, deadline=None, max_examples=600, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("deep" if os.environ.get("MINIZERO_DEEP") else "ci")


TIMEOUT_S = 8.0  # seconds a collective may go without progress in the suite


def _on_rank(me, action, name):
    from tests.mutation import register
    getattr(register, action)(name)


class Pools(RankPools):
    """The suite's pools, with mutants that can be put in place in every rank."""

    def __init__(self):
        super().__init__(timeout_s=TIMEOUT_S)

    @contextmanager
    def patched(self, name: str):
        """Mutant ``name`` in place here and in every rank -- live pools now, and pools forked while it
        is in place (they inherit it) -- then taken out everywhere."""
        from tests.mutation import register
        register.apply(name)
        try:
            for pool in self.live().values():
                pool.run(_on_rank, "apply", name)
            yield
        finally:
            register.undo(name)
            for pool in self.live().values():
                pool.run(_on_rank, "undo", name)


#: Modules none of whose tests measures time: their results are the same on a busy CPU, only later, so
#: ``pytest -m "not alone and not waits"`` may run them beside other work (the lessons, say).  Every other module
#: is marked ``waits`` (:data:`BOUNDED_WAITS`: the launcher's and the faults' stall timeouts, the checker's
#: deadlines, test_robustness, which sleeps for launched work to finish, test_train_command, which shares
#: test_launch's torchrun launch) or ``alone``: the dialled network, overlap, the cost model, the mutants -- and
#: any module not listed.  List a new module only if none of its assertions depends on how long anything takes.
#: (`make test` runs the ``alone`` modules one test at a time, then these, the ``waits`` and the lessons together,
#: two at a time.)
BESIDE_THE_LESSONS = {
    "test_architecture", "test_bad_input", "test_bench_all", "test_bucketed", "test_checkpoint", "test_cli", "test_comm",
    "test_compression", "test_contrast_stages", "test_ddp_equivalence", "test_docs", "test_fingerprint", "test_labs",
    "test_lesson_claims", "test_new_stage", "test_optimizer_semantics", "test_oracle", "test_precision", "test_stall",
    "test_torch_conventions", "test_train_loop", "test_zero", "test_zero3", "test_wrapped_optimizer_state", "test_codec_chunks",
    "test_clip_and_dropout_resume", "test_checkpoint_safety", "test_stage_options", "test_fsdp2_idioms", "test_peak_guess",
    "test_tp_exercise", "test_trace_exercise", "test_search",
    # the labs' checker: its verdicts are words about values, bytes and calls, never about how long anything took
    "test_lab_checker", "test_lab_mistakes", "test_lab_tree", "test_lab_reshard", "test_lab_mixed_precision",
    "test_lab_local_sgd", "test_lab_hierarchical", "test_lab_reading",
    # topology: values and bytes per link class (the dialled timings are test_network's, alone)
    "test_hierarchical", "test_hsdp",
    # the step's memory: checkpointing, offload, the predicted peak -- values, bytes and calls
    "test_activation_checkpointing", "test_step_memory", "test_offload",
    # what the lessons print and draw: structure, names and bytes, never time
    "test_lesson_outputs", "test_production_names", "test_parallelism", "test_lesson_overlap",
    "test_lesson_ring_pictures", "test_lesson_layout", "test_lesson_prose", "test_lesson_debug_flags", "test_lesson_zero2_backward",
    "test_stage_lifetime", "test_bench_method", "test_efficiency", "test_gpu_run",
    # compression beyond 16 bits: values, bytes and the break-even formulas (compute is timed there, never compared)
    "test_codecs", "test_powersgd", "test_break_even", "test_compress_study", "test_quantized_weights",
    # the roofline: formulas and the noise scale's norms, never time; ring attention and experts: values and bytes
    "test_roofline", "test_context_and_expert_parallel",
    # 1-bit Adam in one process: values and bytes
    "test_one_bit_adam",
    # orders of forwards and backwards, routed branches, policies as objects, the reading targets: values and lines
    "test_sync_patterns", "test_routed", "test_policies", "test_targets",
}


#: Modules whose assertions about time are *bounded waits*: a stall named within its timeout, a deadline that stops
#: a looping rank, a launch that ends, a healthy run that outlives its timeout because it keeps moving.  On a busy
#: machine their clocks run out the same, only later, and every bound has seconds of margin -- so `make test` runs
#: them beside the rest and the lessons, apart from the modules that compare durations (the dialled network,
#: overlap, the cost model, the mutants), which run one at a time.  ``torchrun``: the modules sharing one torchrun
#: launch (a session fixture), kept on one worker.
BOUNDED_WAITS = {"test_faults", "test_check_bounded", "test_launch", "test_robustness", "test_torchrun_shutdown",
                 "test_verdicts", "test_train_command", "test_verify"}
SHARING_A_TORCHRUN_LAUNCH = {"test_launch", "test_train_command"}
#: Lessons run alone, first: 18 measures every stage's step as malloc sees it (three spawned ranks sampling the heap after
#: every operator) -- 22 s on two idle cores, past its cell's 300 s beside two other workers; 99 times every stage on a
#: dialled wire (the overlap each one wins) -- 25 s alone, past 300 s in one cell beside them.
LESSONS_ALONE = {"18_will_it_fit.ipynb", "99_summary.ipynb"}


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: measures time; `make test` runs it one test at a time, first")
    config.addinivalue_line("markers", "waits: a bounded wait for a timeout or a deadline; `make test` runs two at a "
                                       "time, next")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items):
    for item in items:
        module = getattr(item, "module", None)  # a lesson notebook's item has none: it runs beside the rest
        name = module.__name__.rsplit(".", 1)[-1] if module is not None else None
        if name in BOUNDED_WAITS:
            item.add_marker(pytest.mark.waits)
            if name in SHARING_A_TORCHRUN_LAUNCH:
                item.add_marker(pytest.mark.xdist_group("torchrun"))
        elif (name is not None and name not in BESIDE_THE_LESSONS) or Path(str(item.fspath)).name in LESSONS_ALONE:
            item.add_marker(pytest.mark.alone)
    interleave_the_lessons(items)


def recorded_seconds(item) -> float:
    """How long the lesson's cells took when it was last executed, from the timestamps its committed notebook
    records (0 when it records none)."""
    total = 0.0
    try:
        cells = json.loads(Path(str(item.fspath)).read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return total
    for cell in cells:
        times = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in times and "shell.execute_reply" in times:
            start, end = (datetime.fromisoformat(times[k].replace("Z", "+00:00"))
                          for k in ("iopub.execute_input", "shell.execute_reply"))
            total += (end - start).total_seconds()
    return total


def interleave_the_lessons(items: list) -> None:
    """Spread the lesson notebooks evenly through the run, each beside tests rather than all of them together at
    the end: a lesson waits on its kernel, its ranks and its dialled wire as much as it computes, and the tests
    beside it use what it leaves of the CPU."""
    lessons = sorted((item for item in items if getattr(item, "module", None) is None), key=recorded_seconds,
                     reverse=True)  # the longest first: what runs last is short
    rest = [item for item in items if getattr(item, "module", None) is not None]
    if not lessons or not rest:
        return
    every = len(rest) / len(lessons)
    order, taken = [], 0
    for i, lesson in enumerate(lessons):
        upto = round(i * every)
        order += rest[taken:upto] + [lesson]
        taken = upto
    items[:] = order + rest[taken:]


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

    def section(self, name: str) -> str:
        """What was printed from rank 0's mark for command ``name`` to the next mark."""
        after = self.stdout.split(f"=== {name}\n", 1)[-1]
        return after.split("\n=== ", 1)[0]


@pytest.fixture(scope="session")
def under_torchrun(tmp_path_factory) -> Launched:
    """Every command of :data:`TORCHRUN_COMMANDS`, in turn, in one ``torchrun --standalone --nproc-per-node 2``."""
    cwd = tmp_path_factory.mktemp("torchrun")
    (cwd / "in_turn.py").write_text(_IN_TURN)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "in_turn.py",
           *("\x1f".join([name, *command]) for name, command in TORCHRUN_COMMANDS.items())]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=480, cwd=cwd,  # ~60 s alone; load 30+ took >180
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return Launched(out.returncode, out.stdout, out.stderr, cwd)

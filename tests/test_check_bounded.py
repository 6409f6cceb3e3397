"""The lab checker is bounded: the learner's file is imported and run in the ranks, never in the checker's own
process, under a deadline.  A loop -- at import, in a method on every rank, or on one rank -- ends within the
deadline with a verdict naming the method and the line (a stack sample of the rank); an exit or a crash at
import is a verdict, exit status 1, never a traceback or a hang.  The pool of the stopped ranks is respawned.

The deadline here is a few seconds; what is asserted of time is only that the verdict came (a guard of
minutes, against a hang), never how fast.
"""
from __future__ import annotations

import re
import threading

import pytest

from minizero.__main__ import main
from minizero.course.labs import check

DEADLINE_S = 5.0
GUARD_S = 120.0  # a hang fails the test instead of stalling the suite: far beyond the deadline on any machine

LOOP_AT_IMPORT = """\
from minizero.stages import DDP as GivenDDP

spins = 0
while True: spins += 1
"""

LOOP_IN_POST_BACKWARD = """\
import torch.distributed as dist

from minizero.stages import DDP as GivenDDP


class DDP(GivenDDP):
    def post_backward(self) -> None:
        spins = 0
        while {who}: spins += 1
        super().post_backward()
"""


def quiet(_):
    pass


def whoami(me):
    return me.rank


def bounded(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, failing the test (not hanging it) if it has not returned after GUARD_S."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn(*args, **kwargs)), daemon=True)
    thread.start()
    thread.join(GUARD_S)
    assert not thread.is_alive(), f"no verdict after {GUARD_S:g} s: the checker hangs"
    return out["value"]


def lab_file(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path.resolve())


def test_a_file_that_loops_at_import_is_stopped_naming_the_line(pools, tmp_path):
    path = lab_file(tmp_path, "loops_at_import.py", LOOP_AT_IMPORT)
    printed = []
    report = bounded(check, "ddp", impl=path, pools=pools, out=printed.append, deadline_s=DEADLINE_S)
    assert f"(a rank {DEADLINE_S:g} s in no collective" in printed[2]  # the deadline is stated before it runs
    assert report.failed == "loading your file"
    assert f"your file was still being imported after {DEADLINE_S:g} s" in report.why, report.why
    assert f"in your file, being imported, at {path}:4: while True: spins += 1" in report.why, report.why
    assert pools.run(2, whoami) == [0, 1]  # the stopped ranks were killed, and the pool respawned


@pytest.mark.parametrize("who", ["True", "dist.get_rank() == 1"], ids=["every rank", "one rank"])
def test_a_loop_in_post_backward_is_stopped_naming_the_method_and_the_line(pools, tmp_path, who):
    path = lab_file(tmp_path, "loops_in_post_backward.py", LOOP_IN_POST_BACKWARD.format(who=who))
    report = bounded(check, "ddp", impl=path, examples=3, pools=pools, out=quiet, deadline_s=DEADLINE_S)
    assert report.failed == "your methods are what runs" and report.final, report
    loop = f"in your DDP.post_backward, at {path}:9: while {who}: spins += 1"
    if who == "True":  # every rank of the first example (world size 1 included) loops: the verdict names those
        # its deadline caught -- rank 0, or rank 1 first when the two reach it a moment apart on a busy machine
        assert re.search(rf"rank \d(, rank \d)* spent more than {DEADLINE_S:g} s of this task in no collective "
                         rf"\(the limit\).*--deadline SECONDS", report.why), report.why
        assert re.search(rf"rank \d(, rank \d)*: {re.escape(loop)}", report.why), report.why
    else:  # rank 1 loops; its peers wait in the all-reduce it never joins
        assert f"rank 1: {loop}" in report.why, report.why
        waiting = f"in your DDP.post_backward, at {path}:10: super().post_backward()"
        assert re.search(rf"rank 0(, rank \d)*: {re.escape(waiting)}", report.why), report.why


LOOP_IN_RING = """\
from minizero.comm import RingComm


class Ring(RingComm):
    def _ring_reduce_scatter(self, chunks, out, op):
        spins = 0
        while True: spins += 1

    def _ring_all_gather(self, *args, **kwargs):
        return RingComm._ring_all_gather(self, *args, **kwargs)
"""


def test_a_loop_inside_a_collective_is_a_stall_and_says_where(pools, tmp_path):
    """Inside a collective the stall timeout, not the deadline, stops the rank: the verdict still says where."""
    path = lab_file(tmp_path, "loops_in_ring.py", LOOP_IN_RING)
    report = bounded(check, "ring", impl=path, examples=3, pools=pools, out=quiet, deadline_s=60.0)
    assert report.failed == "your methods are what runs" and report.final, report  # the first to run them
    assert report.why.startswith("stalled: "), report.why
    assert re.search(rf"rank 0(, rank \d)*: in your Ring._ring_reduce_scatter, at {re.escape(path)}:7: while True: "
                     rf"spins \+= 1", report.why), report.why


@pytest.mark.parametrize("body, verdict", [
    ("import os\nos._exit(3)\n", "your file called os._exit(3) while being imported"),
    ("import sys\nsys.exit(3)\n", "your file called sys.exit(3) while being imported"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "died while importing your file (killed by SIGKILL"),
], ids=["os._exit", "sys.exit", "a crash"])
def test_an_exit_or_a_crash_at_import_is_a_verdict(pools, tmp_path, body, verdict):
    report = bounded(check, "ddp", impl=lab_file(tmp_path, "exits.py", body), pools=pools, out=quiet,
                     deadline_s=DEADLINE_S)
    assert report.failed == "loading your file" and verdict in report.why, report.why


def test_the_check_command_gives_a_verdict_and_exit_1_for_an_exit_at_import(tmp_path, capsys):
    path = lab_file(tmp_path, "exits.py", "import os\nos._exit(3)\n")
    assert bounded(main, ["check", "ddp", "--impl", path, "--deadline", "7"]) == 1
    captured = capsys.readouterr()
    assert "(a rank 7 s in no collective" in captured.out
    assert "your file called os._exit(3) while being imported" in captured.out
    assert "Traceback" not in captured.out + captured.err
    assert main(["check", "ddp", "--deadline", "0"]) == 2
    assert "--deadline must be more than 0 seconds, got 0" in capsys.readouterr().err

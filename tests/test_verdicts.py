"""Every failure of ``train``, ``compare`` and ``soak`` is a verdict: bad options and paths refused before any rank
starts (exit 2), a failure on a rank told in a few lines with the traceback behind ``--debug`` (exit 1), and a
run whose loss or parameters become inf or NaN stopped and named at its step (exit 1)."""
from __future__ import annotations

import contextlib
import math
import re
import shutil
import subprocess

import pytest
import torch

from minizero.__main__ import main
from minizero.course.commands import training_run
from minizero.run import launch
from minizero.stages.local_sgd import LocalSGD

TINY = ["--model", "tiny", "--batch-size", "12", "--log-every", "1"]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    status = main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting a rank is a failure of the test: these cases must be refused before any rank exists."""
    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started for a run that should have been refused before launch")
    monkeypatch.setattr(launch.RankPool, "__init__", refuse)


@contextlib.contextmanager
def read_only_directory(path):
    """A directory nobody can write in -- root included (root ignores permission bits, not the immutable flag)."""
    path.mkdir()
    path.chmod(0o555)
    immutable = False
    try:
        with contextlib.suppress(OSError):
            (path / "probe").touch()
            (path / "probe").unlink()
            if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)]).returncode != 0:
                pytest.skip("cannot make a read-only directory here (root, no chattr)")
            immutable = True
        yield path
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(0o755)


@pytest.mark.parametrize("argv, message", [
    (["train", "--stage", "ps", "--servers", "5", "--world-size", "2"],
     "--servers 5 on 2 rank(s): ranks 0..S-1 serve a shard each, so there can be at most 2; use --servers 2 or fewer"),
    (["compare", "--stages", "ddp,ps-async", "--servers", "3"], "--servers 3 on 2 rank(s)"),
    (["train", "--stage", "local-sgd", "--world-size", "2", "--outer-lr", "0.7", "--outer-momentum", "1"],
     "--outer-momentum 1: the outer Nesterov momentum must be at least 0 and below 1"),
    (["compare", "--stages", "local-sgd", "--outer-momentum", "7"],
     "--outer-momentum 7 has no effect without --outer-lr: plain averaging has no outer optimizer"),
    (["train", "--stage", "local-sgd", "--world-size", "2", "--average-every", "1000", "--steps", "3"],
     "--average-every 1000 with --steps 3: the ranks would never average"),
    (["compare", "--stages", "ddp,zero1", "--servers", "2"],
     "--servers has no effect on --stages ddp,zero1: none of them takes it (it is an option of ps, ps-async)"),
    (["soak", "--stages", "ddp", "--bucket-mb", "5"], "--bucket-mb has no effect on --stages ddp"),
    (["train", "--lr", "1e38"], "--lr 1e+38: adamw's first step is lr / (1 - beta1) = 10 x lr = 1e+39, beyond the "
                                "largest float32 (3.4e+38); use --lr 3.4e+37 or less"),
    (["compare", "--optimizer", "adam", "--lr", "1e38"], "--lr 1e+38: adam's first step is lr / (1 - beta1)"),
    (["train", "--plot", "nodir/x.png"], "--plot nodir/x.png: the directory nodir does not exist"),
    (["train", "--plot", "loss.txt"], "--plot loss.txt: matplotlib cannot write .txt"),
])
def test_options_that_cannot_work_are_refused_before_any_rank_starts(capsys, no_ranks, argv, message):
    status, out, err = run_cli(capsys, *(argv + TINY if argv[0] == "train" else argv))
    assert status == 2 and f"error: {message}" in err, err
    assert out == "" and "Traceback" not in err


def test_a_save_directory_that_cannot_be_written_is_refused_before_training(capsys, no_ranks, tmp_path):
    """Both used to be refused by the first save -- after every step had trained."""
    (tmp_path / "a-file").write_text("")
    status, out, err = run_cli(capsys, "train", *TINY, "--save", str(tmp_path / "a-file"))
    assert status == 2 and "a-file is a file, not a directory: checkpoints go into a directory" in err, err
    with read_only_directory(tmp_path / "ro") as ro:
        status, out, err = run_cli(capsys, "train", *TINY, "--save", str(ro / "ck"))
    assert status == 2 and f"--save {ro / 'ck'}: cannot write in {ro}" in err and out == "", err


def test_local_sgd_refuses_an_outer_optimizer_that_cannot_work():
    """Through the API too, before anything is wrapped (comm None: no rank needed to refuse)."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="the outer optimizer needs a finite outer_lr > 0"):
        LocalSGD(model, optimizer, None, outer_lr=math.inf)
    with pytest.raises(ValueError, match="the outer optimizer needs a finite outer_lr > 0"):
        LocalSGD(model, optimizer, None, outer_lr=0.7, outer_momentum=math.nan)
    with pytest.raises(ValueError, match=r"outer_momentum=7 has no effect without outer_lr"):
        LocalSGD(model, optimizer, None, outer_momentum=7)
    assert LocalSGD.state_bytes(10, 2, 4, 0, outer_lr=0.7) == LocalSGD.state_bytes(10, 2, 4, 0, outer_lr=0.7,
                                                                                   outer_momentum=0.9)


def _failing_build_stage(name, model, optimizer, comm, **options):
    if comm.rank == 1:
        raise RuntimeError("boom: rank 1 could not build its stage")
    return _build_stage(name, model, optimizer, comm, **options)


_build_stage = training_run.build_stage


def test_a_failure_on_a_rank_is_a_verdict_and_the_traceback_is_behind_debug(capsys, monkeypatch):
    """It used to escape as an uncaught RankError: 20-40 lines of two processes' tracebacks, the verdict last."""
    monkeypatch.setattr(training_run, "build_stage", _failing_build_stage)  # the forked ranks inherit it
    status, out, err = run_cli(capsys, "train", *TINY, "--world-size", "2", "--steps", "1")
    assert status == 1 and "Traceback" not in err and len(err.strip().splitlines()) <= 4, err
    assert err.startswith("error: rank 1 failed: RuntimeError: boom: rank 1 could not build its stage\n"), err
    assert "what to do: rerun with --debug" in err
    status, out, err = run_cli(capsys, "train", *TINY, "--world-size", "2", "--steps", "1", "--debug")
    assert status == 1 and err.startswith("error: rank 1 failed: RuntimeError: boom"), err
    assert "Traceback (most recent call last)" in err and "in _failing_build_stage" in err  # the rank's own frames
    assert "in pool.run" not in err and "launch.py" in err  # and the launching process's


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_run_whose_loss_becomes_nan_stops_there_and_fails(capsys, tmp_path, precision):
    """lr 1e30: step 1 trains, step 2's loss is NaN.  It used to print the summary and exit 0."""
    status, out, err = run_cli(capsys, "train", *TINY, "--world-size", "2", "--steps", "4", "--lr", "1e30",
                               "--precision", precision, "--save", str(tmp_path / "ck"), "--save-every", "1")
    assert status == 1, err
    assert "error: the loss became nan at step 2; training stopped there, and nothing was saved from that step on" in err
    assert "stopped at step 2" in out and "step 3/4" not in out
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step-")) == ["step-00000001"]


def test_parameters_that_overflow_on_the_last_step_fail_the_run(capsys):
    """fp16 with lr 1e30: one step leaves fp32 masters near 1e30 (finite) and fp16 parameters inf -- the loss
    of that step was finite, so only a look at the parameters tells."""
    status, out, err = run_cli(capsys, "train", *TINY, "--world-size", "2", "--steps", "1", "--lr", "1e30",
                               "--precision", "fp16")
    assert status == 1 and "error: the parameters became inf or NaN at step 1 (its loss was 4." in err, err


def test_fp16_that_diverges_at_its_minimum_loss_scale_is_a_no_row(capsys):
    """It used to end compare with the rank's FloatingPointError, a 40-line traceback; now a NO row like any
    other divergence, and the next stage still runs (on a fresh pool)."""
    status, out, err = run_cli(capsys, "compare", "--stages", "ddp,zero1", "--task", "mlp", "--precision", "fp16",
                               "--loss-scale", "1", "--min-loss-scale", "1", "--lr", "1e30", "--steps", "3")
    assert status == 1 and "Traceback" not in err, err
    for stage in ("ddp", "zero1"):
        assert re.search(rf"^{stage}\s+inf\s+inf\s+NO", out, re.M), out
        assert re.search(rf"^{stage}: NO -- rank \d: gradients are inf or NaN even at the minimum loss scale \(1\)",
                         out, re.M), out


def test_a_verdict_names_the_exception_that_ended_the_rank():
    """The last exception of a chain, after the last frame's source line and markers; a stall or a death, which
    carries no traceback, is the watchdog's own verdict."""
    from minizero.course.harness.rank_verdict import raised, rank_error_verdict
    chained = ('Traceback (most recent call last):\n  File "a.py", line 1, in f\n    g()\n    ^^^\n'
               'KeyError: \'x\'\n\nDuring handling of the above exception, another exception occurred:\n\n'
               'Traceback (most recent call last):\n  File "b.py", line 2, in h\n    raise ValueError("one\\ntwo")\n'
               'ValueError: rank 0: one\n  two\n')
    assert raised(chained) == "ValueError: rank 0: one\n  two"
    died = launch.RankError("rank 1 died with exit code -9 (negative: killed by that signal); the other ranks were "
                            "stopped", rank=1)
    text = rank_error_verdict(died)
    assert text.startswith("error: rank 1 died with exit code -9") and "Traceback" not in text
    assert "--debug: the launching process's traceback:" in rank_error_verdict(died, debug=True)

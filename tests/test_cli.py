"""The command line answers every bad input with a message naming the option, the value and the fix.

Run in-process (``minizero.__main__.main``): argparse rejects a bad number
before anything starts, so these cost milliseconds, not a torch import each.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from minizero.__main__ import main
from minizero.course.harness import equivalence
from minizero.course.harness.result import RankResult


@pytest.mark.parametrize("argv, message", [
    (["compare", "--steps", "0"], "argument --steps: 0 is not a positive whole number (1 or more)"),
    (["compare", "--accum", "0"], "argument --accum: 0 is not a positive whole number (1 or more)"),
    (["compare", "--micro-batch", "0"], "argument --micro-batch: 0 is not a positive whole number (1 or more)"),
    (["compare", "--world-size", "0"], "argument --world-size: 0 is not a positive whole number (1 or more)"),
    (["compare", "--steps", "2.5"], "argument --steps: '2.5' is not a whole number"),
    (["soak", "--steps", "-3"], "argument --steps: -3 is not a positive whole number (1 or more)"),
    (["bench", "ddp", "--repeats", "0"], "argument --repeats: 0 is not a positive whole number (1 or more)"),
    (["compare", "--bucket-mb", "0"], "argument --bucket-mb: 0 is not a finite number greater than 0"),
    (["compare", "--bucket-mb", "-5"], "argument --bucket-mb: -5 is not a finite number greater than 0"),
    (["compare", "--bucket-mb", "nan"], "argument --bucket-mb: nan is not a finite number greater than 0"),
    (["compare", "--bucket-mb", "inf"], "argument --bucket-mb: inf is not a finite number greater than 0"),
    (["compare", "--lr", "nan"], "argument --lr: nan is not a finite number greater than 0"),
    (["compare", "--lr", "0"], "argument --lr: 0 is not a finite number greater than 0"),
    (["compare", "--clip", "-1"], "argument --clip: -1 is not a finite number greater than 0"),
    (["compare", "--timeout", "0"], "argument --timeout: 0 is not a finite number greater than 0"),
    (["compare", "--seed", "-1"], "argument --seed: -1 is negative; use 0 or more"),
    (["train", "--seed", str(2**64)], f"argument --seed: {2**64} is beyond 17592186044415 (2**44 - 1), the largest seed"),
    (["soak", "--timeout", "0.001"], "argument --timeout: 0.001 s is too short to mean a stall"),
    (["train", "--timeout", "0.5"], "use 1 s or more (default 300)"),
])
def test_numbers_are_validated_where_they_are_parsed(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["compare", "--stages", "ddp,zero9"], "unknown stage(s) ['zero9']; valid stages: ddp"),
    (["compare", "--stages", "ddp,ddp"], "a stage is named twice in ['ddp', 'ddp']; name each once"),
    (["soak", "--stages", "zero1,zero1"], "a stage is named twice in ['zero1', 'zero1']; name each once"),
    (["compare", "--stages", ","], "no stage given; valid stages"),
    (["compare", "--error-feedback"], "error feedback carries the rounding error of compression: it needs --compress"),
    (["soak", "--compress", "fp16"], "soak compares with exact single-device training"),
    (["scale", "--params", "1e8", "--world-size", "4", "--compress", "fp16", "--network",
      "nodes=2x2,intra=nvlink,inter=ethernet-100g"], "scale --compress prices a wire on one flat network"),
    (["compress-study", "--plot", "no-such-dir/x.png"], "--plot no-such-dir/x.png: the directory no-such-dir does "
                                                        "not exist"),  # before the study trains, not after it
    # combinations a stage refuses on every rank: refused here first, in the same words (Stage.check_combination)
    (["compare", "--stages", "ddp,zero2", "--compress", "powersgd:rank=1"], "compress='powersgd:rank=1' adds each "
     "matrix's low-rank factors P and Q in all-reduces"),
    (["train", "--stage", "zero1", "--compress", "powersgd:rank=1"], "compress='powersgd:rank=1' adds each matrix's"),
    (["compare", "--stages", "ddp", "--compress", "int8", "--precision", "bf16"], "compress='int8' under bf16 mixed "
     "precision is not built"),
    (["train", "--stage", "ddp", "--compress", "topk:0.1", "--precision", "fp16"], "compress='topk:0.1' under fp16 "
     "mixed precision is not built"),
    (["compare", "--stages", "hsdp", "--compress", "powersgd:rank=1"], "compress='powersgd:rank=1' on hsdp is not "
     "built"),
    (["compare", "--stages", "zeropp", "--quantized-weights", "int8", "--hpz"], "hpz with quantized_weights='int8' is "
     "not built"),
    (["compare", "--stages", "zeropp", "--quantized-weights", "int8", "--precision", "bf16"],
     "quantized_weights='int8' under mixed precision is not built"),
])
def test_inconsistent_options_are_refused_before_any_rank_starts(argv, message, capsys):
    assert main(argv) == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_a_diverging_run_is_a_failure_never_a_zero_difference():
    """lr 1e30: the reference and every stage end in NaN.  A NaN difference used to print 0.000e+00 yes."""
    with contextlib.redirect_stdout(io.StringIO()) as captured:
        status = main(["compare", "--stages", "ddp,zero1", "--task", "mlp", "--optimizer", "sgd", "--lr", "1e30",
                       "--steps", "3"])
    out = captured.getvalue()
    assert status == 1
    assert re.search(r"^ddp\s+inf\s+inf\s+NO", out, re.M) and re.search(r"^zero1\s+inf\s+inf\s+NO", out, re.M), out
    assert "ddp: NO -- the reference: the loss of step 1 is" in out and "(NaN or inf is never a pass)" in out


def test_a_nan_difference_is_an_infinite_one():
    nan = RankResult(params=[{"w": torch.tensor([math.nan])}], losses=[0.0])
    assert equivalence.max_diff([nan], nan) == (math.inf, math.inf)


def test_output_to_a_closed_pipe_ends_quietly_keeping_the_status():
    """`compare --json | head`: the reader left; no traceback, and the exit status is compare's own."""
    process = subprocess.Popen([sys.executable, "-m", "minizero", "compare", "--stages", "ddp", "--task", "mlp",
                                "--steps", "2", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    process.stdout.close()  # the reader goes away before a byte is written
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err


def test_soak_reports_the_largest_deviation_and_fails_on_nan():
    """The command runs (500 steps is for `make soak`, not CI); a diverging run is a failure there too."""
    with contextlib.redirect_stdout(io.StringIO()) as captured:
        status = main(["soak", "--stages", "ddp,zero3", "--task", "mlp", "--steps", "3", "--world-size", "2"])
    out = captured.getvalue()
    assert status == 0 and re.search(r"^ddp\s+\d\.\de-1\d\s+\d", out, re.M) and "zero3" in out, out
    with contextlib.redirect_stdout(io.StringIO()) as captured:
        status = main(["soak", "--stages", "ddp", "--task", "mlp", "--optimizer", "sgd", "--lr", "1e30",
                       "--steps", "3", "--dtype", "float32"])
    assert status == 1 and "ddp: NO -- rank" in captured.getvalue(), captured.getvalue()

"""``scripts/gpu_run.py``: the GPU run in one command, checked here without a GPU.

Its plan is checked for 0 (refused), 1 and 8 GPUs by injecting the count, and its results file by feeding it
a synthetic run: bench all's rows written out, and train's summary made by its own ``training_run.summary``
(so a renamed key there breaks this test rather than the first GPU run that meets it).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from minizero.course.commands.training_run import Run, summary
from minizero.stages import distributed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_run.py"
spec = importlib.util.spec_from_file_location("gpu_run", SCRIPT)
gpu_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_run)

MACHINE = {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "gpu_memory_bytes": 85_520_809_984,
           "driver": "570.86.15", "torch": "2.11.0+cu130", "cuda": "13.0", "python": "3.12.3",
           "commit": "abc1234", "date": "2026-11-26 00:00 UTC"}


def dry_run(capsys, gpus: int) -> tuple[int, list[str], str]:
    status = gpu_run.main(["--dry-run", "--gpus", str(gpus)])
    out, err = capsys.readouterr()
    return status, [line for line in out.splitlines() if not line.startswith("#")], out + err


def test_no_gpu_refuses_and_writes_nothing(capsys, tmp_path, monkeypatch):
    status, commands, text = dry_run(capsys, 0)
    assert status == 1 and commands == [] and "no CUDA GPU here" in text
    monkeypatch.setattr(gpu_run, "detect_gpus", lambda: 0)  # so this holds on a machine with a GPU too
    monkeypatch.setattr(gpu_run, "run", lambda *a: pytest.fail("a command ran on a machine without CUDA"))
    assert gpu_run.main(["--out", str(tmp_path / "r")]) == 1
    assert gpu_run.main(["--gpus", "1", "--out", str(tmp_path / "r")]) == 1  # --gpus does not make a GPU
    assert list(tmp_path.iterdir()) == []


def test_one_gpu_shares_it_with_gloo_at_two_ranks_and_says_so(capsys):
    status, commands, text = dry_run(capsys, 1)
    assert status == 0
    assert commands[0] == "python -m minizero bench all --device cuda --json"
    assert commands[1].startswith("python scripts/gpu_overlap.py --json --out . --model 100m")
    trains = commands[2:]
    assert [c.split("--stage ")[1].split()[0] for c in trains] == distributed()
    assert all("--device cuda --backend gloo --world-size 2 " in c and c.endswith("--json") for c in trains)
    assert "gloo at N = 2" in text and "GPU 0" in text
    # local-sgd has no precision option, and train refuses one it does not take
    assert all(("--precision bf16" in c) != ("local-sgd" in c) for c in trains)


def test_several_gpus_train_under_nccl_one_rank_per_gpu(capsys):
    status, commands, text = dry_run(capsys, 8)
    assert status == 0 and len(commands) == 2 + len(distributed())
    assert all("--backend nccl --world-size 8 " in c for c in commands[2:])
    assert "NCCL at N = 8" in text and "gloo at N = 2" not in text


def results() -> list[dict]:
    """A synthetic run: bench all's rows for two stages, and train's summary of zero3 at N = 2."""
    # bench all's rows, written out: the bench's own row() is being reworked (issue 28), its keys are these
    rows = [{"stage": "zero3", "counterpart": "torch-fsdp2", "world_size": 2, "model": "small", "psi": 803_072,
             "step_ms": 3.0, "counterpart_step_ms": 2.0, "ratio": 1.5, "held_bytes": 6_424_708,
             "held_bytes_formula": 6_424_576, "cuda_peak_bytes": 81_140_736, "counterpart_cuda_peak_bytes": 90_000_000},
            {"stage": "ddp", "counterpart": "torch-ddp", "world_size": 2, "model": "small", "psi": 803_072,
             "step_ms": 1.0, "counterpart_step_ms": 2.0, "ratio": 0.5, "interval": [0.4, 0.6], "verdict": "faster",
             "held_bytes": 12_849_152, "held_bytes_formula": 12_849_152, "cuda_peak_bytes": 87_449_088,
             "counterpart_cuda_peak_bytes": 87_000_000}]
    ranks = [{"psi": 803_072, "step_s": [0.01, 0.02, 0.03], "first_step": 0, "losses": [4.6, 4.4, 4.2],
              "sent_bytes": 3 * 4.8e6, "held_bytes": {"total": 6_424_708 - r}, "gathered_peak_bytes": 814_592,
              "peak_bytes": {"kind": "cuda max_memory_allocated", "bytes": 81_140_736 + r}, "skipped_steps": 0,
              "tokens_per_step": 512} for r in range(2)]
    trained = summary(Run(stage="zero3", steps=3, device="cuda", options=(("precision", "bf16"),)), ranks, 2, "gloo")
    efficiency = [{"name": "ddp-bucketed", "options": {"bucket_mb": 25.0}, "path": path, "network": "alpha=50us",
                   "stands_for": 2, "rounds": 3, "steps": 6, "measured_ms": [m, m + 1, m + 2], "bound_ms": 74.17,
                   "compute_ms": 71.52, "unhidden_ms": 2.65, "wire_ms": 41.68, "quiet_ms": 72.0, "fraction": f,
                   "fraction_min": f - 0.01, "fraction_max": f + 0.01, "hidden": h}
                  for path, m, f, h in [("own stream", 75.0, 0.98, 0.91), ("thread", 114.0, 0.65, 0.0)]]
    overlap = {"efficiency": efficiency, "every_stage": [
        {"stage": "zero3", "options": {"prefetch": 1}, "runner": "CommStream", "contrast": False,
         "stream_vs_thread": 0.0, "stream_vs_reference": 0.0, "finite": True},
        {"stage": "hsdp", "options": {}, "error": "Traceback ...\nValueError: no nodes\n"}]}
    plan = gpu_run.plan(1)
    return [plan[0] | {"ok": True, "seconds": 60.0, "result": {"machine": {}, "rows": rows}},
            plan[1] | {"ok": True, "seconds": 90.0, "result": overlap},
            plan[6] | {"ok": True, "seconds": 20.0, "result": json.loads(json.dumps(trained, default=str))},
            plan[2] | {"ok": False, "seconds": 5.0, "error": "exit 1: error: something broke"}]


def test_results_file_has_the_machine_first_and_a_row_per_stage_and_rank(tmp_path):
    md, js = gpu_run.write(tmp_path / "gpu", MACHINE, results())
    text = md.read_text()
    assert text.splitlines()[2] == ("**Machine:** 1 × NVIDIA H100 80GB HBM3 (86 GB), driver 570.86.15, torch "
                                    "2.11.0+cu130, CUDA 13.0, Python 3.12.3; minizero abc1234; 2026-11-26 00:00 UTC.")
    assert "python -m minizero bench all --device cuda --json" in text
    assert "| zero3 | torch-fsdp2 | 3.00 | 2.00 | 1.50 | 6,424,708 |" in text  # no interval: the ratio alone
    assert "| ddp | torch-ddp | 1.00 | 2.00 | 0.50 [0.40, 0.60] faster | 12,849,152 |" in text  # with one: beside it
    # train's rows: model states, the formula, peak CUDA and the working set (peak - states), per rank
    assert "| zero3 | 16Ψ/N | 2, gloo | 0 | 6,424,708 | 6,424,576 | 81,140,736 | 74,716,028 | 814,592 |" in text
    assert "| zero3 | 16Ψ/N | 2, gloo | 1 | 6,424,707 | 6,424,576 | 81,140,737 | 74,716,030 | 814,592 |" in text
    assert "**ddp failed**" in text and "something broke" in text  # a failure is shown, not dropped
    # the overlap table as bench gpu-efficiency prints it, and every stage's two paths at N = 1
    assert "  ddp-bucketed bucket_mb=25.0  own stream       76.00 (75.0-77.0)   74.17    71.52" in text
    assert "| zero3 | {'prefetch': 1} | CommStream | 0.0e+00 | 0.0e+00 |" in text
    assert "| hsdp | {} | failed: ValueError: no nodes | | |" in text
    saved = json.loads(js.read_text())
    assert saved["machine"] == MACHINE and [r["ok"] for r in saved["results"]] == [True, True, True, False]

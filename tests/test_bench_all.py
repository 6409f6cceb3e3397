"""``bench all``: every stage beside torch's implementation of its kind, one pool, in rounds.

Timings are never asserted (they are measured on demand); what is asserted is what the table claims
besides them: each stage meets the right counterpart, the bytes are the ledger's and match the stage's
formula, the memory is counted from live tensors -- torch's too -- and the options are refused where they
mean nothing."""
from __future__ import annotations

import math

import pytest
import torch

from minizero.__main__ import main
from minizero.course.commands.bench_all import bench_all, format_table, plot, row
from minizero.course.harness.experiment import Experiment, run_experiment
from minizero.course.harness.models import GPT_SIZES
from minizero.course.harness.rounds import verdict
from minizero.stages import STAGES, Shards, distributed

N = 2
#: What each kind of stage is measured against, written out here rather than derived as the bench does.
EXPECTED = {Shards(): "torch-ddp", Shards(optimizer_states=True): "torch-zero",
            Shards(optimizer_states=True, gradients=True): "torch-zero",
            Shards(optimizer_states=True, gradients=True, parameters=True): "torch-fsdp2"}
#: torch's model state per parameter in fp32 Adam (kept whole, divided by N): DDP holds everything,
#: ZeroRedundancyOptimizer divides only the optimizer's two states, FSDP2 divides all of it.
TORCH_STATE = {"torch-ddp": (16, 0), "torch-zero": (8, 8), "torch-fsdp2": (0, 16)}


STEPS, MICRO_BATCH = 4, 2  # 4: local-sgd averages once in its default H = 4 steps, so its bytes are exact
ROUNDS = 3  # the fewest the method accepts


@pytest.fixture(scope="module")
def rows(pools):
    return bench_all(N, model="tiny", steps=STEPS, micro_batch=MICRO_BATCH, pool=pools.pool(N), rounds=ROUNDS)


def test_every_stage_has_a_row_beside_the_counterpart_of_its_kind(rows):
    assert [r["stage"] for r in rows] == distributed()
    for r in rows:
        assert r["counterpart"] == EXPECTED[STAGES[r["stage"]].shards], r
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0
        assert len(r["round_ms"]) == len(r["counterpart_round_ms"]) == r["rounds"] == ROUNDS
        # The ratio is the median of the per-round ratios, inside its interval; a verdict only from the interval.
        per_round = sorted(a / b for a, b in zip(r["round_ms"], r["counterpart_round_ms"], strict=True))
        assert r["ratio"] == pytest.approx(per_round[1])
        assert r["interval"][0] <= r["ratio"] <= r["interval"][1]
        assert r["verdict"] == verdict(*r["interval"], holds=r["held"])


def test_bytes_are_the_ledgers_and_match_the_stages_formula(rows):
    ddp_bytes = 2 * (N - 1) / N * rows[0]["psi"] * 4
    for r in rows:
        formula = STAGES[r["stage"]].sent_bytes_per_step(r["psi"], N, 4, 4)
        assert r["sent_bytes_formula"] == formula
        # The ledger, not the formula: padding to a multiple of N and ZeRO-3's unit headers add a little.
        assert formula <= r["sent_bytes_per_step"] <= formula * 1.01, r
        assert r["bytes_match"]
        modelled = ddp_bytes if r["counterpart"] == "torch-ddp" else 1.5 * ddp_bytes
        assert r["counterpart_sent_bytes_modelled"] == pytest.approx(modelled, rel=1e-12)
    zero3 = next(r for r in rows if STAGES[r["stage"]].shards.parameters)
    assert zero3["sent_bytes_per_step"] > 1.4 * ddp_bytes  # a mix-up with the formula of another stage shows


def test_the_rows_are_what_the_ledger_and_the_live_tensors_say(rows, pools):
    """Each stage run again on its own: its ledger's bytes and its held bytes are the row's, to the byte
    (both are deterministic) -- a row that printed a formula instead would agree only by chance."""
    for r in rows:
        exp = Experiment(stage=r["stage"], task="gpt", model=GPT_SIZES["tiny"], optimizer="adamw", steps=STEPS,
                         micro_batch=MICRO_BATCH, dtype="float32", check=False, backend="native")
        results = pools.run(N, run_experiment, exp)
        assert r["sent_bytes_per_step"] == sum(x.sent_bytes for x in results) / (N * STEPS), r
        assert r["held_bytes"] == max(x.held_bytes["total"] for x in results), r


def test_a_row_prints_the_measurement_where_it_differs_from_the_formula(rows):
    """Padding (N=3 here) makes the ledger exceed the formula; the row must say what was measured."""
    stage = next(r for r in rows if STAGES[r["stage"]].shards.parameters)["stage"]
    psi, exp = 27584, Experiment(task="gpt", optimizer="adamw", steps=3, dtype="float32")
    mine = {"round_ms": [3.0] * 6, "sent": 220704.0, "held": 147188, "cuda_peak": 0, "psi": psi}  # zero3, N=3
    theirs = {"round_ms": [4.0] * 6, "sent": 0.0, "held": 147200, "cuda_peak": 0, "psi": psi}
    r = row(stage, "torch-fsdp2", mine, theirs, exp, 3, "tiny")
    assert (r["sent_bytes_per_step"], r["held_bytes"], r["counterpart_held_bytes"]) == (220704.0, 147188, 147200)
    assert r["sent_bytes_formula"] == 220672.0 and r["bytes_match"] and r["ratio"] == 0.75
    assert r["interval"] == [0.75, 0.75] and r["verdict"] == "faster"


def test_memory_is_counted_from_live_tensors_beside_the_formula_and_torchs(rows):
    for r in rows:
        formula = STAGES[r["stage"]].state_bytes(r["psi"], N, 4, 2)
        assert r["held_bytes_formula"] == formula
        assert formula <= r["held_bytes"] <= formula * 1.01, r  # padding, Adam's step counters
        assert r["memory_match"]
        whole, divided = TORCH_STATE[r["counterpart"]]
        torch_formula = r["psi"] * (whole + divided / N)
        assert torch_formula <= r["counterpart_held_bytes"] <= torch_formula * 1.01, r
        assert r["cuda_peak_bytes"] == r["counterpart_cuda_peak_bytes"] == 0  # a CPU run


def test_the_table_says_what_is_modelled_and_the_plot_is_a_png(rows, tmp_path):
    text = format_table(rows)
    assert all(r["stage"] in text and r["counterpart"] in text for r in rows)
    assert "MODELLED" in text and "same run" in text and "k-th smallest" in text
    # zero1 overlaps its reduce-scatters as DDP under ZeroRedundancyOptimizer overlaps its all-reduces; no other
    # stage is given an option
    assert {r["stage"]: r["options"] for r in rows if r["options"]} == {"zero1": {"overlap": True}}
    assert "zero1 runs with {'overlap': True}: it overlaps as its counterpart does" in text
    for r in rows:  # each stage's ratio, its interval and its verdict, in one line
        low, high = r["interval"]
        assert f"{r['stage']} vs {r['counterpart']}: {r['ratio']:.2f}x [{low:.2f}, {high:.2f}] {r['verdict']}" in text
    path = tmp_path / "bench_all.png"
    plot(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_options_only_bench_all_takes_are_refused_elsewhere(capsys):
    assert main(["bench", "ddp", "--model", "tiny"]) == 2
    assert "bench ddp does not take --model; only bench all does" in capsys.readouterr().err
    assert main(["bench", "zero3", "--plot", "x.png", "--collectives", "ring"]) == 2
    assert "bench zero3 does not take --plot, --collectives; only bench all does" in capsys.readouterr().err
    assert main(["bench", "all", "--network", "lesson"]) == 2
    assert "bench all does not take --network" in capsys.readouterr().err
    assert main(["bench", "zero", "--stages", "zero1"]) == 2
    assert "bench zero does not take --stages; only bench all does" in capsys.readouterr().err
    # the GPU's overlap table takes a GPT's size, and nothing else of bench all's; without a GPU it says so
    assert main(["bench", "gpu-efficiency", "--model", "100m", "--device", "cuda"]) == 2
    assert "bench gpu-efficiency does not take --device; only bench all does" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "gpu-efficiency", "--model", "100m"]) == 2
        assert "torch.cuda.is_available() is False here; run it on a machine with a CUDA GPU" in capsys.readouterr().err


def test_what_bench_all_cannot_do_is_refused_before_the_run(capsys, tmp_path):
    assert main(["bench", "all", "--plot", str(tmp_path / "missing" / "x.png")]) == 2
    assert "does not exist; create it" in capsys.readouterr().err
    assert main(["bench", "all", "--plot", str(tmp_path / "x.nope")]) == 2
    assert "matplotlib cannot write .nope" in capsys.readouterr().err
    assert main(["bench", "all", "--steps", "2"]) == 2  # every step would be a warm-up: nothing timed
    assert "bench all needs more than 2 steps: the first 2 warm up and are not timed" in capsys.readouterr().err
    assert main(["bench", "ddp", "--rounds", "2"]) == 2  # no interval from two ratios
    assert "--rounds 2: a ratio's interval needs at least 3 rounds" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: nothing to refuse")
def test_cuda_without_cuda_is_refused_in_one_line_before_any_rank_starts(capsys):
    assert main(["bench", "all", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "torch sees no CUDA device here" in err and err.count("\n") == 1, err
    assert "run it on a machine with a GPU and a CUDA build of torch, or leave out --device" in err


def test_a_counterpart_that_cannot_run_here_is_said_not_compared_and_nothing_is_made_up(pools, monkeypatch,
                                                                                        tmp_path):
    """On a GPU, bench all's gloo ranks cannot run FSDP2 (it dies with a segfault): the zero3 row must keep
    zero3's own measurement, leave torch's cells empty, say why -- and never run the counterpart."""
    import minizero.course.commands.bench_all as bench_all_module
    ran = []
    real = bench_all_module._measure
    monkeypatch.setattr(bench_all_module, "_measure", lambda pool, exp, n: ran.append(exp.stage) or real(pool, exp, n))
    monkeypatch.setattr(bench_all_module, "UNMEASURABLE", {("cpu", "torch-fsdp2"): "FSDP2 cannot run here"})
    rows = bench_all(N, model="tiny", steps=STEPS, micro_batch=MICRO_BATCH, pool=pools.pool(N), rounds=ROUNDS)
    assert "torch-fsdp2" not in ran and "torch-ddp" in ran
    uncompared = [r for r in rows if r["counterpart"] == "torch-fsdp2"]
    assert uncompared and all(r["ratio"] is None and r["counterpart_step_ms"] is None
                              and r["verdict"] == "not compared: FSDP2 cannot run here" and r["step_ms"] > 0
                              for r in uncompared)
    assert all(r["ratio"] is not None for r in rows if r["counterpart"] != "torch-fsdp2")
    text = format_table(rows)
    assert all(f"{r['stage']} vs torch-fsdp2: not compared: FSDP2 cannot run here" in text for r in uncompared)
    plot(rows, str(tmp_path / "p.png"))


def test_bench_all_measures_the_stages_asked_for_beside_their_counterparts(pools):
    rows = bench_all(N, model="tiny", steps=STEPS, micro_batch=MICRO_BATCH, pool=pools.pool(N), rounds=ROUNDS,
                     stages=["zero1"])
    assert [(r["stage"], r["counterpart"], r["options"]) for r in rows] == [("zero1", "torch-zero", {"overlap": True})]
    assert len(rows[0]["round_ms"]) == len(rows[0]["counterpart_round_ms"]) == ROUNDS

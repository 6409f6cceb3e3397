"""``python -m minizero train``: a run prints progress and a summary whose measurements agree with the
formulas; it resumes from its checkpoints exactly, or on another number of ranks by another stage; it
runs unchanged under torchrun; and what cannot run is refused in one line before any rank starts."""
from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from minizero.__main__ import main

TINY = ["--model", "tiny", "--batch-size", "12", "--log-every", "2"]


def train(capsys, *args) -> tuple[int, str, str]:
    status = main(["train", *TINY, *args])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """zero2 on 2 ranks, 4 steps, saved at steps 2 and 4 (sharded); the JSON summary and the progress."""
    root = tmp_path_factory.mktemp("train")
    with pytest.MonkeyPatch.context() as patch:
        out, err = io.StringIO(), io.StringIO()
        patch.setattr(sys, "stdout", out)
        patch.setattr(sys, "stderr", err)
        status = main(["train", *TINY, "--stage", "zero2", "--world-size", "2", "--steps", "4", "--save",
                       str(root / "ck"), "--save-every", "2", "--json", "--plot", str(root / "loss.png")])
    assert status == 0, err.getvalue()
    return json.loads(out.getvalue()), err.getvalue(), root


def test_a_run_reports_progress_and_measurements_beside_the_formulas(first_run):
    summary, _, root = first_run  # (the ranks' progress lines go to the process's own stdout: see the torchrun test)
    assert summary["steps"] == [0, 4] and len(summary["losses"]) == 4
    assert summary["losses"][-1] < summary["losses"][0]  # it learns
    assert all(abs(s - summary["sent_bytes_formula"]) <= 1e-9 * s for s in summary["sent_bytes_per_step"])
    assert all(abs(b - summary["model_state_formula"]) < 200 for b in summary["model_state_bytes"])  # Adam's 4-byte steps
    assert all(p["bytes"] > 0 for p in summary["peak_memory"])
    assert (root / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (root / "ck").iterdir()) == ["latest", "step-00000002", "step-00000004"]


def resume_at_step_2(capsys, root, stage: str, world_size: int) -> dict:
    status, out, err = train(capsys, "--stage", stage, "--world-size", str(world_size), "--steps", "4",
                             "--resume", str(root / "ck" / "step-00000002"), "--json")
    assert status == 0, err
    return json.loads(out)


def test_resume_in_place_repeats_the_run_exactly(capsys, first_run):
    summary, _, root = first_run
    resumed = resume_at_step_2(capsys, root, "zero2", 2)
    assert resumed["steps"] == [2, 4] and resumed["losses"] == summary["losses"]  # bit for bit, history included


def test_resume_on_three_ranks_by_another_stage_continues_the_run(capsys, first_run):
    summary, _, root = first_run
    resumed = resume_at_step_2(capsys, root, "zero3", 3)
    for a, b in zip(resumed["losses"][2:], summary["losses"][2:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)  # float32, another summation order


@pytest.mark.parametrize("stage, precision", [("zero1", "fp32"), ("zero2", "bf16"), ("zero3", "fp32")])
def test_offloaded_optimizer_trains_saves_and_resumes_exactly(capsys, tmp_path, stage, precision):
    """``--offload-optimizer`` through the whole command: the run, its saves, its summary, and a resume in place
    repeating it bit for bit (issue 46: every offloaded run died at its first save, the masters' finiteness check
    looking them up under the kind the device keeps them in)."""
    run = ["--stage", stage, "--world-size", "2", "--steps", "4", "--precision", precision, "--offload-optimizer",
           "--json"]
    status, out, err = train(capsys, *run, "--save", str(tmp_path / "ck"), "--save-every", "2")
    assert status == 0, err
    summary = json.loads(out)
    assert summary["steps"] == [0, 4] and len(summary["losses"]) == 4
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-00000002", "step-00000004"]
    status, out, err = train(capsys, *run, "--resume", str(tmp_path / "ck" / "step-00000002"))
    assert status == 0, err
    assert json.loads(out)["losses"] == summary["losses"]


def test_what_needs_the_nodes_runs_with_network(capsys):
    """hsdp, zeropp's hpZ and the two-level collectives, placed by --network: each trains to its summary."""
    for run in (["--stage", "hsdp"], ["--stage", "zeropp", "--hpz"], ["--stage", "ddp", "--collectives", "hierarchical"]):
        status, out, err = train(capsys, *run, "--world-size", "4", "--network", "nodes=2x2", "--steps", "2", "--json")
        assert status == 0, (run, err)
        assert len(json.loads(out)["losses"]) == 2


def test_torchrun_runs_the_same_command(under_torchrun):
    """Progress lines and the summary from rank 0 alone; each rank writes its own checkpoint file.  (The launch,
    ``train`` with TINY's options, zero2 for 3 steps saved to ck, is shared with compare's test: conftest.py.)"""
    out = under_torchrun
    assert out.returncode == 0, out.stdout + out.stderr
    train = out.section("train")
    assert out.stdout.count("trained zero2 on 2 rank(s) (gloo, cpu)") == 1 and train.count("trained ") == 1, out.stdout
    assert "step 2/3 | loss" in train and "tok/s | sent" in train and out.stdout.count("saved ") == 1
    assert sorted(p.name for p in (out.cwd / "ck" / "step-00000003").iterdir()) == [
        "manifest.json", "rank-00000-of-00002.pt", "rank-00001-of-00002.pt"]


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda"], "--device cuda: no CUDA GPU here"),
    (["--backend", "nccl"], "--backend nccl: no CUDA GPU here"),
    (["--stage", "ddp", "--prefetch", "2"], "--stage ddp takes no --prefetch"),
    (["--save-every", "5"], "--save-every 5 needs --save DIR"),
    (["--stage", "nonesuch"], "--stage 'nonesuch': choose one of"),
    # what must know where the ranks sit, told by --network (once each rank failed naming a flag train had not)
    (["--stage", "hsdp", "--world-size", "4"], "--stage hsdp needs to know where the ranks sit"),
    (["--stage", "zeropp", "--hpz", "--world-size", "4"], "--hpz needs to know where the ranks sit"),
    (["--stage", "ddp", "--collectives", "hierarchical"], "--collectives hierarchical needs to know where the ranks"),
    (["--stage", "hsdp", "--world-size", "3", "--network", "nodes=2x2"], "2 nodes of 2 are 4 ranks, and --world-size is 3"),
])
def test_bad_options_are_refused_before_any_rank_starts(capsys, args, message):
    if "CUDA" in message and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    status, _, err = train(capsys, *args)
    assert status == 2 and message in err, err


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "RANK set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT not: launch with torchrun"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK=2 with WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "two", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "torchrun sets whole numbers"),
])
def test_a_broken_torchrun_environment_is_refused(capsys, monkeypatch, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    status, _, err = train(capsys, "--stage", "zero2")
    assert status == 2 and message in err, err


def test_world_size_that_contradicts_torchrun_is_refused(capsys, monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    status, _, err = train(capsys, "--world-size", "4")
    assert status == 2 and "--world-size 4, but torchrun started WORLD_SIZE=2" in err, err


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "8"], "saved by a run with --batch-size 12, this one has 8; resume with --batch-size 12"),
    (["--steps", "2"], "is at step 2 and --steps is 2: nothing to train"),
    (["--schedule", "cosine"], "saved by a run with --schedule constant, this one has cosine; resume with --schedule"),
    (["--precision", "bf16"], "saved with precision fp32, this run uses bf16; resume with --precision fp32"),
    (["--model", "small"], "a checkpoint of another model: 'token_embedding.weight' is float32 [56, 32] in the "
                           "checkpoint and float32 [56, 128] in this model"),
])
def test_a_checkpoint_this_run_cannot_continue_is_refused(capsys, first_run, args, message):
    _, _, root = first_run
    status, _, err = train(capsys, "--resume", str(root / "ck" / "step-00000002"), "--steps", "4", *args)
    assert status == 2 and message in err, err


def test_a_damaged_checkpoint_is_refused_naming_the_file_before_any_rank_starts(capsys, first_run, tmp_path,
                                                                                 monkeypatch):
    """A same-size change inside a rank's file used to load without a word; every CheckpointError now reaches the
    user from train_command.check_resume, before a rank exists (RankPool refuses to start here)."""
    import shutil

    from minizero.run import launch
    _, _, root = first_run
    damaged = tmp_path / "step-00000002"
    shutil.copytree(root / "ck" / "step-00000002", damaged)
    data = bytearray((damaged / "rank-00001-of-00002.pt").read_bytes())
    data[-3000:-2936] = b"\x7f" * 64
    (damaged / "rank-00001-of-00002.pt").write_bytes(bytes(data))
    monkeypatch.setattr(launch.RankPool, "__init__", lambda *a, **k: pytest.fail("a rank was started"))
    status, out, err = train(capsys, "--stage", "zero2", "--world-size", "2", "--steps", "4", "--resume", str(damaged))
    assert status == 2 and out == "" and "Traceback" not in err, err
    assert f"error: {damaged / 'rank-00001-of-00002.pt'}: its SHA-256 differs from the manifest's" in err, err


def test_more_nccl_ranks_than_gpus_is_refused(monkeypatch):
    """On one node NCCL needs a GPU per rank (checked with torch.cuda pretending to see one GPU)."""
    from types import SimpleNamespace

    from minizero.course.commands.train_command import check_hardware
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="--world-size 4 with NCCL needs one GPU per rank, and this machine has 1"):
        check_hardware(SimpleNamespace(device="cuda"), "nccl", 4)
    with pytest.raises(ValueError, match="--backend nccl moves CUDA tensors only"):
        check_hardware(SimpleNamespace(device="cpu"), "nccl", 1)
    check_hardware(SimpleNamespace(device="cuda"), "gloo", 4)  # gloo ranks may share the GPU


def test_a_checkpoint_of_another_optimizer_is_refused_before_any_rank_starts(capsys, tmp_path, monkeypatch):
    """train steps AdamW; a checkpoint an SGD run saved (through the API) is refused by its manifest, before a
    rank exists -- it used to load SGD's state into AdamW's ranks and fail there, or run on silently."""
    from minizero import checkpoint
    from minizero.course.harness.models import GPT_SIZES
    from minizero.course.harness.tasks import TASKS
    from minizero.run import launch
    from minizero.stages import Stage
    model = TASKS["gpt"].make_model(0, torch.float32, **GPT_SIZES[TINY[TINY.index("--model") + 1]])
    checkpoint.save(Stage(model, torch.optim.SGD(model.parameters(), lr=0.1)), tmp_path, 2)
    monkeypatch.setattr(launch.RankPool, "__init__", lambda *a, **k: pytest.fail("a rank was started"))
    status, out, err = train(capsys, "--stage", "ddp", "--world-size", "2", "--steps", "4", "--resume", str(tmp_path))
    assert status == 2 and out == "" and "Traceback" not in err, err
    assert "saved with optimizer SGD, this run's is AdamW; build the optimizer the saved run used" in err, err


def test_under_torchrun_every_rank_of_a_diverged_run_exits_1(monkeypatch):
    """Rank 0 prints the verdict; the others must not exit 0 either -- torchrun reports each rank's exit status.
    (torchrun itself replaced by what the command asks of it: a rank, its result, the gather.)"""
    from types import SimpleNamespace

    from minizero.course.commands import train_command
    monkeypatch.setattr(train_command, "under_torchrun", lambda: True)
    monkeypatch.setattr(train_command, "check_environment", lambda backend: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train_command, "init_from_env", lambda backend, timeout: SimpleNamespace(rank=1, world_size=2))
    monkeypatch.setattr(train_command.dist, "gather_object", lambda *args, **kwargs: None)
    for diverged, status in (("the loss became nan at step 2", 1), (None, 0)):
        monkeypatch.setattr(train_command, "train_on_rank", lambda me, run, d=diverged: {"diverged": d})
        assert main(["train", *TINY, "--stage", "ddp", "--steps", "3"]) == status

"""Checkpoints: S steps, save, a fresh stage, load, S more equals 2S uninterrupted steps bit for bit, for
every stage; saved at N ranks and loaded at M by any stage, training continues as single-device training
would; and a checkpoint that cannot be trusted is refused, naming the file or the tensor."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero import checkpoint
from minizero.checkpoint import CheckpointError
from minizero.checkpoint.directory import find as find_with_notes
from minizero.course.harness.equivalence import judge
from minizero.course.harness.experiment import Experiment, build, exact_reference_of, run_experiment
from minizero.course.harness.tasks import TASKS
from minizero.parts.precision import Precision
from minizero.run.launch import RankError
from minizero.stages import STAGES as REGISTRY
from minizero.stages import distributed
from tests.equivalence import covering, examples, experiments

# The stages whose state is one device's (ps-async and local-sgd refuse: tests/test_contrast_stages.py).
STAGES = [name for name in distributed() if REGISTRY[name].equivalent]
SMALL_GPT = {"d_model": 8, "n_layer": 1, "n_head": 2, "block_size": 4}


def resumed(pools, exp: Experiment, world_size: int, split: int, directory, consolidated=False, load_at=None,
            **later):
    """Steps [0, split) and a save; then a fresh stage -- at ``load_at`` ranks, with ``later``'s changes
    (another stage, batch split) -- loads it and trains the rest.  Returns the second run's results."""
    pools.run(world_size, run_experiment, replace(exp, steps=split, save=str(directory), consolidated=consolidated))
    second = replace(exp, steps=exp.steps - split, first_step=split, resume=str(directory), **later)
    return pools.run(load_at or world_size, run_experiment, second)


def assert_bit_exact(whole, rest, split: int) -> None:
    for rank, (a, b) in enumerate(zip(whole, rest, strict=True)):
        for i, params in enumerate(b.params):
            for name, value in params.items():
                assert torch.equal(value, a.params[split + i][name]), f"rank {rank}, step {split + i}, {name}"
        assert b.losses == a.losses[split:], f"rank {rank}: losses"
        assert b.loss_scales == a.loss_scales[split:], f"rank {rank}: loss scales"
        assert_same_optimizer_state(b.optimizer_state, a.optimizer_state, f"rank {rank}")


def assert_same_optimizer_state(got: dict, want: dict, where: str) -> None:
    """Every state tensor (Adam's moments and step) bit for bit, and every hyper-parameter."""
    assert got["param_groups"] == want["param_groups"], where
    assert got["state"].keys() == want["state"].keys(), where
    for i, entry in want["state"].items():
        for key, value in entry.items():
            same = torch.equal(got["state"][i][key], value) if torch.is_tensor(value) else got["state"][i][key] == value
            assert same, f"{where}: optimizer state {key} of parameter {i}"


# Every stage, each format by turns (ZeRO-3, the one that gathers to consolidate, both); the property below
# draws both formats for every stage.
EVERY_STAGE = [(stage, i % 2 == 1) for i, stage in enumerate(STAGES)] + [("zero3", False), ("zero3", True)]


@pytest.mark.parametrize("stage, consolidated", sorted(set(EVERY_STAGE)))
def test_resume_is_bit_exact_for_every_stage(pools, tmp_path, stage, consolidated):
    """Three ranks (uneven shards), accumulation K=2, AdamW on a GPT with its tied weights; the optimizer
    state (Adam's moments and step) must come back exactly too, or the next steps differ."""
    exp = Experiment(stage=stage, steps=3, accum=2, micro_batch=2, dtype="float32", optimizer="adamw",
                     model=SMALL_GPT)
    whole = pools.run(3, run_experiment, exp)
    assert_bit_exact(whole, resumed(pools, exp, 3, 1, tmp_path, consolidated), 1)


@pytest.mark.parametrize("stage", STAGES)
def test_resume_carries_the_loss_scaler(pools, tmp_path, stage):
    """fp16 with an overflow at step 1 (skipped, scale halved) and a window of 2: at the save after step 3 the
    scale is 128 with one clean step counted, so the next step doubles it -- a fresh scaler would not."""
    exp = Experiment(stage=stage, steps=5, dtype="float32", optimizer="adamw", overflow_at=(1, 0), model=SMALL_GPT,
                     options={"precision": Precision("fp16", loss_scale=2.0 ** 8, loss_scale_window=2)})
    whole = pools.run(2, run_experiment, exp)
    assert whole[0].loss_scales == [256.0, 128.0, 128.0, 256.0, 256.0]
    rest = resumed(pools, exp, 2, 3, tmp_path)
    assert_bit_exact(whole, rest, 3)
    assert rest[0].skipped_steps == whole[0].skipped_steps == 1


@pytest.mark.parametrize("stage", ["ddp-bucketed", "zero3"])
def test_resume_carries_error_feedback(pools, tmp_path, stage):
    """Compression's carried rounding error is each rank's own state: a sharded checkpoint keeps it."""
    exp = Experiment(stage=stage, steps=3, dtype="float32", optimizer="momentum", lr=0.05, model=SMALL_GPT,
                     options={"compress": "fp16", "error_feedback": True})
    whole = pools.run(2, run_experiment, exp)
    assert_bit_exact(whole, resumed(pools, exp, 2, 1, tmp_path), 1)


@covering
@settings(max_examples=examples(6))
@given(drawn=st.sampled_from(STAGES).flatmap(lambda stage: experiments(stage, precision=True)),
       split=st.integers(1, 3), consolidated=st.booleans())
def test_resume_property(pools, tmp_path_factory, drawn, split, consolidated):
    """Any drawn experiment -- world sizes 1-4, uneven and empty batches, frozen and unused parameters,
    mixed precision, compression with error feedback (its residuals are part of the state) -- resumes exactly."""
    exp, world_size = drawn
    exp = replace(exp, steps=max(exp.steps, 2))
    # Error feedback's residuals are each rank's own: only a sharded checkpoint keeps them (load says so).
    consolidated = consolidated and not exp.options.get("error_feedback")
    split = min(split, exp.steps - 1)
    whole = pools.run(world_size, run_experiment, exp)
    rest = resumed(pools, exp, world_size, split, tmp_path_factory.mktemp("ck"), consolidated)
    assert_bit_exact(whole, rest, split)


SPLITS = {1: (12,), 2: (7, 5), 3: (4, 4, 4), 4: (3, 3, 3, 3)}  # one global batch of 12, split over N ranks


@pytest.mark.parametrize("saved, loaded, consolidated", [
    (("zero2", 4), ("zero2", 3), False), (("zero3", 3), ("zero3", 2), True), (("zero1", 2), ("zero1", 1), False),
    (("zero3", 4), ("ddp", 3), False), (("ddp-bucketed", 1), ("zero3", 4), True)])
def test_reshard_continues_single_device_training(pools, tmp_path, saved, loaded, consolidated):
    """Two optimizer param groups (different lr and weight decay), the GPT's tied weights, float64: the
    resumed run at M ranks matches single-device training to 1e-9, parameters and optimizer states."""
    (a, n), (b, m) = saved, loaded
    exp = Experiment(stage=a, steps=3, dtype="float64", optimizer="adamw", rank_sizes=SPLITS[n], model=SMALL_GPT,
                     param_groups=True, record_states=True)
    reference = exact_reference_of(exp, n)
    rest = resumed(pools, exp, n, 1, tmp_path, consolidated, stage=b, load_at=m, rank_sizes=SPLITS[m])
    tail = replace(reference, params=reference.params[1:], losses=reference.losses[1:],
                   optimizer_states=reference.optimizer_states[1:])
    verdict = judge(rest, tail, "float64", states=True)
    assert verdict.ok, verdict.violation or verdict.nonfinite


@settings(max_examples=examples(6))
@given(a=st.sampled_from(STAGES), b=st.sampled_from(STAGES), n=st.integers(1, 4), m=st.integers(1, 4),
       consolidated=st.booleans())
def test_reshard_property(pools, tmp_path_factory, a, b, n, m, consolidated):
    exp = Experiment(stage=a, task="mlp", model={"sizes": (5, 7, 3)}, steps=3, dtype="float64", optimizer="adamw",
                     rank_sizes=SPLITS[n], record_states=True)
    reference = exact_reference_of(exp, n)
    rest = resumed(pools, exp, n, 1, tmp_path_factory.mktemp("ck"), consolidated, stage=b, load_at=m,
                   rank_sizes=SPLITS[m])
    tail = replace(reference, params=reference.params[1:], losses=reference.losses[1:],
                   optimizer_states=reference.optimizer_states[1:])
    verdict = judge(rest, tail, "float64", states=True)
    assert verdict.ok, verdict.violation or verdict.nonfinite


def test_consolidated_loads_into_plain_pytorch(pools, tmp_path):
    """The consolidated file is for people without minizero: torch.load, load_state_dict, train on."""
    exp = Experiment(stage="zero3", steps=2, dtype="float64",
                     optimizer="adamw", save=str(tmp_path), consolidated=True)
    ranks = pools.run(2, run_experiment, exp)
    state = torch.load(tmp_path / "step-00000002" / "consolidated.pt", weights_only=False)
    model = TASKS["gpt"].make_model(7, torch.float64)
    model.load_state_dict(state["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(state["optimizer"])
    for name, value in model.state_dict().items():
        assert torch.equal(value, ranks[0].params[-1].get(name, value)), name
    assert all(int(s["step"]) == 2 for s in optimizer.state.values())


# ---------------------------------------------------------------------- refused, naming the file or tensor
@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory):
    """A run saved twice: at step 1 and step 2 (zero2 at N=2, sharded)."""
    root = tmp_path_factory.mktemp("run")
    exp = Experiment(stage="zero2", steps=1, dtype="float32",
                     optimizer="adamw")
    pools.run(2, run_experiment, replace(exp, save=str(root)))
    pools.run(2, run_experiment, replace(exp, first_step=1, resume=str(root), save=str(root)))
    return exp, root


def load_error(pools, exp, path, world_size=2, **changes) -> str:
    with pytest.raises(RankError) as caught:
        pools.run(world_size, run_experiment, replace(exp, resume=str(path), first_step=2, **changes))
    assert "CheckpointError" in caught.value.remote_traceback
    return caught.value.remote_traceback


def test_latest_is_the_newest_complete_save(saved):
    exp, root = saved
    assert (root / "latest").read_text() == "step-00000002"
    assert checkpoint.find(root) == root / "step-00000002"


def test_a_save_that_crashed_is_refused_and_the_previous_one_still_loads(pools, saved, tmp_path):
    """Rank files written, the manifest never: as if the run died mid-save."""
    exp, root = saved
    copy = tmp_path / "run"
    os.system(f"cp -r {root} {copy}")
    (copy / "step-00000002" / "manifest.json").unlink()
    (copy / "latest").write_text("step-00000001")  # the crash came before latest moved
    error = load_error(pools, exp, copy / "step-00000002")
    assert "step-00000002: no manifest.json, so this save did not finish" in error
    pools.run(2, run_experiment, replace(exp, resume=str(copy), first_step=1))  # loads step 1
    (copy / "latest").unlink()
    assert checkpoint.find(copy) == copy / "step-00000001"  # the newest directory *with* a manifest


def test_a_truncated_file_is_refused_naming_it(pools, saved, tmp_path):
    exp, root = saved
    os.system(f"cp -r {root} {tmp_path / 'run'}")
    victim = tmp_path / "run" / "step-00000002" / "rank-00001-of-00002.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    error = load_error(pools, exp, tmp_path / "run")
    assert "rank-00001-of-00002.pt: 1000 bytes, but the manifest says" in error and "truncated" in error


def test_another_format_version_is_refused(pools, saved, tmp_path):
    exp, root = saved
    os.system(f"cp -r {root} {tmp_path / 'run'}")
    manifest = tmp_path / "run" / "step-00000002" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 99}))
    assert "written in checkpoint format version 99; this minizero reads versions 1 and 2" in load_error(
        pools, exp, tmp_path / "run")


def test_another_model_is_refused_naming_the_first_tensor(pools, saved):
    exp, root = saved
    error = load_error(pools, exp, root, model={"d_model": 16})
    assert "a checkpoint of another model: 'token_embedding.weight' is float32 [" in error
    assert "resume with the --model" in error


def test_another_precision_is_refused(pools, saved):
    exp, root = saved
    error = load_error(pools, exp, root, options={"precision": "bf16"})
    assert "saved with precision fp32, this run uses bf16; resume with --precision fp32" in error


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        checkpoint.find(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        checkpoint.find(tmp_path / "nowhere")


def _save_with_a_fault(me, exp, root, fault):
    """Build and save a stage with ``fault`` injected on one rank; return what each rank raised."""
    import minizero.checkpoint as ck
    stage, _, comm, _ = build(me, exp)
    kept = ck.save_tensors, ck.write_manifest
    if fault == "disk full" and me.rank == 1:
        ck.save_tensors = lambda path, payload: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    if fault == "death before the manifest" and me.rank == 0:
        ck.write_manifest = lambda directory, manifest: os._exit(1)  # the process dies mid-save
    try:
        checkpoint.save(stage, root, 2)
        return None
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    finally:
        ck.save_tensors, ck.write_manifest = kept  # the pool's ranks live on: leave nothing patched
        comm.close()


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(pools, saved, tmp_path):
    """Disk full on rank 1: every rank hears of it at once (no one waits for a manifest that never comes)."""
    exp, _ = saved
    errors = pools.pool(2).run(_save_with_a_fault, exp, str(tmp_path), "disk full")
    assert "No space left on device" in errors[1]
    assert "rank(s) [1] could not write their file, so this save was not completed" in errors[0]
    assert list(tmp_path.iterdir()) == []  # nothing of the failed save is left behind


def test_an_interrupted_save_over_an_old_one_leaves_the_old_one_whole(pools, saved, tmp_path):
    """Saving step 2 again (a rerun into the same directory) and dying before the manifest: the new save was
    staged beside the old one, so step 2 -- the old, complete one -- still loads, and --resume says what it
    skipped; the next save removes what the dead one left."""
    exp, root = saved
    os.system(f"cp -r {root} {tmp_path / 'run'}")
    with pytest.raises(RankError, match="rank 0 died"):
        pools.pool(2).run(_save_with_a_fault, exp, str(tmp_path / "run"), "death before the manifest")
    found, notes = find_with_notes(tmp_path / "run")
    assert found == tmp_path / "run" / "step-00000002"
    assert any(n.startswith("skipped .step-00000002.saving-") for n in notes), notes
    pools.run(2, run_experiment, replace(exp, resume=str(tmp_path / "run"), first_step=2, save=str(tmp_path / "run")))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["latest", "step-00000001", "step-00000002",
                                                                   "step-00000003"]


def test_a_file_from_another_save_is_refused(pools, saved, tmp_path):
    """Same sizes, another save: a rank file copied from another run is named.  (The other run is made as
    ``saved`` was, saved after a resume, so its files have the same sizes -- a fresh two-step run's pickles can
    differ by a few bytes, and the size check would speak first.)"""
    exp, root = saved
    os.system(f"cp -r {root} {tmp_path / 'a'}")
    pools.run(2, run_experiment, replace(exp, save=str(tmp_path / "b")))
    pools.run(2, run_experiment, replace(exp, first_step=1, resume=str(tmp_path / "b"), save=str(tmp_path / "b")))
    step = "step-00000002/rank-00001-of-00002.pt"
    os.system(f"cp {tmp_path / 'b' / step} {tmp_path / 'a' / step}")
    assert "rank-00001-of-00002.pt: written by another save than the manifest's" in load_error(pools, exp, tmp_path / "a")


def test_a_stage_without_its_optimizer_is_refused_before_anything_is_written(tmp_path):
    """A checkpoint keeps the optimizer's state; a stage wrapped without one (its optimizer built afterwards
    over stage.parameters()) cannot be saved or loaded -- and nothing is written or overwritten trying."""
    from minizero.stages import Stage
    stage = Stage(TASKS["mlp"].make_model(0, torch.float32))
    before = {k: v.clone() for k, v in stage.module.state_dict().items()}
    for attempt in (lambda: checkpoint.save(stage, tmp_path, 1), lambda: checkpoint.load(stage, tmp_path)):
        with pytest.raises(CheckpointError, match="a checkpoint keeps the optimizer's state, and this stage was "
                                                  "wrapped without one; pass your optimizer to make_stage"):
            attempt()
    assert list(tmp_path.iterdir()) == []
    assert all(torch.equal(v, before[k]) for k, v in stage.module.state_dict().items())


def _lr_after_resume(me, exp, root):
    """Save with the learning rate a scheduler left (0.25), load into a fresh stage built with 1e-3."""
    stage, _, comm, _ = build(me, exp)
    for group in stage.optimizer.param_groups:
        group["lr"] = 0.25
    checkpoint.save(stage, root, 1)
    comm.close()
    fresh, _, comm, _ = build(me, exp)
    notes = checkpoint.load(fresh, root)["notes"]
    comm.close()
    return [group["lr"] for group in fresh.optimizer.param_groups], notes


@pytest.mark.parametrize("stage, precision", [("ddp", "fp32"), ("ddp", "bf16"), ("zero2", "fp32"), ("zero3", "bf16")])
def test_the_optimizers_hyper_parameters_come_back(pools, tmp_path, stage, precision):
    """What a scheduler changed is part of the state: every path -- the plain optimizer, the one rebuilt over
    fp32 masters, ZeRO's sharded one -- takes the saved settings, not the fresh optimizer's."""
    exp = Experiment(stage=stage, dtype="float32", optimizer="adamw", lr=1e-3, model=SMALL_GPT,
                     options={"precision": precision})
    ranks = pools.run(2, _lr_after_resume, exp, str(tmp_path))
    assert [lrs for lrs, _ in ranks] == [[0.25], [0.25]]
    assert "optimizer group 0: lr 0.25 from the checkpoint replaces this run's 0.001 (as torch's load_state_dict " \
           "does)" in ranks[0][1]  # followed, and said


@pytest.mark.parametrize("stage, compress, split, feedback", [
    ("ddp-bucketed", "powersgd:rank=2", 2, True), ("ddp-bucketed", "powersgd:rank=1,start=2", 1, True),
    ("ddp-bucketed", "powersgd:rank=1,warm_start=0", 2, True), ("ddp-bucketed", "int8:stochastic=1", 2, True),
    ("zero2", "int4:stochastic=1", 2, False), ("ddp-bucketed", "topk:0.1", 1, True), ("zero2", "int8", 2, True),
    ("zeropp", "sign", 1, True),
    # without error feedback PowerSGD still keeps its Q, its steps and its seeds (once saved with feedback only)
    ("ddp-bucketed", "powersgd:rank=2", 2, False), ("ddp-bucketed", "powersgd:rank=1,start=3", 2, False)])
def test_resume_carries_a_codecs_and_powersgds_state(pools, tmp_path, stage, compress, split, feedback):
    """The residuals, a stochastic codec's count of each buffer's averages (its stream's seed, with error feedback or
    without), and PowerSGD's warm-start Q, its count of steps (``start``) and its generator of seeds: all are state
    a resumed run needs -- saved at step 1 (still uncompressed when start=2) or 2, bit for bit;
    on ZeRO (qgZ) each rank's residual of its whole buffer, and ZeRO++ with quantized weights too."""
    options = {"compress": compress, "error_feedback": feedback, "bucket_mb": 0.005}
    if stage == "zeropp":
        options = {"compress": compress, "error_feedback": True, "quantized_weights": "int8"}
    exp = Experiment(stage=stage, steps=4, dtype="float32", optimizer="adamw", model=SMALL_GPT, options=options)
    whole = pools.run(3, run_experiment, exp)
    assert_bit_exact(whole, resumed(pools, exp, 3, split, tmp_path), split)

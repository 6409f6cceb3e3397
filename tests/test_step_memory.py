"""Will it fit? (:mod:`minizero.lab.step_memory`): the activations a step keeps, by Korthikanti et al. 2022's
formula, with and without checkpointing; the peak per rank beside the allocator's own account of a step; the
smallest change that makes a model fit a GPU."""
from __future__ import annotations

import pytest
import torch

from minizero.lab.memory_table import MODELS, gpt_shape, measured_activation_bytes, measured_rows
from minizero.lab.optimizers import OPTIMIZERS, STATE_TENSORS
from minizero.lab.step_memory import (
    Plan,
    Shape,
    activation_bytes,
    fits,
    gathered_unit_bytes,
    gpu_bytes,
    step_bytes,
    step_temporary_bytes,
)
from minizero.lab.tasks import TASKS
from minizero.memory import profiled_step
from minizero.stages import STAGES, distributed


def test_the_formula_is_korthikantis_eq_1_and_full_recomputation_keeps_each_layers_input():
    shape = Shape(layers=32, hidden=4096, heads=32, seq=2048, vocab=50257)
    s, b, h, a = 2048, 1, 4096, 32
    sixteen = activation_bytes(shape, b, 2)
    assert sixteen["per_block"] == s * b * h * (34 + 5 * a * s / h)  # eq. 1, 16-bit bytes
    assert sixteen["peak"] == 32 * sixteen["per_block"] + sixteen["head"]
    fp32 = activation_bytes(shape, b, 4)
    assert fp32["per_block"] == 2 * sixteen["per_block"]  # fp32: the blocks' figures double...
    assert fp32["head"] - sixteen["head"] == 2 * s * b * h * (4 - 2)  # ... and the head's 2sbh inputs; not its fp32 logits
    kept = activation_bytes(shape, b, 2, checkpointed=True)
    assert kept["blocks"] == 32 * 2 * s * b * h and kept["peak"] == kept["blocks"] + kept["head"] + kept["per_block"]
    no_dropout = activation_bytes(Shape(32, 4096, 32, 2048, dropout=False), b, 2)
    assert no_dropout["per_block"] == s * b * h * (32 + 2 * a * s / h)  # the masks and the dropout's outputs gone


def test_the_papers_7_5b_model_on_64_gpus_of_80gb():
    shape = Shape.of_params(7.5e9, 2048)
    assert (shape.layers, shape.hidden, shape.heads) == (32, 4096, 32)  # GPT-3 6.7B's shape, the nearest
    verdicts = {stage: fits(7.5e9, shape, Plan(stage, 64, 1, False), 80e9, "fp16") for stage in
                ("ddp", "zero1", "zero2", "zero3")}
    assert verdicts["zero1"][0]["model_states"] == pytest.approx(31.4e9, rel=1e-3)  # Table 1, with the activations
    assert verdicts["ddp"][1] == Plan("zero1", 64, 1, False)  # the cheapest change that fits: ZeRO-1
    for stage in ("zero1", "zero2", "zero3"):
        assert verdicts[stage][1] == Plan(stage, 64, 1, False)  # fits as it is
    # Longer sequences on 8 GPUs: no ZeRO stage is enough, checkpointing is the smallest change for each.
    for stage in ("zero1", "zero2", "zero3"):
        here, change = fits(7.5e9, Shape.of_params(7.5e9, 4096), Plan(stage, 8, 4, False), 80e9, "fp16")
        assert here["total"] > 80e9 and change == Plan(stage, 8, 4, True), (stage, change)
    assert fits(7.5e9, shape, Plan("ddp", 1, 1, False), 1e9)[1] is None  # 1 GB: nothing tried fits


def test_gpu_sizes_are_read_in_the_vendors_units_and_nonsense_is_refused():
    assert gpu_bytes("80GB") == 80e9 and gpu_bytes("40GiB") == 40 * 2 ** 30 and gpu_bytes("8e10") == 8e10
    for bad in ("eighty", "0GB", "-1GB", "GB"):
        with pytest.raises(ValueError, match="give a memory size such as 80GB"):
            gpu_bytes(bad)


def test_the_predicted_peak_is_within_10_percent_of_the_measured_for_every_stage():
    """fp32, three ranks (uneven shards), blocks stored and checkpointed: model states (the formula / the live
    tensors), activations (the formula / the allocator's peak of a profiled step, less its model states), ZeRO-3's
    gathered units (the formula / the observer's peak)."""
    n, micro_batch = 3, 8
    shape = gpt_shape("gpt")
    rows = measured_rows("gpt", n, "fp32", "adamw", timeout_s=60.0, steps=2)  # (fp32: no step is skipped)
    assert {row["stage"] for row in rows} == set(distributed())
    for checkpointed in (False, True):
        activations = measured_activation_bytes("gpt", micro_batch, checkpointed, "fp32")
        predicted_activations = activation_bytes(shape, micro_batch, 4, checkpointed)["peak"]
        assert abs(activations / predicted_activations - 1) < 0.10, (checkpointed, activations, predicted_activations)
        for row in rows:
            stage, psi = row["stage"], row["psi"]
            states = STAGES[stage].state_bytes(psi, n, 4, STATE_TENSORS["adamw"], "fp32")
            gathered = gathered_unit_bytes(stage, shape, 4)
            assert abs(row["measured_bytes_per_rank"] / states - 1) < 0.01, (stage, row, states)
            assert abs(row["gathered_peak"] - gathered) <= 0.02 * max(gathered, 1), (stage, row["gathered_peak"],
                                                                                     gathered)
            predicted = step_bytes(stage, psi, shape, n, micro_batch, "fp32", "adamw", checkpointed,
                                   foreach=False)["total"]  # (the CPU's for-loop optimizer)
            seen = row["measured_bytes_per_rank"] + activations + row["gathered_peak"]
            assert abs(seen / predicted - 1) < 0.10, (stage, checkpointed, seen, predicted)


def test_16_bit_activations_are_within_15_percent_of_the_formula():
    """bf16 (the logits and their log-softmax counted in fp32, as the stage computes the loss): what is left is
    about one vocabulary-sized fp32 tensor the formula does not count, some 8-12% on this small GPT."""
    shape = gpt_shape("gpt")
    for checkpointed in (False, True):
        measured = measured_activation_bytes("gpt", 8, checkpointed, "bf16")
        predicted = activation_bytes(shape, 8, 2, checkpointed)["peak"]
        assert abs(measured / predicted - 1) < 0.15, (checkpointed, measured, predicted)


def test_offload_moves_the_optimizers_bytes_to_the_host_and_is_a_change_that_can_make_it_fit():
    """13B on four 40 GB GPUs, blocks checkpointed: ZeRO-3 does not fit (its 16Psi/N of model states alone is 52 GB),
    and offloading the optimizer -- 12Psi/N to the host -- is the smallest change; mixed precision's fp32 step
    gradients are 4Psi for DDP, 4Psi/N under ZeRO, none on the device once offloaded."""
    psi, shape = 13e9, Shape.of_params(13e9, 2048)
    here, change = fits(psi, shape, Plan("zero3", 4, 1, True), 40e9, "bf16")
    assert here["total"] > 40e9 and change == Plan("zero3", 4, 1, True, offloaded=True), (here, change)
    offloaded = step_bytes("zero3", psi, shape, 4, 1, "bf16", "adam", True, offloaded=True)
    assert offloaded["model_states"] == pytest.approx(4 * psi / 4) and offloaded["host"] == pytest.approx(12 * psi / 4)
    assert step_bytes("ddp", psi, shape, 4, 1, "bf16")["step_gradients"] == 4 * psi
    assert step_bytes("zero2", psi, shape, 4, 1, "bf16")["step_gradients"] == 4 * psi / 4
    assert offloaded["step_gradients"] == 0 and step_bytes("zero2", psi, shape, 4, 1, "fp32")["step_gradients"] == 0


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_foreach_step_holds_what_the_prediction_says_on_top_of_the_model_states(name):
    """torch's foreach optimizer (its default for CUDA tensors; asked for here on the CPU) computes over whole tensor
    lists: Adam's sqrt(v) is one more fp32 copy of everything it steps -- the GPU run found DDP's peak there, not in
    backward.  The profiled step holds exactly that beyond its parameters, gradients and states; the for-loop
    implementation (the CPU's default) one parameter's worth at a time.  SGD's foreach works in place."""
    model = MODELS["bench-gpt"]
    net = TASKS["gpt"].make_model(0, torch.float32, **model)
    optimizer = OPTIMIZERS[name](net.parameters(), 1e-3)
    x, y = TASKS["gpt"].make_batch(2, 0, 0, torch.float32, **model)
    psi = sum(p.numel() for p in net.parameters())
    largest = max(p.numel() for p in net.parameters()) * 4

    def backward():
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()

    backward()
    optimizer.step()  # the states exist from here on
    held = {}
    for foreach in (True, False):
        for group in optimizer.param_groups:
            group["foreach"] = foreach
        backward()
        seen = profiled_step(optimizer.step)
        held[foreach] = seen["peak"] - seen["parameter"] - seen["gradient"] - seen["optimizer_state"]
    predicted = step_temporary_bytes("ddp", psi, 1, name)
    assert abs(held[True] - predicted) <= 64, (name, held, predicted)  # (64 B: the step counters' scalars)
    assert held[False] <= 2 * largest + 4096, (name, held, largest)  # Adam's loop: sqrt(v) and its quotient
    assert step_temporary_bytes("zero2", psi, 4, name) == predicted / 4  # ZeRO steps the owned shard
    assert step_temporary_bytes("zero2", psi, 4, name, offloaded=True) == 0  # offloaded: on the host


def test_measuring_on_a_gpu_is_refused_without_one_or_without_a_model(capsys):
    """``memory --device cuda`` measures a --model's ranks on the GPU: with --params there is nothing to measure, and
    on a machine without CUDA nothing to measure with -- each refused before any rank starts, saying what to do."""
    from minizero.__main__ import main as cli

    assert cli(["memory", "--params", "1e9", "--device", "cuda"]) != 0
    assert "--params is a prediction only: leave --device out, or give --model" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli(["memory", "--model", "gpt", "--device", "cuda"]) != 0
        assert "sees no CUDA GPU here (torch.cuda.is_available() is False)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["memory", "--model", "gpt", "--stages", "ddp,zero9"])
    assert "zero9 is not a distributed stage; choose from ddp" in capsys.readouterr().err


def test_the_gpu_table_sets_what_cudas_libraries_keep_apart_from_the_step():
    """``memory --device cuda``'s table, from a rank's figures (no GPU needed to read them): the step adds its peak
    less what was allocated as it began; the libraries' share is that start less the model states held, and comes
    off the measured peak before it is set beside the prediction."""
    from types import SimpleNamespace

    from minizero.lab.memory_table import cuda_step_lines

    args = SimpleNamespace(model="gpt", precision="bf16", checkpoint_activations=False, micro_batch=8,
                           optimizer="adam", offload_optimizer=False)
    psi, n = 27_584, 4
    predicted = step_bytes("zero2", psi, gpt_shape("gpt"), n, 8, "bf16", "adam")
    held, libraries = int(predicted["model_states"]), 70_000_000
    adds = int(1.1 * (predicted["total"] - predicted["model_states"]))  # the step adds 10% more than predicted
    row = {"stage": "zero2", "cuda_held": held, "cuda_resident": held + libraries,
           "cuda_peak": held + libraries + adds}
    line = cuda_step_lines(args, psi, [row], n, "a GPU")[2]
    off = (held + adds) / predicted["total"] - 1
    assert line.split()[-2] == f"{off:+.1%}" and line.split()[-1] == f"{libraries:,}", line
    assert f"{adds:,}" in line and f"{held + adds:,}" in line, line

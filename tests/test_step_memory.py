"""Will it fit? (:mod:`minizero.course.harness.step_memory`): the activations a step keeps, by Korthikanti et al. 2022's
formula, with and without checkpointing; the peak per rank beside the allocator's own account of a step; the
smallest change that makes a model fit a GPU."""
from __future__ import annotations

import json

import pytest
import torch

from minizero.__main__ import main
from minizero.course.commands.memory_table import MODELS, gpt_shape, measured_activation_bytes, measured_rows, step_peak
from minizero.course.harness.optimizers import OPTIMIZERS
from minizero.course.harness.step_memory import (
    Plan,
    Shape,
    activation_bytes,
    backward_activation_bytes,
    fits,
    gathered_unit_bytes,
    gpu_bytes,
    step_bytes,
    step_temporary_bytes,
)
from minizero.course.harness.tasks import TASKS
from minizero.observe.memory import profiled_step
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
    for bad in ("eighty", "0GB", "-1GB", "GB", "1e400GB", "infGB"):
        with pytest.raises(ValueError, match="give a memory size such as 80GB"):
            gpu_bytes(bad)
    with pytest.raises(ValueError, match="is 80 bytes -- no GPU is that small; give a unit, such as 80GB"):
        gpu_bytes("80")  # read as 80 bytes, once without a word


@pytest.mark.parametrize("gpu, said", [("80", "is 80 bytes -- no GPU is that small; give a unit, such as 80GB"),
                                       ("1e400GB", "give a memory size such as 80GB")])
def test_the_command_line_says_what_gpu_bytes_refuses_word_for_word(capsys, gpu, said):
    """``memory --gpu 80`` once printed argparse's "invalid gpu_bytes value: '80'": the reason never reached the user."""
    with pytest.raises(SystemExit) as ended:
        main(["memory", "--params", "1e9", "--world-size", "8", "--gpu", gpu])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "invalid" not in err, err


#: How far a step's measured peak may be from the prediction: above it by at most 3% (a "fits" must fit); below it by
#: at most what the communication thread's timing decides (``in_flight``: a bucket being reduced, ZeRO-3's prefetched
#: block, both counted as held), and 1% of the rest (the allocator's rounding).  Measured on two idle cores: zero3 3.6%
#: below, hsdp 5.0% (each within its in-flight bytes); with every collective run at its launch (nothing in flight at
#: all) zero3 11.5% and hsdp 9.4% below -- so a flat percentage fails on a busy machine, or is too loose to catch the
#: gradients zero_grad() freed counted at backward's start.
ABOVE, BELOW = 0.03, 0.01


def within_the_prediction(seen: float, predicted: dict) -> bool:
    low = (1 - BELOW) * (predicted["total"] - predicted["in_flight"])
    return low < seen < (1 + ABOVE) * predicted["total"]


@pytest.mark.alone  # three spawned ranks sampling malloc after every operator: minutes under the parallel phase's load
def test_the_predicted_peak_holds_the_measured_one_for_every_stage():
    """bench-gpt (Psi = 0.8M), fp32, three ranks, blocks checkpointed, 1 MiB buckets (ZeRO-2 packs four): each stage's
    whole step as malloc saw it -- sampled after every operator of a rank, its communication thread's buffers
    included -- less what the process held besides the model states, against the most of the prediction's four
    moments.  Checkpointed, the stages peak at three of them (DDP and the parameter server after backward, the rest
    in it, ZeRO-2 and -3 beside a bucket).  Fails when the gradients zero_grad() frees are counted at backward's
    start, when DDP's flat copy, backward's working memory or ZeRO-2's packed buckets are left out.  (Blocks stored,
    every stage peaks at backward's start, within 1.3%: lesson 18's first measurement, ``memory --model bench-gpt``.)"""
    n, micro_batch, bucket_mb, checkpointed = 3, 8, 1.0, True
    shape, equivalent = gpt_shape("bench-gpt"), [s for s in distributed() if STAGES[s].equivalent]
    rows = measured_rows("bench-gpt", n, "fp32", "adamw", timeout_s=120.0, stages=equivalent, steps=2,
                         micro_batch=micro_batch, checkpointed=checkpointed, bucket_mb=bucket_mb)
    for row in rows:
        stage, psi = row["stage"], row["psi"]
        predicted = step_bytes(stage, psi, shape, n, micro_batch, "fp32", "adamw", checkpointed, foreach=False,
                               bucket_mb=bucket_mb)  # (the CPU's for-loop optimizer)
        assert abs(row["host_held"] / predicted["model_states"] - 1) < 0.01, (stage, row, predicted)
        gathered = gathered_unit_bytes(stage, shape, 4)
        assert abs(row["gathered_peak"] - gathered) <= 0.02 * max(gathered, 1), (stage, row["gathered_peak"], gathered)
        seen = step_peak(row)
        assert within_the_prediction(seen, predicted), (stage, checkpointed, seen, predicted)
    assert step_bytes("zero2", rows[0]["psi"], shape, n, micro_batch, "fp32", "adamw", checkpointed, foreach=False,
                      bucket_mb=bucket_mb)["buckets"] > 0  # the peak is beside a bucket


@pytest.mark.parametrize("model, precision", [("gpt", "fp32"), ("bench-gpt", "bf16")])
def test_activations_measured_in_a_profiled_step_are_within_12_percent_of_the_prediction(model, precision):
    """One device: the most a step held at any moment besides its model states and input
    (torch.profiler's memory categories) beside Korthikanti et al.'s count and what backward adds to it -- the
    loss's gradient, the gradient through a block's MLP, the head's gradient waiting for the embedding's -- blocks
    stored and checkpointed: measured 0-9% under (the prediction takes a replayed block whole, and the gradients into
    and out of GeLU, as alive at once: an upper bound).  The lab's GPT in fp32; bench-gpt in bf16, the logits and
    their log-softmax in fp32, as the stage computes the loss (on the lab's tiny GPT 16 bits leave some tens of kB
    the prediction does not place, +28% checkpointed)."""
    shape, working = gpt_shape(model), 4 if precision == "fp32" else 2
    for checkpointed in (False, True):
        measured = measured_activation_bytes(model, 8, checkpointed, precision)
        predicted = backward_activation_bytes(shape, 8, working, checkpointed)
        assert abs(measured / predicted - 1) < 0.12, (checkpointed, measured, predicted)


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
    implementation (the CPU's default) one parameter's worth at a time -- the largest's, twice for Adam, once for
    Nesterov.  SGD's foreach works in place."""
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
    loop = step_temporary_bytes("ddp", psi, 1, name, foreach=False, largest=largest / 4)  # one tensor's worth
    assert abs(held[False] - loop) <= 4096, (name, held, loop)  # Adam's loop: sqrt(v) and its quotient
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
    less what was allocated as it began; the libraries' share ('rest') is that start less the model states held, and
    comes off the measured peak before it is set beside the prediction."""
    from types import SimpleNamespace

    from minizero.course.commands.memory_table import measured_step_lines

    args = SimpleNamespace(model="gpt", precision="bf16", checkpoint_activations=False, micro_batch=8,
                           optimizer="adam", offload_optimizer=False, bucket_mb=25.0, reduce_scatter_buffers=1)
    psi, n = 27_584, 4
    predicted = step_bytes("zero2", psi, gpt_shape("gpt"), n, 8, "bf16", "adam")
    held, libraries = int(predicted["model_states"]), 70_000_000
    adds = int(1.1 * (predicted["total"] - predicted["model_states"]))  # the step adds 10% more than predicted
    row = {"stage": "zero2", "cuda_held": held, "cuda_resident": held + libraries,
           "cuda_peak": held + libraries + adds, "gathered_peak": 0}
    line = measured_step_lines(args, psi, [row], n, "a GPU")[2]
    off = (held + adds) / predicted["total"] - 1
    assert line.split()[-2] == f"{off:+.1%}" and line.split()[-1] == f"{libraries:,}", line
    assert f"{held + adds:,}" in line and f"{held:,}" in line, line


def test_a_c_library_without_mallinfo2_is_refused_saying_where_to_measure(monkeypatch):
    """The CPU's whole-step figure reads glibc's mallinfo2(); elsewhere (macOS, musl, glibc before 2.33) it is refused
    before any rank starts, saying what to do -- not an AttributeError from ctypes."""
    import minizero.observe.memory as memory

    class NoMallinfo2:
        def __init__(self, *_):
            pass

    monkeypatch.setattr(memory.ctypes, "CDLL", NoMallinfo2)
    with pytest.raises(RuntimeError, match="reads glibc's mallinfo2.*measure on Linux, or on a GPU"):
        memory.HostStepPeaks()


def test_memory_json_holds_the_step_table_and_the_fit_verdicts_the_text_prints(capsys):
    """``memory --json`` once held the model states only; the step's table and the fit verdicts were text alone."""
    from minizero.__main__ import main as cli

    args = ["memory", "--params", "7.5e9", "--world-size", "64", "--gpu", "80GB"]
    assert cli(args) == 0
    text = capsys.readouterr().out.splitlines()
    assert cli(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["stage"] for r in rows if r["step"] is None} == {s for s in distributed() if not STAGES[s].equivalent}
    verdicts = 0
    for r in (r for r in rows if r["step"]):
        step = r["step"]
        line = next(x for x in text if x.startswith(f"{r['stage']} ") and "fit" in x)
        said = "fits" if step["fits"] else f"does not fit; smallest change: {step['smallest_change']}"
        assert line.endswith(said) and f"{step['total'] / 1e9:,.1f} GB" in line, (line, step)
        # the verdict itself, from the fit search on the command's defaults (fp16 Adam, 4 x 2048 tokens)
        plan = Plan(r["stage"], 64, 4, False, False)
        _, fitting = fits(7.5e9, Shape.of_params(7.5e9, 2048), plan, step["gpu_bytes"], "fp16", "adam", 25.0)
        change = None if fitting is None or fitting == plan else fitting.change_from(plan)
        assert step["fits"] == (fitting == plan) and step["smallest_change"] == change, r["stage"]
        verdicts += 1
    assert verdicts >= 4


def test_the_measured_step_rows_are_what_the_table_prints():
    """``memory --model ... --json``'s step entries: the same figures as the printed line, from the same rows."""
    from types import SimpleNamespace

    from minizero.course.commands.memory_table import measured_step_lines, measured_step_rows

    args = SimpleNamespace(model="gpt", precision="bf16", checkpoint_activations=False, micro_batch=8,
                           optimizer="adam", offload_optimizer=False, bucket_mb=25.0, reduce_scatter_buffers=1)
    psi, n = 27_584, 4
    predicted = step_bytes("zero3", psi, gpt_shape("gpt"), n, 8, "bf16", "adam")
    held = int(predicted["model_states"])
    row = {"stage": "zero3", "cuda_held": held, "cuda_resident": held + 5_000, "cuda_peak": held + 5_000 + 40_000,
           "gathered_peak": 12_345}
    (entry,) = measured_step_rows(args, psi, [row], n, cuda=True)
    assert entry["measured"] == {"model_states": held, "activations": None, "gathered_units": 12_345,
                                 "peak": held + 40_000}
    assert entry["off"] == (held + 40_000) / predicted["total"] - 1 and entry["rest"] == 5_000
    line = measured_step_lines(args, psi, [row], n, "a GPU")[2]
    assert line.split()[-2] == f"{entry['off']:+.1%}" and f"{entry['measured']['peak']:,}" in line

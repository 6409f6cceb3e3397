"""When compression pays: the compressors' bytes and times on the alpha-beta ring (``scale --compress``).

The bytes formulas are checked against the ledger of real runs; the break-even bandwidth is checked by
putting the network just either side of it; the all-gather's growth in N is shown to cross fp32's ring."""
from __future__ import annotations

import math

import pytest
import torch

from minizero.comm.network import Network
from minizero.compress.overflow import flag_bytes
from minizero.course.commands.break_even import break_even, compute_s, gpt_shapes, pays_on, table, wire_terms
from minizero.course.harness.experiment import Experiment, run_experiment
from minizero.course.harness.tasks import TASKS

NET = Network(1e-4, 1e8)


@pytest.mark.parametrize("spec", ["none", "fp16", "int8", "int4:block=64", "topk:0.05", "sign", "powersgd:rank=2"])
@pytest.mark.parametrize("world_size", [3])  # uneven chunks and shards: the case a formula gets wrong
@pytest.mark.parametrize("stage", ["ddp", "zero1"])
def test_the_bytes_formula_is_what_the_ledger_counts(pools, spec, world_size, stage):
    """Per rank and step, mean over ranks: ``ddp``'s one all-reduced buffer, or ``zero1``'s one reduce-scattered
    group (a codec's shards through the all-to-all) -- the parameters' all-gather left out of the count."""
    if stage == "zero1" and spec.startswith("powersgd"):
        return  # refused there: tests/test_powersgd.py
    exp = Experiment(stage=stage, task="gpt", model={"d_model": 16, "n_layer": 1, "n_head": 2, "block_size": 8},
                     steps=2, dtype="float32", options={} if spec == "none" else {"compress": spec})
    results = pools.run(world_size, run_experiment, exp)
    model = TASKS["gpt"].make_model(0, torch.float32, **exp.model)
    shapes = [(name, p.shape) for name, p in model.named_parameters() if p.requires_grad]
    gradients = ("all_reduce", "all_gather") if stage == "ddp" else ("reduce_scatter", "all_to_all")
    counted = sum(r.sent_by_kind.get(k, 0) for r in results for k in gradients) / world_size / exp.steps
    via = "all_reduce" if stage == "ddp" else "reduce_scatter"
    assert counted == pytest.approx(wire_terms(spec, shapes, world_size, NET, via)[2], rel=2e-3)  # (ZeRO's padding)
    if stage == "zero1":  # its all-reduce: the ranks' agreement on an inf only one shard holds (compress.overflow)
        agreed = sum(r.sent_by_kind.get("all_reduce", 0) for r in results) / world_size / exp.steps
        assert agreed == flag_bytes(world_size, None if spec == "none" else spec), agreed


def _seconds(terms, network: Network, compute: float = 0.0) -> float:
    return terms[0] + compute + terms[1] / network.bandwidth


@pytest.mark.parametrize("spec, world_size", [("fp16", 8), ("int8", 2), ("topk:0.01", 4), ("powersgd:rank=4", 64),
                                              ("int8", 64), ("sign", 16)])
def test_either_side_of_the_break_even_the_faster_wire_changes(spec, world_size):
    """Just below the bandwidth ``pays`` names, the compressed averaging is faster; just above, slower (or the
    reverse for '>'): the break-even is where the two times cross, with the compute counted."""
    shapes, compute = gpt_shapes(1e8, 4), 0.003
    fp32, wire = wire_terms("none", shapes, world_size, NET), wire_terms(spec, shapes, world_size, NET)
    where, bps = break_even(fp32[:2], wire[:2], compute)
    assert where in ("below", "above"), (spec, world_size, where)
    for factor, faster in ((0.99, where == "below"), (1.01, where == "above")):
        net = Network(NET.alpha, bps * factor)
        assert (_seconds(wire, net, compute) < _seconds(fp32, net)) == faster, (spec, world_size, factor)


def test_a_gathered_codec_sends_more_than_fp32_beyond_some_n_and_powersgd_never_does():
    """int8's all-gather: (N-1) 1.016 Psi bytes against the ring's 2(N-1)/N 4 Psi -- more from N = 8 on; PowerSGD
    all-reduces its factors, so its bytes stay (n + m) r per matrix at any N."""
    shapes = gpt_shapes(1e7, 4)
    ratio = {n: wire_terms("int8", shapes, n, NET)[2] / wire_terms("none", shapes, n, NET)[2] for n in (2, 7, 8, 64)}
    assert ratio[2] < 0.3 and ratio[7] < 1 < ratio[8] < ratio[64]
    assert break_even(wire_terms("none", shapes, 64, NET)[:2], wire_terms("int8", shapes, 64, NET)[:2], 0.0)[0] \
        in ("above", "never")
    power = [wire_terms("powersgd:rank=4", shapes, n, NET)[2] / wire_terms("none", shapes, n, NET)[2]
             for n in (2, 64, 1024)]
    assert max(power) < 0.05 and max(power) / min(power) < 1.01
    # ZeRO++'s qgZ: the shards' messages through an all-to-all -- a reduce-scatter's (N-1)/N, about a quarter
    qgz = [wire_terms("int8", shapes, n, NET, "reduce_scatter")[2] / wire_terms("none", shapes, n, NET, "reduce_scatter")[2]
           for n in (2, 8, 64, 1024)]
    assert all(0.25 < q < 0.26 for q in qgz)


def test_the_table_covers_every_wire_and_size_and_compute_is_timed():
    rows = table(["fp16", "powersgd:rank=2"], 1e6, [1, 4], NET, layers=2)
    assert [(r["compress"], r["averages_with"], r["world_size"]) for r in rows] == [
        ("fp16", "all_reduce", 1), ("fp16", "all_reduce", 4), ("fp16", "reduce_scatter", 1),
        ("fp16", "reduce_scatter", 4), ("powersgd:rank=2", "all_reduce", 1), ("powersgd:rank=2", "all_reduce", 4)]
    assert rows[0]["sent_bytes"] == 0 and rows[1]["sent_bytes"] * 2 == pytest.approx(rows[1]["fp32_sent_bytes"])
    assert rows[3]["compute_ms"] > 0 and math.isfinite(rows[3]["comm_ms"])
    assert all(0 < compute_s(spec, gpt_shapes(1e6, 2), 4) < math.inf for spec in ("fp16", "int8", "powersgd:rank=2"))
    assert compute_s("none", gpt_shapes(1e6, 2), 4) == 0  # (timings are never compared: they move with the load)
    assert pays_on(("below", 2.5e9)) == "< 2.5 GB/s" and pays_on(("never", 0.0)) == "never"


def test_a_codec_is_timed_once_and_its_compute_read_at_every_world_size(monkeypatch):
    """The timing does not depend on N: the table times each codec once and reads encode + N decodes (all-gather)
    or encode + one message's worth of shards (all-to-all) at every N -- the figure equal to its formula."""
    import minizero.course.commands.break_even as be
    timed = []
    monkeypatch.setattr(be, "codec_compute", lambda spec, shapes: timed.append(spec) or be.Compute(0.002, 0.0005))
    rows = table(["int8", "sign"], 1e6, [1, 2, 8], NET, layers=2)
    assert timed == ["int8", "sign"]
    for r in rows:
        decodes = 0 if r["world_size"] == 1 else 1 if r["averages_with"] == "reduce_scatter" else r["world_size"]
        want = 0.0 if r["world_size"] == 1 else 0.002 + decodes * 0.0005
        assert r["compute_ms"] == pytest.approx(want * 1e3), r
    assert be.Compute(0.5).at(64) == 0.5 and be.Compute(0.1, 0.01).at(4, "reduce_scatter") == pytest.approx(0.11)


def test_scale_compress_prints_the_table(capsys):
    from minizero.__main__ import main
    assert main(["scale", "--params", "1e6", "--world-size", "2,4", "--compress", "int8,powersgd:rank=2,start=5",
                 "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "powersgd:rank=2,start=5" in out and "int8" in out and "pays on" in out
    assert main(["scale", "--params", "1e6"]) == 2  # neither compute nor --compress: refused
    assert "--compute-ms" in capsys.readouterr().err



def test_bench_codecs_prints_each_codecs_compute_as_its_share_of_the_step(capsys, monkeypatch):
    """``bench codecs``: each codec's compute (timed once by ``codec_compute``, read on every averaging) divided by
    the fp32 step's -- the figure held equal to its formula; the timings themselves are never compared (they move
    with the load)."""
    import minizero.course.commands.codec_compute as codec_compute
    from minizero.__main__ import main
    from minizero.course.commands.break_even import Compute
    timed = []
    terms = {"int8": Compute(0.010, 0.001), "sign": Compute(0.020, 0.004)}
    monkeypatch.setattr(codec_compute, "step_s", lambda model: 0.25)
    monkeypatch.setattr(codec_compute, "codec_compute", lambda spec, shapes: timed.append(
        (spec, sum(s.numel() for _, s in shapes))) or terms.get(spec, Compute(0.01)))
    rows = codec_compute.bench_codec_compute(3, model="tiny", codecs=("int8", "sign"))
    psi = sum(p.numel() for p in TASKS["gpt"].make_model(0, torch.float32, **codec_compute.GPT_SIZES["tiny"]).parameters())
    assert timed == [("int8", psi), ("sign", psi)]  # each codec timed once, for both collectives
    # all-gather: encode + 3 decodes; all-to-all: encode + one whole message's worth of shards
    seconds = [0.010 + 3 * 0.001, 0.010 + 0.001, 0.020 + 3 * 0.004, 0.020 + 0.004]
    assert [r["ratio"] for r in rows] == pytest.approx([t / 0.25 for t in seconds])
    assert [r["value"] for r in rows] == pytest.approx([t * 1e3 for t in seconds]) and rows[0]["step_ms"] == 250
    assert main(["bench", "codecs", "--world-size", "2", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "against the tiny GPT's fp32 step (250 ms)" in out and "sign over reduce-scatter: encode 1, decode 2 shards" in out

"""HSDP (:mod:`minizero.stages.hsdp`): equivalent to single-device training on every drawn node shape -- one node
(ZeRO-3), one rank per node (DDP of whole shards), and between -- with ZeRO-3's every option; its bytes per link
class and its memory beside their formulas; checkpoints that resume and reshard across node shapes."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings

from minizero.course.commands.compare import compare
from minizero.course.harness.experiment import Experiment, run_experiment
from minizero.course.harness.tasks import TASKS
from minizero.parts.layout import padded_size
from minizero.parts.unit_plan import assign_parameters, default_units
from tests.equivalence import covering, examples, experiments, run_and_check


@covering
@settings(max_examples=examples(24))
@given(drawn=experiments("hsdp", max_accum=3))
def test_hsdp_matches_reference(pools, drawn):
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


@covering
@settings(max_examples=examples(24))
@given(drawn=experiments("zero3", nodes=True, world_sizes=(2, 3, 4)))
def test_zero3_on_drawn_nodes_and_the_hierarchical_backend(pools, drawn):
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


@covering
@settings(max_examples=examples(16))
@given(drawn=experiments("ddp-bucketed", nodes=True, world_sizes=(2, 3, 4)))
def test_bucketed_ddp_on_drawn_nodes_and_the_hierarchical_backend(pools, drawn):
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("shape, backend", [("2x2", "ring"), ("2x2", "hierarchical"), ("1x3", "ring"),
                                            ("3x1", "hierarchical")])  # both levels, one node (uneven), one per node
def test_bytes_per_link_and_memory_beside_their_formulas(shape, backend):
    """compare's own rows: every link class's bytes within 2% of the formula, model states 16Ψ/G."""
    m, g = map(int, shape.split("x"))
    exp = Experiment(task="gpt", steps=2, network=f"nodes={shape}", backend=backend)
    rows = compare(m * g, ["hsdp", "zero3"], exp, timeout_s=120)
    for row in rows:
        assert row.within_tolerance and row.bytes_match and row.memory_match, row
        assert row.links_match, (row.stage, row.intra_bytes_per_step, row.intra_bytes_formula,
                                 row.inter_bytes_per_step, row.inter_bytes_formula)
    hsdp, zero3 = rows
    if m > 1 and g > 1:  # the point: less through the slow link, for more memory.  At 2 x 2 per rank: HSDP's
        # 2(M-1)/M x Psi/G = 0.5 Psi against flat ZeRO-3's 3(N-1)/N x Psi x M/N = 1.125 Psi (4/9), and against
        # hierarchical ZeRO-3's 3(M-1)/(M G) x Psi = 0.75 Psi (2/3)
        assert hsdp.inter_bytes_per_step < zero3.inter_bytes_per_step * (0.45 if backend == "ring" else 0.67)
        assert hsdp.state_bytes > zero3.state_bytes


def _with_hpz(drawn):
    exp, world_size = drawn
    return replace(exp, options={**exp.options, "hpz": True}), world_size


@settings(max_examples=examples(10))
@given(drawn=experiments("zeropp", nodes=True, world_sizes=(2, 4)).map(_with_hpz))
def test_zeropp_with_hpz_matches_reference(pools, drawn):
    """hpZ in every draw, on drawn nodes (one rank per node included: then it changes nothing)."""
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("shape", ["2x2", "1x3", "4x1"])
def test_hpz_keeps_the_backward_gather_inside_the_node(shape):
    """ZeRO++'s hpZ (zeropp): the same training; the backward gather's bytes move from the slow link to the fast
    one (2 x 2: inter-node bytes 2/3 of ZeRO-3's), for a working set larger by the node-local slices."""
    m, g = map(int, shape.split("x"))
    exp = Experiment(task="gpt", steps=2, network=f"nodes={shape}")
    plain, hpz = (compare(m * g, [stage], exp, timeout_s=120, **options)[0]
                  for stage, options in (("zero3", {}), ("zeropp", {"hpz": True})))
    for row in (plain, hpz):
        assert row.within_tolerance and row.bytes_match and row.links_match, row
    if m > 1:
        assert hpz.inter_bytes_per_step == pytest.approx(plain.inter_bytes_per_step * 2 / 3, rel=0.02)
    if g > 1:  # (exactly Psi/G more, at every prefetch: test_hpz_adds_the_papers_psi_over_g_to_the_working_set)
        assert hpz.gathered_peak_bytes > plain.gathered_peak_bytes
    assert hpz.sent_bytes_per_step <= plain.sent_bytes_per_step


@covering
@settings(max_examples=examples(16))
@given(drawn=experiments("hsdp", compress=True))
def test_hsdp_compressing_the_slow_hop_matches_the_same_casts_reference(pools, drawn):
    """fp16/bf16 on the all-reduce across nodes only (with and without error feedback), the node's reduce-scatter
    exact: against a reference that averages each node exactly and then casts as the slow hop does."""
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


@covering
@settings(max_examples=examples(12))
@given(drawn=experiments("hsdp", precision=True, backends=("ring",)))
def test_hsdp_in_mixed_precision_matches_the_same_casts_reference(pools, drawn):
    """16-bit gradients summed in each node, then across -- or in fp32 at both levels (reduce_dtype).  The ring's
    sums, whose order the reference follows (gloo's own 16-bit sums add in another order: test_precision's rule)."""
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("codec", ["int8", "sign"])  # a block-scaled codec and a one-bit one (top-k: test_codecs)
def test_a_codec_on_the_slow_hop_only(codec):
    """A codec rides HSDP's all-reduce across nodes (its messages all-gathered, decoded in node order); inside the
    node nothing is rounded.  Against the same-casts reference, with each link's bytes beside the formula."""
    exp = Experiment(task="gpt", steps=2, network="nodes=2x2", dtype="float32")
    row = compare(4, ["hsdp"], exp, timeout_s=120, compress=codec, error_feedback=True)[0]
    assert row.within_tolerance and row.bytes_match, row
    plain = compare(4, ["hsdp"], exp, timeout_s=120)[0]
    # the fast hop: exact, as before -- but for the ranks' agreement on inf/NaN (compress.overflow), a bitmap of 4
    # floats all-reduced round the ring of 2x2, half of whose links stay inside a node: 2(N-1)/N * 16 B / 2
    assert row.intra_bytes_per_step == plain.intra_bytes_per_step + 2 * 3 / 4 * 16 / 2
    assert row.inter_bytes_per_step <= plain.inter_bytes_per_step / 2  # (top-k at 1/4: index and value, 8 bytes)
    assert row.max_abs_diff_exact > 0  # it did round: the slow hop's messages are the codec's


@pytest.mark.parametrize("saved, loaded, consolidated", [
    (("hsdp", "nodes=2x2", 4), ("hsdp", "nodes=1x3", 3), False), (("hsdp", "nodes=2x1", 2), ("hsdp", "nodes=2x2", 4), True),
    (("hsdp", "nodes=2x2", 4), ("zero3", None, 3), False), (("zero2", None, 2), ("hsdp", "nodes=4x1", 4), False)])
def test_checkpoints_reshard_across_node_shapes(pools, tmp_path, saved, loaded, consolidated):
    """A sharded checkpoint written by HSDP's first replica (or a consolidated one) reads into another node
    shape, another N, another stage -- and training goes on as single-device training (float64, AdamW, two param
    groups, the GPT's tied weights), parameters and optimizer states to 1e-9."""
    from minizero.course.harness.equivalence import judge
    from minizero.course.harness.experiment import exact_reference_of
    from tests.test_checkpoint import SMALL_GPT, SPLITS, resumed
    (a, net_a, n), (b, net_b, m) = saved, loaded
    exp = Experiment(stage=a, steps=3, dtype="float64", optimizer="adamw", rank_sizes=SPLITS[n], model=SMALL_GPT,
                     param_groups=True, record_states=True, network=net_a)
    reference = exact_reference_of(exp, n)
    rest = resumed(pools, exp, n, 1, tmp_path, consolidated, stage=b, load_at=m, rank_sizes=SPLITS[m], network=net_b)
    tail = replace(reference, params=reference.params[1:], losses=reference.losses[1:],
                   optimizer_states=reference.optimizer_states[1:])
    verdict = judge(rest, tail, "float64", states=True)
    assert verdict.ok, verdict.violation or verdict.nonfinite


def _native_without_nodes(me, stage, options):
    import torch

    from minizero.comm import make_comm
    from minizero.stages import make_stage
    try:
        make_stage(stage, torch.nn.Linear(3, 2), None, make_comm("native"), **options)
    except ValueError as error:
        return str(error)


@pytest.mark.parametrize("stage, options, who", [("hsdp", {}, "hsdp"), ("zeropp", {"hpz": True}, "hpz")])
def test_the_native_backend_without_nodes_is_refused_saying_what_to_pass(pools, stage, options, who):
    """torch's collectives on a view need its process group, made when the Comm is built: one built without nodes
    cannot grow them later (new_group is collective), so the stage says which network to give instead."""
    said = pools.run(2, _native_without_nodes, stage, options)
    assert said == [f"rank {r}: {who} on the native backend needs the nodes at the Comm's construction (it creates "
                    f"their process groups): make_comm('native', network='nodes=2x1')" for r in range(2)]


def _built_without_nodes(me, stage, options):
    import warnings

    import torch

    from minizero.comm import make_comm
    from minizero.stages import make_stage
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = make_stage(stage, torch.nn.Linear(3, 2), None, make_comm("ring"), **options)
    nodes = built.nodes if stage == "hsdp" else built.secondary.nodes
    return nodes.per_node, [str(w.message) for w in caught if "no nodes given" in str(w.message)]


@pytest.mark.parametrize("stage, options, who", [("hsdp", {}, "hsdp"), ("zeropp", {"hpz": True}, "hpz")])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_mesh_assumed_with_one_rank_per_node_is_said_on_rank_0(pools, stage, options, who, n):
    """Without nodes, N = 2 and odd N are assumed to be N nodes of 1 rank: HSDP then shards nothing (and hpZ's
    node-local copy is one rank's) -- equivalent training, so no error, but rank 0 says so; at N = 4 (2 x 2) it
    shards, and nothing is said."""
    said = pools.run(n, _built_without_nodes, stage, options)
    if n == 4:
        assert said == [(2, [])] * n
    else:
        assert said[0] == (1, [f"{who} on {n} ranks with no nodes given: assumed {n} nodes of 1 rank, so nothing "
                               f"is sharded within a node (G = 1) and every rank holds all the state. Say where the "
                               f"ranks sit: make_comm(..., network='nodes=MxG') (train: --network)"])
        assert said[1:] == [(1, [])] * (n - 1)


@pytest.mark.parametrize("shape", ["1x2", "1x3", "2x2"])
def test_hpz_adds_the_papers_psi_over_g_to_the_working_set(pools, shape):
    """hpZ's price, exactly (ZeRO++ section 3.2: a secondary copy of the weights sharded within the node).  ZeRO-3's
    working set peaks in forward once its window is full -- the root and ``min(1 + prefetch, L)`` blocks -- and at
    that moment hpZ holds, beside them, its ``1/G`` slice of every unit started so far: all of them, Psi/G elements
    (each unit padded to a multiple of N, as its flat buffer is).  Backward only consumes slices, so this is the
    peak for every prefetch depth.  (A slice is counted from when its gather starts, as its full buffer is: counted
    when the gather ended, on the communication thread, a prefetched unit's slice raced the main thread's free of
    the unit before it, and the peak landed anywhere from Psi/G - 3 blocks/G to Psi/G.)"""
    m, g = map(int, shape.split("x"))
    n = m * g
    for n_layer, prefetch in ((2, 0), (2, 1), (4, 1), (4, 2)):
        gpt = TASKS["gpt"].make_model(0, torch.float64, n_layer=n_layer)
        units = [padded_size(sum(p.numel() for _, p in params), n) * 8
                 for params in assign_parameters(gpt, default_units(gpt))]
        root, block = units[0], units[1]
        peaks = {}
        for stage, options in (("zero3", {}), ("zeropp", {"hpz": True})):
            exp = Experiment(stage=stage, task="gpt", model={"n_layer": n_layer}, steps=2, dtype="float64",
                             options={"prefetch": prefetch, **options}, network=f"nodes={shape}")
            peaks[stage] = {r.gathered_peak_bytes for r in pools.run(n, run_experiment, exp)}
        zero3 = root + min(1 + prefetch, n_layer) * block
        assert peaks["zero3"] == {zero3}, (n_layer, prefetch, peaks, units)
        assert peaks["zeropp"] == {zero3 + sum(units) // g}, (n_layer, prefetch, peaks, units, g)


def test_hsdp_without_a_network_says_where_it_assumed_the_ranks(capsys):
    """At N = 2 and every odd N the assumed nodes hold one rank each: HSDP shards nothing (G = 1), once silently."""
    from minizero.__main__ import main
    from minizero.course.commands.compare import assumed_nodes_notes
    assert main(["compare", "--world-size", "2", "--stages", "hsdp", "--steps", "1"]) == 0
    assert ("(hsdp: no --network, so its ranks were assumed on 2 nodes of 1 rank: G = 1, so nothing is sharded "
            "within a node and every rank holds all the state; say where they sit: --network nodes=MxG)"
            in capsys.readouterr().out)
    assert assumed_nodes_notes(["ddp", "hsdp"], None, 4, None) == [
        "(hsdp: no --network, so its ranks were assumed on 2 nodes of 2 ranks; say where they sit: --network nodes=MxG)"]
    assert assumed_nodes_notes(["hsdp"], "nodes=1x4", 4, None) == [] and assumed_nodes_notes(["ddp"], None, 3, None) == []


def _hpz_slices_through_a_step(me, n_layer: int):
    """This rank's hpZ slices (their units, their bytes) after forward and after backward."""
    import torch.nn.functional as F

    from minizero.course.harness.experiment import build
    exp = Experiment(stage="zeropp", task="gpt", model={"n_layer": n_layer}, steps=1, dtype="float32",
                     options={"prefetch": 1, "hpz": True}, network=f"nodes=1x{me.world_size}")
    stage, _, comm, _ = build(me, exp)
    try:
        x, y = TASKS["gpt"].make_batch(4, 0, 0, torch.float32)
        out = stage(x)
        held = [(sorted(u for _, u, _ in stage.secondary._slices.values()),
                 sum(t.numel() * t.element_size() for t in stage.secondary.held()))]
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        held.append((sorted(u for _, u, _ in stage.secondary._slices.values()),
                     sum(t.numel() * t.element_size() for t in stage.secondary.held())))
        return held
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_hpz_keeps_one_slice_a_unit_from_forward_and_none_after_backward(pools, world_size):
    """hpZ's node-local copies are used once: after forward one slice of every unit (root included), 1/G of its
    padded flat buffer; after backward none -- each consumed by its unit's backward gather.  A copy kept after use
    (dropped only at the step) would hold up to Psi/G more through every later backward."""
    n_layer = 3
    gpt = TASKS["gpt"].make_model(0, torch.float32, n_layer=n_layer)
    units = [padded_size(sum(p.numel() for _, p in params), world_size) * 4
             for params in assign_parameters(gpt, default_units(gpt))]
    for forward, backward in pools.run(world_size, _hpz_slices_through_a_step, n_layer):
        assert forward == (list(range(n_layer + 1)), sum(units) // world_size), (forward, units)
        assert backward == ([], 0), backward

"""ZeRO-3: parameters sharded and gathered per unit; the same training, 1.5x DDP's bytes, 16 Psi / N."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from torch import nn

from minizero.comm import make_comm
from minizero.course.harness.costs import bytes_problem, memory_problem
from minizero.course.harness.experiment import Experiment, build, run_experiment
from minizero.course.harness.models import MLP, ReuseModel, TinyGPT
from minizero.course.harness.tasks import TASKS
from minizero.parts.layout import padded_size
from minizero.parts.unit_plan import assign_parameters, default_units, resolve_units
from minizero.run.launch import RankError
from minizero.stages import STAGES, make_stage
from tests.equivalence import covering, examples, experiments, run_and_check


@covering
@settings(max_examples=examples(24))
@given(drawn=experiments("zero3", max_accum=4))
def test_zero3_matches_reference(pools, drawn):
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


GPT_UNITS = ["token_embedding", "head", "blocks.0", "blocks.1", "ln_f"]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_weights_tied_across_units_under_uneven_sharding(pools, world_size):
    """The FSDP2 bug: embedding and LM head in different units, Psi not divisible by N.
    The tied parameter belongs to the root, so both uses see it and it is updated whole."""
    gpt = TASKS["gpt"].make_model(0, torch.float64)
    assert sum(p.numel() for p in gpt.parameters()) % 3 != 0
    exp = Experiment(stage="zero3", task="gpt", optimizer="adamw", steps=3, accum=2, dtype="float64",
                     options={"units": GPT_UNITS}, record_states=True)
    run_and_check(pools, exp, world_size)


def test_tied_parameter_goes_to_the_root():
    gpt = TinyGPT()
    units = resolve_units(gpt, GPT_UNITS)
    owners = {n: i for i, params in enumerate(assign_parameters(gpt, units)) for n, _ in params}
    assert owners["token_embedding.weight"] == 0 and owners["blocks.0.fc.weight"] == 3


@pytest.mark.parametrize("optimizer", ["momentum", "adamw"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_unit_called_twice_and_unit_skipped_in_some_steps(pools, optimizer, world_size):
    """layers.0 runs twice per forward; layers.2 only every other step (no gradient: not updated,
    as on one device); the model carries a buffer."""
    exp = Experiment(stage="zero3", task="reuse", optimizer=optimizer, lr=0.05, steps=4, dtype="float64",
                     record_states=True)
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_frozen_parameters_inside_units(pools, world_size):
    exp = Experiment(stage="zero3", task="edge", model={"with_unused": False}, optimizer="adamw", steps=3, accum=2,
                     dtype="float64", options={"units": ["frozen", "mid", "out"]})
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("reshard", [True, False])
def test_bytes_are_one_and_a_half_ddps_with_resharding(pools, world_size, reshard):
    exp = Experiment(stage="zero3", task="gpt", steps=2, accum=2, dtype="float32",
                     options={"reshard_after_forward": reshard})
    results = pools.run(world_size, run_experiment, exp)
    psi = results[0].psi
    sent = sum(r.sent_bytes for r in results) / (world_size * exp.steps)
    ddp = STAGES["ddp"].sent_bytes_per_step(psi, world_size, 4, 4)
    ratio = 1.5 if reshard else 1.0
    assert ratio * ddp <= sent <= ratio * ddp * 1.01, (sent / ddp)  # padding and the 8-byte unit headers
    assert bytes_problem(results, ratio * ddp, {"reduce_scatter", "all_gather"}, rel=0.01) is None


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_memory_is_16_psi_over_n(pools, world_size):
    results = pools.run(world_size, run_experiment, Experiment(stage="zero3", task="gpt", steps=1, dtype="float32"))
    formula = STAGES["zero3"].state_bytes(results[0].psi, world_size, 4, 2)
    assert memory_problem(results, formula) is None


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gathered_peak_is_the_root_plus_the_units_prefetch_implies(pools, prefetch, world_size):
    """Exactly, counted by the gathered-memory observer: outside accumulation the root unit (gathered for the whole
    forward and backward) and the block computing with the ``prefetch`` blocks gathering behind it -- each unit's
    flat buffer padded to a multiple of N elements (3 shards unevenly) -- as ``memory`` and lesson 18 predict
    (:func:`minizero.course.harness.step_memory.gathered_unit_bytes`).  Across accumulation's micro-batches every
    unit stays gathered until the micro-batch that synchronises: the whole padded model."""
    n_layer = 4
    gpt = TASKS["gpt"].make_model(0, torch.float32, n_layer=n_layer)
    per_unit = [padded_size(sum(p.numel() for _, p in params), world_size) * 4
                for params in assign_parameters(gpt, default_units(gpt))]
    root, blocks = per_unit[0], per_unit[1:]
    assert len(set(blocks)) == 1 and len(blocks) == n_layer
    for accum, formula in ((1, root + min(1 + prefetch, n_layer) * blocks[0]), (2, sum(per_unit))):
        exp = Experiment(stage="zero3", task="gpt", model={"n_layer": n_layer}, steps=2, accum=accum,
                         dtype="float32", options={"prefetch": prefetch})
        peaks = [r.gathered_peak_bytes for r in pools.run(world_size, run_experiment, exp)]
        assert peaks == [formula] * world_size, (accum, peaks, formula, root, blocks[0])
    assert root + min(1 + prefetch, n_layer) * blocks[0] < sum(per_unit)  # sharding saves memory outside accumulation


def _what_autograd_keeps_of_the_gathered_parameters(me, checkpointed: bool):
    """After one forward: the bytes of every gathered full buffer that a tensor autograd saved still holds, and the
    bytes of the units gathered now.  (Every buffer a unit's parameters were pointed into is recorded.)"""
    from minizero.parts.unit_groups import ShardedFlatGroup

    exp = Experiment(stage="zero3", task="gpt", dtype="float32", micro_batch=4, checkpoint_activations=checkpointed)
    stage, model, comm, _ = build(me, exp)
    buffers, use = set(), ShardedFlatGroup.use

    def recording_use(group, full):
        buffers.add(full.untyped_storage()._cdata)
        use(group, full)

    saved = []
    x, y = TASKS["gpt"].make_batch(exp.global_batch(me.world_size), 0, 0, torch.float32)
    ShardedFlatGroup.use = recording_use
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            stage(x[:4])
    finally:
        ShardedFlatGroup.use = use
        comm.close()
    kept = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in saved
            if t.untyped_storage()._cdata in buffers}
    return sum(kept.values()), sum(g.full_bytes for g in stage.groups if g.gathered)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_resharded_unit_keeps_no_memory_through_what_autograd_saved(pools, checkpointed):
    """A linear layer on a batch of sequences saves ``weight.t()``, a view of the gathered buffer: resharding by
    pointing the parameters elsewhere left every unit's full parameters allocated from its forward to its
    backward -- the whole model at once, found on a GPU (issue 31: ZeRO-3's step 30% above the prediction).
    Freed in place, the buffers autograd saved hold nothing beyond the units still gathered.  (Checkpointed, the
    blocks' forward saves under checkpoint's own hooks, which this probe does not see: only the root's saves are.)"""
    for kept, gathered_now in pools.run(2, _what_autograd_keeps_of_the_gathered_parameters, checkpointed):
        assert kept <= gathered_now, (kept, gathered_now)


def _use_a_kept_gather_after_reshard(me):
    from minizero.parts.unit_groups import FreedBuffer

    exp = Experiment(stage="zero3", task="gpt", dtype="float32")
    stage, _, comm, _ = build(me, exp)
    try:
        unit = stage.units[1]
        unit.unshard("forward")
        kept = [g.data for g in unit.groups]
        unit.reshard()
        try:
            unit.groups[0].use(kept[0])
        except FreedBuffer as error:
            return str(error)
        return "accepted"
    finally:
        comm.close()


def test_a_gathered_buffer_used_after_its_unit_resharded_is_refused(pools):
    """Freed in place, a kept gather result holds no values at all -- not even stale ones: a lab's Unit that keeps
    one is told so, naming the rank and the parameter, instead of meeting torch's storage error mid-backward."""
    for said in pools.run(2, _use_a_kept_gather_after_reshard):
        assert "use() was handed a buffer freed when its unit last resharded" in said, said
        assert said.startswith(("rank 0's blocks.0.", "rank 1's blocks.0.")), said


def test_a_buffer_of_another_size_or_dtype_handed_to_use_is_refused_naming_the_group():
    """A unit's gather returns one buffer per group: one handed to the wrong group (a lab's Unit zipping them in
    reverse) is told so, naming the rank, the parameter and both sizes -- not torch's view error about a shape."""
    from minizero.parts.unit_groups import ShardedFlatGroup
    first = nn.Linear(3, 2, dtype=torch.float64)
    group = ShardedFlatGroup(list(first.named_parameters()), rank=0, world_size=1, group_index=1)
    for wrong in (torch.zeros(5, dtype=torch.float64), torch.zeros(8, dtype=torch.float32)):
        with pytest.raises(ValueError, match=r"rank 0's weight \(flat group 1\): use\(\) was handed a buffer of "
                                             r"\d+ torch.float\d+ elements; this group gathers 8 torch.float64 ones") as said:
            group.use(wrong)
        assert "another group's buffer?" in str(said.value)
    group.use(group.full_buffer())  # its own: taken
    assert first.weight.shape == (2, 3) and group.gathered


def _full_state_dict_loads(me):
    gpt = TinyGPT(seed=me.rank, dtype=torch.float64)
    stage = make_stage("zero3", gpt, torch.optim.SGD(gpt.parameters(), lr=0.1), make_comm("ring"))
    full = stage.full_state_dict()
    plain = TinyGPT(seed=123, dtype=torch.float64)
    plain.load_state_dict(full)
    try:  # nn.Module's would be the placeholders: 0-element tensors that load into nothing, silently
        stage.state_dict()
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    return {k: v for k, v in plain.state_dict().items()}, sum(group.shard.numel() for group in stage.groups), refused


def test_full_state_dict_loads_into_the_plain_model_and_shards_are_1_over_n(pools):
    results = pools.run(3, _full_state_dict_loads)
    rank0 = TinyGPT(seed=0, dtype=torch.float64).state_dict()
    psi = sum(p.numel() for p in TinyGPT().parameters())
    for state, shard_numel, refused in results:
        assert all(torch.equal(state[k], rank0[k]) for k in rank0)  # rank 0's weights, broadcast at wrap
        assert psi / 3 <= shard_numel <= psi / 3 + 3 * 8
        assert "state_dict() would return 0-element placeholders: call stage.full_state_dict()" in refused, refused


def _call_count_differs(me):
    model = ReuseModel(seed=0, skip_every_other=False)
    stage = make_stage("zero3", model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring", check=True))
    x = torch.randn(2, 6)
    stage(x).sum().backward()
    if me.rank == 1:
        stage(x).sum().backward()  # rank 1 runs an extra forward and backward


def test_a_rank_that_runs_an_extra_forward_is_named_not_hung():
    """Rank 0 is done; rank 1 gathers a unit for a forward rank 0 never runs.  The launcher names rank 0."""
    from minizero.run.launch import RankPool
    with RankPool(2, timeout_s=5) as pool:
        with pytest.raises(RankError) as info:
            pool.run(_call_count_differs)
    assert "Stopped making progress: rank 0 -- it finished its task without joining this collective" in str(info.value)
    assert "forward all-gather' (optimizer step 0, backward 1, synchronising)" in str(info.value)


def _rank_dependent_branch(me):
    model = ReuseModel(seed=0, skip_every_other=False)
    stage = make_stage("zero3", model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring", check=True))
    if me.rank == 0:
        model.skip_every_other, model.calls = True, 1  # rank 0 skips layers.2 this step
    stage(torch.randn(2, 6)).sum().backward()


def test_unit_skipped_on_one_rank_only_names_the_disagreement(pools):
    with pytest.raises(RankError, match="(?s)unit 3 \\(layers.2\\) forward all-gather.*"
                                        "a module was called a different number of times"):
        pools.run(2, _rank_dependent_branch)


def test_units_must_not_nest_and_the_root_is_implicit():
    gpt = TinyGPT()
    with pytest.raises(ValueError, match="must not contain one another"):
        resolve_units(gpt, ["blocks", "blocks.0"])
    with pytest.raises(ValueError, match="root module is always a unit"):
        resolve_units(gpt, [gpt])
    assert [type(u).__name__ for u in default_units(gpt)] == ["Block", "Block"]
    assert len(default_units(MLP((3, 4, 5)))) == 2


def _weight_decay_on_a_skipped_unit(me):
    """layers.2 runs every other step.  With zero_grad(set_to_none=False) its zero gradient is still
    stepped, so AdamW's decay moves it in the steps that skip it -- after its prefetch (from the last
    forward's order) was already gathered.  A prefetch kept across the step would hold stale weights.
    ``me`` None: the single-device reference, running both ranks' halves of each step."""
    model = ReuseModel(seed=0, dtype=torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)
    stage = model if me is None else make_stage("zero3", model, optimizer, make_comm("ring", check=True))
    clear_and_step = optimizer if me is None else stage
    for step in range(4):
        clear_and_step.zero_grad(set_to_none=False)
        for r in (range(2) if me is None else [me.rank]):
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + r), dtype=torch.float64)
            loss = stage(x).pow(2).mean()
            (loss / 2 if me is None else loss).backward()  # the reference: the mean over both ranks
            if me is None and r == 0:
                model.calls -= 1  # both halves are one forward of the step: the same skip pattern
        clear_and_step.step()
    state = model.state_dict() if me is None else stage.full_state_dict()
    return {k: v.clone() for k, v in state.items()}


def test_a_prefetch_left_from_the_last_forward_is_dropped_at_the_step(pools):
    want = _weight_decay_on_a_skipped_unit(None)
    for got in pools.run(2, _weight_decay_on_a_skipped_unit):
        for name, value in want.items():
            assert torch.allclose(got[name], value, rtol=0, atol=1e-12), name


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.extra = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()

    def forward(self, x, use_extra):
        x = torch.tanh(self.lin(x))
        return x + self.extra(x) if use_extra else x


class _ExtraOnRankZero(nn.Module):
    """Three units, each called on every rank; the last one's ``extra`` layer is used on rank 0 only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x, use_extra):
        for i, block in enumerate(self.blocks):
            x = block(x, use_extra and i == 2)
        return x


def _extra_on_rank_zero(me):
    model = _ExtraOnRankZero()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stage = model if me is None else make_stage("zero3", model, optimizer, make_comm("ring", check=True),
                                                find_unused_parameters=True)
    for step in range(3):
        (optimizer if me is None else stage).zero_grad()
        for r in (range(2) if me is None else [me.rank]):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + r), dtype=torch.float64)
            loss = stage(x, use_extra=r == 0).pow(2).mean()
            (loss / 2 if me is None else loss).backward()
        (optimizer if me is None else stage).step()
    state = model.state_dict() if me is None else stage.full_state_dict()
    return {k: v.clone() for k, v in state.items()}


def test_find_unused_with_a_parameter_used_on_some_ranks_only_across_units(pools):
    """Its unit's gradients are ready on rank 0 and not on rank 1; reduce-scatters that started when
    ready would sit between different backward all-gathers on the two ranks.  With the flag they wait
    for the end of backward, in order -- the same training as one device."""
    want = _extra_on_rank_zero(None)
    for got in pools.run(2, _extra_on_rank_zero):
        for name, value in want.items():
            assert torch.allclose(got[name], value, rtol=0, atol=1e-12), name

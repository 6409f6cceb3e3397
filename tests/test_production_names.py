"""Lesson 14's table of production names is right about the installed torch, and its check can fail."""
from __future__ import annotations

import pytest

from minizero.course.harness.production import ROWS, Ours, Row, Torch, left_out, table_markdown, wrong
from minizero.stages import DDP, ZeRO2, ZeRO3


def test_every_checked_name_is_in_the_installed_torch():
    assert wrong() == []


def test_every_torch_row_is_checked_and_every_deepspeed_row_says_it_is_not():
    for row in ROWS:
        if row.deepspeed:
            assert row.verdict().startswith("from DeepSpeed's source, not checked here"), row.name
        else:
            assert row.torch and row.verdict().startswith("ok: "), row.name


@pytest.mark.parametrize("fact, says", [
    (Torch("torch.distributed.fsdp.fully_shard_everything"), "does not resolve"),
    (Torch("torch.distributed.optimizer.ZeRO"), "does not resolve"),  # a name the source documents invent
    (Torch("torch.nn.parallel.DistributedDataParallel", "bucket_size_mb"), "takes no parameter 'bucket_size_mb'"),
    (Torch("torch.nn.parallel.DistributedDataParallel", "static_graph", True), "defaults to False, not True"),
    (Torch("torch.distributed.fsdp.ShardingStrategy", member="ZERO_2"), "has no member ZERO_2"),
    (Torch("torch.distributed._DEFAULT_FIRST_BUCKET_BYTES", value=25 * 2**20), "is 1048576"),
    (Torch("torch.distributed.fsdp.fully_shard", "reshard_after_forward", annotation="float"), "does not take float"),
    (Ours(ZeRO3, "prefetch", 2), "defaults to 1, not 2"),
    (Ours(ZeRO2, "reshard_after_forward"), "has no option"),
    (Ours(type("ZeRO4", (ZeRO3,), {"name": "zero4"}), "units"), "registers no stage 'zero4'"),
    (Ours(type("ZeRO4", (ZeRO3,), {"name": "zero4"})), "registers no stage 'zero4'"),
    (Ours(DDP, method="no_sync_please"), "has no method no_sync_please()"),
])
def test_a_made_up_name_is_caught(fact, says):
    row = Row("made up", "nothing", "none", torch=(fact,) if isinstance(fact, Torch) else (),
              ours=(fact,) if isinstance(fact, Ours) else ())
    verdict = row.verdict()
    assert verdict.startswith("WRONG: ") and says in verdict, verdict
    assert wrong((*ROWS, row)) == [f"made up: {verdict}"]
    assert "WRONG" in table_markdown((row,))


def test_the_table_has_a_line_per_row():
    assert len(table_markdown().splitlines()) == len(ROWS) + 2


def test_what_minizero_leaves_out_is_read_from_the_table():
    names = left_out()
    assert "DDP static_graph" in names and "DeepSpeed offload_optimizer" not in names  # (built: minizero.parts.offload)
    assert all(row.minizero.startswith("none") == (row.name in names) for row in ROWS)
    extra = Row("made up", "nothing", "none: not built")
    assert left_out((*ROWS, extra)) == [*names, "made up"]


def test_a_minizero_column_without_a_fact_to_check_it_is_wrong():
    """minizero's column is held to the code as torch's is to torch: a row whose minizero column is not "none" carries
    an Ours fact (the stage registered; its option, default or method), so a stage or option renamed or dropped turns
    the row WRONG -- and a row that names something of minizero's with nothing to check it is WRONG already."""
    made_up = Row("made up", "nothing", "zero3(gather_twice=True)")
    assert made_up.verdict().startswith("WRONG: ") and wrong((*ROWS, made_up)) == [f"made up: {made_up.verdict()}"]
    assert Row("made up", "nothing", "none: not built").verdict() == "not checked"


def test_the_int_reshard_row_names_hpz():
    """torch 2.13: an int reshard_after_forward is the world size to reshard to after forward (the node, say), so
    backward's all-gather runs over fewer ranks -- ZeRO++'s hpZ, minizero's zeropp(hpz=True)."""
    row = next(row for row in ROWS if row.name == "fully_shard(reshard_after_forward=<int>)")
    verdict = row.verdict()
    assert verdict.startswith("ok: ") and "int" in verdict and "zeropp(hpz=False)" in verdict, verdict
    assert row.name not in left_out()

"""The reshard lab: the package's flat-shard conversion continues single-device training from N ranks to M, blank
skeletons fail by name, both answer keys pass, every planted mistake -- none of them a known one -- fails on the
property it breaks, the known ones are named, and the second property catches on its own what the first does."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minizero.checkpoint.flat import FlatShard
from minizero.checkpoint.reshard import Reshard
from minizero.course.labs import check
from minizero.course.labs.catalogue import LABS
from minizero.course.labs.check import Checker
from minizero.course.labs.failed import Failed
from minizero.course.labs.loading import Impl
from minizero.course.labs.mistakes_reshard import RESHARD_MISTAKES, StepRestarted
from minizero.course.labs.property_table import PROPERTIES

HERE = Path(__file__).parent
RANGES = "every rank's new shard holds exactly its range"


def quiet(_):
    pass


def shards_of(group: torch.Tensor, n: int) -> list[FlatShard]:
    size = -(-group.numel() // n)
    padded = torch.cat([group, group.new_zeros(size * n - group.numel())])
    return [FlatShard(r, n, group.numel(), padded[r * size:(r + 1) * size].clone(),
                      {"exp_avg": -padded[r * size:(r + 1) * size].clone(), "step": torch.tensor(3.0)})
            for r in range(n)]


@pytest.mark.parametrize("n, m", [(4, 3), (3, 4), (1, 4), (4, 1), (2, 3)])
def test_resharding_n_to_m_is_laying_out_at_m(n, m):
    """The conversion's own arithmetic: 10 elements saved by N ranks come out as if M ranks had saved them --
    the same ranges, zeros in the padding, the count whole."""
    group = torch.arange(1.0, 11.0)
    saved, want = shards_of(group, n), shards_of(group, m)
    for r in range(m):
        got = Reshard().reshard(saved, m, r)
        assert torch.equal(got.values, want[r].values) and torch.equal(got.state["exp_avg"], want[r].state["exp_avg"])
        assert got.state["step"].item() == 3.0 and (got.rank, got.world_size, got.numel) == (r, m, 10)


def test_a_file_that_leaves_a_method_to_the_package_fails_naming_it(pools, tmp_path):
    """A reshard written without its owned_range: the base's raises, so the file's reshard cannot call it -- and one
    that computes the range inline, leaving owned_range unused, is named too."""
    solution = (HERE / "lab_solutions" / "guided" / "reshard.py").read_text()
    inline = tmp_path / "inline.py"
    inline.write_text(solution.replace("start, stop = self.owned_range(numel, world_size, rank)",
                                       "start, stop = rank * -(-numel // world_size), (rank + 1) * -(-numel // world_size)"))
    report = check("reshard", impl=inline, examples=2, pools=pools, out=quiet)
    assert report.failed == "your methods are what runs", report
    assert "Reshard.owned_range is never called while a rank builds its shards" in report.why, report.why
    empty = tmp_path / "empty.py"
    empty.write_text("from minizero.checkpoint.reshard import Reshard as Given\n\n\nclass Reshard(Given):\n    pass\n")
    report = check("reshard", impl=empty, examples=2, pools=pools, out=quiet)
    assert "your file does not define Reshard.owned_range" in report.why, report.why


@pytest.mark.parametrize("mistake", RESHARD_MISTAKES, ids=lambda m: m.name)
def test_a_known_mistake_is_named(pools, mistake):
    report = check("reshard", impl=mistake, examples=5, pools=pools, out=quiet, shrink_s=0)
    assert report.failed == RANGES and report.mistake == mistake.mistake, report


def test_resumed_training_alone_catches_a_restarted_step_count(pools):
    """The second property is no echo of the first: run alone, it fails a resharder whose tensors are right and
    whose Adam step restarts -- on the parameters after the first step on M ranks -- and names the mistake."""
    lab = LABS["reshard"]
    checker = Checker(lab, Impl.of(lab, StepRestarted), pools, examples=3, shrink_s=0)
    with pytest.raises(Failed) as failed:
        PROPERTIES["resumed on M ranks"][1](checker)
    assert "steps counted from the reshard" in failed.value.why and failed.value.mistake == StepRestarted.mistake

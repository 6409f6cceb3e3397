"""Lessons 1 and 3's pictures: drawn from what the code did, and the reading of it right."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402

from minizero.comm import ReduceOp, make_comm  # noqa: E402
from minizero.course.figures.ddp_flow import draw_ddp_flow  # noqa: E402
from minizero.course.figures.ring import draw_ring_schedule, holdings, read_tag, recording, tagged  # noqa: E402
from minizero.run.launch import run  # noqa: E402


def test_a_tag_names_its_chunk_and_the_ranks_it_sums():
    n = 4
    assert [read_tag(float(v), n) for v in tagged(2, n)] == [(c, frozenset([2])) for c in range(n)]
    total = sum(tagged(r, n) for r in (0, 1, 3))
    assert [read_tag(float(v), n) for v in total] == [(c, frozenset([0, 1, 3])) for c in range(n)]


def _recorded(me):
    comm = make_comm("ring")
    x = tagged(me.rank, me.world_size)
    with recording(comm) as steps:
        comm.all_reduce(x, ReduceOp.SUM)
    assert "_send_right_recv_left" not in vars(comm)  # the recording leaves the comm as it found it
    return steps, x


def test_the_recorded_schedule_is_the_rings_and_ends_complete():
    n = 3
    for rank, (steps, x) in enumerate(run(_recorded, n)):
        expected = [("reduce-scatter", s, (rank - s - 1) % n) for s in range(n - 1)]
        expected += [("all-gather", s, (rank - s) % n) for s in range(n - 1)]
        assert [(part, s, sent[0]) for part, s, sent, _ in steps] == expected  # ring.py's docstrings' schedule
        assert holdings(rank, steps, n)[-1] == [frozenset(range(n))] * n
        assert torch.equal(x, sum(tagged(r, n) for r in range(n)))


def test_the_pictures_draw():
    steps = [("reduce-scatter", 0, (1, frozenset([0])), (0, frozenset([1])))]
    assert draw_ring_schedule([steps, steps]).axes
    assert draw_ddp_flow([[2, 2], [2, 2]], 10, 40.0).axes

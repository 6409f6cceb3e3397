"""Lesson 4's structural claims about the dialled-wire picture, which hold in every run.

The lesson draws one step of ``ddp-bucketed`` (1 MiB buckets on the bench GPT) and says, without quoting any
timing: four buckets; the first holds the last layers and is complete before backward ends, so it *can* start
while backward computes; the last holds the embeddings, whose gradient is the last one backward produces, so
that bucket is always exposed.  Run-varying figures live in the lesson's "Measured on this machine" box; these
are the parts that do not vary.
"""
from __future__ import annotations

import torch

from minizero.course.commands.bench import BENCH_GPT
from minizero.course.harness.tasks import TASKS
from minizero.stages.ddp_bucketed import assign_buckets


def test_the_first_bucket_completes_during_backward_and_the_embeddings_bucket_last():
    task = TASKS["gpt"]
    model = task.make_model(0, torch.float32, **BENCH_GPT)
    buckets = assign_buckets(list(model.named_parameters()), 1.0)
    assert len(buckets) == 4
    ready: list[str] = []  # names, in the order backward made their gradients final
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: ready.append(name))
    x, y = task.make_batch(2, 0, 0, torch.float32, **BENCH_GPT)
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    assert sorted(ready) == sorted(n for n, _ in model.named_parameters())
    complete = [max(ready.index(n) for n in b.names) for b in buckets]  # when each bucket's last gradient came
    assert complete == sorted(complete), "buckets complete in index order: the order ReadyOrder launches them"
    assert complete[0] < len(ready) - 1 and complete[-1] == len(ready) - 1
    assert ready[-1].endswith("embedding.weight") and ready[-1] in buckets[-1].names


def test_at_0_05_mib_each_block_weight_matrix_is_a_bucket_of_its_own():
    """Lesson 4's bucket sweep: at 0.05 MiB every block's weight matrix is alone in its bucket, 29 buckets in all
    (the small vectors between them, and the two embeddings with blocks.0.ln1, share)."""
    model = TASKS["gpt"].make_model(0, torch.float32, **BENCH_GPT)
    buckets = assign_buckets(list(model.named_parameters()), 0.05)
    assert len(buckets) == 29
    for b in buckets:
        if any(n.startswith("blocks.") and n.endswith(".weight") and "ln" not in n for n in b.names):
            assert len(b.names) == 1, b.names
    assert {"position_embedding.weight", "token_embedding.weight"} <= set(buckets[-1].names)

"""On a GPU: the overlapped collectives run on their own stream, and the host queues a dialled step without
waiting for its wire.  Skipped without CUDA (``tests/test_comm_stream.py`` checks the same calls on a CPU);
``scripts/gpu_overlap.py`` runs this file on the GPU machine."""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL at N = 1)")

#: Each message holds its stream this long: far beyond what queueing a backward costs the host (a few ms).
SLOW = "alpha=100ms,bandwidth=1TB/s"


def _stage(stage_name: str, options: dict, own_stream: bool, network: str | None = None):
    from minizero.comm import make_comm
    from minizero.course.commands.gpu_efficiency import one_rank_group
    from minizero.course.harness.models import BENCH_GPT
    from minizero.course.harness.tasks import TASKS
    from minizero.stages import make_stage

    one_rank_group()
    model = TASKS["gpt"].make_model(0, torch.float32, **BENCH_GPT).cuda()
    comm = make_comm("native", network=network)
    comm.own_stream = own_stream
    if comm.port is not None:
        comm.port.stands_for = 2
    stage = make_stage(stage_name, model, torch.optim.SGD(model.parameters(), lr=0.1), comm, **options)
    x, y = (t.cuda() for t in TASKS["gpt"].make_batch(8, 0, 0, torch.float32, **BENCH_GPT))
    return stage, x, y


@pytest.mark.parametrize("stage_name, options", [("ddp-bucketed", {"bucket_mb": 0.5}), ("zero2", {"bucket_mb": 0.5}),
                                                 ("zero3", {"prefetch": 1})])
def test_the_host_queues_a_dialled_backward_without_waiting_for_the_wire(stage_name, options):
    from minizero.comm.stream import CommStream
    from minizero.run.train import sum_loss

    stage, x, y = _stage(stage_name, options, True, SLOW)
    stage.comm.port.clock.calibrate()
    for _ in range(2):  # the first builds the buffers
        stage.zero_grad()
        loss = sum_loss(stage(x), y) / y.numel()
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss.backward()
        queued = time.perf_counter() - start
        torch.cuda.synchronize()
        done = time.perf_counter() - start
        stage.step()
    assert isinstance(stage.comm._thread, CommStream)
    assert done > 0.19, f"the dialled wire (2 messages of 100 ms at least) did not hold the device: {done:.3f} s"
    assert queued < 0.1, f"the host waited {queued:.3f} s in backward for a collective whose result it did not need"

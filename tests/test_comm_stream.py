"""The GPU path's stream logic, checked on a CPU (:mod:`minizero.comm.stream`).

Under NCCL a Comm queues its overlapped collectives on a CUDA stream of its own.  The calls that make that right
-- the communication stream waits for the compute stream before a bucket is packed, the collective runs with the
communication stream current, the consumer's stream (never the host) waits for the result's event, the tensors
stay alive until then -- are made through a streams API that the suite swaps for a :class:`Recorder`.  The stages
then run on gloo with every submitted function on the recorder's "communication stream", so the same stage code a
GPU runs is trained here, compared with the communication thread's run, and its calls inspected.
"""
from __future__ import annotations

import gc
import json
import time
import weakref
from contextlib import contextmanager

import pytest
import torch

from minizero.comm import make_comm
from minizero.comm.stream import CommStream, DeviceClock
from minizero.stages import make_stage
from tests.test_robustness import Branchy, _data, _flat


class FakeStream:
    def __init__(self, recorder: "Recorder", name: str):
        self.recorder, self.name = recorder, name

    def wait_stream(self, other: "FakeStream") -> None:
        self.recorder.calls.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: "FakeEvent") -> None:
        self.recorder.calls.append(("wait_event", self.name, event.number))


class FakeEvent:
    def __init__(self, recorder: "Recorder"):
        self.recorder = recorder
        self.number = len(recorder.events)
        recorder.events.append(self)

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorder.calls.append(("record", (stream or self.recorder.current_stream()).name, self.number))

    def query(self) -> bool:
        return False  # never finished on its own: done() must come from the wait

    def synchronize(self) -> None:
        self.recorder.calls.append(("host blocks",))


class Recorder:
    """``torch.cuda``'s stream API as far as the Comm uses it, recording each call; "host blocks" is the one a
    GPU path must never make for a collective."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.events: list[FakeEvent] = []
        self._current = FakeStream(self, "compute")

    def current_device(self) -> int:
        return 0

    def Stream(self, device) -> FakeStream:  # noqa: N802 -- torch.cuda's name
        assert device == 0
        return FakeStream(self, "communication")

    def current_stream(self) -> FakeStream:
        return self._current

    @contextmanager
    def stream(self, stream: FakeStream):
        before, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = before

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802
        return FakeEvent(self)

    def synchronize(self) -> None:
        self.calls.append(("host blocks",))


def test_a_submitted_function_runs_on_its_stream_after_the_compute_stream_and_is_waited_on_the_device():
    recorder = Recorder()
    runner = CommStream(recorder)

    class Bucket:  # stands for the gradients a bucket's closure holds
        pass

    bucket = Bucket()
    held = weakref.ref(bucket)
    ran_on = []

    def collective(b=bucket):
        ran_on.append(recorder.current_stream().name)
        recorder.calls.append(("collective",))
        return "reduced"

    work = runner.submit(collective)
    del bucket, collective
    gc.collect()
    assert ran_on == ["communication"] and recorder.current_stream().name == "compute"
    assert recorder.calls == [("wait_stream", "communication", "compute"), ("collective",),
                              ("record", "communication", 0)], "the bucket must wait for the gradients it packs"
    assert held() is not None, "the bucket's tensors must stay alive until the consumer's stream waited"
    assert not work.done()
    assert work.result() == "reduced"
    assert recorder.calls[-1] == ("wait_event", "compute", 0), "the consumer's stream waits for the event"
    gc.collect()
    assert held() is None, "once waited, the bucket is let go"
    assert work.done()
    work.wait()
    assert recorder.calls.count(("wait_event", "compute", 0)) == 1
    assert ("host blocks",) not in recorder.calls


def test_an_error_while_queueing_is_raised_where_the_work_is_waited():
    runner = CommStream(Recorder())

    def failing():
        raise RuntimeError("bucket 3 failed")

    work = runner.submit(failing)
    assert work.done()
    with pytest.raises(RuntimeError, match="bucket 3 failed"):
        work.wait()
    assert not runner.here


def test_the_device_clock_converts_seconds_at_its_calibrated_rate():
    class Spins(Recorder):
        def __init__(self):
            super().__init__()
            self.spun: list[int] = []

        def _sleep(self, cycles: int) -> None:
            self.spun.append(cycles)

    spins = Spins()
    clock = DeviceClock(spins)
    clock.cycles_per_s = 2e9
    clock.sleep(1.5e-3)
    clock.sleep(0.0)
    assert spins.spun == [3_000_000]


def _train(me, stage_name, options, on_stream, steps=3):
    """Train a few steps, the Comm's overlapped collectives on the recorder's stream (or on the thread); the
    final parameters, and what the recorder saw."""
    model = Branchy()
    comm = make_comm("native")
    recorder = Recorder()
    seen = []
    if on_stream:
        comm.own_stream = recorder
        comm.add_span_observer(lambda call, start, end, thread: seen.append(
            (call.tag.describe() if call is not None else "wait", recorder.current_stream().name, thread)))
    stage = make_stage(stage_name, model, torch.optim.Adam(model.parameters(), lr=0.01), comm, **options)
    for s in range(steps):
        stage.zero_grad()
        stage(_data(me.rank, s)).pow(2).mean().backward()
        stage.step()
    runner = comm._thread
    result = _flat(model, stage)
    comm.close()
    return {"parameters": result, "runner": type(runner).__name__, "calls": recorder.calls, "seen": seen}


OVERLAPPED = [("ddp-bucketed", {"bucket_mb": 1e-9}), ("ddp-bucketed", {"bucket_mb": 1e-9, "compress": "fp16"}),
              ("zero2", {"bucket_mb": 1e-9}), ("zero3", {"prefetch": 1}), ("zero3", {"prefetch": 0}),
              ("zero2", {"bucket_mb": 1e-9, "reduce_scatter_buffers": 2}), ("zero3", {"prefetch": 1, "reduce_scatter_buffers": 2})]


@pytest.mark.parametrize("stage, options", OVERLAPPED)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_overlapped_stage_on_its_own_stream_trains_as_on_the_thread_and_never_blocks_the_host(
        pools, stage, options, world_size):
    on_thread = pools.run(world_size, _train, stage, options, False)
    on_stream = pools.run(world_size, _train, stage, options, True)
    assert {r["runner"] for r in on_thread} == {"CommThread"}
    for rank, (streamed, threaded) in enumerate(zip(on_stream, on_thread, strict=True)):
        assert streamed["runner"] == "CommStream", f"rank {rank}: the overlapped collectives did not use the stream"
        assert torch.equal(streamed["parameters"], threaded["parameters"]), \
            f"rank {rank}: {(streamed['parameters'] - threaded['parameters']).abs().max()} from the thread's run"
        calls = streamed["calls"]
        assert ("host blocks",) not in calls, f"rank {rank}: the host waited for a collective"
        recorded = [c[2] for c in calls if c[0] == "record"]
        waited = [c[2] for c in calls if c[0] == "wait_event"]
        assert recorded and sorted(waited) == recorded, \
            f"rank {rank}: events recorded {recorded}, waited {waited}: each result must be waited where it is used"
        assert all(c[1] == "compute" for c in calls if c[0] == "wait_event"), f"rank {rank}: {calls}"
        # every record follows, at its submit, the communication stream's wait for the compute stream
        for i, call in enumerate(calls):
            if call[0] == "record":
                before = [c for c in calls[:i] if c[0] in ("wait_stream", "record")]
                assert before[-1] == ("wait_stream", "communication", "compute"), f"rank {rank}: {calls[:i + 1]}"
        on_comm = [tag for tag, stream, _ in streamed["seen"] if stream == "communication"]
        assert on_comm, f"rank {rank}: no collective ran on the communication stream: {streamed['seen']}"
        assert all(thread == "MainThread" for _, _, thread in streamed["seen"]), "no communication thread under NCCL"


class Clock:
    """A :class:`DeviceClock` that records what it was asked to wait."""

    def __init__(self):
        self.waits: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)


def _one_gpu_standing_for_two(me):
    """World size 1, a dialled wire, the port standing for a ring of two: what does each collective hold?"""
    comm = make_comm("native", network="alpha=1ms,bandwidth=1MB/s")
    comm.port.clock, comm.port.stands_for = Clock(), 2
    t = torch.ones(1000)
    comm.all_reduce(t)
    comm.reduce_scatter(torch.empty(1000), torch.ones(1000))
    comm.all_gather(torch.empty(1000), torch.ones(1000))
    return comm.port.clock.waits


def test_one_gpu_standing_for_a_ring_of_two_holds_rank_0s_messages_on_the_device(pools):
    waits = pools.run(1, _one_gpu_standing_for_two)[0]
    message = 1e-3 + 2000 / 1e6  # half of 4,000 bytes at 1 MB/s, after alpha
    # all-reduce: a reduce-scatter step and an all-gather step; reduce-scatter and all-gather: one step each
    assert waits == pytest.approx([message] * 4, rel=1e-12), waits


def test_a_port_with_a_device_clock_never_sleeps_the_host():
    from minizero.comm.network import parse_network
    from minizero.comm.port import Port

    port = Port(parse_network("alpha=1s,bandwidth=1MB/s"), record=True)
    port.clock = Clock()
    start = time.perf_counter()
    port.send(1_000_000, "all_reduce")
    assert time.perf_counter() - start < 0.5, "a dialled wait under NCCL belongs on the device"
    assert port.clock.waits == [2.0]


def test_the_streams_picture_reads_a_profilers_trace_by_stream_and_kind(tmp_path):
    from minizero.course.figures import gpu_streams

    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "ampere_sgemm_128x64_nn", "ts": 10.0, "dur": 5.0, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "void at::cuda::(anonymous namespace)::spin_kernel(long)", "ts": 12.0,
         "dur": 40.0, "args": {"stream": 24}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ts": 52.0, "dur": 3.0,
         "args": {"stream": 24}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 9.0, "dur": 1.0, "args": {}},
    ]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    found = gpu_streams.kernels(str(path))
    assert [(k["stream"], k["kind"]) for k in found] == [(7, "compute"), (24, "wire"), (24, "nccl")]
    assert gpu_streams.stream_summary(found) == {"7": {"compute": 5.0, "nccl": 0.0, "wire": 0.0},
                                                 "24": {"compute": 0.0, "nccl": 3.0, "wire": 40.0}}
    gpu_streams.draw([("one", found), ("two", found[:1])], str(tmp_path / "streams.png"))
    assert (tmp_path / "streams.png").stat().st_size > 10_000

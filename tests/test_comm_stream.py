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
              ("zero2", {"bucket_mb": 1e-9}), ("zero3", {"prefetch": 1}), ("zero3", {"prefetch": 0})]


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

"""Stall / I/O attribution (docs/design.md §4): the CUDA-events arithmetic checked on the CPU with a
simulated device (fake events on a fake clock), the host-blocking protocol of the CPU device, peak device memory."""

from __future__ import annotations

import contextlib

import pytest
import torch

from zenflow.harness.records import summarize_steps
from zenflow.harness.runner import run_in_subprocess
from zenflow.harness.session import step_row
from zenflow.telemetry.timeline import EventClock, HostClock, StepTimeline

MS = 1e-3


class FakeDevice:
    """One in-order queue (the compute stream) and a host clock the test moves by hand."""

    def __init__(self) -> None:
        self.host = 0.0
        self.busy_until = 0.0  # host time at which the queued work is done
        self.waits = 0  # synchronize() calls: a step must never make one

    def now(self) -> float:
        return self.host

    def run(self, host_ms: float) -> None:
        self.host += host_ms * MS

    def launch(self, device_ms: float) -> None:
        """Queue `device_ms` of kernels (the launch itself takes no host time here)."""
        self.busy_until = max(self.busy_until, self.host) + device_ms * MS

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device, self.done = device, None

    def record(self, stream=None) -> None:
        self.done = max(self.device.busy_until, self.device.host)  # completes after the work queued before it

    def query(self) -> bool:
        return self.device.host >= self.done

    def synchronize(self) -> None:
        self.device.waits += 1
        self.device.host = max(self.device.host, self.done)

    def elapsed_time(self, later: FakeEvent) -> float:
        assert self.query() and later.query(), "elapsed_time of an event that has not completed"
        return (later.done - self.done) / MS


def cuda_timeline() -> tuple[StepTimeline, FakeDevice]:
    dev = FakeDevice()
    return StepTimeline(EventClock(dev.event, now=dev.now)), dev


def step_with_block(tl: StepTimeline, dev: FakeDevice, what: str, backward_ms: float, launch_ms: float,
                    block_ms: float) -> None:
    """forward+backward queued in `launch_ms` of host time, then a blocking section of `block_ms`, then loss.item()."""
    tl.mark("forward")
    dev.launch(backward_ms)
    dev.run(launch_ms)
    tl.mark("backward")
    tl.on_block_start(what)
    dev.run(block_ms)
    tl.on_block_end(what)
    tl.mark("optimizer")
    dev.host = max(dev.host, dev.busy_until)  # loss.item(): the host waits for the device


def assert_parts_sum_to_period(step) -> None:
    assert min(step.compute_ms, step.io_ms, step.stall_ms) >= 0
    assert step.compute_ms + step.io_ms + step.stall_ms == pytest.approx(step.period_ms, abs=1e-9)


@pytest.mark.parametrize("what, part", [("host_update", "stall_ms"), ("copy_d2h", "io_ms")])
def test_a_block_whose_queued_device_work_finishes_halfway_books_half_as_compute(what, part):
    tl, dev = cuda_timeline()
    step = tl.start_step(0)
    step_with_block(tl, dev, what, backward_ms=10, launch_ms=0, block_ms=20)  # the GPU drains at 10 of 20 ms
    tl.start_step(1)
    assert tl.attribution == "cuda-events"
    assert step.period_ms == pytest.approx(20)
    assert getattr(step, part) == pytest.approx(10)  # only the part after the device drained
    assert step.compute_ms == pytest.approx(10)  # the backward tail is compute, not stall
    assert step.forward_backward_ms == pytest.approx(10)  # device time, not the (zero) launch time
    assert step.optimizer_ms == pytest.approx(10)
    assert_parts_sum_to_period(step)


def test_the_same_step_on_the_host_protocol_books_the_whole_block():
    dev = FakeDevice()
    tl = StepTimeline(HostClock(now=dev.now))
    step = tl.start_step(0)
    step_with_block(tl, dev, "host_update", backward_ms=10, launch_ms=0, block_ms=20)
    tl.finish()
    assert tl.attribution == "host-blocking"
    assert step.stall_ms == pytest.approx(20) and step.forward_backward_ms == pytest.approx(0)


def test_a_block_entered_when_the_device_is_already_idle_is_all_stall_or_io():
    tl, dev = cuda_timeline()
    step = tl.start_step(0)
    tl.mark("forward")
    dev.launch(5)
    dev.run(8)  # the host is slower than the device: it drained at 5 ms
    tl.mark("backward")
    for what, ms in (("copy_d2h", 4), ("host_wait", 3)):
        tl.on_block_start(what)
        dev.run(ms)
        tl.on_block_end(what)
    tl.finish()
    assert step.io_ms == pytest.approx(4) and step.stall_ms == pytest.approx(3)
    assert step.forward_backward_ms == pytest.approx(8)  # the backward mark is queued at 8 ms on an idle device
    assert_parts_sum_to_period(step)


def test_parts_sum_to_the_period_with_nested_blocks_and_many_steps():
    tl, dev = cuda_timeline()
    shapes = [(12, 1, 3), (2, 1, 9), (30, 2, 30), (0, 0, 0), (7, 7, 7)]
    for i, (device_ms, launch_ms, block_ms) in enumerate(shapes):
        tl.start_step(i)
        tl.mark("forward")
        dev.launch(device_ms)
        dev.run(launch_ms)
        tl.on_block_start("reselect")
        tl.on_block_start("copy_h2d")  # nested: counted once, as part of the reselection
        dev.run(block_ms / 2)
        tl.on_block_end("copy_h2d")
        dev.run(block_ms / 2)
        tl.on_block_end("reselect")
        dev.launch(1)
        dev.host = max(dev.host, dev.busy_until)
    tl.finish()
    for step, (device_ms, launch_ms, block_ms) in zip(tl.steps, shapes):
        assert_parts_sum_to_period(step)
        assert step.io_ms == 0.0
        assert step.stall_ms == pytest.approx(max(0.0, launch_ms + block_ms - max(device_ms, launch_ms)))


def test_steps_are_settled_without_waiting_and_only_finish_may_wait():
    tl, dev = cuda_timeline()
    first = tl.start_step(0)
    step_with_block(tl, dev, "host_wait", backward_ms=4, launch_ms=1, block_ms=1)
    dev.launch(50)  # work the step did not wait for: its "optimizer" event is done, later work is not
    second = tl.start_step(1)  # step 0's events completed: settled now, no wait
    tl.mark("forward")
    dev.launch(10)
    tl.mark("backward")  # completes at 60 ms; nothing waits for it
    third = tl.start_step(2)
    assert dev.waits == 0
    assert first.stall_ms == pytest.approx(0) and first.forward_backward_ms == pytest.approx(4)
    assert second.forward_backward_ms == 0.0  # not settled yet: its events are still queued
    tl.finish()  # after the last step a wait delays nothing
    assert dev.waits > 0
    assert second.forward_backward_ms == pytest.approx(10) and third.period_ms is not None


def test_an_opaque_step_books_stall_from_the_device_end_of_backward():
    """DeepSpeed engines: the span from backward (device time) to the step's end is stall, the tail compute."""
    tl, dev = cuda_timeline()
    step = tl.start_step(0)
    tl.mark("forward")
    dev.launch(10)
    dev.run(1)  # backward() returns after 1 ms; the device works until 10 ms
    tl.mark("backward")
    dev.run(29)  # engine.step(): host work
    tl.mark("optimizer", stall_since="backward")
    tl.finish()
    assert step.forward_backward_ms == pytest.approx(10)
    assert step.stall_ms == pytest.approx(20)  # not 29: the backward tail is compute
    assert_parts_sum_to_period(step)


class PeakClock(EventClock):
    memory = "fake peaks"

    def __init__(self, dev: FakeDevice, peaks: list[tuple[int, int]]) -> None:
        super().__init__(dev.event, now=dev.now)
        self.peaks = peaks

    def read_memory_peaks(self):
        return self.peaks.pop(0)


def test_peak_memory_is_per_step_and_the_summary_takes_the_largest_timed_one():
    dev = FakeDevice()
    # one reset before the first step, then one read per ended step
    tl = StepTimeline(PeakClock(dev, [(0, 0), (900, 1000), (300, 512), (700, 2048)]))
    for i, kind in enumerate(["warmup", "accumulate", "update"]):
        tl.start_step(i).kind = kind
        dev.run(1)
    tl.finish()
    rows = [step_row(t) for t in tl.steps]
    assert [r["peak_memory_allocated_bytes"] for r in rows] == [900, 300, 700]
    peak = summarize_steps(rows, cycle=1, model_bytes=None)["peak_memory"]
    assert peak == {"allocated_bytes": 700, "reserved_bytes": 2048, "reason": None}  # the warm-up step excluded


def test_on_the_cpu_peak_memory_is_not_measured_and_says_why():
    tl = StepTimeline()
    tl.use_device(torch.device("cpu"))
    tl.start_step(0)
    tl.finish()
    assert tl.attribution == "host-blocking" and "not measured" in tl.memory
    peak = summarize_steps([step_row(t) for t in tl.steps], cycle=1, model_bytes=None)["peak_memory"]
    assert peak["allocated_bytes"] is None and peak["reserved_bytes"] is None and "not measured" in peak["reason"]


@pytest.mark.slow
def test_a_run_record_names_its_attribution_protocol_and_its_parts_sum_to_the_period(run_spec, tmp_path):
    spec = run_spec("ref-zenflow", weight_decay=0.01, warmup_steps=1, timed_steps=4)  # the tiny workload
    record = run_in_subprocess(spec, tmp_path / "run.json")
    assert record.status == "ok", record.error
    cuda = record.protocol["device"].startswith("cuda")
    assert record.protocol["attribution"] == ("cuda-events" if cuda else "host-blocking")
    for s in record.steps:
        assert s["compute_ms"] + s["io_ms"] + s["stall_ms"] == pytest.approx(s["period_ms"])
        assert s["forward_backward_ms"] > 0 and s["optimizer_ms"] > 0
    peak = record.summary["peak_memory"]
    if cuda:
        assert peak["allocated_bytes"] > 0 and peak["reserved_bytes"] >= peak["allocated_bytes"]
    else:
        assert peak["allocated_bytes"] is None and peak["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_backward_tail_is_compute_and_peaks_are_measured():
    tl = StepTimeline()
    x = torch.randn(4096, 4096, device="cuda")
    for i in range(3):
        tl.start_step(i)
        tl.use_device(x.device)
        tl.mark("forward")
        for _ in range(20):
            x = (x @ x).tanh_()  # tens of ms of queued kernels, launched in microseconds
        tl.mark("backward")
        tl.on_block_start("host_update")
        torch.cuda.current_stream().synchronize()  # a blocking section that absorbs the queued work
        tl.on_block_end("host_update")
        tl.mark("optimizer")
        x.sum().item()
    tl.finish()
    assert tl.attribution == "cuda-events"
    for step in tl.steps:
        assert_parts_sum_to_period(step)
        assert step.forward_backward_ms > 10 * step.stall_ms  # the block waited on compute, not on the host
        assert step.peak_memory_allocated_bytes >= 2 * 4096 * 4096 * 4  # x and x @ x


def recorded(dev: FakeDevice) -> FakeEvent:
    event = dev.event()
    event.record()
    return event


def step_with_device_wait(tl: StepTimeline, dev: FakeDevice, observers, upload_ms: float,
                          inside: str | None = None) -> None:
    """backward 10 ms, then the compute stream waits `upload_ms` for an upload (no host time), then a 3 ms device
    update; `inside`: the wait happens within a blocking section of that name (a reselection's moves)."""
    tl.mark("forward")
    dev.launch(10)
    tl.mark("backward")
    section = observers.blocking(inside) if inside else contextlib.nullcontext()
    with section, observers.device_wait("copy_h2d", lambda: recorded(dev)):
        dev.launch(upload_ms)  # the stream is idle until the copy lands: device time that is not compute
    dev.launch(3)
    tl.mark("optimizer")
    dev.host = max(dev.host, dev.busy_until)  # loss.item()


def test_an_exposed_upload_wait_on_the_compute_stream_is_io_not_compute():
    """`compute.wait_event(upload)` used to land in compute; the events around it book it as I/O."""
    from zenflow.hooks import Observers

    tl, dev = cuda_timeline()
    observers = Observers()
    observers.add(tl)
    step = tl.start_step(0)
    step_with_device_wait(tl, dev, observers, upload_ms=5)
    tl.finish()
    assert step.period_ms == pytest.approx(18)
    assert step.io_ms == pytest.approx(5) and step.blocks_ms["copy_h2d"] == pytest.approx(5)
    assert step.compute_ms == pytest.approx(13)
    assert dev.waits == 0  # nothing in the step synchronized
    assert_parts_sum_to_period(step)


def test_without_the_device_wait_hook_the_upload_is_booked_as_compute():
    """Negative control: an observer that does not book device waits sees the old split (the wait in compute)."""
    from zenflow.hooks import Observers

    tl, dev = cuda_timeline()
    class Blind:
        def __init__(self, inner):
            self.inner = inner

        def on_transfer(self, *a):
            self.inner.on_transfer(*a)

        def on_block_start(self, what):
            self.inner.on_block_start(what)

        def on_block_end(self, what):
            self.inner.on_block_end(what)

    observers = Observers()
    observers.add(Blind(tl))
    step = tl.start_step(0)
    step_with_device_wait(tl, dev, observers, upload_ms=5)
    tl.finish()
    assert step.io_ms == 0 and step.compute_ms == pytest.approx(18)


def test_a_device_wait_inside_a_blocking_section_is_not_booked_twice():
    from zenflow.hooks import Observers

    tl, dev = cuda_timeline()
    observers = Observers()
    observers.add(tl)
    step = tl.start_step(0)
    step_with_device_wait(tl, dev, observers, upload_ms=5, inside="reselect")
    tl.finish()
    assert "copy_h2d" not in step.blocks_ms
    assert_parts_sum_to_period(step)

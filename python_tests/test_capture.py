"""CUDA graph capture is refused first, on the tensors' own GPU (issue 29 item 3.2). No GPU here:
torch.cuda's capture state and device switch are faked, so the checks run on any machine."""

import contextlib
import importlib

import pytest
import torch

import freescale_comm as fc
from freescale_comm import _capture, _core, _device_dispatch
from freescale_comm.communicator import Communicator
from freescale_comm.work import Work

dispatch = importlib.import_module("freescale_comm.dispatch")  # the module (fc.dispatch is the function)


class FakeGpus:
    """torch.cuda as seen by code running while `capturing` GPUs capture a graph; the current
    device is 0 unless switched with torch.cuda.device."""

    def __init__(self, monkeypatch, capturing: set[int]) -> None:
        self.current = 0
        self.capturing = capturing

        @contextlib.contextmanager
        def device(d):
            index = d.index if isinstance(d, torch.device) else int(d)
            saved, self.current = self.current, index
            try:
                yield
            finally:
                self.current = saved

        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.current in self.capturing)


class FakeTensor:
    """What the refusal needs of a CUDA tensor before anything touches it."""

    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)


def test_the_check_looks_at_the_tensors_gpu_not_the_current_one(monkeypatch):
    FakeGpus(monkeypatch, capturing={1})
    _capture.refuse_capture(torch.device("cuda", 0), "x")  # the current device, not capturing
    with pytest.raises(fc.InvalidUsageError, match="cuda:1 cannot be captured"):
        _capture.refuse_capture(torch.device("cuda", 1), "x")


def test_an_all_to_all_of_another_gpus_tensors_under_capture_is_refused_before_anything_is_queued(monkeypatch):
    """communicator.py checked the current device's stream: tensors on cuda:1 while cuda:0 is
    current went on to be queued under cuda:1's capture."""
    FakeGpus(monkeypatch, capturing={1})
    comm = Communicator.__new__(Communicator)
    comm._core_for = lambda device: pytest.fail("the op reached its transport under capture")
    with pytest.raises(fc.InvalidUsageError, match="all_to_all"):
        comm._submit_now(FakeTensor(1), FakeTensor(1), layout=None, priority=0, async_op=True, op_name="all_to_all_single")


def test_work_wait_under_capture_is_refused(monkeypatch):
    """A stream wait captured as a graph node would never wait at replay."""
    FakeGpus(monkeypatch, capturing={1})

    class Handle:
        seq = 7

        def rethrow_if_failed(self):
            pass

    class Core:
        def stream_wait(self, *args):
            pytest.fail("a stream wait was enqueued under capture")

    work = Work(Core(), Handle(), [], keepalive=(), device=torch.device("cuda", 1))
    with pytest.raises(fc.InvalidUsageError, match="Work.wait"):
        work.wait()


def test_dispatch_under_capture_is_refused_before_the_plan_reads_counts_back(monkeypatch):
    """The plan's host read (counts.tolist()) invalidates a capture instead of raising."""
    FakeGpus(monkeypatch, capturing={0})
    monkeypatch.setattr(_device_dispatch, "plan", lambda *a: pytest.fail("the plan ran (and synced) under capture"))
    with pytest.raises(fc.InvalidUsageError, match="fc.dispatch"):
        dispatch._dispatch_cuda(FakeTensor(0), None, None, 2, None, 0)


def test_combine_under_capture_is_refused(monkeypatch):
    FakeGpus(monkeypatch, capturing={0})

    class Values:
        device = torch.device("cuda", 0)

        def contiguous(self):
            pytest.fail("combine went on under capture")

    with pytest.raises(fc.InvalidUsageError, match="fc.combine"):
        dispatch._move_rows(Values(), handle=None, priority=0, forward=False)


def test_plan_tensors_are_kept_for_the_stream_that_uses_them(monkeypatch):
    """Issue 29 item 3.3: combine may run the scatter on another stream than the dispatch that
    made the plan; the plan's tensors must not be reused before that kernel ran."""
    recorded = []

    class Tracked:
        def __init__(self, name):
            self.name = name

        def record_stream(self, stream):
            recorded.append((self.name, stream))

        def data_ptr(self):
            return 0

        def numel(self):
            return 0

    class Home:
        shape = (0, 4)
        device = torch.device("cuda", 0)

        def element_size(self):
            return 4

        def data_ptr(self):
            return 0

    class Stream:
        cuda_stream = 1234

    combine_stream = Stream()
    FakeGpus(monkeypatch, capturing=set())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: combine_stream)
    plan = _device_dispatch.DevicePlan(0, Tracked("sent"), Tracked("home_row"), Tracked("packed_row"),
                                       Tracked("row_home"), [0], [0])
    _device_dispatch.copy_runs(Home(), Home(), plan, to_packed=False)
    assert sorted(name for name, _ in recorded) == ["home_row", "packed_row", "row_home", "sent"]
    assert all(stream is combine_stream for _, stream in recorded)


def test_close_completes_the_cuda_ops_the_caller_waited_for_before_closing(monkeypatch):
    """Work.wait() on CUDA returns once the op's copies here are enqueued; the op completes on
    the host only once every peer confirmed. close() right after (end of a job) must not fail
    the peers still waiting for this rank's receipt: it completes waited-for ops first."""
    FakeGpus(monkeypatch, capturing=set())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 1})())
    events = []

    class Handle:
        seq = 3
        done = False

        def rethrow_if_failed(self):
            pass

        def is_completed(self):
            return self.done

        def failed(self):
            return False

    class Core:
        device_work_abandoned = False

        def stream_wait(self, handle, stream, timeout):
            return True

        def wait(self, handle, timeout):
            events.append("completed the waited-for op")
            handle.done = True
            return True

        def close(self):
            events.append("closed")

    core = Core()
    waited, never_waited = Work(core, Handle(), [], (), torch.device("cuda", 0)), Work(core, Handle(), [], (), torch.device("cuda", 0))
    waited.wait()
    comm = Communicator.__new__(Communicator)
    comm._forked_from, comm._cuda_cores, comm._core, comm._timeout_ms = None, {0: core}, core, 1000
    comm._inflight = [waited, never_waited]
    comm.close()
    assert events == ["completed the waited-for op", "closed", "closed"], events

"""TrainPipelinePEC's worker on a CUDA stream of its own, checked without a GPU: the two threads run
as two virtual streams (stream_order.StreamChecker sees every op, its reads and writes, the events
and record_stream calls the pipeline's hand-offs make), in every prefetch mode, on whole batches and
micro-batches, with balance. Each mutation of the hand-offs must be caught, so the clean runs'
zero is a finding, not a checker that cannot fail."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch import nn

from freescale_comm.pipelines._streams import HostStreams, for_device, tensors_in
from freescale_comm.testing import spawn

CLEAN = {
    "pec": {},
    "pec, balance": {"balance": True},
    "dual_buffer": {"pipeline": {"prefetch": "dual_buffer"}},
    "ids, 4 micro-batches": {"pipeline": {"prefetch": "ids", "micro_batches": 4}},
    "pec, 4 micro-batches, balance": {"pipeline": {"micro_batches": 4}, "balance": True},
    "dual_buffer, 4 micro-batches": {"pipeline": {"prefetch": "dual_buffer", "micro_batches": 4}},
    "pec, eval": {"eval": True},
    "pec, collision 0": {"collision": 0.0},  # no OL rows or gradients: those rounds are skipped
    "pec, 4 micro-batches, collision 1": {"pipeline": {"micro_batches": 4}, "collision": 1.0},
}
FAILED = {"a peer's data ends early": {"fail": True}}  # the failure drains, and close() after it too
MUTATED = {
    "no stream edges": {"pipeline": {"micro_batches": 4}, "mirror": False},
    "no record_stream": {"pipeline": {"micro_batches": 4}, "record": False},
}


@pytest.mark.usefixtures("torchrec_installed")
def test_every_cross_stream_use_is_ordered_and_recorded_and_each_mutation_is_caught():
    from stream_programs import checked_run

    for report in spawn(checked_run, 2, 6, {**CLEAN, **FAILED, **MUTATED}, timeout_s=300):
        failed = report["a peer's data ends early"]
        # the failure orders the main stream after the worker's (a checkpoint next reads its updates), close() again
        assert failed["failed"] == "CommError" and failed["drains"] == 2 and failed["copied_on"] == ["freescale-pec_0"], \
            failed
        for name in CLEAN:
            r = report[name]
            assert r["violations"] == 0 and r["failed"] is None, (name, r["first"], r["failed"])
            # every batch's host-to-device copy on the worker (its stream), none on the compute stream
            assert r["copied_on"] == ["freescale-pec_0"], (name, r["copied_on"])
            # the run had something to check: both streams ran ops, tensors crossed between them
            assert min(r["ops"].values()) > 100 and r["cross_stream_uses"] > 50, (name, r)
            assert r["drains"] == 1, (name, r["drains"])  # close(): the main stream after the worker's
        assert report["no stream edges"]["kinds"] == ["ordering"], report["no stream edges"]
        assert report["no record_stream"]["kinds"] == ["memory"], report["no record_stream"]
        # the mutations change no result on CPU (one host): only the device would go wrong
        assert report["no stream edges"]["total"] == report["no record_stream"]["total"]


@dataclasses.dataclass
class _Held:
    a: torch.Tensor
    rest: list


class _Slotted:
    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _MoreSlotted(_Slotted):
    __slots__ = "u"  # one name as a string; the base's slot is walked too

    def __init__(self, t: torch.Tensor, u: torch.Tensor) -> None:
        super().__init__(t)
        self.u = u


def test_a_hand_off_reaches_every_tensor_but_modules_and_threads():
    from torchrec import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=["f"], values=torch.arange(3), lengths=torch.tensor([1, 2]))
    plain, shared = torch.ones(2), torch.zeros(1)
    base, derived = torch.ones(5), torch.ones(6)
    held = _Held(plain, [shared, {"k": (shared, _Slotted(torch.ones(3)), _MoreSlotted(base, derived))}])
    queue = collections.deque([kjt, held])
    found = list(tensors_in(queue, None, 3, "s"))
    assert sum(t is plain for t in found) == 1 and sum(t is shared for t in found) == 1  # each once
    assert any(t is kjt.values() for t in found) and any(t.shape == (3,) and t.dtype == torch.float32 for t in found)
    assert any(t is base for t in found) and any(t is derived for t in found)
    module = nn.Linear(2, 2)
    assert list(tensors_in(module, [module], for_device)) == []  # parameters are never freed: not walked


def _one_hand_off(record: bool, write_after_post: bool) -> list[str]:
    """Main makes two tensors (from host values, and by a factory), posts a task reading them (with
    their records or not), and maybe writes one after the post: the checker's violations."""
    from concurrent.futures import ThreadPoolExecutor

    from stream_order import CheckedStreams, StreamChecker

    checker = StreamChecker()
    streams = CheckedStreams(checker, record=record)
    worker = ThreadPoolExecutor(1)
    with checker.on("main"):
        host = torch.tensor([1.0, 2.0])  # aten.lift_fresh
        made = torch.zeros_like(host)  # a factory: reads nothing, makes a block
        mark = streams.posted()
        streams.cross(True, (host, made))
        if write_after_post:
            made.add_(1.0)  # not ordered before the task: it was posted first
        worker.submit(streams.run, mark, lambda: host + made, ()).result()
    worker.shutdown()
    return checker.violations


def test_the_checker_tracks_tensors_from_host_values_and_factories():
    assert _one_hand_off(record=True, write_after_post=False) == []
    unrecorded = _one_hand_off(record=False, write_after_post=False)
    assert len(unrecorded) == 2 and all(v.startswith("memory") for v in unrecorded), unrecorded
    late = _one_hand_off(record=True, write_after_post=True)
    assert len(late) == 1 and late[0].startswith("ordering") and "add_" in late[0], late


def test_cpu_pipelines_hand_off_without_streams():
    streams = for_device(torch.device("cpu"))
    assert type(streams) is HostStreams
    mark = streams.posted()
    assert streams.run(mark, lambda x: x + 1, (1,)) == (2, None)


def test_cuda_hand_offs_wait_and_record_in_order(monkeypatch):
    """CudaStreams' calls, on stand-ins for torch.cuda's streams and events (no GPU here): a task's
    stream waits for the post's event before the task runs on it, records its end after; a join
    makes the caller's stream wait for that; the worker's stream is never the caller's own (the
    pool's first draw here is); close's drain waits for the whole worker stream."""
    import contextlib

    from freescale_comm.pipelines._streams import CudaStreams

    log: list[tuple[str, ...]] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_event(self, event: "Event") -> None:
            log.append((self.name, "waits for", event.name))

        def wait_stream(self, other: "Stream") -> None:
            log.append((self.name, "waits for stream", other.name))

    class Event:
        made = 0

        def __init__(self) -> None:
            Event.made += 1
            self.name = f"event {Event.made}"

        def record(self, stream: Stream) -> None:
            log.append((stream.name, "records", self.name))

    caller = Stream("main")
    current = [caller]
    pool = iter([caller, Stream("side")])

    @contextlib.contextmanager
    def on(stream: Stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: next(pool))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", on)

    streams = CudaStreams(torch.device("cuda", 0))
    assert streams.side.name == "side"
    mark = streams.posted()
    result, done = streams.run(mark, lambda: log.append(("task runs on", current[-1].name)) or 7, ())
    streams.joined(done)
    streams.cross(True, [torch.ones(2)], {"k": torch.zeros(1)})  # CPU tensors: nothing to record
    streams.drain()
    assert result == 7
    assert log == [("main", "records", "event 1"), ("side", "waits for", "event 1"), ("task runs on", "side"),
                   ("side", "records", "event 2"), ("main", "waits for", "event 2"),
                   ("main", "waits for stream", "side")], log

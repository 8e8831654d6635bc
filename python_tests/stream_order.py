"""A stream-ordering checker for TrainPipelinePEC's two threads, run on CPU.

On CUDA the pipeline's worker has its own stream (pipelines/_streams.py). No GPU runs here, so this
module plays CUDA's part: every op the main thread runs is a kernel on stream "main", every op a
worker task runs one on stream "side" (a TorchDispatchMode sees each op and the tensors it reads
and writes), events are vector clocks, and two rules are checked as a GPU would break them:

- ordering: an op on one stream that reads a tensor last written on the other, or writes one the
  other read or wrote, must come after an event the other stream recorded after that access
  (a posted task waits for the main stream's event at its post; the main thread waits for a
  task's end event when it joins it);
- memory: a tensor allocated on one stream and used on the other must have been recorded on the
  user stream (record_stream) before the use; otherwise CUDA's caching allocator may hand its block
  out again on the allocating stream while the other still reads it. (Harsher than CUDA, which only
  needs the record before the free.)

Tensors that existed before the checker saw them allocated (parameters, fused-optimizer state,
TBE weights, which the exchange's protocol keeps row-disjoint between the threads, checked by the
staleness oracle) are not tracked. Violations are collected, not raised, so a run finishes and
reports all of them.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from freescale_comm.pipelines._streams import HostStreams, tensors_in

STREAMS = ("main", "side")
aten = torch.ops.aten
# ops that read no tensor's memory (their outputs take only shapes, dtypes and devices from inputs)
_NO_DATA = {aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.new_empty, aten.new_zeros,
            aten.new_ones, aten.new_full, aten.new_empty_strided}


@dataclass
class _Storage:
    allocated_on: str
    recorded: set = field(default_factory=set)
    # accesses not yet ordered before everything the other stream does: (stream, epoch, lo, hi, write, op),
    # [lo, hi) the bytes of the storage the tensor spans (a slice of a buffer is not the whole buffer)
    accesses: list = field(default_factory=list)


class StreamChecker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()  # a storage freed by a GC pass inside a locked region calls _forget
        self._local = threading.local()
        self.clock = {s: 0 for s in STREAMS}
        self.knows = {s: {t: -1 for t in STREAMS} for s in STREAMS}  # s has waited for t's events up to epoch
        self.storages: dict[int, Optional[_Storage]] = {}  # data_ptr -> tracked storage (None: not tracked)
        self.violations: list[str] = []
        self.ops = {s: 0 for s in STREAMS}
        self.cross_stream_uses = 0  # uses of a tensor the other stream allocated (what the rules checked)

    # -- streams and events --------------------------------------------------------------------------
    def stream(self) -> str:
        return getattr(self._local, "stream", "main")

    @contextlib.contextmanager
    def on(self, stream: str) -> Iterator[None]:
        """This thread's ops run on `stream`, seen by the checker, until the block ends."""
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            with self:
                yield
        finally:
            self._local.stream = previous

    def record_event(self, stream: str) -> tuple[str, int]:
        with self._lock:
            event = (stream, self.clock[stream])
            self.clock[stream] += 1
            return event

    def wait_event(self, stream: str, event: tuple[str, int]) -> None:
        with self._lock:
            other, epoch = event
            self.knows[stream][other] = max(self.knows[stream][other], epoch)

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        with self._lock:
            info = self.storages.get(_ptr(tensor))
            if info is not None:
                info.recorded.add(stream)

    # -- ops -------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        fresh = func is aten.lift_fresh.default  # torch.tensor / from_numpy: a new tensor (a "view" of itself)
        if func.is_view and not fresh:  # no kernel: the output aliases the input
            return out
        stream = self.stream()
        written = _written_arguments(func, args, kwargs)
        # *_like and new_* factories read no input's memory; their outputs are new blocks all the same
        inputs = [] if func.overloadpacket in _NO_DATA else \
            [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        with self._lock:
            self.ops[stream] += 1
            rows = _indexed_rows(func, args, kwargs)  # index ops touch only the indexed rows of their first tensor
            for t in inputs:
                self._access(t, stream, write=id(t) in written, new=fresh, op=func,
                             span=_row_span(t, rows) if rows is not None and t is args[0] else None)
            aliased = {_ptr(t) for t in inputs}
            for t in outputs:  # a view of an input is not an allocation; anything else is a new block
                if _ptr(t) not in aliased:
                    self.storages.pop(_ptr(t), None)
                    self._access(t, stream, write=True, new=True, op=func)
        return out

    def _access(self, t: torch.Tensor, stream: str, write: bool, new: bool, op: Any,
                span: Optional[tuple[int, int]] = None) -> None:
        ptr = _ptr(t)
        if ptr == 0:
            return
        if ptr not in self.storages:
            if not new:  # it existed before the checker saw it made: not tracked
                self.storages[ptr] = None
                return
            self.storages[ptr] = _Storage(stream, accesses=[(stream, self.clock[stream], 0, 1 << 62, True, op)])
            weakref.finalize(t.untyped_storage(), self._forget, ptr)
            return
        info = self.storages[ptr]
        if info is None:
            return
        epoch, (lo, hi) = self.clock[stream], span if span is not None else _span(t)
        if info.allocated_on != stream:
            self.cross_stream_uses += 1
            if stream not in info.recorded:
                self.violations.append(f"memory: a tensor {tuple(t.shape)} allocated on {info.allocated_on} is used on "
                                       f"{stream} without record_stream({stream})")
        for other, when, a, b, wrote, by in info.accesses:
            if other != stream and (wrote or write) and a < hi and lo < b and self.knows[stream][other] < when:
                self.violations.append(
                    f"ordering: {stream} {'writes' if write else 'reads'} bytes [{lo}, {hi}) of a tensor "
                    f"{tuple(t.shape)} ({op}) that {other} {'wrote' if wrote else 'read'} ([{a}, {b}), epoch {when}, "
                    f"{by}) without waiting for it")
        # keep what some other stream has not waited for yet, and this access
        info.accesses = [r for r in info.accesses if any(self.knows[s][r[0]] < r[1] for s in STREAMS if s != r[0])]
        info.accesses.append((stream, epoch, lo, hi, write, op))

    def _forget(self, ptr: int) -> None:
        with self._lock:
            self.storages.pop(ptr, None)


class CheckedStreams(HostStreams):
    """The pipeline's hand-offs (pipelines/_streams.py's CudaStreams) on the checker's two virtual
    streams. mirror=False drops the events, record=False the record_stream calls: the mutations the
    checker must catch."""

    def __init__(self, checker: StreamChecker, mirror: bool = True, record: bool = True) -> None:
        self.checker, self.mirror, self.record = checker, mirror, record
        self.drains = 0  # close() and a failure must order the main stream after the worker's

    def drain(self) -> None:
        self.drains += 1
        self.checker.wait_event("main", self.checker.record_event("side"))

    def posted(self) -> Any:
        return self.checker.record_event("main")

    def run(self, mark: Any, fn: Callable[..., Any], args: tuple) -> tuple[Any, Any]:
        with self.checker.on("side"):
            if self.mirror:
                self.checker.wait_event("side", mark)
            result = fn(*args)
            return result, self.checker.record_event("side")

    def joined(self, done: Any) -> None:
        if self.mirror:
            self.checker.wait_event("main", done)

    def cross(self, to_worker: bool, *objects: Any) -> None:
        if self.record:
            for tensor in tensors_in(*objects):
                self.checker.record_stream(tensor, "side" if to_worker else "main")


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse or other storage-less tensors
        return 0


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of its storage the tensor's elements lie in."""
    if t.numel() == 0:
        return 0, 0
    size = t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.storage_offset() * size, (t.storage_offset() + last + 1) * size


# index ops (self, dim, index, ...): along dim 0 they read or write only the indexed rows of self
_INDEX_OPS = {aten.index_select.default, aten.index_select.out, aten.index_copy_.default, aten.index_copy.default,
              aten.index_add_.default, aten.index_add.default, aten.index_fill_.int_Scalar}


def _indexed_rows(func: Any, args: tuple, kwargs: dict) -> Optional[tuple[int, int]]:
    """(lowest, highest) row a dim-0 index op touches in its first tensor; None: not such an op."""
    if func not in _INDEX_OPS or len(args) < 3 or args[1] != 0 or not isinstance(args[2], torch.Tensor):
        return None
    index = args[2]
    return (0, -1) if index.numel() == 0 else (int(index.min()), int(index.max()))


def _row_span(t: torch.Tensor, rows: tuple[int, int]) -> tuple[int, int]:
    """The bytes of rows[0]..rows[1] of t (its dim 0), each row as _span spans it."""
    if rows[1] < rows[0] or t.dim() == 0:
        return 0, 0
    return _span(t[rows[0]:rows[1] + 1])


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> set[int]:
    """ids of the tensors `func` writes in place (its schema's mutable arguments)."""
    written: set[int] = set()
    schema = getattr(func, "_schema", None)
    if schema is None:
        return written
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                written.add(id(t))
    return written

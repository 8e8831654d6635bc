"""The worker's own device stream, and the stream edges that mirror the pipeline's thread hand-offs.

TrainPipelinePEC's worker thread copies batches to the device, routes them, looks rows up and runs
the exchange's rounds while the main thread computes. On CUDA that overlap needs the worker off the
main thread's stream: a host read the worker makes (the sizes of what arrives) on the legacy default
stream would wait for every kernel the main thread enqueued before it, i.e. for batch N's forward
and backward, and its rounds (and a batch's copy) would queue behind them too. So the worker runs on a stream of its own (non-blocking, from
PyTorch's pool), and the ordering the two threads agree on at the host is made the device's:

- post (main -> worker): an event recorded on the main thread's current stream when the task is
  posted; the worker's stream waits for it before the task's first kernel;
- join (worker -> main: the main thread waits for a task): an event recorded on the worker's stream
  after the task's last kernel; the main thread's current stream waits for it.

Every host-level happens-before between the threads is one of the two (the threads share nothing
else but what the exchange's protocol keeps disjoint: rows of a table that one thread looks up while
the other updates others), so the device runs every cross-thread dependency in the order the CPU
tests check. Memory: a tensor one stream allocated and the other uses must not return to the
allocating stream's pool while the other's kernels may still read it (CUDA's caching allocator
reuses a freed block on its own stream at once). At each hand-off every tensor reachable from what
crosses (the task's arguments and result, and the exchange's state) is recorded on the receiving
stream (`record_stream`): blunt, complete, one call per tensor and hand-off, and on CUDA only (the
walk visits ~360 tensors a step for whole batches, ~2,900 with 4 micro-batches: ~1 and ~5 ms of
the main thread's CPU, measured on CPU; and a block the worker frees after the main stream was
recorded on it is reused once the main stream's work queued by then is done: about a step later).
close() orders the main stream after the worker's (drain), after a failure too. Not covered:
sparse tensors in a batch (not recorded; TorchRec's batches hold none). On CPU there are no streams:
nothing is recorded, nothing waits.
"""

from __future__ import annotations

import collections
import functools
import types
from typing import Any, Callable, Iterator

import torch
from torch import nn

from freescale_comm.communicator import Communicator
from freescale_comm.pipelines._catalog import Catalog

# What a hand-off never walks into: modules and the catalog (parameters and tables, never freed), the
# communicator, streams, functions, classes and threading's objects
_OPAQUE = (nn.Module, Catalog, Communicator, torch.Stream, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType, functools.partial, type)


def tensors_in(*objects: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `objects` through containers, dataclasses and plain objects'
    attributes (KeyedJaggedTensors and users' batch classes included), each once."""
    seen: set[int] = set()
    stack = list(objects)
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, (int, float, str, bytes, bool)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
            continue
        if isinstance(obj, _OPAQUE) or type(obj).__module__ in ("threading", "_thread"):
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(obj)
        else:  # dataclasses, KeyedJaggedTensors, users' batch classes: attributes and slots (any base's)
            if hasattr(obj, "__dict__"):
                stack.extend(vars(obj).values())
            for klass in type(obj).__mro__:
                slots = klass.__dict__.get("__slots__", ())
                for name in (slots,) if isinstance(slots, str) else slots:
                    stack.append(getattr(obj, name, None))


class HostStreams:
    """CPU: one host, ops run as they are issued; the hand-offs cost nothing."""

    def posted(self) -> Any:
        """Main thread, posting a task: the mark the worker waits for."""
        return None

    def run(self, mark: Any, fn: Callable[..., Any], args: tuple) -> tuple[Any, Any]:
        """Worker: fn(*args) after `mark`; (its result, the mark the main thread joins)."""
        return fn(*args), None

    def joined(self, done: Any) -> None:
        """Main thread, after a task finished: its work ordered before what this thread issues next."""

    def cross(self, to_worker: bool, *objects: Any) -> None:
        """The tensors in `objects` may be used on the other side from now on."""

    def drain(self) -> None:
        """Main thread, the worker stopped: what it issued is ordered before what this thread issues
        next (close(), after a failure too: the tables may be restored from a checkpoint next)."""


class CudaStreams(HostStreams):
    """The worker on its own stream; events and record_stream at each hand-off (see the module)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # from PyTorch's pool (non-blocking: not ordered with the legacy default stream). The pool hands
        # its streams out in turn: never the caller's own, or the worker would queue behind compute
        main = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)
        for _ in range(64):
            if self.side != main:
                break
            self.side = torch.cuda.Stream(device)

    def posted(self) -> Any:
        stream = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def run(self, mark: Any, fn: Callable[..., Any], args: tuple) -> tuple[Any, Any]:
        self.side.wait_event(mark)
        with torch.cuda.stream(self.side):
            result = fn(*args)
            done = torch.cuda.Event()
            done.record(self.side)
        return result, done

    def joined(self, done: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(done)

    def cross(self, to_worker: bool, *objects: Any) -> None:
        stream = self.side if to_worker else torch.cuda.current_stream(self.device)
        for tensor in tensors_in(*objects):
            if tensor.device.type == "cuda" and tensor.layout == torch.strided and tensor.untyped_storage().nbytes():
                tensor.record_stream(stream)

    def drain(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.side)


def for_device(device: torch.device) -> HostStreams:
    """The hand-offs for a pipeline whose tables live on `device` (tests substitute a checker)."""
    return CudaStreams(device) if device.type == "cuda" else HostStreams()

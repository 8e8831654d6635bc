"""Work: the handle of one submitted collective (wait / is_completed / get_future)."""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any, Optional, Union

import torch

from freescale_comm import _completions, _core
from freescale_comm._capture import refuse_capture
from freescale_comm._errors import comm_error

Timeout = Union[None, float, int, datetime.timedelta]
logger = logging.getLogger("freescale_comm")


def _timeout_seconds(timeout: Timeout) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"timeout must be None, a non-negative number of seconds or a timedelta, got {timeout!r}")
    return float(timeout)


def c10d_wait_limit(timeout: Optional[datetime.timedelta]) -> Optional[datetime.timedelta]:
    """The limit a c10d Work.wait(timeout) sets: None for none (c10d passes timedelta(0) when the
    caller gave none); a negative one has run out already (gloo's wait raises unless done)."""
    return None if timeout is None or timeout == datetime.timedelta(0) else timeout


# Tensors of ops that failed after their communicator gave up on device copies it could not cancel
# (_core.Communicator.device_work_abandoned): the device may still read or write them, so they are
# kept for the life of the process (a leak, bounded by those ops) instead of going back to the
# caching allocator, which would hand their blocks to new tensors under the stuck copies.
_ABANDONED_BUFFERS: list[tuple[Any, ...]] = []


class Work:
    """Returned by every collective. Keeps the tensors it reads and writes alive until done."""

    def __init__(
        self, comm: _core.Communicator, handle: _core.Work, result: list[torch.Tensor], keepalive: tuple[Any, ...],
        device: Optional[torch.device] = None,
    ) -> None:
        self._comm = comm  # waiting drives its progress on the waiting thread
        self._device = device  # CUDA ops: wait() orders the current stream, not the CPU
        self._handle = handle
        self._result = result
        self._keepalive: Optional[tuple[Any, ...]] = keepalive
        self._future: Optional[torch.futures.Future] = None
        self._future_done: Optional[threading.Event] = None  # set once the future completed and its callbacks ran
        self._lock = threading.Lock()
        self.device_waited = False  # CUDA: a stream was made to wait for its bytes (Work.wait)

    @property
    def seq(self) -> int:
        """The op's sequence number in its communicator (program order)."""
        return self._handle.seq

    def wait(self, timeout: Timeout = None) -> bool:
        """CPU tensors: blocks (GIL released) until the op completed on this rank and every peer
        received its part. Raises CommError if the op failed, or if `timeout` (seconds or
        timedelta) passed first (the op itself goes on). CUDA tensors (as NCCL): makes the current
        stream wait for the op's bytes on this rank, on an event recorded after its last copy, so
        the wait can never sit ahead of the copies it depends on (design.md §4); the CPU blocks
        until that copy is enqueued, not until it lands. A failure raises here if already known,
        else on a later call (the stream is released either way). Returns True."""
        if self._device is not None:
            seconds = _timeout_seconds(timeout)
            refuse_capture(self._device, "Work.wait()")  # a wait captured as a graph node never waits at replay
            self._handle.rethrow_if_failed()
            if not self._comm.stream_wait(self._handle, torch.cuda.current_stream(self._device).cuda_stream, seconds):
                raise self._timed_out(timeout, "its copies were not all enqueued")
            self.device_waited = True
            self._handle.rethrow_if_failed()
            return True
        seconds = _timeout_seconds(timeout)
        start = time.monotonic()
        if not self._comm.wait(self._handle, seconds):
            raise self._timed_out(timeout, "the op is still pending")
        if not self._future_ran(None if seconds is None else max(0.0, seconds - (time.monotonic() - start))):
            raise self._timed_out(timeout, "the op completed; its future's callbacks are still running")
        self._keepalive = None
        return True

    def _settle_buffers(self) -> None:
        """The op is done or its communicator closed: its tensors go to the process-lifetime list if
        it failed after device work was abandoned (they may still be written), else nothing changes
        (they are freed with this Work)."""
        if self._keepalive is not None and self._handle.failed() and self._comm.device_work_abandoned:
            _ABANDONED_BUFFERS.append(self._keepalive)

    def wait_for_callbacks(self) -> None:
        """Blocks the CPU until the op is done on this rank and its future's callbacks ran (on CUDA
        too, where wait() returns once the copies are enqueued). No-op without a future."""
        self._future_ran(None)

    def _future_ran(self, seconds: Optional[float]) -> bool:
        """Once the op is done: waits until its future (if one was asked for) completed and its
        callbacks ran, as a wait() returned only after them when they ran on the completing thread
        (callers rely on it: PEC's serving). Not from inside those callbacks (they would wait on
        themselves): there the future is complete already."""
        done = self._future_done
        if done is None or done.is_set() or _completions.running_here(self):
            return True
        return done.wait(seconds)

    def _complete_before_close(self, seconds: float, pending_too: bool) -> None:
        """Before its communicator closes: the op is driven to completion on the host, within
        `seconds`, where a CUDA stream was made to wait for it (wait()) or `pending_too`. Its
        failure is the caller's to see at its next call, not here."""
        if not (self.device_waited or pending_too) or self._handle.is_completed():
            return
        try:
            self._comm.wait(self._handle, seconds)
        except Exception:  # noqa: BLE001
            logger.debug("an op failed while its communicator closed", exc_info=True)

    def _timed_out(self, timeout: Timeout, why: str) -> Exception:
        return comm_error(f"all_to_all op #{self.seq} did not complete within {timeout} ({why}; it goes on)", "TIMEOUT")

    def is_completed(self) -> bool:
        """True once the op finished, successfully or not, and its future (if asked for) says so
        too (like torch's Work)."""
        if not self._handle.is_completed():
            return False
        done = self._future_done
        return done is None or done.is_set() or _completions.running_here(self)

    def is_success(self) -> bool:
        return self._handle.is_completed() and not self._handle.failed()

    def exception(self) -> Optional[BaseException]:
        """The op's error once it failed, else None."""
        if not self._handle.failed():
            return None
        try:
            self._handle.rethrow_if_failed()
        except Exception as e:  # noqa: BLE001 - we hand the error back, not raise it
            return e
        return None

    def result(self) -> list[torch.Tensor]:
        """The output tensors (valid once completed)."""
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with [output] (or the CommError) when the op finishes. Its
        callbacks run on a completion thread (_completions), never on the thread driving the
        communicator's progress, so they may block on other ops, as gloo's may; on the calling
        thread if the op was already done. wait() and is_completed() answer once it completed and
        its callbacks ran. CUDA tensors (as NCCL's): a CUDA-aware future, so its wait() and
        value() make the current stream wait for the op's bytes, and then() callbacks run on a
        stream that does."""
        with self._lock:
            if self._future is None:
                devices = [self._device] if self._device is not None else None
                future: torch.futures.Future = torch.futures.Future(devices=devices)
                done = threading.Event()

                def complete() -> None:
                    try:
                        error = self.exception()
                        if error is not None:
                            future.set_exception(error)
                        elif self._device is None:
                            future.set_result(self._result)
                        else:
                            self._set_cuda_result(future)
                    finally:
                        done.set()

                self._future, self._future_done = future, done
                if self._handle.is_completed():
                    complete()
                else:
                    self._handle.add_done_callback(lambda: _completions.run_soon_for(self, complete))
            return self._future

    def _set_cuda_result(self, future: torch.futures.Future) -> None:
        """Completes `future` with the events it records on a side stream that waits for the op
        (the op completed: stream_wait returns at once). Not the completing thread's current stream: on the default stream the events would also wait for unrelated work."""
        assert self._device is not None
        try:
            side = _side_stream(self._device)
            self._comm.stream_wait(self._handle, side.cuda_stream)
            with torch.cuda.device(self._device), torch.cuda.stream(side):
                future.set_result(self._result)
        except Exception as e:  # noqa: BLE001 - on a completion thread: the future must still complete
            if not future.done():
                future.set_exception(e)


_side_streams: dict[int, "torch.cuda.Stream"] = {}
_side_streams_lock = threading.Lock()


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One stream per GPU on which CUDA futures are completed (it carries only stream waits)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _side_streams_lock:
        stream = _side_streams.get(index)
        if stream is None:
            stream = _side_streams[index] = torch.cuda.Stream(device=index)
        return stream

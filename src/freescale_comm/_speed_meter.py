"""A rank's compute speed as its balanced module's forwards show it (fc.balance(...,
measure_speed=True)): the cost the plan gave this rank per second from the end of the dispatch to
the end of the forward, averaged with the speed measured before. Forwards only: a module's
backward costs about a fixed multiple of its forward, which the ratio of speeds does not see."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch


class SpeedMeter:
    """CPU: the wall clock (a core other work holds shows as a slower rank). CUDA: events on the
    current stream, read once the forward's end completed: a forward still running is read at a
    later one, and the device is never waited for (not run on a GPU yet)."""

    clock = staticmethod(time.perf_counter)  # seconds (tests substitute a counted clock)

    def __init__(self) -> None:
        self.speed: Optional[float] = None  # cost per second, averaged over forwards
        self._open: Optional[tuple[float, Any]] = None  # (cost, start marker) of the forward running
        self._done: Optional[tuple[float, Any, Any]] = None  # (cost, start, end) not read yet

    @staticmethod
    def _mark(device: torch.device) -> Any:
        if device.type != "cuda":
            return SpeedMeter.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def start(self, cost: float, device: torch.device) -> None:
        """The dispatch handed this rank samples of `cost`; its forward starts now."""
        self._open = (cost, self._mark(device)) if cost > 0 else None

    def stop(self, device: torch.device) -> None:
        """The forward of the samples start() was told of ended."""
        if self._open is not None:
            self._done = (*self._open, self._mark(device))
            self._open = None

    def update(self) -> Optional[float]:
        """The speed with the last finished forward folded in (None until one was measured)."""
        if self._done is None:
            return self.speed
        cost, start, end = self._done
        if isinstance(end, torch.cuda.Event):
            if not end.query():
                return self.speed  # still on the device: read at a later forward
            seconds = start.elapsed_time(end) / 1e3
        else:
            seconds = end - start
        self._done = None
        return self.fold(cost, seconds)

    def fold(self, cost: float, seconds: float) -> Optional[float]:
        """The speed with `cost` computed in `seconds` averaged in (nothing computed: unchanged)."""
        if cost > 0 and seconds > 0:
            now = cost / seconds
            self.speed = now if self.speed is None else (self.speed + now) / 2
        return self.speed

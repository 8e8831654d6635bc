"""Where a training step's time goes, per rank: compute, issued comm, exposed comm, idle wait.

Both the measured run (`freescale-bench e2e`) and the simulator (`freescale-bench simulate`)
write the same records, so one piece of code turns them into the same metrics:

- `Busy`: a compute interval of one rank.
- `Blocked`: an interval a rank spent blocked on collective op `op` (in `wait()`, or inside a
  blocking call). It splits into *idle* (waiting for the last rank to issue the op: straggler
  bubble) and *exposed comm* (the op was issued everywhere and still moving bytes).
- `OpSeen`: one rank's view of op `op`: when it issued it, when the op completed there.
  Ops are matched across ranks by their key (name + per-step counter: program order).

All times are seconds on one clock shared by the ranks (CLOCK_MONOTONIC on one host).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np

__all__ = ["Busy", "Blocked", "OpSeen", "StepWindow", "Timeline", "StepRecorder", "idle_end", "last_issue",
           "run_queue_wait", "step_breakdown", "mode_metrics"]


@dataclass(frozen=True)
class Busy:
    rank: int
    step: int
    name: str
    t0: float
    t1: float
    core_wait: float = 0.0  # seconds of [t0, t1] the thread was ready but other threads held its core


@dataclass(frozen=True)
class Blocked:
    rank: int
    step: int
    op: str
    t0: float
    t1: float


@dataclass(frozen=True)
class OpSeen:
    rank: int
    step: int
    op: str
    issued: float
    done: float


@dataclass(frozen=True)
class StepWindow:
    rank: int
    step: int
    t0: float
    t1: float


@dataclass
class Timeline:
    """Every record of one mode's run, all ranks."""

    busy: list[Busy] = field(default_factory=list)
    blocked: list[Blocked] = field(default_factory=list)
    ops: list[OpSeen] = field(default_factory=list)
    steps: list[StepWindow] = field(default_factory=list)

    def extend(self, other: "Timeline") -> None:
        self.busy += other.busy
        self.blocked += other.blocked
        self.ops += other.ops
        self.steps += other.steps

    def select(self, keep: Callable[[int], bool]) -> "Timeline":
        """The records of the steps `keep(step)` accepts."""
        return Timeline([x for x in self.busy if keep(x.step)], [x for x in self.blocked if keep(x.step)],
                        [x for x in self.ops if keep(x.step)], [x for x in self.steps if keep(x.step)])

    def to_dict(self) -> dict[str, list[dict[str, Any]]]:
        return {k: [asdict(x) for x in getattr(self, k)] for k in ("busy", "blocked", "ops", "steps")}

    @classmethod
    def from_dict(cls, d: dict[str, list[dict[str, Any]]]) -> "Timeline":
        return cls([Busy(**x) for x in d["busy"]], [Blocked(**x) for x in d["blocked"]],
                   [OpSeen(**x) for x in d["ops"]], [StepWindow(**x) for x in d["steps"]])


def run_queue_wait() -> float:
    """Seconds this thread has spent ready to run but waiting for a core (Linux schedstat's
    run_delay), 0.0 where the kernel does not say. Other processes on a rank's core show here."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return 0.0


class StepRecorder:
    """Records one rank's timeline while it runs. `sync` (e.g. torch.cuda.synchronize) is called
    before a compute interval closes, so asynchronous devices are timed to completion."""

    def __init__(self, rank: int, clock: Callable[[], float] = time.monotonic,
                 sync: Optional[Callable[[], None]] = None) -> None:
        self.rank = rank
        self.clock = clock
        self.sync = sync
        self.timeline = Timeline()
        self.step = -1
        self._step_t0 = 0.0
        self._counts: dict[str, int] = defaultdict(int)
        self._pending: dict[str, tuple[float, list[float]]] = {}  # op -> (issued, [done time])

    def begin_step(self, step: int) -> None:
        self.step = step
        self._counts.clear()
        self._step_t0 = self.clock()

    def end_step(self) -> None:
        # Ops may stay pending across the boundary (a prefetch for the next step): an op is
        # recorded under the step that waits for it.
        self.timeline.steps.append(StepWindow(self.rank, self.step, self._step_t0, self.clock()))

    @contextmanager
    def compute(self, name: str) -> Iterator[None]:
        waited0 = run_queue_wait()
        t0 = self.clock()
        yield
        if self.sync is not None:
            self.sync()
        t1 = self.clock()
        self.timeline.busy.append(Busy(self.rank, self.step, name, t0, t1, run_queue_wait() - waited0))

    def _key(self, name: str) -> str:
        self._counts[name] += 1
        return f"{name}@{self.step}#{self._counts[name]}"  # the step that issued it, program order

    def blocking(self, name: str, fn: Callable[[], Any]) -> Any:
        """Runs a blocking collective `fn` and records it as issued, waited and done at once."""
        key = self._key(name)
        t0 = self.clock()
        result = fn()
        t1 = self.clock()
        self.timeline.ops.append(OpSeen(self.rank, self.step, key, t0, t1))
        self.timeline.blocked.append(Blocked(self.rank, self.step, key, t0, t1))
        return result

    def issue(self, name: str, work: Any) -> str:
        """Records that async op `work` (a torch / freescale Work) was just issued; returns its key."""
        key = self._key(name)
        done: list[float] = []
        clock = self.clock
        work.get_future().add_done_callback(lambda _: done.append(clock()))
        self._pending[key] = (self.clock(), done)
        return key

    def issue_at(self, name: str, issued: float, work: Any) -> str:
        """Like issue() for an op whose call began at `issued` (the call itself took time)."""
        key = self.issue(name, work)
        self._pending[key] = (issued, self._pending[key][1])
        return key

    def wait(self, key: str, work: Any) -> None:
        issued, done = self._pending.pop(key)
        t0 = self.clock()
        work.wait()
        t1 = self.clock()
        # The completion callback may run a moment after wait() returns: wait's end bounds it.
        finished = min(done[0], t1) if done else t1
        self.timeline.ops.append(OpSeen(self.rank, self.step, key, issued, finished))
        self.timeline.blocked.append(Blocked(self.rank, self.step, key, t0, t1))


def last_issue(ops: list[OpSeen]) -> dict[tuple[int, str], float]:
    """(step, op) -> when the last rank issued it."""
    last: dict[tuple[int, str], float] = {}
    for o in ops:
        k = (o.step, o.op)
        last[k] = max(last.get(k, o.issued), o.issued)
    return last


def idle_end(b: Blocked, last_issued: float) -> float:
    """Where blocked interval b stops being idle (waiting for the last rank to issue its op) and
    becomes exposed comm: the last issue, clamped to [b.t0, b.t1]."""
    return min(max(b.t0, last_issued), b.t1)


def step_breakdown(tl: Timeline) -> dict[tuple[int, int], dict[str, float]]:
    """(step, rank) -> seconds of step, compute, comm (issued: from the op's last issue to its
    completion here), exposed_comm, idle and core_wait (of compute: the core was another's). A
    blocked interval is idle until the last rank issued the op, exposed comm after."""
    last = last_issue(tl.ops)
    out: dict[tuple[int, int], dict[str, float]] = {}
    for w in tl.steps:
        out[(w.step, w.rank)] = {"step": w.t1 - w.t0, "compute": 0.0, "comm": 0.0, "exposed_comm": 0.0, "idle": 0.0,
                                 "core_wait": 0.0}
    for b in tl.busy:
        out[(b.step, b.rank)]["compute"] += b.t1 - b.t0
        out[(b.step, b.rank)]["core_wait"] += b.core_wait
    for o in tl.ops:
        out[(o.step, o.rank)]["comm"] += max(0.0, o.done - last[(o.step, o.op)])
    for b in tl.blocked:
        idle = idle_end(b, last[(b.step, b.op)]) - b.t0
        row = out[(b.step, b.rank)]
        row["idle"] += idle
        row["exposed_comm"] += (b.t1 - b.t0) - idle
    return out


def mode_metrics(tl: Timeline) -> dict[str, float]:
    """Per-step means over the recorded steps: step_ms (the slowest rank's step), straggler_pct
    (mean over ranks of idle / step time), and mean-over-ranks idle_ms, exposed_comm_ms,
    bubble_ms (= idle + exposed comm), compute_ms, comm_ms, core_wait_ms (the part of compute_ms
    the ranks' threads waited for a core other threads held)."""
    rows = step_breakdown(tl)
    steps = sorted({s for s, _ in rows})
    if not steps:
        raise ValueError("the timeline has no steps")
    per_step = []
    for s in steps:
        ranks = [v for (st, _), v in rows.items() if st == s]
        step_s = max(v["step"] for v in ranks)
        mean = {k: float(np.mean([v[k] for v in ranks]))
                for k in ("compute", "comm", "exposed_comm", "idle", "core_wait")}
        per_step.append({
            "step_ms": step_s * 1e3,
            "straggler_pct": 100.0 * float(np.mean([v["idle"] for v in ranks])) / step_s if step_s > 0 else 0.0,
            "idle_ms": mean["idle"] * 1e3,
            "exposed_comm_ms": mean["exposed_comm"] * 1e3,
            "bubble_ms": (mean["idle"] + mean["exposed_comm"]) * 1e3,
            "compute_ms": mean["compute"] * 1e3,
            "comm_ms": mean["comm"] * 1e3,
            "core_wait_ms": mean["core_wait"] * 1e3,  # of compute_ms: other threads held the rank's core
        })
    return {k: float(np.mean([p[k] for p in per_step])) for k in per_step[0]}

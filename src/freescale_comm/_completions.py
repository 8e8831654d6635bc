"""Where a Work's torch Future is completed: never on the thread that drives a communicator's
progress (it holds the progress lock, so a callback blocking on another op there would wait on
itself), but on a completion thread. Its then() callbacks run there and may block on other ops
(PowerSGD's hooks wait on a nested future inside then(), as gloo's worker threads allow).

Invariant: a task never waits behind a blocked one. Tasks run in submission order on an idle
thread; when none is idle a new one starts (so a callback waiting on a future that a later task
completes always gets a thread). Threads leave after `_IDLE_EXIT_S` idle, or at once when a
communicator closes (release_idle); a forked child starts with none."""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Callable

logger = logging.getLogger("freescale_comm")

_IDLE_EXIT_S = 30.0

_lock = threading.Lock()
_ready = threading.Condition(_lock)
_tasks: collections.deque[Callable[[], None]] = collections.deque()
_idle = 0  # threads waiting for a task (under _lock)
_releases = 0  # release_idle() calls so far (under _lock): a thread busy during one leaves once idle
_running = threading.local()  # .tasks: the completions this thread is running now (a stack)


def run_soon(task: Callable[[], None]) -> None:
    """Runs `task()` on a completion thread; it must not raise (its errors are its own)."""
    global _idle
    with _lock:
        _tasks.append(task)
        if _idle > len(_tasks) - 1:
            _ready.notify()
            return
        _idle += 1  # counted idle before it starts, so two submissions do not both wait on it
    try:
        threading.Thread(target=_serve, name="freescale-completions", daemon=True).start()
    except BaseException:  # noqa: BLE001 - no thread (a thread limit): the task runs here, not stranded
        with _lock:
            _idle -= 1
            try:
                _tasks.remove(task)
            except ValueError:  # another thread took it
                return
        task()


def release_idle() -> None:
    """Idle threads leave now rather than after `_IDLE_EXIT_S` (a communicator closed: torch's own
    groups leave no thread behind once destroyed); a later task starts a new one."""
    global _releases
    with _lock:
        _releases += 1
        _ready.notify_all()  # woken with no task, a thread leaves (_serve)


def running_here(owner: object) -> bool:
    """True on a completion thread inside a task of `owner` (see run_soon_for)."""
    return owner in getattr(_running, "owners", ())


def run_soon_for(owner: object, task: Callable[[], None]) -> None:
    """run_soon, with running_here(owner) True while it runs."""

    def marked() -> None:
        owners = getattr(_running, "owners", None)
        if owners is None:
            owners = _running.owners = []
        owners.append(owner)
        try:
            task()
        finally:
            owners.pop()

    run_soon(marked)


def _serve() -> None:
    global _idle
    with _lock:
        seen = _releases
    while True:
        with _lock:
            if not _tasks and seen == _releases:  # (a release while it ran a task: it leaves now)
                _ready.wait(_IDLE_EXIT_S)
            if not _tasks:
                _idle -= 1
                return
            task = _tasks.popleft()
            _idle -= 1
            seen = _releases
        try:
            task()
        except BaseException:  # noqa: BLE001 - a task's errors are its own; the thread serves on
            logger.debug("a completion task raised", exc_info=True)
        with _lock:
            _idle += 1


def _reset_after_fork() -> None:
    """The parent's threads do not exist in a forked child; nor does their lock's holder."""
    global _lock, _ready, _tasks, _idle, _running, _releases
    _lock = threading.Lock()
    _ready = threading.Condition(_lock)
    _tasks = collections.deque()
    _idle = 0
    _releases = 0
    _running = threading.local()


os.register_at_fork(after_in_child=_reset_after_fork)

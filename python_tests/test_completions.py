"""The completion threads that complete Works' futures (_completions): a task never waits behind a
blocked one, and a task that raises neither prints nor stops the threads."""

import threading

from freescale_comm import _completions


def test_a_task_blocked_on_a_later_one_gets_it_run():
    later_ran, first_done = threading.Event(), threading.Event()

    def first() -> None:
        _completions.run_soon(later_ran.set)
        if later_ran.wait(30):  # only another thread can run it: this one is blocked here
            first_done.set()

    _completions.run_soon(first)
    assert first_done.wait(60)


def test_a_task_that_raises_is_silent_and_the_next_one_runs(monkeypatch):
    """Before, its error escaped the thread (threading.excepthook: a traceback on stderr, from a
    library) and the thread died."""
    escaped, ran, failed = [], threading.Event(), threading.Event()
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))

    def fails() -> None:
        failed.set()
        raise RuntimeError("a callback's own error")

    _completions.run_soon(fails)
    assert failed.wait(30)
    _completions.run_soon(ran.set)
    assert ran.wait(30)
    assert escaped == []


def test_running_here_is_true_only_inside_the_owners_task():
    owner, seen, done = object(), [], threading.Event()

    def task() -> None:
        seen.append(_completions.running_here(owner))
        seen.append(_completions.running_here(object()))
        done.set()

    _completions.run_soon_for(owner, task)
    assert done.wait(30)
    assert seen == [True, False] and not _completions.running_here(owner)


def test_a_task_whose_thread_cannot_start_runs_on_the_caller(monkeypatch):
    """Before, the task stayed queued behind a thread counted idle that did not exist: a Work's
    wait() blocked on callbacks that never ran. (A fresh copy of the module: no idle thread.)"""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fresh_completions", _completions.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    ran = threading.Event()

    def no_thread(self) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    fresh.run_soon(ran.set)
    assert ran.is_set() and fresh._idle == 0 and not fresh._tasks

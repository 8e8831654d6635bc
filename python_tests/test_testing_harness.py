"""freescale_comm.testing, the harness every multi-rank test runs on."""
import multiprocessing
import signal

import pytest

from freescale_comm.testing import RankFailure, run_ranks, spawn
from rank_programs import exit_without_reporting, fail_after, sleep_for_a_minute


def test_ranks_do_not_outlive_a_call_interrupted_by_the_tests_own_timeout():
    """pytest-timeout (the GPU checklist's --timeout) raises inside run_ranks' wait: its ranks were
    left running, sharing the GPU with the next tests until pytest exited."""
    def interrupt(signum, frame):
        raise TimeoutError("the test's own timeout")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(3)
    try:
        with pytest.raises(TimeoutError):
            run_ranks(sleep_for_a_minute, 2, backend=None, timeout_s=60)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    alive = [p.name for p in multiprocessing.active_children() if p.name.startswith("freescale-rank")]
    assert alive == [], alive


def test_a_rank_failing_just_past_the_deadline_is_a_failure_not_a_pass():
    """Past timeout_s the harness stopped reading results but waited a few seconds for the ranks:
    one that raised in that window exited 0, its traceback unread, and came back as a pass."""
    with pytest.raises(RankFailure, match="the check failed"):
        spawn(fail_after, 2, 2.0, backend=None, timeout_s=1.0)


def test_a_rank_exiting_0_without_reporting_is_a_failure_not_a_pass():
    with pytest.raises(RankFailure, match="exited \\(code 0\\) without reporting a result"):
        spawn(exit_without_reporting, 2, backend=None, timeout_s=30)

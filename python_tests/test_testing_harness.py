"""freescale_comm.testing, the harness every multi-rank test runs on."""
import multiprocessing
import pathlib
import signal
import subprocess
import sys

import pytest

from freescale_comm.testing import RankFailure, preload_in_ranks, run_ranks, spawn
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


def test_ranks_start_with_the_modules_preloaded_and_only_those():
    """preload_in_ranks: the forkserver imports them once, so each rank starts with them imported.
    A fresh interpreter, since this process's server has started already."""
    program = (f"import sys; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})\n"
               "from freescale_comm import testing\n"
               "import rank_programs\n"
               "testing.preload_in_ranks('wave')\n"
               "print(testing.spawn(rank_programs.modules_imported_at_start, 1, ['wave', 'tabnanny'],"
               " backend=None, timeout_s=60))\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[True, False]]"


@pytest.mark.parametrize("bad", [b"torchrec", "", None])
def test_preloading_takes_module_names_only(bad):
    with pytest.raises(TypeError, match="preload_in_ranks takes module names"):
        preload_in_ranks(bad)

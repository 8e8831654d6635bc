"""Where measured ranks run (bench/placement.py), how busy their cores were, and what the e2e
report says about both: behaviour, never timing."""

import os
import threading
import time

import pytest

from freescale_comm.bench import placement, report
from freescale_comm.bench.e2e_config import E2EConfig
from freescale_comm.bench.timeline import run_queue_wait
from freescale_comm.testing import run_ranks


def test_each_rank_gets_its_own_core_while_there_are_enough():
    p = placement.place_ranks(3, [4, 2, 7])
    assert p.cores == (2, 4, 7) and not p.oversubscribed and p.shared == 1
    assert placement.oversubscription_note(p) == ""


def test_more_ranks_than_cores_share_them_round_robin_and_the_note_says_what_it_does():
    p = placement.place_ranks(4, [0, 1])
    assert p.cores == (0, 1, 0, 1) and p.oversubscribed and p.shared == 2
    note = placement.oversubscription_note(p)
    assert note.startswith("# oversubscribed: 4 ranks share 2 CPU cores")
    assert "lends its core" in note and "--ranks 2" in note and "\n" not in note


def test_default_ranks_are_one_per_usable_core_from_2_to_4():
    assert [placement.default_ranks(list(range(n))) for n in (1, 2, 3, 4, 16)] == [2, 2, 3, 4, 4]
    assert E2EConfig().ranks == placement.default_ranks()


@pytest.mark.parametrize("ranks, cores", [(0, [0]), (2, [])])
def test_bad_placements_are_refused(ranks, cores):
    with pytest.raises(ValueError, match="ranks must be >= 1|cores must name"):
        placement.place_ranks(ranks, cores)


def _pin_and_report(info, core):
    started = threading.Event()
    stop = threading.Event()
    before = threading.Thread(target=lambda: (started.set(), stop.wait()))  # a thread already running
    before.start()
    started.wait()
    placement.pin_this_process(core)
    after = threading.Thread(target=stop.wait)  # a thread started later inherits the core
    after.start()
    cores = [sorted(os.sched_getaffinity(t.native_id)) for t in (before, after)]
    stop.set()
    before.join()
    after.join()
    return cores, placement.thread_cores()


def test_pinning_covers_running_threads_and_later_ones():
    core = placement.usable_cores()[-1]
    (result,) = run_ranks(_pin_and_report, 1, core, backend=None, timeout_s=60)
    assert result.ok, result.error
    assert result.value == ([[core], [core]], [core])


def _start_environment(info, name):
    with open("/proc/self/environ", "rb") as f:  # the environment the interpreter started with
        start = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return start.get(name.encode(), b"").decode()


def test_a_ranks_env_is_there_when_its_interpreter_starts():
    # glibc reads GLIBC_TUNABLES once, at start: setting os.environ in the rank is too late.
    name = "FREESCALE_TEST_START_ENV"
    (result,) = run_ranks(_start_environment, 1, name, backend=None, timeout_s=60, env={name: "yes"})
    assert result.ok, result.error
    assert result.value == "yes"
    assert name not in os.environ  # the parent's environment is restored


def _environment_seen(info, name):
    """(what the interpreter started with, what C's getenv sees now) for `name`."""
    import ctypes

    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    return _start_environment(info, name), (getenv(name.encode()) or b"").decode()


def test_a_forked_rank_sees_env_where_the_library_reads_it_and_costs_no_new_interpreter():
    # fresh_interpreter=False: forked from the preloaded server (its start environment lacks the
    # variable), yet C's getenv, where cpp/config.cc reads FREESCALE_TIMEOUT_S, has it before fn.
    name = "FREESCALE_TEST_FORKED_ENV"
    (result,) = run_ranks(_environment_seen, 1, name, backend=None, timeout_s=60, env={name: "yes"},
                          fresh_interpreter=False)
    assert result.ok, result.error
    assert result.value == ("", "yes")
    assert name not in os.environ
    with pytest.raises(TypeError, match="fresh_interpreter must be True, False or None"):
        run_ranks(_environment_seen, 1, name, backend=None, fresh_interpreter="no")


def _environment_of(info, names):
    return {name: os.environ.get(name) for name in names}


# Set while tests are collected, before any test starts ranks: in the forkserver's environment.
os.environ.setdefault("FREESCALE_TEST_SERVER_ENV", "there when the forkserver started")


def test_ranks_see_the_launchers_environment_as_it_is_at_the_call(monkeypatch):
    """Ranks fork from a forkserver whose environment is the launcher's when the server started:
    a variable set or removed since must be so in every rank too, as with spawned ranks."""
    run_ranks(_environment_of, 1, [], backend=None, timeout_s=60)  # the forkserver runs from here on
    monkeypatch.setenv("FREESCALE_TEST_LATE_ENV", "set after the server started")
    monkeypatch.delenv("FREESCALE_TEST_SERVER_ENV")
    results = run_ranks(_environment_of, 2, ["FREESCALE_TEST_LATE_ENV", "FREESCALE_TEST_SERVER_ENV"], backend=None,
                        timeout_s=60)
    for r in results:
        assert r.ok, r.error
        assert r.value == {"FREESCALE_TEST_LATE_ENV": "set after the server started", "FREESCALE_TEST_SERVER_ENV": None}


def test_device_like_env_keeps_freed_memory_and_the_users_tunables_win():
    env = placement.device_like_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    tunables = env["GLIBC_TUNABLES"].split(":")
    assert "glibc.malloc.mmap_threshold=33554432" in tunables
    assert tunables[-1] == "glibc.malloc.arena_max=2"
    assert placement.device_like_env({})["GLIBC_TUNABLES"].count("glibc.malloc") == 2


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="the kernel keeps no schedstat")
def test_run_queue_wait_counts_the_time_another_thread_held_the_core():
    core = placement.usable_cores()[0]
    stop = threading.Event()
    spin = lambda: [None for _ in iter(stop.is_set, True)]  # noqa: E731 - a CPU-bound loop until stop
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})  # this thread, and the spinner it starts, on one core
    try:
        other = threading.Thread(target=spin)
        waited0 = run_queue_wait()
        other.start()
        deadline = time.monotonic() + 0.5
        x = 0
        while time.monotonic() < deadline:  # CPU-bound too: the two share the core
            x += 1
        waited = run_queue_wait() - waited0
        stop.set()
        other.join()
    finally:
        os.sched_setaffinity(0, saved)
    assert waited > 0.05  # ~0.25 s when the core is split fairly; 0 if the count were not read


def test_the_report_says_when_other_processes_held_the_cores():
    quiet = [{"mode": "vanilla", "compute_ms": 100.0, "core_wait_ms": 1.0},
             {"mode": "freescale", "compute_ms": 100.0, "core_wait_ms": 4.0}]
    assert report.busy_note(quiet) == ""
    busy = quiet + [{"mode": "pec", "compute_ms": 100.0, "core_wait_ms": 40.0}]
    note = report.busy_note(busy)
    assert note.startswith("# busy machine: other processes held the ranks' cores for 15% of their compute")
    assert "(40% in pec)" in note


def test_the_summary_gives_step_time_and_bubbles_together_and_explains_overlap():
    rows = [{"mode": "vanilla", "step_ms": 500.0, "bubble_ms": 100.0, "idle_ms": 96.0, "exposed_comm_ms": 4.0,
             "compute_ms": 400.0},
            {"mode": "overlap", "step_ms": 510.0, "bubble_ms": 110.0, "idle_ms": 108.0, "exposed_comm_ms": 2.0,
             "compute_ms": 410.0},
            {"mode": "freescale", "step_ms": 450.0, "bubble_ms": 30.0, "idle_ms": 20.0, "exposed_comm_ms": 10.0,
             "compute_ms": 420.0}]
    assert report.bubble_summary(rows) == ("# vanilla -> freescale: step 500.0 -> 450.0 ms (10.0% faster), bubbles "
                                           "(idle + exposed comm) 100.0 -> 30.0 ms (70.0% fewer)")
    assert report.compute_line(rows).endswith("400.0 to 420.0 ms (spread 5.0%)")
    note = report.overlap_note(rows)
    assert note.startswith("# overlap shows more bubbles than vanilla (110.0 vs 100.0 ms)")
    assert "exposed 4.0 -> 2.0 ms" in note
    rows[1]["bubble_ms"] = 90.0
    assert report.overlap_note(rows) == ""


def _wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _scheduler_of(pid):
    try:
        return os.sched_getscheduler(pid)
    except ProcessLookupError:
        return None


def test_a_held_core_runs_an_idle_priority_spinner_there_until_released():
    core = placement.usable_cores()[-1]
    with placement.hold_core(core) as holder:
        assert _wait_for(lambda: _scheduler_of(holder.pid) == os.SCHED_IDLE), "the holder never went SCHED_IDLE"
        assert os.sched_getaffinity(holder.pid) == {core}
        assert holder.poll() is None
    assert holder.poll() is not None


def _hold_and_vanish(info, core, pid_file):
    with placement.hold_core(core) as holder:
        with open(pid_file, "w") as f:
            f.write(str(holder.pid))
        _wait_for(lambda: _scheduler_of(holder.pid) == os.SCHED_IDLE)
        os._exit(0)  # no cleanup: the holder must go with us


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped is gone too
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_holder_dies_with_a_rank_that_exits_without_cleanup(tmp_path):
    pid_file = tmp_path / "holder.pid"
    run_ranks(_hold_and_vanish, 1, placement.usable_cores()[-1], str(pid_file), backend=None, timeout_s=60)
    pid = int(pid_file.read_text())
    assert _wait_for(lambda: _gone(pid)), f"holder {pid} outlived its rank"

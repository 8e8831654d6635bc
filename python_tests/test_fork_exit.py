"""A process forked from a rank exits promptly whatever the rank's Communicator held, and the
rank's ops stay right after. The ranks are plain `python` processes (no test harness in them), so
nothing has imported torch._dynamo before the group exists: importing Dynamo with a group alive
binds it as a default argument of torch.distributed.nn.functional, keeping it past
dist.destroy_process_group, and the forked child then hung at exit in ~ProcessGroupGloo."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from freescale_comm.testing import free_port

PROGRAM = Path(__file__).resolve().parent / "fork_exit_program.py"


@pytest.fixture(scope="module")
def ranks_seen() -> list[dict]:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(PROGRAM), str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    seen = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, err[-3000:]
            seen.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return seen


@pytest.mark.timeout(180)
def test_a_child_forked_after_a_communicator_exits_by_sys_exit_and_the_parents_ops_stay_right(ranks_seen):
    for rank, seen in enumerate(ranks_seen):
        assert seen["sys_exit_s"] is not None, f"rank {rank}: the child of sys.exit(0) still ran after 10 s: {seen}"
        assert seen["close_then_exit_s"] is not None, f"rank {rank}: close() + sys.exit(0) hung: {seen}"
        assert min(seen["sys_exit_s"], seen["close_then_exit_s"]) >= 0, f"rank {rank}: a child failed: {seen}"
        assert all(seen[k] for k in ("first_op_ok", "after_sys_exit_op_ok", "after_close_op_ok")), seen


@pytest.mark.timeout(180)
def test_a_multiprocessing_fork_worker_of_a_rank_ends(ranks_seen):
    for rank, seen in enumerate(ranks_seen):
        assert seen["fork_worker_s"] is not None, f"rank {rank}: the fork worker still ran after 10 s: {seen}"
        assert seen["fork_worker_exitcode"] == 0 and seen["after_worker_op_ok"], seen

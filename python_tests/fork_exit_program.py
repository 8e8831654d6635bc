"""A rank as a user launches it (a plain `python` process over a TCP init): builds a Communicator,
runs an op, destroys its group, then forks children that leave (sys.exit, close + sys.exit, the end
of a multiprocessing fork worker) and times their exit; between forks the parent's ops must stay
right. Prints one JSON line of what it saw. Run by test_fork_exit.py: `python this.py RANK PORT`."""
import json
import multiprocessing
import os
import sys
import time

import torch
import torch.distributed as dist

import freescale_comm as fc

EXIT_LIMIT_S = 10.0
WORLD = 2


def exit_seconds(pid: int) -> float | None:
    """Seconds the child `pid` took to exit; None if it still ran after EXIT_LIMIT_S (killed then)."""
    start = time.monotonic()
    while time.monotonic() - start < EXIT_LIMIT_S:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return round(time.monotonic() - start, 2) if os.waitstatus_to_exitcode(status) == 0 else -1.0
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def fork_child(leave) -> float | None:
    pid = os.fork()
    if pid == 0:
        leave()
        os._exit(3)  # (leave never returns)
    return exit_seconds(pid)


def a_worker_that_returns() -> None:
    """A DataLoader worker's shape: runs, returns, and multiprocessing ends it by os._exit."""


def op_is_right(comm: fc.Communicator, rank: int, step: int) -> bool:
    x = torch.arange(4.0) + 10 * rank + step
    y = torch.empty(4)
    comm.all_to_all_single(y, x)
    expected = torch.cat([torch.arange(2.0) + 10 * p + step + 2 * rank for p in range(WORLD)])
    return bool(torch.equal(y, expected))


def main() -> None:
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    comm = fc.Communicator()
    seen = {"first_op_ok": op_is_right(comm, rank, 0)}
    dist.destroy_process_group()
    seen["sys_exit_s"] = fork_child(lambda: sys.exit(0))
    seen["after_sys_exit_op_ok"] = op_is_right(comm, rank, 1)
    seen["close_then_exit_s"] = fork_child(lambda: (comm.close(), sys.exit(0)))
    seen["after_close_op_ok"] = op_is_right(comm, rank, 2)
    worker = multiprocessing.get_context("fork").Process(target=a_worker_that_returns)
    start = time.monotonic()
    worker.start()
    worker.join(EXIT_LIMIT_S)
    seen["fork_worker_s"] = None if worker.is_alive() else round(time.monotonic() - start, 2)
    seen["fork_worker_exitcode"] = worker.exitcode
    if worker.is_alive():
        worker.kill()
        worker.join()
    seen["after_worker_op_ok"] = op_is_right(comm, rank, 3)
    comm.close()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()

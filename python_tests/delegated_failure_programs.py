"""Rank programs: collectives a freescale group delegates to gloo, failing. Every survivor's error
is a CommError naming the root cause (as the group's own ops), not gloo's socket message."""

from __future__ import annotations

import datetime
import os
import signal
import time

import torch
import torch.distributed as dist

import freescale_comm as fc


def _outcome(run) -> str:
    try:
        run()
    except fc.CommError as e:
        chained = type(e.__cause__).__name__ if e.__cause__ is not None else "-"
        return f"CommError {e.code} culprit={e.culprit} cause={chained}"
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        return f"{type(e).__name__}: {str(e)[:120]}"
    return "no error"


def delegated_ops_after_a_peer_died(info, victim: int) -> dict[str, str]:
    """All ranks run an all_reduce on a freescale group, then `victim` SIGKILLs itself; survivors
    run delegated ops that need it (blocking, through a Work's future, one without a future, a
    send to it) and report what each raised."""
    group = dist.new_group(backend="freescale", timeout=datetime.timedelta(seconds=20))
    world = info.world_size
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    assert t.tolist() == [float(world)] * 4
    dist.barrier(group=group)
    if info.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    return {
        "all_reduce": _outcome(lambda: dist.all_reduce(t, group=group)),
        "all_gather_future": _outcome(lambda: dist.all_gather([torch.empty(4) for _ in range(world)], t, group=group,
                                                              async_op=True).get_future().wait()),
        "reduce_scatter_tensor": _outcome(lambda: dist.reduce_scatter_tensor(torch.empty(1), torch.ones(world),
                                                                             group=group)),
        "send_to_victim": _outcome(lambda: dist.send(t, dst=victim, group=group)),
    }


def delegated_op_timed_out(info) -> str:
    """Rank 0 runs an all_reduce that rank 1 never joins (alive, busy elsewhere) on a freescale
    group with a 2 s timeout: rank 0 reports what it raised; rank 1 waits for that, then leaves."""
    group = dist.new_group(backend="freescale", timeout=datetime.timedelta(seconds=2))
    if info.rank == 0:
        outcome = _outcome(lambda: dist.all_reduce(torch.ones(2), group=group))
        dist.barrier()  # the world group (gloo): rank 1 leaves only now
        return outcome
    dist.barrier()
    return "waited"

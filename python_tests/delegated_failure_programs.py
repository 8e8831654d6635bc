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
    core = group._comm._core  # (the group is the ProcessGroupFreescale itself)
    return {
        # a cause only among the ranks an op needs: one not needing the victim sees nothing wrong
        "sight_without_victim": _outcome(lambda: core.raise_peer_failure([p for p in range(world) if p != victim])),
        "sight_with_victim": _outcome(lambda: core.raise_peer_failure([victim])),
        "all_reduce": _outcome(lambda: dist.all_reduce(t, group=group)),
        "all_gather_future": _outcome(lambda: dist.all_gather([torch.empty(4) for _ in range(world)], t, group=group,
                                                              async_op=True).get_future().wait()),
        "reduce_scatter_tensor": _outcome(lambda: dist.reduce_scatter_tensor(torch.empty(1), torch.ones(world),
                                                                             group=group)),
        "send_to_victim": _outcome(lambda: dist.send(t, dst=victim, group=group)),
        # a wait with a limit: gloo's reduce-scatter Works never report completed (that told a limit
        # running out from a failure, and the failure came out as gloo's error)
        "reduce_scatter_tensor_limited_wait": _outcome(lambda: dist.reduce_scatter_tensor(
            torch.empty(1), torch.ones(world), group=group, async_op=True).wait(datetime.timedelta(seconds=10))),
        # one op per tensor under one Work (functional collectives, _coalescing_manager): its wait()
        # returned True and its outputs held zeros
        "all_gather_coalesced": _outcome(lambda: group.allgather_into_tensor_coalesced(
            [torch.empty(4 * world), torch.empty(world)], [t, t[:1]], torch._C._distributed_c10d.AllgatherOptions()).wait()),
        "all_gather_coalesced_future": _outcome(lambda: group.allgather_into_tensor_coalesced(
            [torch.empty(4 * world), torch.empty(world)], [t, t[:1]], torch._C._distributed_c10d.AllgatherOptions()).get_future().wait()),
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


def communicator_over_a_failed_group(info, how: str) -> str:
    """fc.Communicator(group) bootstraps through the group's all_gather_object. how="late": rank 1
    arrives after the (gloo) group's 2 s timeout; how="killed": rank 2 of a freescale group is
    SIGKILLed first; how="exited": rank 2 of a gloo group exits first (it was PEER_DIED naming no
    rank). Each rank but the late or killed one returns its error's type, code and
    culprit. The setup exchange called every failure PEER_DIED, naming no rank."""
    timeout = datetime.timedelta(seconds=2 if how == "late" else 20)
    group = dist.new_group(backend="freescale" if how == "killed" else "gloo", timeout=timeout)
    dist.barrier(group=group)
    if how == "late" and info.rank == 1:
        time.sleep(4)
    if how == "exited" and info.rank == 2:
        os._exit(0)  # its connections close: the others' setup exchange fails
    if how == "killed" and info.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    try:
        fc.Communicator(group)
    except fc.CommError as e:
        return f"CommError {e.code} culprit={e.culprit}"
    return "built"


def delegated_waits_and_refusals_stay_gloos(info) -> dict[str, str]:
    """What stays gloo's own error on a freescale group: a wait(timeout) that runs out while the op
    goes on (it was a CommError after a second, the op then completing), and arguments gloo refuses
    in the call after this rank's communicator failed (they became that old failure's CommError)."""
    group = dist.new_group(backend="freescale", timeout=datetime.timedelta(seconds=20))
    out = {}
    t = torch.ones(2)
    a2a_out = torch.empty(2)
    if info.rank == 0:
        work = dist.all_reduce(t, group=group, async_op=True)
        native = dist.all_to_all_single(a2a_out, torch.ones(2), group=group, async_op=True)
        start = time.monotonic()
        out["short_wait"] = _outcome(lambda: work.wait(datetime.timedelta(seconds=0.3)))
        out["short_wait_fast"] = str(time.monotonic() - start < 0.9)
        # a negative limit is one already run out, as gloo's (it was no limit: a wait for good)
        out["negative_wait"] = _outcome(lambda: work.wait(datetime.timedelta(seconds=-1)))
        out["native_negative_wait"] = _outcome(lambda: native.wait(datetime.timedelta(seconds=-1)))
        dist.barrier()  # the world group: rank 1 joins the all_reduce now
        out["then_wait"] = _outcome(work.wait) + f" {t.tolist()}"
        native.wait()
        out["done_negative_wait"] = _outcome(lambda: work.wait(datetime.timedelta(seconds=-1)))
        out["native_done_negative_wait"] = _outcome(lambda: native.wait(datetime.timedelta(seconds=-1)))
    else:
        dist.barrier()
        dist.all_reduce(t, group=group)
        dist.all_to_all_single(a2a_out, torch.ones(2), group=group)
    # a coalesced call (one op per tensor) waited for with a limit: the limit holds for the whole
    # call (it held for each part: 3 parts 0.35 s apart passed a 0.5 s limit)
    parts = [torch.ones(1) * (p + 1) for p in range(3)]
    outs = [torch.empty(info.world_size) for _ in parts]
    if info.rank == 0:
        coalesced = group.allgather_into_tensor_coalesced(outs, parts, torch._C._distributed_c10d.AllgatherOptions())
        out["coalesced_negative"] = _outcome(lambda: coalesced.wait(datetime.timedelta(seconds=-1)))
        out["coalesced_limit"] = _outcome(lambda: coalesced.wait(datetime.timedelta(seconds=0.5)))
        coalesced.wait()
        out["coalesced_then"] = str([o.tolist() for o in outs])
    else:
        for o, p in zip(outs, parts):
            time.sleep(0.35)
            dist.all_gather_into_tensor(o, p, group=group)
    # this rank's communicator fails: an op no peer joins, past FREESCALE_TIMEOUT_S
    alone = group._comm.all_to_all_single(torch.empty(2), torch.ones(2), async_op=True) if info.rank == 1 else None
    if alone is not None:
        out["alone"] = _outcome(alone.wait)
    dist.barrier()
    out["refused"] = _outcome(lambda: dist.all_gather([torch.empty(3) for _ in range(info.world_size)], t, group=group))
    return out


def a_death_after_an_old_failure(info) -> str:
    """Ranks 1 and 2 fail first in a native op rank 0 never joins (past FREESCALE_TIMEOUT_S: their
    notices say TIMEOUT, culprit rank 0); a delegated all_reduce then works; then rank 2 is
    SIGKILLed and rank 0 runs an all_reduce that needs it. Rank 0 returns what that raised: the old
    notices named the cause (PEER_ABORTED culprit=0, itself), not rank 2's death."""
    group = dist.new_group(backend="freescale", timeout=datetime.timedelta(seconds=20))
    if info.rank != 0:
        _outcome(group._comm.all_to_all_single(torch.empty(3), torch.ones(3), async_op=True).wait)
    dist.barrier()  # the world group
    t = torch.ones(2)
    dist.all_reduce(t, group=group)
    dist.barrier()
    if info.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    if info.rank == 0:
        return _outcome(lambda: dist.all_reduce(t, group=group))
    return "survived"


def delegated_calls_that_disagree(info) -> str:
    """Rank 1 calls all_reduce on 5 elements where every other rank calls it on 4 (freescale
    group). Gloo fails rank 1's call once its peers finish theirs and close; they may complete
    (gloo's ring does not check every size). Each rank returns what it raised. Rank 1's error
    blamed rank 0, which had closed cleanly ("closed its communicator while an op that needs it
    was pending")."""
    group = dist.new_group(backend="freescale", timeout=datetime.timedelta(seconds=20))
    dist.all_reduce(torch.ones(2), group=group)
    return _outcome(lambda: dist.all_reduce(torch.ones(5 if info.rank == 1 else 4), group=group))

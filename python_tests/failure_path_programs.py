"""Failure-path rank programs run on either device: "cpu" (the host transport, in CI) and "cuda"
(the copy-engine transport, several ranks sharing GPU 0: gpu-checklist item 2). On CUDA each also
checks that the user's stream is released: `torch.cuda.synchronize()` returns after the failure."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import freescale_comm as fc

MiB = 1 << 20


def _use(device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(0)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()  # hangs (the rank times out) if a failed op left the stream waiting


def _context_healthy(device: str) -> bool:
    """A fresh kernel runs and synchronizes: the CUDA context survived (a copy from a dead peer's
    freed memory would have faulted it, sticky, for every later call)."""
    x = torch.arange(8, device=device)
    return int((x + 1).sum().item()) == 36


def _wait(work: fc.Work, device: str) -> None:
    """Waits for `work` as a user does and raises its CommError. CPU: wait() blocks. CUDA: the
    first wait() only makes the current stream wait (it raises only a failure already known);
    once the device synchronized, the op has finished on the host too, and wait() raises it."""
    work.wait()
    if device == "cuda":
        torch.cuda.synchronize()
        work.wait()


def _exchange_works(device: str) -> bool:
    """A fresh Communicator moves one AllToAll right: a failure leaves the process usable."""
    world, rank = dist.get_world_size(), dist.get_rank()
    with fc.Communicator() as comm:
        x = torch.arange(2 * world, dtype=torch.int32, device=device) + 100 * rank
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x)
        _synchronize(device)
    want = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.int32) + 100 * p for p in range(world)])
    return torch.equal(out.cpu(), want)


def mismatch_by_bytes(info, device: str, cases: list[tuple[int, int]]) -> list[str]:
    """For each (sent, expected) byte count: rank 0 sends `sent` bytes to rank 1, which expects
    `expected` (every other pair agrees), in a fresh Communicator. Returns each case's CommError
    code ("no error" if none), then whether a fresh Communicator works afterwards."""
    _use(device)
    world, rank = info.world_size, info.rank
    codes = []
    for sent, expected in cases:
        in_splits = [64] * world
        out_splits = [64] * world
        if rank == 0:
            in_splits[1] = sent
        if rank == 1:
            out_splits[0] = expected
        x = torch.ones(sum(in_splits), dtype=torch.uint8, device=device)
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
        with fc.Communicator() as comm:
            try:
                _wait(comm.all_to_all_single(out, x, out_splits, in_splits, async_op=True), device)
                codes.append("no error")
            except fc.CommError as e:
                codes.append(e.code)
            _synchronize(device)
        dist.barrier()
    return codes + [str(_exchange_works(device))]


def killed_mid_op(info, victim: int, device: str = "cpu") -> str:
    """The victim SIGKILLs itself during a large all_to_all_single (4 MiB per peer; on CUDA 128 MiB,
    which a GPU does not finish in the victim's 5 ms); survivors return their CommError's code, how
    long their wait took, and whether their CUDA context still works (issue 41: copies from the
    victim's arena must not fault it)."""
    _use(device)
    comm = fc.Communicator()
    world = info.world_size
    per_peer = (128 if device == "cuda" else 4) * MiB
    x = torch.ones(world * per_peer // 4, device=device)
    out = torch.empty_like(x)
    comm.all_to_all_single(out[:world], x[:world])  # a CUDA core is built collectively, before the victim dies
    work = comm.all_to_all_single(out, x, async_op=True)
    if info.rank == victim:
        time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        _wait(work, device)
    except fc.CommError as e:
        _synchronize(device)
        return f"{e.code} after {time.monotonic() - start:.2f}s healthy={_context_healthy(device)}"
    return "no error"


def close_with_ops_pending(info, device: str, ops: int) -> dict:
    """Rank 0 queues `ops` async AllToAlls (1 MiB per peer) that no peer joins, then closes its
    Communicator: every op fails with CommError, the current stream is released, and a fresh
    Communicator works afterwards. Returns the codes seen, and whether that fresh one worked."""
    _use(device)
    world = info.world_size
    comm = fc.Communicator()
    warm = torch.ones(world, device=device)
    comm.all_to_all_single(torch.empty_like(warm), warm)  # every rank builds its (CUDA) core together
    codes: set[str] = set()
    if info.rank == 0:
        ins = [torch.full((world * MiB // 4,), float(k), device=device) for k in range(ops)]
        works = [comm.all_to_all_single(torch.empty_like(x), x, async_op=True) for x in ins]
        comm.close()
        for work in works:
            try:
                work.wait()
                codes.add("no error")
            except fc.CommError as e:
                codes.add(e.code)
        _synchronize(device)
    dist.barrier()  # peers close after rank 0 did, their communicators never used past the warm-up
    comm.close()
    return {"codes": sorted(codes), "fresh works": _exchange_works(device)}


def ops_on_many_streams(info, streams: int) -> int:
    """`streams` torch CUDA streams made before the Communicator's first op, one async AllToAll
    issued on each (its input written on that stream), all waited on together. Returns the wrong
    elements over all of them."""
    torch.cuda.set_device(0)
    world, rank = info.world_size, info.rank
    made = [torch.cuda.Stream() for _ in range(streams)]
    comm = fc.Communicator()
    n = 4096 * world
    outs, works = [], []
    for k, stream in enumerate(made):
        with torch.cuda.stream(stream):
            x = torch.arange(n, dtype=torch.int32, device="cuda") + (rank * streams + k) * n
            out = torch.full_like(x, -1)
            works.append(comm.all_to_all_single(out, x, async_op=True))
            outs.append(out)
    for work in works:
        work.wait()
    torch.cuda.synchronize()
    m = n // world
    wrong = 0
    for k, out in enumerate(outs):
        want = torch.cat([torch.arange(rank * m, (rank + 1) * m, dtype=torch.int32, device="cuda")
                          + (p * streams + k) * n for p in range(world)])
        wrong += int((out != want).sum())
    comm.close()
    return wrong


def _exit_at_once_round(info, scenario: str, round_: int, report_fd: int) -> None:
    """In a forked child of a rank: a fresh Communicator (its own store keys), one AllToAll that
    fails as `scenario` says, the CommError's code, culprit and message written to `report_fd`,
    then os._exit(0) at once, as a training script that dies on an exception does."""
    import datetime
    import json

    from freescale_comm._bootstrap import StoreBootstrap

    world, rank = info.world_size, info.rank
    try:
        store = dist.TCPStore(info.master_addr, info.master_port, world, is_master=False,
                              timeout=datetime.timedelta(seconds=60))
        bootstrap = StoreBootstrap(dist.PrefixStore(f"exit-at-once/{scenario}/{round_}/", store), rank, world)
        comm = fc.Communicator._over(bootstrap, datetime.timedelta(seconds=30))
    except Exception as e:  # reported (the round then fails its assertion naming why), not lost
        os.write(report_fd, json.dumps({"code": "setup failed", "message": repr(e)}).encode())
        os._exit(0)
    in_splits, out_splits = [2] * world, [2] * world
    if scenario == "mismatch" and rank == 1:
        out_splits[0] = 3  # rank 0 sends 2 rows
    rows = 1 if scenario == "mismatch" else MiB // 4
    x = torch.ones(sum(in_splits), rows)
    out = torch.empty(sum(out_splits), rows)
    work = comm.all_to_all_single(out, x, out_splits, in_splits, async_op=True)
    if scenario == "killed" and rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        work.wait()
        report = {"code": "no error"}
    except fc.CommError as e:
        report = {"code": e.code, "culprit": e.culprit, "message": str(e)}
    except Exception as e:  # not a CommError: reported with its reason instead of "no report"
        report = {"code": "not a CommError", "message": repr(e)}
    os.write(report_fd, json.dumps(report).encode())
    os._exit(0)


CHILD_DEADLINE_S = 100


def _read_until_eof(fd: int, deadline_s: float) -> tuple[bytes, bool]:
    """Everything written to the pipe `fd` until its writer closes it; (what came, True) if that
    takes longer than deadline_s. Closes fd."""
    import select
    import time

    chunks, end = [], time.monotonic() + deadline_s
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return b"".join(chunks), True
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks), False
            chunks.append(chunk)
    finally:
        os.close(fd)


def _round_zygote(info, scenario: str, commands: int, reports: int) -> None:
    """A rank's single-threaded helper: for each round number read from `commands`, forks a child
    that runs _exit_at_once_round, and writes one JSON report line to `reports` ({"code":
    "killed"} for a child killed by a signal, "hung: ..." for one that outlived CHILD_DEADLINE_S)."""
    import json

    with os.fdopen(commands, "r") as rounds, os.fdopen(reports, "w") as out:
        for line in rounds:
            round_ = int(line)
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(read_fd)
                    _exit_at_once_round(info, scenario, round_, write_fd)
                finally:
                    os._exit(1)
            os.close(write_fd)
            blob, hung = _read_until_eof(read_fd, CHILD_DEADLINE_S)
            if hung:  # well past the child's 30 s op and 60 s store timeouts: fail this round, not the suite's clock
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            if hung:
                report = {"code": f"hung: no report within {CHILD_DEADLINE_S} s (round {round_})"}
            else:
                report = json.loads(blob) if blob else {"code": "killed" if os.WIFSIGNALED(status) else "no report"}
            out.write(json.dumps(report) + "\n")
            out.flush()


def exit_at_once_rounds(info, scenario: str, rounds: int) -> list[dict]:
    """Issue 28, `rounds` times: each rank's child runs _exit_at_once_round (scenario "mismatch":
    rank 1 expects 3 rows from rank 0, which sends 2; "killed": rank 3 SIGKILLs itself mid-op), and
    reports what it raised. Forking keeps a round cheap (no new interpreter). The children fork
    from a zygote this rank forks before it has any thread: forked beside the gloo group's threads
    (and rank 0's TCPStore server thread, busy with the other children), a child could inherit a
    lock one of them held and hang before its first store write, as CI saw. Run with backend=None:
    the rank starts its gloo group itself, after the zygote. Returns one report per round."""
    import datetime
    import json

    commands_r, commands_w = os.pipe()
    reports_r, reports_w = os.pipe()
    zygote = os.fork()
    if zygote == 0:
        try:
            os.close(commands_w)
            os.close(reports_r)
            _round_zygote(info, scenario, commands_r, reports_w)
        finally:
            os._exit(0)
    os.close(commands_r)
    os.close(reports_w)
    reports = []
    with os.fdopen(commands_w, "w") as commands, os.fdopen(reports_r, "r") as answers:
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{info.master_addr}:{info.master_port}",
                                    rank=info.rank, world_size=info.world_size,
                                    timeout=datetime.timedelta(seconds=120))
            for round_ in range(rounds):
                commands.write(f"{round_}\n")
                commands.flush()
                reports.append(json.loads(answers.readline() or '{"code": "the zygote died"}'))
                dist.barrier()  # every rank's child is gone before the next round starts
        finally:
            commands.close()  # the zygote leaves at end of input
            os.waitpid(zygote, 0)
            if dist.is_initialized():
                dist.destroy_process_group()
    return reports


def frozen_then_resumed(info) -> str:
    """Rank 1 posts an op and stops itself (SIGSTOP); rank 0 then posts its own, times out
    (FREESCALE_TIMEOUT_S), names rank 1, and resumes it. Each rank's error: code and culprit.
    Before, the resumed rank saw its own deadline first and blamed rank 0 (TIMEOUT, culprit 0),
    though rank 0's notice naming rank 1 was in view."""
    comm = fc.Communicator()
    pids = [None] * info.world_size
    dist.all_gather_object(pids, os.getpid())
    comm.all_to_all_single(torch.empty(2), torch.ones(2))  # both built and connected
    big = torch.ones(2 * (4 << 20))  # 16 MiB a peer: more than the 4 MiB staging, so rank 1's bytes wait for rank 0
    if info.rank == 1:
        work = comm.all_to_all_single(torch.empty_like(big), big, async_op=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        while open(f"/proc/{pids[1]}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)  # until rank 1 is stopped, its op posted
        work = comm.all_to_all_single(torch.empty_like(big), big, async_op=True)
    try:
        work.wait()
        outcome = "no error"
    except fc.CommError as e:
        outcome = f"{e.code} culprit={e.culprit}"
    if info.rank == 0:
        os.kill(pids[1], signal.SIGCONT)
    return outcome

"""Rank functions run by freescale_comm.testing in spawned processes (must be importable)."""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

import freescale_comm as fc

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int8, torch.bool, torch.complex64]


def _random_splits(gen: torch.Generator, world: int, max_rows: int) -> list[list[int]]:
    """counts[src][dst]: rows src sends to dst; about a quarter are zero."""
    counts = torch.randint(0, max_rows + 1, (world, world), generator=gen)
    counts[torch.rand(world, world, generator=gen) < 0.25] = 0
    return counts.tolist()


def _fill(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen).to(dtype)


def alltoall_matches_gloo(info, seed: int, cases: int) -> int:
    """Random uneven splits, several dtypes, 1-D and 3-D, random priorities, async interleaved,
    non-contiguous inputs: every output equals gloo's. Returns the number of cases checked."""
    comm = fc.Communicator()
    world, rank = info.world_size, info.rank
    shared = torch.Generator().manual_seed(seed)          # same on every rank: splits, shapes
    local = torch.Generator().manual_seed(seed * 1000 + rank)  # this rank's data
    pending = []
    for case in range(cases):
        counts = _random_splits(shared, world, max_rows=40)
        in_splits = counts[rank]
        out_splits = [counts[p][rank] for p in range(world)]
        dtype = DTYPES[case % len(DTYPES)]
        trailing = () if case % 2 == 0 else (3, 5)
        priority = int(torch.randint(-2, 3, (1,), generator=shared))
        x = _fill((sum(in_splits),) + trailing, dtype, local)
        if case % 3 == 2 and x.dim() == 3:
            x = x.transpose(1, 2).contiguous().transpose(1, 2)  # same values, non-contiguous
        ours = torch.full((sum(out_splits),) + trailing, 7, dtype=torch.float32).to(dtype)
        ref = torch.empty_like(ours)
        dist.all_to_all_single(ref, x.contiguous(), out_splits, in_splits)
        work = comm.all_to_all_single(ours, x, out_splits, in_splits, priority=priority, async_op=case % 2 == 1)
        pending.append((work, ours, ref, case))
        if case % 4 == 3:
            for w, o, r, c in pending:
                w.wait()
                assert torch.equal(o, r), f"case {c} ({dtype}) differs from gloo"
            pending.clear()
    for w, o, r, c in pending:
        w.wait()
        assert torch.equal(o, r), f"case {c} differs from gloo"
    # None splits = equal, as in dist; and a future resolves to [output].
    x = torch.arange(world * 6, dtype=torch.float32) + 100 * rank
    ours, ref = torch.empty_like(x), torch.empty_like(x)
    dist.all_to_all_single(ref, x)
    fut = comm.all_to_all_single(ours, x, async_op=True).get_future()
    assert torch.equal(fut.wait()[0], ref)
    comm.close()
    return cases


def bad_inputs_raise_before_communicating(info) -> list[str]:
    """Each bad call raises ValueError/TypeError naming the argument; afterwards a good op still
    matches, which shows nothing was sent. Returns the messages."""
    comm = fc.Communicator()
    world = info.world_size
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty(8)
    messages = []
    cases = [
        (ValueError, "input_split_sizes", dict(output=out, input=x, input_split_sizes=[3, 4])),
        (ValueError, "output_split_sizes", dict(output=out, input=x, output_split_sizes=[9, -1])),
        (ValueError, "input_split_sizes", dict(output=out, input=x, input_split_sizes=[8])),
        (ValueError, "input_split_sizes", dict(output=out, input=x, input_split_sizes=torch.tensor([1, 2, 5]))),
        (TypeError, "dtype", dict(output=out.to(torch.float64), input=x)),
        (TypeError, "input", dict(output=out, input=[1.0, 2.0])),
        (TypeError, "input_split_sizes", dict(output=out, input=x, input_split_sizes=[1.5, 6.5])),
        (ValueError, "meta", dict(output=out.to("meta"), input=x.to("meta"))),
        (ValueError, "device", dict(output=out.to("meta"), input=x)),
        (ValueError, "output", dict(output=torch.empty(8, 2).t(), input=torch.empty(2, 8))),
        (ValueError, "world size", dict(output=torch.empty(7), input=torch.empty(7))),
        (TypeError, "priority", dict(output=out, input=x, priority="high")),
    ]
    assert world == 2
    for exc, needle, kwargs in cases:
        try:
            comm.all_to_all_single(**kwargs)
        except exc as e:
            assert needle in str(e), f"{exc.__name__} does not name {needle!r}: {e}"
            messages.append(str(e))
        else:
            raise AssertionError(f"no {exc.__name__} for {kwargs}")
    for exc, needle, bad in [(ValueError, "only CUDA tensors", x), (TypeError, "torch.Tensor", [1.0])]:
        try:
            comm.register_buffer(bad)
        except exc as e:
            assert needle in str(e), f"register_buffer's {exc.__name__} does not say {needle!r}: {e}"
            messages.append(str(e))
        else:
            raise AssertionError(f"register_buffer({bad!r}) raised no {exc.__name__}")
    ref = torch.empty(8)
    dist.all_to_all_single(ref, x + info.rank)
    comm.all_to_all_single(out, x + info.rank)
    assert torch.equal(out, ref)
    comm.close()
    return messages


def self_block_refused_locally(info) -> list[str]:
    """Issue 28: a rank's block to itself that differs in bytes from what it expects from itself
    (16 bytes sent, 12 expected) raises ValueError on every rank before any communication, through
    fc.Communicator and through a freescale group (all_to_all_single and the list form); then a
    correct op on the same communicator / group matches gloo. Returns the messages."""
    world, rank = info.world_size, info.rank
    fs = dist.new_group(backend="freescale")
    comm = fc.Communicator()
    out, inp, splits = torch.empty(world, 3), torch.zeros(world, 4), [1] * world
    calls = {
        "communicator": lambda: comm.all_to_all_single(out, inp, splits, splits),
        "communicator_async": lambda: comm.all_to_all_single(out, inp, splits, splits, async_op=True),
        "backend_single": lambda: dist.all_to_all_single(out, inp, splits, splits, group=fs),
        "backend_list": lambda: dist.all_to_all([torch.empty(3) for _ in range(world)],
                                                [torch.zeros(4) for _ in range(world)], group=fs),
    }
    messages = []
    for name, call in calls.items():
        try:
            call()
        except ValueError as e:
            for needle in (f"rank {rank} sends itself 16 bytes", "expects 12 bytes", "input_split_sizes",
                           "output_split_sizes"):
                assert needle in str(e), f"{name}: {needle!r} not in {e}"
            messages.append(str(e))
        else:
            raise AssertionError(f"{name}: a self block of 16 bytes where 12 are expected was accepted")
    # Nothing moved: correct ops on the same communicator and group match gloo.
    x = torch.arange(world * 3, dtype=torch.float32).view(world, 3) + 100 * rank
    ref, ours, via_group = torch.empty(world, 3), torch.empty(world, 3), torch.empty(world, 3)
    dist.all_to_all_single(ref, x)
    comm.all_to_all_single(ours, x)
    dist.all_to_all_single(via_group, x, group=fs)
    assert torch.equal(ours, ref) and torch.equal(via_group, ref), (ours, via_group, ref)
    outs = [torch.empty(3) for _ in range(world)]
    dist.all_to_all(outs, list(x.unbind(0)), group=fs)
    assert torch.equal(torch.stack(outs), ref)
    comm.close()
    return messages


def disagreeing_splits(info) -> str:
    """Rank 1 expects fewer rows from rank 0 than rank 0 sends: CommError on every rank."""
    comm = fc.Communicator()
    world, rank = info.world_size, info.rank
    in_splits = [2] * world
    out_splits = [2] * world
    if rank == 1:
        out_splits = [1] + [2] * (world - 1)
    x = torch.ones(sum(in_splits))
    out = torch.empty(sum(out_splits))
    try:
        comm.all_to_all_single(out, x, out_splits, in_splits)
    except fc.CommError as e:
        return e.code
    return "no error"


def peer_never_joins(info) -> str:
    """Rank 1 never issues the op: rank 0 times out with CommError (FREESCALE_TIMEOUT_S)."""
    comm = fc.Communicator()
    if info.rank == 1:
        time.sleep(3.0)
        return "slept"
    x = torch.ones(4)
    try:
        comm.all_to_all_single(torch.empty(4), x)
    except fc.CommError as e:
        assert "Timed out" in str(e)
        return e.code
    return "no error"


def wait_releases_the_gil(info) -> int:
    """While rank 0 blocks in a sync all_to_all_single (rank 1 joins 1 s late), a Python thread
    keeps running: returns how often it ran."""
    comm = fc.Communicator()
    x = torch.ones(4)
    if info.rank == 1:
        time.sleep(1.0)
        comm.all_to_all_single(torch.empty(4), x)
        return 0
    ticks = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.05)
    before = ticks
    comm.all_to_all_single(torch.empty(4), x)
    stop.set()
    t.join()
    return ticks - before


def in_place_and_lazy_views_as_gloo(info, elements: int) -> list[str]:
    """Issue 22 item 6. In place (input is output, as gloo allows): the result gloo gives. A lazy
    conjugate input: its values, conjugated. A conjugate output: refused before communicating.
    Returns the cases checked."""
    rank, world = info.rank, info.world_size
    comm = fc.Communicator()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(elements * world, generator=gen)
    want = torch.empty_like(x)
    dist.all_to_all_single(want, x.clone())  # gloo (default group)
    y = x.clone()
    comm.all_to_all_single(y, y)
    assert torch.equal(y, want), f"in place: {int((y != want).sum())} of {y.numel()} elements wrong"
    z = x.clone()
    comm.all_to_all_single(z[: elements * world // 2 * 2].view(-1, 2), z[: elements * world // 2 * 2].view(-1, 2))
    c = torch.complex(torch.randn(4 * world, generator=gen), torch.randn(4 * world, generator=gen))
    want_c = torch.empty_like(c)
    dist.all_to_all_single(want_c, c.conj().resolve_conj())
    got = torch.empty_like(c)
    comm.all_to_all_single(got, c.conj())
    assert torch.equal(got, want_c), "a lazy conjugate was sent unconjugated"
    try:
        comm.all_to_all_single(torch.empty_like(c).conj(), c)
    except ValueError as e:
        assert "conjugate" in str(e), e
    else:
        raise AssertionError("a conjugate output view was accepted")
    comm.close()
    return ["in_place", "conj_input", "conj_output_refused"]


def huge_timeouts_mean_no_timeout(info) -> list[str]:
    """Issue 22 item 5: FREESCALE_TIMEOUT_S=1e10 (set by the test), wait(timeout=1e10) and a group
    timeout of ~2700 years used to overflow into an immediate TIMEOUT. Each op here completes."""
    world = info.world_size
    x = torch.arange(4.0 * world)
    comm = fc.Communicator()  # FREESCALE_TIMEOUT_S=1e10
    work = comm.all_to_all_single(torch.empty_like(x), x, async_op=True)
    work.wait(timeout=1e10)
    comm.close()
    checked = ["env", "wait"]
    pg = dist.new_group(backend="freescale", timeout=datetime.timedelta(days=10**6))
    dist.all_to_all_single(torch.empty_like(x), x, group=pg)
    checked.append("group")
    return checked


def arena_bigger_than_dev_shm(info, nbytes: int) -> str:
    """Run (by the test) where /dev/shm holds less than the arenas: "no error" if an AllToAll of
    `nbytes` per peer went through intact, else the CommError's code and message."""
    world = info.world_size
    try:
        comm = fc.Communicator()
        x = torch.arange(nbytes // 4 * world, dtype=torch.int32) + info.rank
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x)
        want = torch.empty_like(x)
        dist.all_to_all_single(want, x)
        if not torch.equal(out, want):
            return "wrong bytes"
    except fc.CommError as e:
        return f"{e.code}: {e}"
    return "no error"


def wait_inside_a_done_callback(info) -> str:
    """Issue 22 item 3: a done-callback of op A blocking on op B of the same communicator (B
    pending: rank 1 joins it a second later) used to hang for good, its timeout ignored. Now the
    wait raises InvalidUsageError inside the callback, which fails the chained future. Returns
    what rank 0's chained future held."""
    comm = fc.Communicator()
    x = torch.arange(4.0 * info.world_size)
    a = comm.all_to_all_single(torch.empty_like(x), x, async_op=True)
    if info.rank == 1:
        a.wait()
        time.sleep(1.0)
        comm.all_to_all_single(torch.empty_like(x), x)
        comm.close()
        return "joined"
    b = comm.all_to_all_single(torch.empty_like(x), x, async_op=True)
    chained = a.get_future().then(lambda _: b.wait(timeout=30))
    try:
        chained.wait()
        outcome = "the callback's wait returned"
    except Exception as e:  # noqa: BLE001 - torch wraps what the callback raised
        outcome = f"{type(e).__name__}: {e}"
    b.wait()
    comm.close()
    return outcome


def fork_after_communicator(info) -> dict:
    """Issue 22 item 1: a child forked after fc.Communicator() used to hang (or abort) in its
    atexit close, and a child calling close() told the parent's peers this rank left. Now the
    child is refused clearly if it uses the parent's communicator and exits cleanly; the parent's
    group goes on. Returns the child's outcome and the parent's next op's result."""
    comm = fc.Communicator()
    x = torch.arange(4.0 * info.world_size) + info.rank
    comm.all_to_all_single(torch.empty_like(x), x)
    outcome = {}
    if info.rank == 0:
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the child: use, close, exit (atexit handlers run)
            os.close(read)
            try:
                comm.all_to_all_single(torch.empty_like(x), x)
                said = "used the parent's communicator"
            except fc.InvalidUsageError as e:
                said = "refused" if "forked" in str(e) else f"refused without saying why: {e}"
            comm.close()
            os.write(write, said.encode())
            os.close(write)
            atexit._run_exitfuncs()  # what interpreter exit runs (freescale's close-all among them)
            os._exit(0)  # not sys.exit: the test harness in this (copied) process would report it as rank 0
        os.close(write)
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            status = "hung"
        outcome["child"] = os.read(read, 200).decode()
        outcome["child_exit"] = status if status == "hung" else os.waitstatus_to_exitcode(status)
        os.close(read)
    dist.barrier()  # (gloo) the child is gone before the next op
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x)
    want = torch.empty_like(x)
    dist.all_to_all_single(want, x)
    outcome["next_op_ok"] = bool(torch.equal(out, want))
    comm.close()
    return outcome


def sleep_for_a_minute(info) -> None:
    """A rank that outlives its caller's patience (the harness's own tests)."""
    time.sleep(60)


def modules_imported_at_start(info, names: list[str]) -> list[bool]:
    """Which of `names` the rank had imported before its program ran (the harness's own tests)."""
    import sys

    return [name in sys.modules for name in names]


def fail_after(info, seconds: float) -> None:
    """A rank whose check fails `seconds` in (the harness's own tests)."""
    time.sleep(seconds)
    raise AssertionError(f"rank {info.rank}: the check failed")


def a_peer_leaves_before_building_its_communicator(info) -> str:
    """Rank 0 fails before building its fc.Communicator and exits; rank 1 waits in the setup
    exchange over the (gloo) group. It got gloo's RuntimeError ("Connection closed by peer"), not
    a CommError; then one naming no rank. Returns rank 1's error type, code and culprit."""
    import freescale_comm as fc

    if info.rank == 0:
        time.sleep(1.0)
        return "left"
    try:
        fc.Communicator(dist.group.WORLD)
    except Exception as e:  # noqa: BLE001 - the type and code are the result
        return f"{type(e).__name__} {getattr(e, 'code', None)} culprit={getattr(e, 'culprit', None)}"
    return "built"


def a_rank_dies_while_a_freescale_group_is_set_up(info) -> Optional[tuple[str, str, Optional[int], float]]:
    """Rank 1 dies between the setup rounds of dist.new_group(backend="freescale", timeout=2 s) on
    a freescale world of 30 s. Its peers waited the world store's 30 s, then raised torch's
    DistStoreError naming no rank. Returns (error type, code, culprit, seconds waited)."""
    import datetime

    import freescale_comm as fc
    from freescale_comm import _bootstrap

    if info.rank == 1:
        original, calls = _bootstrap.StoreBootstrap.allgather, [0]

        def dies_in_round_two(self, blob):
            calls[0] += 1
            if calls[0] == 2:
                os._exit(1)
            return original(self, blob)

        _bootstrap.StoreBootstrap.allgather = dies_in_round_two
    start = time.monotonic()
    try:
        dist.new_group(backend="freescale", timeout=datetime.timedelta(seconds=2))
    except Exception as e:  # noqa: BLE001 - the error is the result
        return (type(e).__name__, getattr(e, "code", None), getattr(e, "culprit", None), time.monotonic() - start)
    return None


def a_rank_never_comes_to_build_a_freescale_group(info) -> Optional[tuple[str, str, Optional[int], str]]:
    """Rank 2 of 3 leaves before dist.new_group(backend="freescale", timeout=3 s); ranks 0 and 1
    return (error type, code, culprit, message)."""
    import datetime

    if info.rank == 2:
        os._exit(3)
    try:
        dist.new_group(backend="freescale", timeout=datetime.timedelta(seconds=3))
    except Exception as e:  # noqa: BLE001 - the error is the result
        return (type(e).__name__, getattr(e, "code", None), getattr(e, "culprit", None), str(e))
    return None


def exit_without_reporting(info) -> int:
    """Rank 1 leaves with os._exit(0) before returning (the harness's own tests)."""
    if info.rank == 1:
        os._exit(0)
    return 42

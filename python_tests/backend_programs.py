"""Rank functions for the backend tests: run with a "freescale" default group, each collective is
compared with the same call on a gloo group of the same ranks."""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

import freescale_comm as fc
from freescale_comm.backend import ProcessGroupFreescale, _NativeWork
from freescale_comm.communicator import _close_all


def _pair(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t.clone(), t.clone()


def every_collective_matches_gloo(info, seed: int) -> list[str]:
    """Runs each torch.distributed collective on the freescale default group and on a gloo group;
    returns the names of those checked (any mismatch raises)."""
    rank, world = info.rank, info.world_size
    fs = dist.group.WORLD
    assert isinstance(fs, ProcessGroupFreescale), type(fs)
    assert dist.get_backend() == "freescale"
    gl = dist.new_group(backend="gloo")
    gen = torch.Generator().manual_seed(seed + rank)
    checked = []

    def same(name: str, a, b) -> None:
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"{name}: {a} != {b}"
        else:
            assert len(a) == len(b), name
            for x, y in zip(a, b):
                same(name, x, y)
        if name not in checked:
            checked.append(name)

    def both(name: str, fn, *tensors):
        """fn(group, *copies) on both groups; compares the tensors it filled (outputs start as
        zeros: buffers a collective leaves alone on some rank must still compare equal)."""
        a = [t.clone() if isinstance(t, torch.Tensor) else [u.clone() for u in t] for t in tensors]
        b = [t.clone() if isinstance(t, torch.Tensor) else [u.clone() for u in t] for t in tensors]
        fn(fs, *a)
        fn(gl, *b)
        same(name, a, b)

    x = torch.randn(5, 3, generator=gen)
    both("broadcast", lambda g, t: dist.broadcast(t, src=world - 1, group=g), x)
    both("all_reduce", lambda g, t: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g), x)
    both("all_reduce_max", lambda g, t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g), x)
    both("reduce", lambda g, t: dist.reduce(t, dst=0, group=g), x)
    both("all_gather", lambda g, outs, t: dist.all_gather(outs, t, group=g), [torch.zeros(5, 3) for _ in range(world)], x)
    both("all_gather_into_tensor", lambda g, out, t: dist.all_gather_into_tensor(out, t, group=g), torch.zeros(5 * world, 3), x)
    both("gather", lambda g, outs, t: dist.gather(t, outs if rank == 0 else None, dst=0, group=g),
         [torch.zeros(5, 3) for _ in range(world)], x)
    both("scatter", lambda g, out, ins: dist.scatter(out, ins if rank == 0 else None, src=0, group=g),
         torch.zeros(5, 3), [torch.full((5, 3), float(p)) for p in range(world)])
    both("reduce_scatter", lambda g, out, ins: dist.reduce_scatter(out, ins, group=g),
         torch.zeros(2), [torch.randn(2, generator=gen) + rank for _ in range(world)])
    both("reduce_scatter_tensor", lambda g, out, t: dist.reduce_scatter_tensor(out, t, group=g),
         torch.zeros(2), torch.randn(2 * world, generator=gen))

    # all_to_all_single: uneven splits (every rank derives the same matrix), several dtypes.
    counts = torch.randint(0, 4, (world, world), generator=torch.Generator().manual_seed(seed)).tolist()
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.complex64):
        send = torch.randn(sum(counts[rank]), 2, generator=gen).to(dtype)
        recv_rows = sum(counts[p][rank] for p in range(world))
        both(f"all_to_all_single[{dtype}]",
             lambda g, out, t: dist.all_to_all_single(out, t, [c[rank] for c in counts], counts[rank], group=g),
             torch.zeros(recv_rows, 2, dtype=dtype), send)
    both("all_to_all_single_equal", lambda g, out, t: dist.all_to_all_single(out, t, group=g),
         torch.zeros(world * 3), torch.randn(world * 3, generator=gen))
    # all_to_all (list form); gloo needs equal shapes, freescale also takes shapes differing per peer.
    ins = [torch.full((3, 2), float(rank * 10 + p)) for p in range(world)]
    both("all_to_all", lambda g, o, i: dist.all_to_all(o, i, group=g), [torch.zeros(3, 2) for _ in range(world)], ins)
    outs = [torch.zeros(rank + 1, p + 1) for p in range(world)]
    dist.all_to_all(outs, [torch.full((p + 1, rank + 1), float(rank * 10 + p)) for p in range(world)])
    same("all_to_all_uneven", outs, [torch.full((rank + 1, p + 1), float(p * 10 + rank)) for p in range(world)])

    # Point to point, in a ring.
    if world > 1:
        right, left = (rank + 1) % world, (rank - 1) % world

        def ring(g, out, t):
            reqs = [dist.isend(t, dst=dist.get_global_rank(g, right), group=g),
                    dist.irecv(out, src=dist.get_global_rank(g, left), group=g)]
            for r in reqs:
                r.wait()

        both("isend_irecv", ring, torch.zeros(4), torch.arange(4.0) + rank)

    # Object collectives.
    objs_fs, objs_gl = [None] * world, [None] * world
    dist.all_gather_object(objs_fs, {"rank": rank, "s": "x" * rank}, group=fs)
    dist.all_gather_object(objs_gl, {"rank": rank, "s": "x" * rank}, group=gl)
    assert objs_fs == objs_gl, (objs_fs, objs_gl)
    checked.append("all_gather_object")
    lst = [rank, "hello"] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0, group=fs)
    assert lst == [0, "hello"], lst
    checked.append("broadcast_object_list")

    dist.barrier()
    # an async barrier's future holds [], as gloo's (it held the empty message sent)
    assert dist.barrier(group=fs, async_op=True).get_future().wait() == \
        dist.barrier(group=gl, async_op=True).get_future().wait() == []
    checked.append("barrier")
    dist.destroy_process_group(gl)
    return checked


def async_ops_and_priorities_interleave(info, seed: int) -> int:
    """Async all_to_all_single under several fc.priority levels, waited in a shuffled order and
    through futures: every result equals the blocking gloo reference. Returns ops checked."""
    rank, world = info.rank, info.world_size
    gl = dist.new_group(backend="gloo")
    gen = torch.Generator().manual_seed(seed)
    pending = []
    for i in range(12):
        counts = torch.randint(0, 5000, (world, world), generator=gen).tolist()
        send = torch.randn(sum(counts[rank]), generator=torch.Generator().manual_seed(seed * 100 + i * 10 + rank))
        out = torch.empty(sum(counts[p][rank] for p in range(world)))
        with fc.priority(i % 3 * 5):
            work = dist.all_to_all_single(out, send, [c[rank] for c in counts], counts[rank], async_op=True)
        assert isinstance(work, _NativeWork), f"not moved by freescale: {type(work)}"
        ref = torch.empty_like(out)
        dist.all_to_all_single(ref, send, [c[rank] for c in counts], counts[rank], group=gl)
        pending.append((work, out, ref, i))
    order = torch.randperm(len(pending), generator=torch.Generator().manual_seed(seed)).tolist()
    for k in order:
        work, out, ref, i = pending[k]
        if i % 2:
            result = work.get_future().wait()
            assert torch.equal(result[0], ref), f"op {i} via future"
        else:
            work.wait()
            assert work.is_completed()
            assert torch.equal(out, ref), f"op {i}"
    dist.destroy_process_group(gl)
    return len(pending)


def subgroup_of_some_ranks(info) -> list[float]:
    """new_group(ranks=[even ranks], backend="freescale") on a gloo world: all_to_all_single and
    all_reduce inside it; the odd ranks are not members."""
    rank, world = info.rank, info.world_size
    members = list(range(0, world, 2))
    sub = dist.new_group(ranks=members, backend="freescale")
    if rank not in members:
        return []
    n = len(members)
    x = torch.arange(n, dtype=torch.float32) + 10 * rank
    y = torch.empty(n)
    dist.all_to_all_single(y, x, group=sub)
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)
    dist.barrier(group=sub)
    dist.destroy_process_group(sub)
    return y.tolist() + t.tolist()


def barrier_peer_never_joins(info, timeout_s: float) -> str:
    """Rank 1 never enters the barrier of a freescale group with a `timeout_s` timeout (it stays
    alive, silent, past it). Rank 0 returns "<seconds waited>|<error message>"."""
    group = dist.new_group(backend="freescale", timeout=datetime.timedelta(seconds=timeout_s))
    if info.rank == 1:
        time.sleep(timeout_s + 5)
        return "silent"
    start = time.monotonic()
    try:
        dist.barrier(group=group)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{time.monotonic() - start:.2f}|{type(e).__name__}: {e}"
    return "no error"


def _shape_cases(rank: int) -> dict[str, tuple]:
    """all_to_all_single calls at world 2: name -> (output, input, output_split_sizes,
    input_split_sizes), each as rank `rank` makes it."""
    base = torch.arange(12.0) + 100 * rank
    return {
        # TorchRec's All2All_Seq_Req on ranks that own no table: a [0, D] input, a flat output,
        # splits in elements.
        "torchrec_seq_req": (torch.zeros(16), torch.empty(0, 8), [0, 16], [0, 0]) if rank == 0
        else (torch.zeros(0), torch.arange(16.0) + 100, [0, 0], [16, 0]),
        "row_shapes_differ": (torch.zeros(8), base[:8].view(4, 2), [4, 4], [2, 2]),
        "three_wide_rows_into_two_wide": (torch.zeros(6, 2), base.view(4, 3), [3, 3], [2, 2]),
        "equal_splits_row_shapes_differ": (torch.zeros(4), base[:4].view(2, 2), None, None),
        "zero_rows_any_shapes": (torch.zeros(0, 5, 3), torch.zeros(0, 7), [0, 0], [0, 0]),
        "zero_rows_equal_splits": (torch.zeros(0, 3), torch.zeros(0, 8), None, None),
        "empty_side_3d_output": (torch.zeros(2, 2, 2), torch.empty(0, 4), [0, 2], [0, 0]) if rank == 0
        else (torch.zeros(0, 9), base[:8].view(2, 4), [0, 0], [2, 0]),
    }


def _refused_cases(rank: int) -> dict[str, tuple]:
    """Calls gloo refuses before communicating; freescale must refuse them too, naming why."""
    return {
        "dtypes_differ": ("dtype", (torch.zeros(4, dtype=torch.float64), torch.arange(4.0), [2, 2], [2, 2])),
        "split_sum_is_not_dim0": ("output_split_sizes", (torch.zeros(3), torch.arange(4.0), [2, 2], [2, 2])),
        "scalar_with_splits": ("dimension", (torch.tensor(-1.0), torch.tensor(1.0 + rank), [1, 0], [1, 0])),
        # Issue 28: 16 bytes to itself, 12 expected from itself (gloo: an enforce in alltoallv.cc).
        "self_block_bytes_differ": ("sends itself", (torch.empty(2, 3), torch.zeros(2, 4), [1, 1], [1, 1])),
    }


def all_to_all_shapes_as_gloo(info) -> list[str]:
    """Each call of _shape_cases on the freescale group and on a gloo group: the same outputs.
    Each of _refused_cases: both refuse (freescale with ValueError/TypeError naming the argument),
    and the groups stay usable. Returns the case names checked."""
    assert info.world_size == 2
    rank = info.rank
    gl = dist.new_group(backend="gloo")
    checked = []
    for name, (out, inp, out_splits, in_splits) in _shape_cases(rank).items():
        ours, theirs = out.clone(), out.clone()
        dist.all_to_all_single(ours, inp, out_splits, in_splits)
        dist.all_to_all_single(theirs, inp, out_splits, in_splits, group=gl)
        assert torch.equal(ours, theirs), f"{name}: freescale {ours} != gloo {theirs}"
        checked.append(name)
    for name, (needle, (out, inp, out_splits, in_splits)) in _refused_cases(rank).items():
        for group in (None, gl):
            try:
                dist.all_to_all_single(out.clone(), inp, out_splits, in_splits, group=group)
            except (ValueError, TypeError, RuntimeError, IndexError) as e:
                if group is None:
                    assert isinstance(e, (ValueError, TypeError)) and needle in str(e), f"{name}: {e!r}"
            else:
                raise AssertionError(f"{name}: {'freescale' if group is None else 'gloo'} accepted it")
        checked.append(name)
    x = torch.arange(4.0) + 10 * rank  # both groups still work
    ours, theirs = torch.zeros(4), torch.zeros(4)
    dist.all_to_all_single(ours, x)
    dist.all_to_all_single(theirs, x, group=gl)
    assert torch.equal(ours, theirs)
    # Split sizes from a generator (freescale: "object of type 'generator' has no len()").
    for group in (None, gl):
        out = ours if group is None else theirs
        dist.all_to_all_single(out, x, (2 for _ in range(2)), (2 for _ in range(2)), group=group)
    assert torch.equal(ours, theirs) and ours.tolist() == [2.0 * rank, 2.0 * rank + 1, 10.0 + 2 * rank, 11.0 + 2 * rank], ours
    checked.append("generator_splits")
    # A 0-dim tensor on a group of one rank: gloo copies it (freescale refused every 0-dim tensor).
    alone = [[dist.new_group([r]) for r in range(2)][rank], [dist.new_group([r], backend="gloo") for r in range(2)][rank]]
    scalars = [torch.zeros(()), torch.zeros(())]
    for group, out in zip(alone, scalars):
        dist.all_to_all_single(out, torch.tensor(5.0 + rank), group=group)
    assert scalars[0].item() == scalars[1].item() == 5.0 + rank, scalars
    checked.append("scalar_on_one_rank")
    return checked


def pair_bytes_disagree_across_row_shapes(info) -> str:
    """Rank 0 sends rank 1 two 3-wide rows; rank 1 expects two 2-wide rows (gloo: an enforce
    failure on one rank, a closed connection on the other). Returns this rank's CommError code."""
    rank = info.rank
    if rank == 0:
        out, inp, out_splits, in_splits = torch.zeros(2, 3), torch.ones(4, 3), [2, 0], [2, 2]
    else:
        out, inp, out_splits, in_splits = torch.zeros(2, 2), torch.ones(0, 3), [2, 0], [0, 0]
    try:
        dist.all_to_all_single(out, inp, out_splits, in_splits)
    except fc.CommError as e:
        return e.code
    return "no error"


def _freescale_ranges(prof) -> list[str]:
    return [e.name for e in prof.events() if e.name.startswith("freescale:")]


def native_ops_are_profiler_ranges(info) -> list[str]:
    """Under torch.profiler, each native op (all_to_all_single sync and async, the list form,
    barrier, dispatch, combine) is one range named by the op, its priority and its bytes. Returns
    the range names, in order of their start."""
    rank, world = info.rank, info.world_size
    x = torch.arange(4 * world, dtype=torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.all_to_all_single(torch.empty_like(x), x)
        with fc.priority(9):
            work = dist.all_to_all_single(torch.empty(2 * world, dtype=torch.int64), torch.ones(2 * world, dtype=torch.int64),
                                          async_op=True)
        work.wait()
        dist.all_to_all([torch.empty(3) for _ in range(world)], [torch.ones(3) for _ in range(world)])
        dist.barrier()
        lengths = torch.tensor([2, 1])
        res = fc.dispatch(torch.ones(3, 4), lengths, torch.tensor([(rank + 1) % world, rank]))
        fc.combine(res.values, res.handle)
    events = sorted((e for e in prof.events() if e.name.startswith("freescale:")), key=lambda e: e.time_range.start)
    return [e.name for e in events]



def communicator_peer_never_posts(info, timeout_s: float, group_backend: str) -> str:
    """fc.Communicator on a `group_backend` group with a `timeout_s` timeout; rank 1 never posts
    (it stays alive, silent, past it). Rank 0 returns "<seconds waited>|<code>|<culprit>|<message>"."""
    import freescale_comm as fc

    group = dist.new_group(backend=group_backend, timeout=datetime.timedelta(seconds=timeout_s))
    comm = fc.Communicator(group)
    if info.rank == 1:
        time.sleep(timeout_s + 2)
        return "silent"
    start = time.monotonic()
    try:
        comm.all_to_all_single(torch.zeros(4), torch.ones(4))
    except fc.CommError as e:
        return f"{time.monotonic() - start:.2f}|{e.code}|{e.culprit}|{e}"
    return "no error"


def coalesced_gathers_and_reduce_scatters(info) -> dict:
    """What functional collectives, DTensor and FSDP2 reach: the coalesced all_gather_into_tensor
    and reduce_scatter_tensor (the inner gloo group's are not callable from Python: every rank
    raised AttributeError). Returns each result as a list."""
    import torch.distributed._functional_collectives as fcol

    rank, world = info.rank, info.world_size
    group = dist.group.WORLD
    out = {
        "all_gather_tensor": fcol.all_gather_tensor(torch.ones(2) * rank, 0, group),
        "reduce_scatter_tensor": fcol.reduce_scatter_tensor(torch.arange(2.0 * world) + rank, "sum", 0, group),
        "all_gather_coalesced": torch.cat(fcol.all_gather_into_tensor_coalesced(
            [torch.ones(2) * rank, torch.full((1,), 10.0 + rank)], group)),
        "reduce_scatter_coalesced": torch.cat(fcol.reduce_scatter_tensor_coalesced(
            [torch.arange(2.0 * world) + rank, torch.ones(world) * (rank + 1)], "sum", [0, 0], group)),
    }
    outs = [torch.zeros(2 * world), torch.zeros(world)]
    with dist._coalescing_manager():
        dist.all_gather_into_tensor(outs[0], torch.ones(2) * rank)
        dist.all_gather_into_tensor(outs[1], torch.ones(1) * rank)
    out["coalescing_manager"] = torch.cat(outs)
    return {k: v.tolist() for k, v in out.items()}


def local_refusals_are_runtime_errors(info) -> list[str]:
    """Calls gloo refuses locally with RuntimeError: per call, which of (RuntimeError, ValueError,
    TypeError) the raised exception is, and whether the group still works after."""
    world = info.world_size
    calls = {
        "too_few_tensors": lambda: dist.all_to_all([torch.zeros(1)], [torch.zeros(1)] * world),
        "split_list_too_short": lambda: dist.all_to_all_single(torch.zeros(2), torch.zeros(2), [2], [1, 1]),
        "negative_split": lambda: dist.all_to_all_single(torch.zeros(2), torch.zeros(2), [3, -1], [1, 1]),
        # outputs whose elements share memory: freescale failed as it unpacked (a RuntimeError
        # alone, after communicating, and torch logged its done-callback's traceback on stderr)
        "stride0_outputs": lambda: dist.all_to_all([torch.zeros(1).expand(2) for _ in range(world)],
                                                   [torch.ones(2)] * world),
    }
    out = []
    for name, call in calls.items():
        try:
            call()
            out.append(f"{name}: accepted")
        except Exception as e:  # noqa: BLE001 - the kinds are the result
            out.append(f"{name}: " + ",".join(k.__name__ for k in (RuntimeError, ValueError, TypeError)
                                              if isinstance(e, k)))
    t = torch.full((world,), float(info.rank))
    dist.all_to_all_single(t, t.clone())
    out.append(f"after: {t.tolist()}")
    return out


def list_all_to_all_outputs_once_complete(info) -> dict:
    """dist.all_to_all (list form, async) on the default group: what its outputs and result()
    hold once is_completed() says True, before wait(), and what the outputs of a Work dropped
    unwaited come to hold (within 30 s; a later op does not order it: ops of another priority
    complete in any order). gloo's hold the data; freescale's stayed zeros until wait() (the
    unpack from the packed buffer ran only there)."""
    rank, world = info.rank, info.world_size
    inputs = [torch.full((2,), float(10 * rank + p)) for p in range(world)]
    outputs = [torch.zeros(2) for _ in range(world)]
    work = dist.all_to_all(outputs, inputs, async_op=True)
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.005)
    seen = [t.tolist() for t in outputs]
    result = [t.tolist() for t in work.result()]
    work.wait()
    dropped = [torch.zeros(2) for _ in range(world)]
    dist.all_to_all(dropped, inputs, async_op=True)  # its Work dropped at once
    dist.barrier()
    deadline = time.monotonic() + 30
    while not all(bool((t != 0).any()) for t in dropped[1:]) and time.monotonic() < deadline:
        time.sleep(0.005)
    return {"seen": seen, "result": result, "dropped": [t.tolist() for t in dropped]}


def future_callbacks_wait_on_other_ops(info, beyond_gloo: bool) -> dict:
    """then() callbacks of an async all_to_all_single's future that block on another op of the
    same group, as PowerSGD's hooks do (a nested future's wait() inside then()), or on a Work
    posted before. beyond_gloo (gloo's worker threads hang at two deep and abort the process on a
    synchronous op inside): nested two deep, and a synchronous op inside. Before, callbacks ran on
    the thread driving progress: a nested future's wait() hung past every timeout, Work.wait()
    inside raised INVALID_USAGE on the ranks whose op completed late and worked on the others."""
    rank, world = info.rank, info.world_size
    x = torch.arange(float(world)) + 10 * rank

    def a2a(async_op: bool) -> tuple[torch.Tensor, dist.Work]:
        out = torch.zeros(world)
        return out, dist.all_to_all_single(out, x, async_op=async_op)

    def nested_future(fut: torch.futures.Future) -> list:
        out, work = a2a(True)
        work.get_future().wait()
        return out.tolist()

    def nested_two_deep(fut: torch.futures.Future) -> list:
        out, work = a2a(True)
        inner = work.get_future().then(nested_future).wait()
        return [out.tolist(), inner]

    seen = {}
    _, first = a2a(True)
    seen["nested_future"] = first.get_future().then(nested_future).wait()
    _, first = a2a(True)
    prior_out, prior = a2a(True)
    seen["work_posted_before"] = first.get_future().then(lambda f: (prior.wait(), prior_out.tolist())[1]).wait()
    if beyond_gloo:
        _, first = a2a(True)
        seen["nested_two_deep"] = first.get_future().then(nested_two_deep).wait()
        _, first = a2a(True)
        seen["sync_op_inside"] = first.get_future().then(lambda f: a2a(False)[0].tolist()).wait()
    out, work = a2a(True)
    work.wait()  # once wait() returned, the future holds the value
    seen["value_after_wait"] = [t.tolist() for t in work.get_future().value()]
    return seen


def barrier_honours_its_timeout(info) -> str:
    """dist.barrier(timeout=1 s) while the peer stays away until this rank has raised: a CommError
    (TIMEOUT) here, and the group goes on (the barrier completes once the peer comes). Before, the
    timeout was ignored: it waited for the peer (the group's timeout, 30 min by default)."""
    store = dist.distributed_c10d._get_default_store()
    if info.rank == 0:
        try:
            dist.barrier(timeout=datetime.timedelta(seconds=1))
            outcome = "completed"
        except fc.CommError as e:
            outcome = f"{e.code}"
        store.set("raised", "1")
    else:
        store.wait(["raised"], datetime.timedelta(seconds=60))
        dist.barrier()
        outcome = "peer"
    dist.barrier()
    return outcome


def dict_split_sizes_are_refused(info) -> list[str]:
    """Split sizes as a dict, as output and as input splits: the exception's kind per call (before:
    the dict's keys were taken as splits, communicated, and the group died of SIZE_MISMATCH), then
    an op that shows the group works."""
    world = info.world_size
    out = []
    splits = {r: 1 for r in range(world)}
    for output_splits, input_splits in ((splits, [1] * world), ([1] * world, splits)):
        try:
            dist.all_to_all_single(torch.zeros(world), torch.zeros(world), output_splits, input_splits)
            out.append("accepted")
        except Exception as e:  # noqa: BLE001 - the kind is the result
            out.append(",".join(k.__name__ for k in (RuntimeError, TypeError) if isinstance(e, k)))
    t = torch.full((world,), float(info.rank))
    dist.all_to_all_single(t, t.clone())
    out.append(f"after: {t.tolist()}")
    return out


def pending_op_at_teardown(info, how: str) -> str:
    """Rank 0 posts an async all_to_all and tears down while rank 1 is late to it:
    destroy_process_group() of a freescale WORLD ("world") or of a freescale subgroup ("subgroup"),
    or an fc.Communicator left open at interpreter exit ("exit"). Gloo lets the op finish: both
    ranks get their bytes (the op failed, and the late healthy peer got a CommError)."""
    send, recv = torch.full((2,), float(info.rank + 1)), torch.zeros(2)
    if how == "exit":
        comm = fc.Communicator()
        if info.rank == 0:
            work = comm.all_to_all_single(recv, send, async_op=True)
            _close_all()  # the hook interpreter exit runs (multiprocessing's children skip atexit)
            return f"{work.is_completed()} {recv.tolist()}"
        time.sleep(1.5)
        comm.all_to_all_single(recv, send)
        return str(recv.tolist())
    group = dist.new_group(backend="freescale") if how == "subgroup" else dist.group.WORLD
    if info.rank == 0:
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        work.get_future()  # (completed on a completion thread)
        dist.destroy_process_group(group if how == "subgroup" else None)
        done = f"{work.wait()} {recv.tolist()}"
        # and no completion thread stays behind (gloo's leave none: they lingered 30 s)
        deadline = time.monotonic() + 2
        while any(t.name == "freescale-completions" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return done + ("" if time.monotonic() < deadline else " (a completion thread stayed)")
    time.sleep(1.5)
    dist.all_to_all_single(recv, send, group=group)
    return str(recv.tolist())


def close_from_a_done_callback(info, where: str) -> str:
    """Rank 0 closes its communicator from a raw done-callback, run by the thread driving progress:
    the progress thread (where="progress") or a thread blocked in the core's wait, which drives it
    (where="waiter"). Refused with InvalidUsageError, and the process exits cleanly. Before: on the
    progress thread, join() on itself threw after the communicator was marked closed, and destroying
    the still-joinable thread ended the process (std::terminate); on the waiter, close() took the
    progress lock the waiter held: a hang."""
    comm = fc.Communicator()
    if info.rank == 1:
        time.sleep(0.5)
    work = comm.all_to_all_single(torch.empty(2), torch.arange(2.0) + info.rank, async_op=True)
    seen = []

    def close_here() -> None:
        try:
            comm._core.close()
        except Exception as e:  # noqa: BLE001 - the test reads what was raised
            seen.append(type(e).__name__)

    if info.rank == 0:
        work._handle.add_done_callback(close_here)
        if where == "waiter":
            comm._core.wait(work._handle, 5.0)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        work.wait()
    return ",".join(seen)


def collectives_checked_in_detail_mode(info, case: str) -> str:
    """Run with TORCH_DISTRIBUTED_DEBUG=DETAIL: torch's collective checks hold for a freescale group
    as for gloo, native ops included ("agree": every op runs and is right; else ranks disagree on
    the dtype of an all_reduce, delegated vs native ops, or two native ops). Before, torch skipped
    them (it wraps no ProcessGroup subclass): a silent wrong sum, a timeout blaming a dead rank, a
    size mismatch."""
    x, rank = torch.ones(8), info.rank
    try:
        if case == "agree":
            dist.all_reduce(x)
            single = torch.empty(8)
            dist.all_to_all_single(single, torch.full((8,), float(rank)))
            parts = [torch.empty(4) for _ in range(2)]
            dist.all_to_all(parts, [torch.full((4,), float(rank))] * 2)
            dist.barrier()
            return f"{x[0].item()} {single.tolist()} {[p[0].item() for p in parts]}"
        if case == "dtype":
            dist.all_reduce(x if rank == 0 else x.int())
        elif case == "delegated_vs_native":
            dist.all_reduce(x) if rank == 0 else dist.all_to_all_single(torch.empty(8), x)
        elif case == "native_vs_native":
            dist.all_to_all_single(torch.empty(8), x) if rank == 0 else dist.barrier()
    except fc.CommError as e:
        return f"CommError {e.code} {'Detected mismatch between collectives' in str(e)}"
    return "no error"


def native_ops_of_different_kinds(info, case: str) -> str:
    """Without DETAIL checks, rank 1 runs another native op than rank 0 at the same point:
    "barrier": an all_to_all_single against a barrier fails on both ranks naming both ops (before:
    SIZE_MISMATCH, a message about split sizes; gloo times out); "list_vs_single": an all_to_all
    against an all_to_all_single completes, as under gloo."""
    rank = info.rank
    try:
        if case == "barrier":
            dist.all_to_all_single(torch.empty(8), torch.ones(8)) if rank == 0 else dist.barrier()
            return "no error"
        if rank == 0:
            parts = [torch.empty(4) for _ in range(2)]
            dist.all_to_all(parts, [torch.full((4,), 10.0 * rank + peer) for peer in range(2)])
            return str([p.tolist() for p in parts])
        single = torch.empty(8)
        dist.all_to_all_single(single, torch.tensor([10.0] * 4 + [11.0] * 4))
        return str([single[:4].tolist(), single[4:].tolist()])
    except fc.CommError as e:  # seen in a chunk header here, or read in the peer's abort notice
        named = "rank 0 runs all_to_all_single where rank 1 runs barrier" in str(e) or \
            "rank 1 runs barrier where rank 0 runs all_to_all_single" in str(e)
        return f"CommError {e.code in ('COMM_ERROR', 'PEER_ABORTED')} {named}"


def a_death_then_a_survivor_leaves(info) -> str:
    """Rank 1 dies before an all_reduce (delegated to gloo) the others run; each survivor leaves at
    once after its CommError, as a script does. The survivors that raise last see two ranks gone:
    they must name rank 1, which died first, not rank 0, which only left after naming rank 1 (it
    did: the lowest dead rank won). Returns "code culprit named-rank-1"."""
    import os

    if info.rank == 1:
        os._exit(3)
    try:
        dist.all_reduce(torch.ones(4))
    except fc.CommError as e:
        if info.rank == 0:
            os._exit(0)
        return f"{e.code} {e.culprit} {'rank 1 (pid' in str(e)}"
    return "completed"


def delegated_vs_native_out_of_step(info) -> str:
    """Rank 0 all_reduces (delegated to gloo) while rank 1 runs a native all_to_all_single (programs
    out of step): rank 1 times out (FREESCALE_TIMEOUT_S) and leaves. Rank 0's error names rank 1
    and says that its own op had failed first (TIMEOUT, caused by rank 0): before, only that it died."""
    x = torch.ones(8)
    try:
        if info.rank == 0:
            dist.all_reduce(x)
        else:
            dist.all_to_all_single(torch.empty(8), x)
    except fc.CommError as e:
        told = "an op of its own had failed (TIMEOUT, caused by rank 0)" in str(e)
        return f"{e.code} culprit={e.culprit} told={told}" if info.rank == 0 else e.code
    return "completed"

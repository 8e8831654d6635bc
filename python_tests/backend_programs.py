"""Rank functions for the backend tests: run with a "freescale" default group, each collective is
compared with the same call on a gloo group of the same ranks."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

import freescale_comm as fc
from freescale_comm.backend import ProcessGroupFreescale, _NativeWork


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

"""Rank programs of test_ce_gpu.py: several processes share GPU 0 (CUDA IPC works within a device)."""

from __future__ import annotations

import time

import torch

import freescale_comm as fc


def _splits(gen: torch.Generator, world: int, total_rows: int) -> list[int]:
    """Random non-negative splits of `total_rows` into `world` parts (zeros included)."""
    cuts = sorted(torch.randint(0, total_rows + 1, (world - 1,), generator=gen).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [total_rows])]


def alltoallv_matches_reference(info, cases: list[tuple[str, int]]) -> list[str]:
    """For each (dtype name, bytes per rank): random splits, CE AllToAllv vs a pure-torch reference
    built from every rank's input (regenerated here from the shared seed). Returns mismatches."""
    torch.cuda.set_device(0)
    comm = fc.Communicator()
    world, wrong = info.world_size, []
    for case, (dtype_name, nbytes) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        rows = max(0, nbytes // (4 * torch.tensor([], dtype=dtype).element_size()))
        gen = torch.Generator().manual_seed(1000 + case)
        splits = [_splits(gen, world, rows) for _ in range(world)]  # splits[src][dst]
        inputs = [(torch.randn(rows, 4, generator=gen) * 100).to(dtype) for _ in range(world)]
        mine = inputs[info.rank].cuda()
        out_splits = [splits[src][info.rank] for src in range(world)]
        out = torch.empty(sum(out_splits), 4, dtype=dtype, device="cuda")
        comm.all_to_all_single(out, mine, out_splits, splits[info.rank])
        want = torch.cat([inputs[src].split(splits[src])[info.rank] for src in range(world)])
        if not torch.equal(out.cpu(), want):
            wrong.append(f"{dtype_name} {nbytes} B")
    comm.close()
    return wrong


def kernels_during_alltoall(info, nbytes: int) -> tuple[list[str], int]:
    """Names of the GPU kernels the profiler saw while CE AllToAlls ran (memcpys are not kernels),
    and how many memcpys it saw: none would mean it saw nothing (a vacuous pass). Note: on a
    driver before 13.1, copies within one GPU run on SMs while still reported as memcpys
    (Communicator.data_paths says so): zero kernels is not zero SMs there."""
    torch.cuda.set_device(0)
    comm = fc.Communicator()
    x = torch.ones(nbytes // 4, device="cuda")
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x)  # warm-up: arena and handles set up outside the trace
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            comm.all_to_all_single(out, x)
        torch.cuda.synchronize()
    comm.close()
    gpu = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sorted({n for n in gpu if "memcpy" not in n.lower() and "memset" not in n.lower()})
    return kernels, sum("memcpy" in n.lower() for n in gpu)


def urgent_overtakes_bulk(info, bulk_bytes: int) -> bool:
    """A small priority-100 AllToAll submitted after a bulk priority-0 one completes first."""
    torch.cuda.set_device(0)
    comm = fc.Communicator()
    bulk_in = torch.ones(bulk_bytes // 4, device="cuda")
    bulk_out = torch.empty_like(bulk_in)
    small_in = torch.ones(1024 * info.world_size, device="cuda")
    small_out = torch.empty_like(small_in)
    torch.cuda.synchronize()
    bulk = comm.all_to_all_single(bulk_out, bulk_in, priority=0, async_op=True)
    small = comm.all_to_all_single(small_out, small_in, priority=100, async_op=True)
    deadline = time.monotonic() + 120  # a hang guard, not a timing check
    while not small.is_completed() and time.monotonic() < deadline:
        time.sleep(0.0005)
    overtook = small.is_completed() and not bulk.is_completed()
    bulk.wait()
    torch.cuda.synchronize()
    comm.close()
    return overtook



def capture_is_refused_and_the_communicator_goes_on(info) -> str:
    """all_to_all inside torch.cuda.graph raises InvalidUsageError before queuing anything; the
    next op (outside the capture) still moves the right bytes. Returns the message."""
    torch.cuda.set_device(0)
    comm = fc.Communicator()
    world, rank = info.world_size, info.rank
    x = torch.arange(4 * world, device="cuda", dtype=torch.int32) + 100 * rank
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x)  # the CUDA core exists before the capture
    message = ""
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            comm.all_to_all_single(out, x)
    except fc.InvalidUsageError as e:
        message = str(e)
    out.fill_(-1)
    comm.all_to_all_single(out, x)
    want = torch.cat([torch.arange(4 * rank, 4 * rank + 4, dtype=torch.int32) + 100 * p for p in range(world)])
    assert torch.equal(out.cpu(), want)
    comm.close()
    return message


def backend_moves_cuda_alltoall_on_copy_engines(info) -> list[int]:
    """With the freescale backend, dist.all_to_all_single / all_to_all on CUDA tensors run on the
    copy-engine transport (a per-GPU core appears) and match the expected blocks. Returns the
    GPUs that have a core."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    world, rank = info.world_size, info.rank
    pg = dist.group.WORLD
    x = torch.arange(3 * world, device="cuda", dtype=torch.float32) + 100 * rank
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    want = torch.cat([torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32) + 100 * p for p in range(world)])
    assert torch.equal(out.cpu(), want)
    outs = [torch.empty(2, device="cuda") for _ in range(world)]
    dist.all_to_all(outs, [torch.full((2,), float(10 * rank + p), device="cuda") for p in range(world)])
    assert [o.tolist() for o in outs] == [[float(10 * p + rank)] * 2 for p in range(world)]
    return sorted(pg._comm._cuda_cores)


def back_to_back_ops_without_a_host_sync(info, nbytes: int, ops: int) -> list[int]:
    """`ops` synchronous AllToAlls of `nbytes` (far more than the arena's rings hold) enqueued
    back to back: each one's stream wait precedes the next one's submission, so a comm stream that
    waited on the caller's stream would block the earlier op's later copies (a deadlock). Returns
    the wrong elements of each op."""
    torch.cuda.set_device(0)
    comm = fc.Communicator()
    world, rank = info.world_size, info.rank
    n = nbytes // 4 // world * world
    ins = [torch.arange(n, dtype=torch.int32, device="cuda") + (rank * ops + k) * n % (1 << 30) for k in range(ops)]
    outs = [torch.empty_like(x) for x in ins]
    for x, out in zip(ins, outs):
        comm.all_to_all_single(out, x)  # the current stream waits for it; the CPU does not
    torch.cuda.synchronize()
    m = n // world
    wrong = []
    for k, out in enumerate(outs):
        want = torch.cat([torch.arange(rank * m, (rank + 1) * m, dtype=torch.int32, device="cuda")
                          + (p * ops + k) * n % (1 << 30) for p in range(world)])
        wrong.append(int((out != want).sum()))
    comm.close()
    return wrong


def cuda_transport_name(info) -> str:
    """The transport of this rank's CUDA core after one AllToAll of CUDA tensors."""
    return cuda_transport_and_data_path(info)[0]


def cuda_transport_and_data_path(info) -> tuple[str, str]:
    """The transport of this rank's CUDA core after one AllToAll of CUDA tensors, and its
    Communicator.data_paths entry."""
    torch.cuda.set_device(0)
    comm = fc.Communicator()
    x = torch.ones(4 * info.world_size, device="cuda")
    comm.all_to_all_single(torch.empty_like(x), x)
    torch.cuda.synchronize()
    name, path = comm._cuda_cores[0].transport, comm.data_paths["cuda:0"]
    comm.close()
    return name, path


def futures_order_the_waiting_stream(info, nbytes: int) -> dict[str, int]:
    """CUDA futures of the freescale backend order streams (as NCCL's): list-form all_to_all and
    all_to_all_single issued on one stream, their futures waited on (or chained with then()) on
    another, whose kernels then read the outputs with no host sync in between. The list form's
    unpack copies are the race this catches: before, they ran on the progress thread's default
    stream and the future was a CPU one. Returns the wrong elements per path."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    world, rank = info.world_size, info.rank
    n = nbytes // 4 // world
    ins = [torch.arange(n, dtype=torch.int32, device="cuda") + (rank * world + p) * n for p in range(world)]
    want = [torch.arange(n, dtype=torch.int32, device="cuda") + (p * world + rank) * n for p in range(world)]
    flat_in, flat_want = torch.cat(ins), torch.cat(want)
    torch.cuda.synchronize()
    issue, consume = torch.cuda.Stream(), torch.cuda.Stream()

    def count(outs: list[torch.Tensor], expected: list[torch.Tensor]) -> torch.Tensor:
        return sum((o != e).sum() for o, e in zip(outs, expected))  # on the current stream

    outs = [torch.full((n,), -1, dtype=torch.int32, device="cuda") for _ in range(world)]
    with torch.cuda.stream(issue):
        issue.wait_stream(torch.cuda.default_stream())  # the fills, before the op writes
        fut = dist.all_to_all(outs, ins, async_op=True).get_future()
    with torch.cuda.stream(consume):
        bad_wait = count(fut.wait(), want)

    outs2 = [torch.full((n,), -1, dtype=torch.int32, device="cuda") for _ in range(world)]
    with torch.cuda.stream(issue):
        issue.wait_stream(torch.cuda.default_stream())
        chained = dist.all_to_all(outs2, ins, async_op=True).get_future().then(lambda f: count(f.value(), want))
    with torch.cuda.stream(consume):
        bad_then = chained.wait()

    outs3 = [torch.full((n,), -1, dtype=torch.int32, device="cuda") for _ in range(world)]
    with torch.cuda.stream(issue):
        issue.wait_stream(torch.cuda.default_stream())
        work = dist.all_to_all(outs3, ins, async_op=True)
        work.wait()  # unpacks on `issue`
    with torch.cuda.stream(consume):
        bad_wait_then_future = count(work.get_future().wait(), want)

    out = torch.full_like(flat_in, -1)
    with torch.cuda.stream(issue):
        issue.wait_stream(torch.cuda.default_stream())
        fut_single = dist.all_to_all_single(out, flat_in, async_op=True).get_future()
    with torch.cuda.stream(consume):
        bad_single = count(fut_single.wait(), [flat_want])

    torch.cuda.synchronize()
    return {"wait": int(bad_wait), "then": int(bad_then), "wait_then_future": int(bad_wait_then_future),
            "single": int(bad_single)}

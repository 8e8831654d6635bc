"""Rank functions for fc.dispatch / fc.combine. Every rank rebuilds every rank's inputs from the
same seeds, so it can compute its expected results (and single-process gradients) locally."""

from __future__ import annotations

import torch
import torch.distributed as dist

import freescale_comm as fc

PATTERNS = ("random", "all_to_one", "stay_home", "empty_samples", "no_samples_on_rank0")


def _inputs(pattern: str, seed: int, rank: int, world: int, row_shape: tuple[int, ...], dtype: torch.dtype):
    """(values, lengths, dest) of `rank` for a test pattern."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    samples = int(torch.randint(0, 9, (1,), generator=gen))
    if pattern == "no_samples_on_rank0" and rank == 0:
        samples = 0
    lengths = torch.randint(0, 6, (samples,), generator=gen, dtype=torch.int64)
    if pattern == "empty_samples":
        lengths[torch.rand(samples, generator=gen) < 0.5] = 0
    dest = torch.randint(0, world, (samples,), generator=gen, dtype=torch.int64)
    if pattern == "all_to_one":
        dest.fill_(world - 1)
    elif pattern == "stay_home":
        dest.fill_(rank)
    rows = int(lengths.sum())
    values = (torch.randn((rows, *row_shape), generator=gen) * 10).to(dtype)
    return values, lengths, dest


def _expected(all_inputs, rank: int):
    """Rows, lengths and source ranks rank `rank` receives: by source, then original order."""
    rows, lengths, sources = [], [], []
    for src, (values, lens, dest) in enumerate(all_inputs):
        starts = torch.cumsum(lens, 0) - lens
        for i in range(lens.numel()):
            if int(dest[i]) == rank:
                rows.append(values[int(starts[i]):int(starts[i]) + int(lens[i])])
                lengths.append(int(lens[i]))
                sources.append(src)
    shape = all_inputs[0][0].shape[1:]
    values = torch.cat(rows) if rows else all_inputs[0][0].new_empty((0, *shape))
    return values, torch.tensor(lengths, dtype=torch.int64), torch.tensor(sources, dtype=torch.int64)


def _on(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    if device == "cuda":
        torch.cuda.set_device(0)  # every rank shares GPU 0 in the GPU tests
    return [t.to(device) for t in tensors]


# Row shapes cover every word width of the CUDA copy kernel: 12 B (4), 16 B (16), 8 B (8), 5 B (1).
ROW_CASES = (((3,), torch.float32), ((2, 4), torch.bfloat16), ((), torch.int64), ((5,), torch.uint8))


def roundtrip_is_identity(info, seed: int, device: str = "cpu") -> int:
    """dispatch delivers exactly the expected samples (on `device`); combine brings every row
    home unchanged. Returns the number of cases checked."""
    rank, world = info.rank, info.world_size
    cases = 0
    for k, pattern in enumerate(PATTERNS):
        for row_shape, dtype in ROW_CASES:
            all_inputs = [_inputs(pattern, seed + k, p, world, row_shape, dtype) for p in range(world)]
            values, lengths, dest = _on(device, *all_inputs[rank])
            res = fc.dispatch(values, lengths, dest, priority=k % 3)
            exp_values, exp_lengths, exp_sources = _expected(all_inputs, rank)
            assert res.values.device == values.device and res.lengths.device == values.device
            assert torch.equal(res.values.cpu(), exp_values), (pattern, row_shape)
            assert torch.equal(res.lengths.cpu(), exp_lengths), (pattern, res.lengths, exp_lengths)
            assert torch.equal(res.source_ranks.cpu(), exp_sources), (pattern, res.source_ranks, exp_sources)
            back = fc.combine(res.values, res.handle)
            assert torch.equal(back, values), (pattern, row_shape)
            cases += 1
    return cases


def roundtrip_through_the_layout_kernels(info, seed: int, order: str = "identity") -> int:
    """roundtrip_is_identity on CPU tensors, once a dispatch proved it took the layout kernels
    (FREESCALE_LAYOUT_KERNELS_ON_CPU=1 and TRITON_INTERPRET=1 in the environment), the kernels'
    programs run in `order` (program_order.ORDERS)."""
    from freescale_comm._device_dispatch import DevicePlan
    from program_order import permute_programs

    permute_programs(order, seed=seed + info.rank)

    values, lengths, dest = _inputs("random", seed, info.rank, info.world_size, (3,), torch.float32)
    assert isinstance(fc.dispatch(values, lengths, dest).handle.plan, DevicePlan), "the CPU planner ran"
    return roundtrip_is_identity(info, seed)


def gradients_match_single_process(info, seed: int, device: str = "cpu") -> float:
    """loss = Σ_r <combine(dispatch(x).values * (r + 1) + r), g>  +  Σ_r <dispatch(x).values, w_r>:
    the gradient of x on every rank equals the one autograd computes over all ranks' data in one
    process. Returns the largest absolute difference."""
    rank, world = info.rank, info.world_size
    all_inputs = [_inputs("random", seed, p, world, (4,), torch.float64) for p in range(world)]
    weights = [torch.randn(int(_expected(all_inputs, r)[0].shape[0]), 4, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(seed + 7 * r)) for r in range(world)]
    home_weights = [torch.randn(all_inputs[p][0].shape, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(seed + 11 * p)) for p in range(world)]

    # Distributed.
    values, lengths, dest, home_weight, weight = _on(device, *all_inputs[rank], home_weights[rank], weights[rank])
    x = values.clone().requires_grad_(True)
    res = fc.dispatch(x, lengths, dest)
    z = fc.combine(res.values * (rank + 1) + rank, res.handle)
    loss = (z * home_weight).sum() + (res.values * weight).sum()
    loss.backward()

    # Single process: the same function over every rank's data.
    xs = [v.clone().requires_grad_(True) for v, _, _ in all_inputs]
    total = torch.zeros((), dtype=torch.float64)
    for p, (_, lens, d) in enumerate(all_inputs):
        row_dest = torch.repeat_interleave(d, lens).to(torch.float64).unsqueeze(1)
        total = total + ((xs[p] * (row_dest + 1) + row_dest) * home_weights[p]).sum()
    for r in range(world):
        received, _, _ = _expected([(xs[p], lens, d) for p, (_, lens, d) in enumerate(all_inputs)], r)
        total = total + (received * weights[r]).sum()
    total.backward()
    return float((x.grad.cpu() - xs[rank].grad).abs().max()) if x.numel() else 0.0


def bad_inputs_raise_before_communicating(info, device: str = "cpu") -> list[str]:
    """Each bad call raises ValueError/TypeError on every rank, before any collective (ranks
    that raised would otherwise desynchronize the next good call). Returns the messages."""
    rank, world = info.rank, info.world_size
    values, lengths, dest = _on(device, torch.randn(6, 2), torch.tensor([2, 3, 1]), torch.tensor([0, world - 1, 0]))
    messages = []

    def t(*data):
        return torch.tensor(*data, device=device)

    def expect(exc, fn):
        try:
            fn()
        except exc as e:
            messages.append(str(e))
            return
        raise AssertionError(f"expected {exc.__name__}")

    expect(ValueError, lambda: fc.dispatch(values, t([2, 3, 2]), dest))          # sum != rows
    expect(ValueError, lambda: fc.dispatch(values, lengths, t([0, world, 0])))  # rank out of range
    expect(ValueError, lambda: fc.dispatch(values, lengths, t([0, -1, 0])))
    expect(ValueError, lambda: fc.dispatch(values, t([2, -1, 5]), dest))        # negative length
    expect(TypeError, lambda: fc.dispatch(values, lengths.int(), dest))         # not int64
    expect(ValueError, lambda: fc.dispatch(values, lengths, t([0, 0])))         # one dest per sample
    expect(ValueError, lambda: fc.dispatch(values, lengths.to("meta"), dest))   # not on values' device
    expect(ValueError, lambda: fc.dispatch(values.to("meta"), lengths, dest))   # neither CPU nor CUDA
    expect(TypeError, lambda: fc.dispatch(values, lengths, dest, priority=1.5))
    res = fc.dispatch(values, lengths, dest)  # a good call still works after all that
    other = fc.dispatch(*_on(device, torch.randn(7, 2), torch.tensor([7]), torch.tensor([rank])))
    expect(ValueError, lambda: fc.combine(res.values[:-1] if res.values.shape[0] else values[:1], res.handle))
    expect(ValueError, lambda: fc.combine(res.values, other.handle) if res.values.shape[0] != 7
           else fc.combine(values.new_zeros(8, 2), other.handle))                 # handle of another call
    expect(ValueError, lambda: fc.combine(res.values.to("meta"), res.handle))  # another device
    expect(TypeError, lambda: fc.combine(res.values, {"not": "a handle"}))
    back = fc.combine(res.values, res.handle)
    assert torch.equal(back, values)
    dist.barrier()
    return messages


def side_communicator_lets_the_group_go(info) -> dict:
    """fc.dispatch over a gloo group builds a freescale Communicator on it (kept for the next
    call). After dist.destroy_process_group the group must die then, as torch intends: a group
    kept alive into interpreter shutdown keeps gloo's worker threads running, and one of them,
    dropping the last work's tensors, takes the GIL while Python finalizes and aborts the process
    ("terminate called without an active exception", seen ~1 run in 8 at exit)."""
    import gc
    import weakref

    from freescale_comm._bootstrap import GroupBootstrap

    rank, world = info.rank, info.world_size
    values, lengths = torch.arange(6.0).reshape(3, 2), torch.tensor([1, 2], dtype=torch.int64)
    out = fc.dispatch(values, lengths, torch.tensor([(rank + 1) % world] * 2))
    comm = out.handle.comm
    group = weakref.ref(dist.group.WORLD)
    bootstrap = GroupBootstrap(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    report = {"group_alive": group() is not None, "comm_group": comm.group is not None}
    try:
        bootstrap.allgather(b"x")
        report["bootstrap_error"] = None
    except RuntimeError as e:
        report["bootstrap_error"] = str(e)
    comm.close()
    return report


def layout_work_per_call(info) -> dict:
    """What one fc.dispatch, fc.combine and dispatch_like ask of the device when the layout
    kernels run (CUDA; here CPU tensors through the interpreter, the same code path): Triton
    launches by kernel, other device ops (aten ops that are neither views nor allocations, outside
    the launches; the transports' copies are not counted) and host reads (read_host calls, and
    any .item()). Counted on this rank after one warm-up call."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    from freescale_comm import _device_dispatch, _layout_kernels
    from freescale_comm.dispatch import dispatch_like
    from kernel_launches import intercept

    launches: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()
    state = {"in_launch": False, "counting": False, "reads": 0}

    def launch(name, kernel, args, kwargs, run):
        if state["counting"]:
            launches[name] += 1
        state["in_launch"] = True  # the interpreter's own copies of the arguments are no device op
        try:
            return run()
        finally:
            state["in_launch"] = False

    intercept(_layout_kernels, launch)
    read_host = _device_dispatch.read_host

    def counted_read(t):
        if state["counting"]:
            state["reads"] += 1
        return read_host(t)
    _device_dispatch.read_host = counted_read

    class DeviceOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if state["counting"] and not state["in_launch"] and not func.is_view and \
                    not name.startswith(("aten.empty", "aten.new_empty")):
                ops[name] += 1
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(info.rank)
    lengths = torch.randint(0, 5, (50,), generator=gen)
    values = torch.randn(int(lengths.sum()), 8, generator=gen)
    dest = torch.randint(0, info.world_size, (50,), generator=gen)
    fc.dispatch(values, lengths, dest)  # warm-up
    report = {}
    for call in ("dispatch", "combine", "dispatch_like"):
        res = fc.dispatch(values, lengths, dest)
        launches.clear(), ops.clear()
        state.update(reads=0, counting=True)
        with DeviceOps():
            if call == "dispatch":
                fc.dispatch(values, lengths, dest)
            elif call == "combine":
                fc.combine(res.values, res.handle)
            else:
                dispatch_like(values, res.handle)
        state["counting"] = False
        report[call] = {"launches": dict(launches), "ops": dict(ops), "reads": state["reads"]}
    return report


def second_order_gradients_match_single_process(info, seed: int) -> float:
    """A gradient penalty through dispatch and combine: g = d<combine(dispatch(x).values³ ·
    (dest + 1)), w>/dx with create_graph=True, then d Σ g² / dx. Both orders equal one process's
    autograd over the same rows (the backward of each movement was a plain movement, so g did not
    require grad and the second order silently lost the path through the ranks). Returns the
    largest absolute difference."""
    rank, world = info.rank, info.world_size
    all_inputs = [_inputs("random", seed, p, world, (3,), torch.float64) for p in range(world)]
    home_weights = [torch.randn(all_inputs[p][0].shape, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(seed + 11 * p)) for p in range(world)]

    values, lengths, dest = all_inputs[rank]
    x = values.clone().requires_grad_(True)
    res = fc.dispatch(x, lengths, dest)
    z = fc.combine(res.values ** 3 * (rank + 1), res.handle)
    (g,) = torch.autograd.grad((z * home_weights[rank]).sum(), x, create_graph=True)
    assert g.requires_grad
    (h,) = torch.autograd.grad((g ** 2).sum(), x)

    xs = [v.clone().requires_grad_(True) for v, _, _ in all_inputs]
    row_dest = torch.repeat_interleave(dest, lengths).to(torch.float64).unsqueeze(1)
    ref = ((xs[rank] ** 3 * (row_dest + 1)) * home_weights[rank]).sum()
    (g_ref,) = torch.autograd.grad(ref, xs[rank], create_graph=True)
    (h_ref,) = torch.autograd.grad((g_ref ** 2).sum(), xs[rank])
    if not x.numel():
        return 0.0
    return max(float((g - g_ref).abs().max()), float((h - h_ref).abs().max() / h_ref.abs().max()))


def combine_requires_grad_only_where_a_dispatch_did(info) -> list[bool]:
    """No rank's values require grad (grad mode on, as in an eval loop without no_grad): the combine's
    result must not require grad (it did: .numpy() raised). Then rank 0's values do: every rank's
    combine result does, so every rank joins its backward. Returns both results' requires_grad."""
    rank = info.rank
    lengths = torch.tensor([3, 1] if rank == 0 else [1], dtype=torch.int64)
    seen = []
    for grad_on_rank_0 in (False, True):
        values = torch.randn(int(lengths.sum()), 2).requires_grad_(grad_on_rank_0 and rank == 0)
        res = fc.dispatch(values, lengths, torch.tensor([1, 0] if rank == 0 else [0]))
        back = fc.combine(res.values.detach() * 2, res.handle)  # rows without grad on every rank
        seen.append(back.requires_grad)
        if back.requires_grad:
            back.sum().backward()
    return seen


def row_kinds_that_differ_fail_every_rank(info) -> list[str]:
    """Rank 0 dispatches float32 rows of 2, the others float64 rows of 1 (bytes per row equal), then
    rows of 2 vs 3 of one dtype, then (all agreeing) a round trip: each call's outcome. Before, the
    first moved silently: each receiver read the other's bytes as its own dtype."""
    rank, world = info.rank, info.world_size
    lengths = torch.ones(4, dtype=torch.int64)
    dest = torch.arange(4, dtype=torch.int64) % world
    out = []
    for values in (torch.full((4, 2), 1.5) if rank == 0 else torch.full((4, 1), 1.5, dtype=torch.float64),
                   torch.ones(4, 2 if rank == 0 else 3)):
        try:
            fc.dispatch(values, lengths, dest)
            out.append("moved")
        except fc.CommError as e:
            out.append(f"{e.code}: {e}")
    values = torch.arange(8.0).view(4, 2) + rank
    res = fc.dispatch(values, lengths, dest)
    out.append(str(torch.equal(fc.combine(res.values, res.handle), values)))
    return out

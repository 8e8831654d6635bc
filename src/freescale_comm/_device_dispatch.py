"""The CUDA side of fc.dispatch / fc.combine. The layout kernels (plan, gather, scatter) are the
only SM work; the rows move packed on the copy-engine transport. One host sync per dispatch: the
transports need the byte counts on the host (as every AllToAllv does)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freescale_comm import _core


@dataclass(frozen=True)
class DevicePlan:
    """A dispatch's plan of CUDA tensors, on the GPU; entry k is the k-th sample in send order
    (by destination rank, then original order)."""

    rows: int  # rows of the original (home) values
    sent_lengths: torch.Tensor  # int64 [samples]: rows of sample k
    home_row: torch.Tensor  # int64 [samples]: its first row in the home values
    packed_row: torch.Tensor  # int64 [samples]: its first row in the packed send buffer
    sample_counts: list[int]  # [world] samples sent to each rank
    row_counts: list[int]  # [world] rows sent to each rank


def check_device_support(world: int) -> None:
    if not hasattr(_core, "plan_jagged_dispatch_cuda"):
        raise ValueError("values are CUDA tensors, but this build of freescale_comm has no CUDA sources "
                         f"(build_info: {_core.build_info()}); dispatch CPU tensors or rebuild with nvcc")
    if world > _core.max_device_plan_world:
        raise ValueError(f"dispatch of CUDA tensors serves groups of up to {_core.max_device_plan_world} ranks; "
                         f"this group has {world}: dispatch CPU tensors instead")


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def plan(lengths: torch.Tensor, dest_ranks: torch.Tensor, world: int) -> DevicePlan:
    """Runs the plan kernel on the current stream and reads the counts back (the one host sync).
    ValueError naming the first bad sample, as the CPU planner does, before anything collective."""
    device, samples = lengths.device, lengths.numel()
    counts = torch.empty(2 * world + 1, dtype=torch.int64, device=device)
    sent_lengths, home_row, packed_row = (torch.empty(samples, dtype=torch.int64, device=device) for _ in range(3))
    with torch.cuda.device(device):
        _core.plan_jagged_dispatch_cuda(lengths.data_ptr(), dest_ranks.data_ptr(), samples, world, counts.data_ptr(),
                                        sent_lengths.data_ptr(), home_row.data_ptr(), packed_row.data_ptr(),
                                        _stream(device))
    host = counts.tolist()
    bad = host[-1]
    if bad >= 0:
        length, rank = int(lengths[bad]), int(dest_ranks[bad])
        if length < 0:
            raise ValueError(f"lengths[{bad}] = {length} is negative; every sample has >= 0 rows")
        raise ValueError(f"dest_ranks[{bad}] = {rank} is not a rank of this group; it must be in [0, {world})")
    row_counts = host[world:2 * world]
    return DevicePlan(sum(row_counts), sent_lengths, home_row, packed_row, host[:world], row_counts)


def copy_runs(home: torch.Tensor, packed: torch.Tensor, plan: DevicePlan, to_packed: bool) -> None:
    """Gathers the plan's samples from `home` into send order in `packed` (to_packed), or
    scatters them back; both contiguous, same dtype and row shape, on the current stream."""
    row_bytes = math.prod(home.shape[1:]) * home.element_size()
    stream = torch.cuda.current_stream(home.device)
    for t in (plan.sent_lengths, plan.home_row, plan.packed_row):
        # Made on the dispatch's stream; this kernel may run on another (combine, dispatch_like):
        # the allocator must not reuse them before it ran, even if the handle goes first.
        t.record_stream(stream)
    with torch.cuda.device(home.device):
        _core.copy_jagged_runs_cuda(home.data_ptr(), packed.data_ptr(), to_packed, plan.sent_lengths.data_ptr(),
                                    plan.home_row.data_ptr(), plan.packed_row.data_ptr(), plan.sent_lengths.numel(),
                                    packed.shape[0], row_bytes, _stream(home.device))


def gather(values: torch.Tensor, plan: DevicePlan) -> torch.Tensor:
    """The plan's rows in send order: [sum(plan.row_counts), *values.shape[1:]]."""
    values = values.contiguous()
    packed = torch.empty((sum(plan.row_counts), *values.shape[1:]), dtype=values.dtype, device=values.device)
    copy_runs(values, packed, plan, to_packed=True)
    return packed


def scatter(packed: torch.Tensor, plan: DevicePlan) -> torch.Tensor:
    """The inverse of gather: rows back in their home order, [plan.rows, *packed.shape[1:]]."""
    home = torch.empty((plan.rows, *packed.shape[1:]), dtype=packed.dtype, device=packed.device)
    copy_runs(home, packed.contiguous(), plan, to_packed=False)
    return home

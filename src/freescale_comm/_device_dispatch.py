"""The device side of fc.dispatch / fc.combine: the layout kernels (plan, gather, scatter; Triton,
in _layout_kernels) are the only SM work; the rows move packed on the copy-engine transport. One
host sync per dispatch: the transports need the byte counts on the host (as every AllToAllv does).
The kernels also run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1): with
FREESCALE_LAYOUT_KERNELS_ON_CPU=1 (tests only) fc.dispatch takes this path for CPU tensors too."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(frozen=True)
class DevicePlan:
    """A dispatch's plan, made by the layout kernels on the values' device; entry k is the k-th
    sample in send order (by destination rank, then original order)."""

    rows: int  # rows of the original (home) values
    sent_lengths: torch.Tensor  # int64 [samples]: rows of sample k
    home_row: torch.Tensor  # int64 [samples]: its first row in the home values
    packed_row: torch.Tensor  # int64 [samples]: its first row in the packed send buffer
    sample_counts: list[int]  # [world] samples sent to each rank
    row_counts: list[int]  # [world] rows sent to each rank


def forced_on_cpu() -> bool:
    """Tests only: CPU tensors take the layout kernels (through Triton's interpreter)."""
    return os.environ.get("FREESCALE_LAYOUT_KERNELS_ON_CPU", "0") == "1"


def kernels() -> ModuleType:
    """The Triton layout kernels, imported on first use (CPU tensors never need triton)."""
    try:
        from freescale_comm import _layout_kernels
    except ImportError as e:
        raise ValueError(f"dispatch of CUDA tensors runs Triton layout kernels, and triton does not import ({e}): "
                         "pip install triton (CUDA builds of torch bring it), or dispatch CPU tensors") from e
    return _layout_kernels


def plan(lengths: torch.Tensor, dest_ranks: torch.Tensor, world: int) -> DevicePlan:
    """Runs the plan kernels on the current stream and reads the counts back (the one host sync).
    ValueError naming the first bad sample, as the CPU planner does, before anything collective
    (or naming the fix when triton does not import: kernels())."""
    k = kernels()
    device, samples = lengths.device, lengths.numel()
    blocks = max(1, k.plan_grid(samples))

    def int64(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int64, device=device)

    block_samples, block_rows, block_total = int64(blocks * world), int64(blocks * world), int64(blocks)
    total_samples, total_rows, bad = int64(world), int64(world), torch.full((1,), samples, dtype=torch.int64,
                                                                            device=device)
    sent_lengths, home_row, packed_row = int64(samples), int64(samples), int64(samples)
    if samples > 0:
        k.count_kernel[(blocks,)](lengths, dest_ranks, samples, world, block_samples, block_rows, block_total, bad,
                                  BLOCK=k.PLAN_BLOCK, DT=k.DEST_TILE)
        k.scan_kernel[(k.triton.cdiv(world, k.DEST_TILE),)](block_samples, block_rows, blocks, world, total_samples,
                                                             total_rows, DT=k.DEST_TILE)
        start_samples = torch.cumsum(total_samples, 0) - total_samples  # [world] and [blocks]: small scans
        start_rows = torch.cumsum(total_rows, 0) - total_rows
        block_home = torch.cumsum(block_total, 0) - block_total
        k.place_kernel[(blocks,)](lengths, dest_ranks, samples, world, block_samples, block_rows, start_samples,
                                  start_rows, block_home, sent_lengths, home_row, packed_row, BLOCK=k.PLAN_BLOCK)
    host = torch.cat([total_samples, total_rows, bad]).tolist()
    first_bad = host[-1]
    if first_bad < samples:
        length, rank = int(lengths[first_bad]), int(dest_ranks[first_bad])
        if length < 0:
            raise ValueError(f"lengths[{first_bad}] = {length} is negative; every sample has >= 0 rows")
        raise ValueError(f"dest_ranks[{first_bad}] = {rank} is not a rank of this group; it must be in [0, {world})")
    row_counts = host[world:2 * world]
    return DevicePlan(sum(row_counts), sent_lengths, home_row, packed_row, host[:world], row_counts)


def _words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8).view(word)


def copy_runs(home: torch.Tensor, packed: torch.Tensor, plan: DevicePlan, to_packed: bool) -> None:
    """Gathers the plan's samples from `home` into send order in `packed` (to_packed), or
    scatters them back; both contiguous, same dtype and row shape, on the current stream."""
    if home.device.type == "cuda":
        stream = torch.cuda.current_stream(home.device)
        for t in (plan.sent_lengths, plan.home_row, plan.packed_row):
            # Made on the dispatch's stream; this kernel may run on another (combine, dispatch_like):
            # the allocator must not reuse them before it ran, even if the handle goes first.
            t.record_stream(stream)
    row_bytes = math.prod(home.shape[1:]) * home.element_size()
    rows, runs = packed.shape[0], plan.sent_lengths.numel()
    if rows == 0 or row_bytes == 0:
        return
    # The widest word that divides a row and both buffers' alignment: fewer, wider accesses.
    word, size = next(((w, n) for w, n in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))
                       if row_bytes % n == 0 and home.data_ptr() % n == 0 and packed.data_ptr() % n == 0),
                      (torch.uint8, 1))
    k = kernels()
    row_words = row_bytes // size
    grid = (k.triton.cdiv(rows, k.COPY_ROWS), k.triton.cdiv(row_words, k.COPY_WORDS))
    k.copy_kernel[grid](_words(home, word), _words(packed, word), plan.home_row, plan.packed_row, runs, rows, row_words,
                        TO_PACKED=to_packed, STEPS=max(1, runs.bit_length()), ROWS=k.COPY_ROWS, WORDS=k.COPY_WORDS)


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

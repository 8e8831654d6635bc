"""The device side of fc.dispatch / fc.combine: the layout kernels (plan, gather, scatter; Triton,
in _layout_kernels) are the only SM work; the rows move packed on the copy-engine transport. One
host sync per dispatch (read_host): the transports need the byte counts on the host (as every
AllToAllv does). Every launch runs under the tensors' own device (launch_device).
The kernels also run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1): with
FREESCALE_LAYOUT_KERNELS_ON_CPU=1 (tests only) fc.dispatch takes this path for CPU tensors too."""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(frozen=True)
class DevicePlan:
    """A dispatch's plan, made by the layout kernels on the values' device; entry k is the k-th
    sample in send order (by destination rank, then original order)."""

    rows: int  # rows of the original (home) values = rows sent
    sent: torch.Tensor  # int64 [samples, 2]: (rows of sample k, the sending rank): what the receivers get
    home_row: torch.Tensor  # int64 [samples]: its first row in the home values
    packed_row: torch.Tensor  # int64 [samples]: its first row in the packed send buffer
    row_home: torch.Tensor  # int64 [rows]: packed row -> its home row (every copy of this plan reads it)
    sample_counts: list[int]  # [world] samples sent to each rank
    row_counts: list[int]  # [world] rows sent to each rank

    @property
    def sent_lengths(self) -> torch.Tensor:
        return self.sent[:, 0]


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


def launch_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Where a kernel for tensors of `device` must launch: Triton launches on the current CUDA
    device's current stream, so the tensors' own GPU becomes current (their stream is the one the
    transport and record_stream use); nothing for CPU tensors (the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def read_host(t: torch.Tensor) -> list[int]:
    """The one device-to-host read of a dispatch (its counts): every one goes through here."""
    return t.tolist()


def plan(lengths: torch.Tensor, dest_ranks: torch.Tensor, world: int, rank: int, rows: int) -> DevicePlan:
    """Runs the plan kernels on the current stream of the tensors' device and reads the counts
    back (the one host sync): four launches and one copy. `rank`: this rank (sent with every
    sample's length); `rows`: the values' rows, which the lengths must sum to. ValueError naming
    the first bad sample (or the mismatch), as the CPU planner does, before anything collective
    (or naming the fix when triton does not import: kernels())."""
    samples = lengths.numel()
    if samples * rows >= 1 << 63:  # then no sum of lengths in [0, rows] wraps in int64
        raise ValueError(f"{samples} samples of up to {rows} rows each could sum past 2**63 rows; dispatch fewer")
    counts, sent, home_row, packed_row, row_home = run_plan_kernels(lengths, dest_ranks, world, rank, rows)
    first_bad = counts[-1]
    if first_bad < samples:
        length, to = (int(v) for v in torch.stack([lengths[first_bad], dest_ranks[first_bad]]).tolist())
        if length < 0:
            raise ValueError(f"lengths[{first_bad}] = {length} is negative; every sample has >= 0 rows")
        if length > rows:
            raise ValueError(f"lengths[{first_bad}] = {length} exceeds the {rows} rows of values; lengths must sum "
                             "to values.shape[0]")
        raise ValueError(f"dest_ranks[{first_bad}] = {to} is not a rank of this group; it must be in [0, {world})")
    row_counts = counts[world:2 * world]
    if sum(row_counts) != rows:
        raise ValueError(f"lengths sum to {sum(row_counts)}, but values has {rows} rows; they must be equal")
    return DevicePlan(rows, sent, home_row, packed_row, row_home, counts[:world], row_counts)


def run_plan_kernels(lengths: torch.Tensor, dest_ranks: torch.Tensor, world: int, rank: int, rows: int,
                     with_map: bool = True) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """plan()'s launches and its host read, unchecked: (counts read back: [world] samples, [world]
    rows, the first bad sample; sent [samples, 2], home_row, packed_row, row_home [rows], or empty
    without the map: tests of offsets past 2**31 rows)."""
    k = kernels()
    device, samples = lengths.device, lengths.numel()
    blocks = max(1, k.plan_grid(samples))
    chunks = k.triton.cdiv(blocks, k.SCAN_CHUNK)
    width = world + 1
    # Scratch (dropped when this returns; the allocator orders its reuse on this stream) and the
    # plan's own tensors: two allocations, nothing to initialize (every kernel writes what it reads).
    table, sums = 2 * blocks * width, 2 * chunks * width
    hist, prefix, chunk_sums, chunk_prefix, starts, block_bad, host = _int64_pieces(
        device, [table, table, sums, sums, 2 * width, blocks, 2 * world + 1])
    map_rows = rows if with_map else 0
    sent, home_row, packed_row, row_home = _int64_pieces(device, [2 * samples, samples, samples, map_rows])
    with launch_device(device):
        k.count_kernel[(blocks,)](lengths, dest_ranks, samples, world, rows, hist, block_bad, BLOCK=k.PLAN_BLOCK,
                                  DT=k.DEST_TILE)
        k.scan_chunks_kernel[(chunks, k.triton.cdiv(width, k.DEST_TILE))](hist, prefix, chunk_sums, blocks, width,
                                                                           CHUNK=k.SCAN_CHUNK, DT=k.DEST_TILE,
                                                                           num_warps=k.SCAN_WARPS)
        k.scan_totals_kernel[(1,)](chunk_sums, chunk_prefix, starts, block_bad, host, samples, blocks, chunks, width,
                                   CHUNK=k.SCAN_CHUNK, DT=k.DEST_TILE, num_warps=k.SCAN_WARPS)
        k.place_kernel[(blocks,)](lengths, dest_ranks, samples, world, rank, rows, map_rows, prefix, chunk_prefix,
                                  starts, sent, home_row, packed_row, row_home, BLOCK=k.PLAN_BLOCK, CHUNK=k.SCAN_CHUNK,
                                  num_warps=k.PLACE_WARPS)
    return read_host(host), sent.view(samples, 2), home_row, packed_row, row_home


def _int64_pieces(device: torch.device, sizes: list[int]) -> list[torch.Tensor]:
    """int64 tensors of these sizes in one allocation, each starting 16-byte aligned (Triton
    specializes pointers on 16-byte alignment: an offset that moved with a batch's shape would
    compile the kernels again)."""
    padded = [n + n % 2 for n in sizes]
    whole = torch.empty(sum(padded), dtype=torch.int64, device=device)
    return [piece[:n] for piece, n in zip(whole.split(padded), sizes)]


def _words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8).view(word)


def copy_runs(home: torch.Tensor, packed: torch.Tensor, plan: DevicePlan, to_packed: bool) -> None:
    """Gathers the plan's samples from `home` into send order in `packed` (to_packed), or
    scatters them back; both contiguous, same dtype and row shape, on the current stream of their
    device: one launch."""
    if home.device.type == "cuda":
        stream = torch.cuda.current_stream(home.device)
        for t in (plan.sent, plan.home_row, plan.packed_row, plan.row_home):
            # Made on the dispatch's stream; this kernel may run on another (combine, dispatch_like):
            # the allocator must not reuse them before it ran, even if the handle goes first.
            t.record_stream(stream)
    row_bytes = math.prod(home.shape[1:]) * home.element_size()
    rows = packed.shape[0]
    if rows == 0 or row_bytes == 0:
        return
    # The widest word that divides a row and both buffers' alignment: fewer, wider accesses.
    word, size = next(((w, n) for w, n in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))
                       if row_bytes % n == 0 and home.data_ptr() % n == 0 and packed.data_ptr() % n == 0),
                      (torch.uint8, 1))
    k = kernels()
    row_words = row_bytes // size
    tile_rows, tile_words = k.copy_shape(row_words, size)
    grid = (k.triton.cdiv(rows, tile_rows), k.triton.cdiv(row_words, tile_words))
    with launch_device(home.device):
        k.copy_kernel[grid](_words(home, word), _words(packed, word), plan.row_home, rows, row_words,
                            TO_PACKED=to_packed, ROWS=tile_rows, WORDS=tile_words)


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

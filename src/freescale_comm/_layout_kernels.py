"""The layout kernels of fc.dispatch / fc.combine, in Triton: the stable plan (a counting sort of
jagged samples by destination rank) and the packed row gather/scatter. The only SM work freescale
launches (bytes between ranks move on copy engines). Imported only when a dispatch needs them
(CUDA tensors, or the interpreter in tests): CPU tensors never need triton. With
TRITON_INTERPRET=1 (set before this module is imported) the same kernels run on CPU tensors,
which is how CI tests them: correctness only, never a timing.

The plan, four launches: count (per block of samples: a histogram over destinations), scan_chunks
(per chunk of blocks: exclusive prefixes, in parallel), scan_totals (one program: the chunks'
prefixes, the totals, the destinations' starts, the first bad sample, all the host needs in one
buffer), place (each sample's slot in send order, and the packed-row -> home-row map the copies
use). Every program reads what others wrote only in a later launch: no order among the programs
of one launch is assumed (tests run them in permuted orders).

No compile-time constant depends on a batch's shape: runtime sizes are `do_not_specialize` (Triton
would otherwise compile again when one becomes a multiple of 16 or 1), and the copy's constants
depend only on the row width. Index arithmetic is int64 throughout (rows, slots and byte offsets
may pass 2**31)."""

from __future__ import annotations

import triton
import triton.language as tl

# Tile sizes keep every kernel within its registers, no spills (ptxas for sm_90, checked in CI:
# test_layout_kernels.py compiles them): place's [BLOCK, BLOCK] int64 tiles bound PLAN_BLOCK.
PLAN_BLOCK = 64  # samples per program of count and place
DEST_TILE = 16  # destinations per step of the histograms and scans
SCAN_CHUNK = 128  # blocks per program of scan_chunks (and per step of scan_totals)
SCAN_WARPS = 8  # warps of the scans' programs ([SCAN_CHUNK, DEST_TILE] int64 tiles)
PLACE_WARPS = 8  # warps of place's programs ([PLAN_BLOCK, PLAN_BLOCK] int64 tiles: 4 spilled with Triton 3.6)
COPY_TILE_BYTES = 4096  # bytes a copy program moves (rows x words)
COPY_MAX_WORDS = 1024  # words of a row per copy program at most (wider rows take several)


@triton.jit(do_not_specialize=["samples", "world", "rows"])
def count_kernel(lengths, dest, samples, world, rows, hist, block_bad, BLOCK: tl.constexpr, DT: tl.constexpr):
    """Per block b of samples: hist[0, b, d] samples and hist[1, b, d] rows going to destination d
    (d < world); column `world`: every valid sample and row of the block (rows: its share of the
    home values). hist: int64 [2, blocks, world + 1]. block_bad[b]: the smallest index of a sample
    with a length outside [0, rows] (rows: the values'; so no sum of valid lengths wraps, the host
    having checked samples * rows < 2**63) or a destination outside [0, world), or `samples`."""
    b = tl.program_id(0).to(tl.int64)
    blocks = tl.num_programs(0).to(tl.int64)
    width = world.to(tl.int64) + 1
    i = b * BLOCK + tl.arange(0, BLOCK)
    m = i < samples
    length = tl.load(lengths + i, mask=m, other=0)
    d = tl.load(dest + i, mask=m, other=0)
    ok = (length >= 0) & (length <= rows) & (d >= 0) & (d < world)
    tl.store(block_bad + b, tl.min(tl.where(m & ~ok, i, samples), axis=0))
    valid = m & ok
    length = tl.where(valid, length, 0)
    for d0 in range(0, width, DT):
        dd = d0 + tl.arange(0, DT).to(tl.int64)
        hit = valid[:, None] & ((d[:, None] == dd[None, :]) | (dd[None, :] == width - 1))
        at = b * width + dd
        tl.store(hist + at, tl.sum(hit.to(tl.int64), axis=0), mask=dd < width)
        tl.store(hist + blocks * width + at, tl.sum(tl.where(hit, length[:, None], 0), axis=0), mask=dd < width)


@triton.jit(do_not_specialize=["blocks", "width"])
def scan_chunks_kernel(hist, prefix, chunk_sums, blocks, width, CHUNK: tl.constexpr, DT: tl.constexpr):
    """Program (c, t): for blocks [c*CHUNK, (c+1)*CHUNK) and destinations of tile t, the exclusive
    prefix over the chunk's blocks (prefix, same shape as hist [2, blocks, width]) and the chunk's
    sums (chunk_sums [2, chunks, width]). Reads hist only: input and output are separate."""
    c = tl.program_id(0).to(tl.int64)
    chunks = tl.num_programs(0).to(tl.int64)
    bb = c * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    dd = tl.program_id(1).to(tl.int64) * DT + tl.arange(0, DT).to(tl.int64)
    m = (bb < blocks)[:, None] & (dd < width)[None, :]
    at = bb[:, None] * width + dd[None, :]
    plane = blocks.to(tl.int64) * width  # entries of one of the two tables
    for q in tl.static_range(2):  # samples, rows
        x = tl.load(hist + q * plane + at, mask=m, other=0)
        tl.store(prefix + q * plane + at, tl.cumsum(x, axis=0) - x, mask=m)
        tl.store(chunk_sums + (q * chunks + c) * width + dd, tl.sum(x, axis=0), mask=dd < width)


@triton.jit(do_not_specialize=["samples", "blocks", "chunks", "width"])
def scan_totals_kernel(chunk_sums, chunk_prefix, starts, block_bad, host, samples, blocks, chunks, width,
                       CHUNK: tl.constexpr, DT: tl.constexpr):
    """One program: chunk_prefix [2, chunks, width], the exclusive prefix of chunk_sums over chunks;
    starts [2, width], each destination's first sample / row in send order (exclusive prefix of the
    totals over destinations < world); host int64 [2 * world + 1]: samples and rows per
    destination, then the first bad sample (`samples` if none): what the host reads, in one copy."""
    world = width - 1
    for q in tl.static_range(2):
        carry_d = tl.zeros([1], dtype=tl.int64)  # total of the destinations before this tile
        for d0 in range(0, width, DT):
            dd = d0 + tl.arange(0, DT).to(tl.int64)
            acc = tl.zeros([DT], dtype=tl.int64)
            for c0 in range(0, chunks, CHUNK):
                cc = c0 + tl.arange(0, CHUNK).to(tl.int64)
                m = (cc < chunks)[:, None] & (dd < width)[None, :]
                at = (q * chunks + cc[:, None]) * width + dd[None, :]
                x = tl.load(chunk_sums + at, mask=m, other=0)
                tl.store(chunk_prefix + at, acc[None, :] + tl.cumsum(x, axis=0) - x, mask=m)
                acc += tl.sum(x, axis=0)
            real = dd < world  # column `world` (every valid row) is no destination
            mine = tl.where(real, acc, 0)
            tl.store(starts + q * width + dd, carry_d + tl.cumsum(mine, axis=0) - mine, mask=dd < width)
            tl.store(host + q * world + dd, acc, mask=real)
            carry_d += tl.sum(mine, axis=0)
    bad = tl.zeros([1], dtype=tl.int64) + samples
    for b0 in range(0, blocks, CHUNK * DT):
        bb = b0 + tl.arange(0, CHUNK * DT).to(tl.int64)
        bad = tl.minimum(bad, tl.min(tl.load(block_bad + bb, mask=bb < blocks, other=samples), axis=0))
    tl.store(host + 2 * world + tl.arange(0, 1), bad)


@triton.jit(do_not_specialize=["samples", "world", "rank", "rows", "map_rows"])
def place_kernel(lengths, dest, samples, world, rank, rows, map_rows, prefix, chunk_prefix, starts, sent, home_row,
                 packed_row, row_home, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Each valid sample's slot k in send order (by destination, then original order), and its
    rows: sent[k] = (length, rank) (int64 [samples, 2]: what its destination receives), home_row[k]
    (first row in the home values), packed_row[k] (first row in the packed send buffer); and
    row_home [map_rows]: for each packed row, its home row, written only when the valid lengths sum
    to map_rows (plan: the values' rows; else the host refuses the plan; tests: 0, no map)."""
    b = tl.program_id(0).to(tl.int64)
    blocks = tl.num_programs(0).to(tl.int64)
    chunks = (blocks + CHUNK - 1) // CHUNK
    width = world.to(tl.int64) + 1
    j = tl.arange(0, BLOCK)
    i = b * BLOCK + j
    m = i < samples
    length = tl.load(lengths + i, mask=m, other=0)
    d = tl.load(dest + i, mask=m, other=0)
    ok = m & (length >= 0) & (length <= rows) & (d >= 0) & (d < world)  # as count_kernel
    length = tl.where(ok, length, 0)
    c = b // CHUNK
    home = tl.load(chunk_prefix + (chunks + c) * width + world) + tl.load(prefix + (blocks + b) * width + world) \
        + tl.cumsum(length, axis=0) - length
    # Earlier samples of this block with the same destination: how many and their rows, stably.
    # The other samples (axis 1) are loaded again as a [1, BLOCK] row rather than broadcast from
    # the 1-D values: Triton 3.6 (torch 2.11's) fails to compile those broadcast along both axes.
    jo = j[None, :]
    io = b * BLOCK + jo
    lo = tl.load(lengths + io, mask=io < samples, other=0)
    do = tl.load(dest + io, mask=io < samples, other=0)
    oko = (io < samples) & (lo >= 0) & (lo <= rows) & (do >= 0) & (do < world)
    earlier = (jo < j[:, None]) & (do == d[:, None]) & oko
    before = tl.sum(earlier.to(tl.int64), axis=1)
    rows_before = tl.sum(tl.where(earlier, lo, 0), axis=1)
    dc = tl.where(ok, d, 0).to(tl.int64)
    k = tl.load(starts + dc, mask=ok, other=0) + tl.load(chunk_prefix + c * width + dc, mask=ok, other=0) \
        + tl.load(prefix + b * width + dc, mask=ok, other=0) + before
    first = tl.load(starts + width + dc, mask=ok, other=0) \
        + tl.load(chunk_prefix + (chunks + c) * width + dc, mask=ok, other=0) \
        + tl.load(prefix + (blocks + b) * width + dc, mask=ok, other=0) + rows_before
    tl.store(sent + 2 * k, length, mask=ok)
    tl.store(sent + 2 * k + 1, tl.zeros_like(length) + rank, mask=ok)
    tl.store(home_row + k, home, mask=ok)
    tl.store(packed_row + k, first, mask=ok)
    # The map, BLOCK of the block's home rows per step (its samples' rows are contiguous at home):
    # row q belongs to the sample whose rows end after it; its packed row is q + first - home.
    # None unless the lengths sum to the map's size.
    base = home - (tl.cumsum(length, axis=0) - length)  # the block's first home row (every lane)
    ends = tl.cumsum(length, axis=0)
    shift = first - home  # packed row - home row, per sample
    mapped = tl.where(tl.load(starts + width + world) == map_rows, tl.sum(length, axis=0), 0)
    for r0 in range(0, mapped, BLOCK):
        q = r0 + j.to(tl.int64)
        owner = tl.sum((q[:, None] >= ends[None, :]).to(tl.int32), axis=1)  # sample within the block
        at = q + base + tl.sum(tl.where(owner[:, None] == j[None, :], shift[None, :], 0), axis=1)
        tl.store(row_home + at, base + q, mask=q < mapped)


@triton.jit(do_not_specialize=["rows", "row_words"])
def copy_kernel(home, packed, row_home, rows, row_words, TO_PACKED: tl.constexpr, ROWS: tl.constexpr,
                WORDS: tl.constexpr):
    """Copies rows between the home buffer and the packed one, [*, row_words] words each: ROWS
    packed rows x WORDS words per program (WORDS: the row's words rounded up to a power of two, so
    few lanes idle; ROWS fills COPY_TILE_BYTES), each row's home row read from the plan's map."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = r < rows
    h = tl.load(row_home + r, mask=rm, other=0)
    c = tl.program_id(1).to(tl.int64) * WORDS + tl.arange(0, WORDS)
    mask = rm[:, None] & (c < row_words)[None, :]
    at_packed = r[:, None] * row_words + c[None, :]
    at_home = h[:, None] * row_words + c[None, :]
    if TO_PACKED:
        tl.store(packed + at_packed, tl.load(home + at_home, mask=mask), mask=mask)
    else:
        tl.store(home + at_home, tl.load(packed + at_packed, mask=mask), mask=mask)


def plan_grid(samples: int) -> int:
    return triton.cdiv(samples, PLAN_BLOCK)


def copy_shape(row_words: int, word_bytes: int) -> tuple[int, int]:
    """(ROWS, WORDS) of copy_kernel for rows of `row_words` words of `word_bytes` bytes."""
    words = min(triton.next_power_of_2(max(1, row_words)), COPY_MAX_WORDS)
    return max(1, COPY_TILE_BYTES // (words * word_bytes)), words

"""The layout kernels of fc.dispatch / fc.combine, in Triton: the stable plan (a counting sort of
jagged samples by destination rank) and the packed row gather/scatter. The only SM work freescale
launches (bytes between ranks move on copy engines). Imported only when a dispatch needs them
(CUDA tensors, or the interpreter in tests): CPU tensors never need triton. With
TRITON_INTERPRET=1 (set before this module is imported) the same kernels run on CPU tensors,
which is how CI tests them: correctness only, never a timing.

Index arithmetic is int64 throughout (rows and byte offsets may pass 2**31)."""

from __future__ import annotations

import triton
import triton.language as tl

PLAN_BLOCK = 128  # samples per program of the plan kernels
DEST_TILE = 64  # destinations per step of the per-block histogram
COPY_ROWS = 32  # packed rows per program of the copy kernel
COPY_WORDS = 128  # words of a row per program of the copy kernel


@triton.jit
def count_kernel(lengths, dest, samples, world, block_samples, block_rows, block_total, bad,
                 BLOCK: tl.constexpr, DT: tl.constexpr):
    """Per block of samples: how many samples / rows go to each destination
    (block_samples / block_rows [blocks, world]), its valid rows (block_total [blocks]), and the
    smallest index of a sample with a negative length or a destination outside [0, world) into
    `bad` (atomic min; it starts at `samples`)."""
    b = tl.program_id(0).to(tl.int64)
    i = b * BLOCK + tl.arange(0, BLOCK)
    m = i < samples
    length = tl.load(lengths + i, mask=m, other=0)
    d = tl.load(dest + i, mask=m, other=0)
    ok = (length >= 0) & (d >= 0) & (d < world)
    tl.atomic_min(bad, tl.min(tl.where(m & ~ok, i, samples), axis=0))
    valid = m & ok
    length = tl.where(valid, length, 0)
    tl.store(block_total + b, tl.sum(length, axis=0))
    for d0 in range(0, world, DT):
        dd = d0 + tl.arange(0, DT)
        hit = valid[:, None] & (d[:, None] == dd[None, :])
        at = b * world + dd
        tl.store(block_samples + at, tl.sum(hit.to(tl.int64), axis=0), mask=dd < world)
        tl.store(block_rows + at, tl.sum(tl.where(hit, length[:, None], 0), axis=0), mask=dd < world)


@triton.jit
def scan_kernel(block_samples, block_rows, blocks, world, total_samples, total_rows, DT: tl.constexpr):
    """Per destination: block_samples / block_rows become exclusive prefixes over the blocks (in
    place); the totals go to total_samples / total_rows [world]."""
    dd = tl.program_id(0).to(tl.int64) * DT + tl.arange(0, DT)
    m = dd < world
    acc_samples = tl.zeros([DT], dtype=tl.int64)
    acc_rows = tl.zeros([DT], dtype=tl.int64)
    for b in range(0, blocks):
        at = b * world + dd
        s = tl.load(block_samples + at, mask=m, other=0)
        r = tl.load(block_rows + at, mask=m, other=0)
        tl.store(block_samples + at, acc_samples, mask=m)
        tl.store(block_rows + at, acc_rows, mask=m)
        acc_samples += s
        acc_rows += r
    tl.store(total_samples + dd, acc_samples, mask=m)
    tl.store(total_rows + dd, acc_rows, mask=m)


@triton.jit
def place_kernel(lengths, dest, samples, world, block_samples, block_rows, start_samples, start_rows, block_home,
                 sent_lengths, home_row, packed_row, BLOCK: tl.constexpr):
    """Each valid sample's slot k in send order (by destination, then original order), and its
    rows: sent_lengths[k], home_row[k] (first row in the home values), packed_row[k] (first row
    in the packed send buffer). start_*: [world] exclusive prefixes over destinations;
    block_home: [blocks] exclusive prefix of block_total."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    i = b * BLOCK + j
    m = i < samples
    length = tl.load(lengths + i, mask=m, other=0)
    d = tl.load(dest + i, mask=m, other=0)
    ok = m & (length >= 0) & (d >= 0) & (d < world)
    length = tl.where(ok, length, 0)
    home = tl.load(block_home + b) + tl.cumsum(length, axis=0) - length
    # Earlier samples of this block with the same destination: rank and rows before, stably.
    earlier = (j[None, :] < j[:, None]) & (d[None, :] == d[:, None]) & ok[None, :]
    rank = tl.sum(earlier.to(tl.int64), axis=1)
    rows_before = tl.sum(tl.where(earlier, length[None, :], 0), axis=1)
    dc = tl.where(ok, d, 0)
    at = b * world + dc
    k = tl.load(start_samples + dc, mask=ok, other=0) + tl.load(block_samples + at, mask=ok, other=0) + rank
    first = tl.load(start_rows + dc, mask=ok, other=0) + tl.load(block_rows + at, mask=ok, other=0) + rows_before
    tl.store(sent_lengths + k, length, mask=ok)
    tl.store(home_row + k, home, mask=ok)
    tl.store(packed_row + k, first, mask=ok)


@triton.jit
def copy_kernel(home, packed, home_row, packed_row, runs, packed_rows, row_words, TO_PACKED: tl.constexpr,
                STEPS: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """Copies rows between the home buffer and the packed one, [*, row_words] words each: the
    work is cut evenly over the packed rows (ROWS x WORDS per program), so a long sample does not
    serialize the copy and one-row samples keep every lane busy. Each packed row finds its run by
    binary search over packed_row (the rightmost run starting at or before it; STEPS >=
    ceil(log2(runs + 1)))."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = r < packed_rows
    lo = tl.zeros([ROWS], dtype=tl.int64)  # packed_row[lo] <= r < packed_row[hi] (hi = runs: beyond)
    hi = tl.zeros([ROWS], dtype=tl.int64) + runs
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        active = rm & (hi - lo > 1)
        right = tl.load(packed_row + mid, mask=active, other=0) <= r
        lo = tl.where(active & right, mid, lo)
        hi = tl.where(active & ~right, mid, hi)
    h = tl.load(home_row + lo, mask=rm, other=0) + r - tl.load(packed_row + lo, mask=rm, other=0)
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

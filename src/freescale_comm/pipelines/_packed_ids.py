"""The ids message of a batch cut into micro-batches: each distinct row once, with the micro-batches
that read it.

Within a batch a row's value is frozen, so it moves once (with the first micro-batch that reads
it) and its gradient goes back once (with the last); the owner still has to know every
micro-batch's rows to cut its rounds. Asking each micro-batch's distinct rows one after another
repeats every row several micro-batches share (1.8x the batch's distinct rows at collision 1 with
4 micro-batches). Instead each slot sends its batch's distinct rows once, ascending, each packed
with a bit mask of the micro-batches reading it: `row << M | mask` (int64; bit m = micro-batch m).
The owner rebuilds the same micro-batch-major layout the requester keeps (micro-batch m's rows:
those with bit m, ascending, as `distinct` gives them) and marks each row's first and last entry
from the lowest and highest bit, without a sort.

Packing needs shard rows below 2^(62 - M): `packs` says whether a catalog's slots all fit (both
sides decide alike from the catalog); where they do not, every micro-batch's rows go as they are."""

from __future__ import annotations

import torch

from freescale_comm.pipelines._catalog import Catalog
from freescale_comm.pipelines._host_counts import positions

__all__ = ["packs", "pack", "unpack"]


def packs(catalog: Catalog, micro_batches: int) -> bool:
    """Whether batches of `micro_batches` micro-batches send packed ids: 2 or more micro-batches
    and every slot's shard rows below 2^(62 - micro_batches) (the sign bit stays clear)."""
    if not 2 <= micro_batches <= 61:
        return False
    return all(slot.rows <= 1 << (62 - micro_batches) for slot in catalog.slots)


def pack(rows: torch.Tensor, masks: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """int64 [D]: distinct rows [D] (ascending) with their micro-batch masks [D] (int64, bit m:
    micro-batch m reads the row), `row << M | mask`."""
    return (rows << micro_batches) | masks


def unpack(wire: torch.Tensor, micro_batches: int, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """The requester's layout from its packed ids [D]: int64 rows [E] micro-batch after micro-batch
    (each micro-batch's ascending), E = sum(sizes), sizes [M] (host ints) the rows each micro-batch
    reads; the micro-batch of each entry (int64 [E]); bool [E] whether the entry is its row's first
    in the batch; bool [E] whether it is its row's last. No host read."""
    m_count = micro_batches
    rows = wire >> m_count
    masks = wire & ((1 << m_count) - 1)
    bits = ((masks.unsqueeze(0) >> torch.arange(m_count, device=wire.device).unsqueeze(1)) & 1).bool()  # [M, D]
    total = sum(sizes)
    if wire.numel() == 0 or total == 0:
        none = torch.zeros(0, dtype=torch.bool, device=wire.device)
        empty = torch.zeros(0, dtype=torch.int64, device=wire.device)
        return empty, empty, none, none
    flat = positions(bits.reshape(-1), total)  # m * D + d, ascending: micro-batch-major, rows ascending
    micro, index = flat // wire.numel(), flat % wire.numel()
    mask = masks.index_select(0, index)
    # first entry: its bit is the mask's lowest (mask & -mask); last: no bit above it
    return rows.index_select(0, index), micro, (mask & -mask) == (1 << micro), (mask >> (micro + 1)) == 0

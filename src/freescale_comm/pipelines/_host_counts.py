"""How many entries of device masks are set, per segment, read on the host in one transfer.

Every size PEC's later rounds need (rows per requester and micro-batch that go first or wait) is
a segment count of the flags of one batch pair. Reading each with .tolist() / int() would cost
a device sync per slot and round on CUDA; CountBatch gathers every mask's running sums at its
segment boundaries on the device and reads them all with one .tolist(). Selections then use
torch.nonzero_static with the count known, which needs no sync either."""

from __future__ import annotations

from typing import Optional

import torch


class CountBatch:
    """Collects (mask, segment boundaries) requests; read() returns, per request, the count of
    set entries in each segment, all in one host read."""

    def __init__(self) -> None:
        self._picks: list[torch.Tensor] = []
        self._sizes: list[int] = []

    def add(self, mask: torch.Tensor, bounds: list[int]) -> int:
        """mask: bool [n]; bounds: [k + 1] nondecreasing positions from 0 to n (host ints), the
        k segments being mask[bounds[i]:bounds[i + 1]]. Returns the request's index."""
        upto = torch.cat([mask.new_zeros(1, dtype=torch.int64), mask.cumsum(0)])  # [n + 1]: set before i
        self._picks.append(upto[torch.tensor(bounds, dtype=torch.int64, device=mask.device)])
        self._sizes.append(len(bounds))
        return len(self._sizes) - 1

    def read(self) -> list[list[int]]:
        if not self._picks:
            return []
        flat = torch.cat(self._picks).tolist()  # the one host read
        out, at = [], 0
        for size in self._sizes:
            ends = flat[at:at + size]
            out.append([b - a for a, b in zip(ends, ends[1:])])
            at += size
        return out


def select(values: torch.Tensor, mask: Optional[torch.Tensor], count: int) -> torch.Tensor:
    """values' entries (along dim 0) where `mask` is set, `count` of them (known on the host: no
    sync); all of them if mask is None or every entry is set."""
    if mask is None or count == values.shape[0]:
        return values
    if count == 0:
        return values[:0]
    return values.index_select(0, positions(mask, count))


def positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """int64 [count]: where `mask` is set (count known on the host: no sync)."""
    return torch.nonzero_static(mask, size=count).squeeze(1)

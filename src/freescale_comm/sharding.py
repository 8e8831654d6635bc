"""Where the rows of sharded embedding tables live: row-wise or table-wise, as TorchRec shards.

A sharding routes the ids a rank reads, given per table, to (owner rank, row in the owner's
shard). A rank's shard stores the rows it owns of every table, table after table, in one
[shard_rows(rank), dim] tensor. Routing is vectorized: one pass of tensor ops per table.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Optional

import torch

__all__ = ["Sharding", "RowWiseSharding", "TableWiseSharding"]


def _check_sizes(num_rows: Sequence[int], world: int) -> tuple[tuple[int, ...], int]:
    try:
        rows = tuple(operator.index(n) for n in num_rows)
        world = operator.index(world)
    except TypeError:
        raise TypeError(f"num_rows must be a sequence of ints and world an int, got {num_rows!r}, {world!r}") from None
    if not rows or min(rows) < 1:
        raise ValueError(f"num_rows must list the row count (>= 1) of every table, got {list(rows)}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return rows, world


class Sharding:
    """The rows of `len(num_rows)` tables over `world` ranks. Subclasses say who owns what by
    filling, per table t: `_block[t]` (rows per owner block) and `_owner_of_block[t]` (int64
    [blocks]: the owner of each block); rows of a table keep their order inside an owner."""

    num_rows: tuple[int, ...]
    world: int

    def __init__(self, num_rows: Sequence[int], world: int) -> None:
        self.num_rows, self.world = _check_sizes(num_rows, world)
        self._block: list[int] = []
        self._owner_of_block: list[torch.Tensor] = []

    def _finish(self) -> None:
        # _base[t][r]: where table t's rows start in rank r's shard (its earlier tables first).
        counts = torch.zeros(len(self.num_rows) + 1, self.world, dtype=torch.int64)
        for t, (n, block, owners) in enumerate(zip(self.num_rows, self._block, self._owner_of_block)):
            sizes = torch.full((owners.numel(),), block, dtype=torch.int64)
            sizes[-1] = n - block * (owners.numel() - 1)
            counts[t + 1] = torch.bincount(owners, weights=sizes.double(), minlength=self.world).long()
        self._base = counts.cumsum(0)
        self._first_block: list[torch.Tensor] = []  # per table: block index where each owner's rows begin
        for owners in self._owner_of_block:
            first = torch.zeros(self.world, dtype=torch.int64)
            for r in range(self.world):  # world-sized loop, once per table at construction
                hits = (owners == r).nonzero()
                first[r] = hits[0, 0] if hits.numel() else 0
            self._first_block.append(first)

    @property
    def tables(self) -> int:
        return len(self.num_rows)

    def shard_rows(self, rank: int) -> int:
        """How many rows rank `rank` stores (all its tables together)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {rank}")
        return int(self._base[-1, rank])

    def check_ids(self, ids: Sequence[torch.Tensor], name: str = "ids") -> list[torch.Tensor]:
        """`ids` as one int64 CPU tensor per table, range-checked (ValueError/TypeError naming the table)."""
        if isinstance(ids, torch.Tensor):
            ids = [ids]
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"{name} must be a list or tuple of int tensors, one per table ({self.tables}), or one "
                            f"tensor for one table; got {type(ids).__name__}")
        if len(ids) != self.tables:
            raise ValueError(f"{name} must hold one id tensor per table ({self.tables}), got {len(ids)}")
        out = []
        for t, x in enumerate(ids):
            if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
                raise TypeError(f"{name}[{t}] must be an integer torch.Tensor, got "
                                f"{getattr(x, 'dtype', type(x).__name__)}")
            x = x.reshape(-1).to(device="cpu", dtype=torch.int64)
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.num_rows[t]):
                raise ValueError(f"{name}[{t}] holds ids outside [0, {self.num_rows[t]}) "
                                 f"(min {int(x.min())}, max {int(x.max())}); table {t} has {self.num_rows[t]} rows")
            out.append(x)
        return out

    def route(self, ids: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-table ids (checked by check_ids) → (owner rank, row in the owner's shard), both int64
        [Σ ids], tables concatenated in order."""
        owners, rows = [], []
        for t, x in enumerate(ids):
            block = x // self._block[t]
            owner = self._owner_of_block[t][block]
            owners.append(owner)
            within = x - self._first_block[t][owner] * self._block[t]  # row among the owner's rows of t
            rows.append(self._base[t][owner] + within)
        if not owners:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        return torch.cat(owners), torch.cat(rows)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_rows={list(self.num_rows)}, world={self.world})"


class RowWiseSharding(Sharding):
    """Every table cut into `world` contiguous blocks of ceil(rows / world) rows; block r on rank r
    (TorchRec's row-wise sharding). Every rank holds a slice of every table."""

    def __init__(self, num_rows: Sequence[int], world: int) -> None:
        super().__init__(num_rows, world)
        for n in self.num_rows:
            block = -(-n // self.world)
            self._block.append(block)
            self._owner_of_block.append(torch.arange(-(-n // block), dtype=torch.int64))
        self._finish()


class TableWiseSharding(Sharding):
    """Every table whole on one rank: `owners[t]` (default: round robin, table t on rank t % world)."""

    def __init__(self, num_rows: Sequence[int], world: int, owners: Optional[Sequence[int]] = None) -> None:
        super().__init__(num_rows, world)
        explicit = owners is not None
        owners = list(owners) if explicit else [t % self.world for t in range(self.tables)]
        if len(owners) != self.tables:
            raise ValueError(f"owners must name one rank per table ({self.tables}), got {len(owners)}")
        for t, (n, r) in enumerate(zip(self.num_rows, owners)):
            r = operator.index(r)
            if not 0 <= r < self.world:
                raise ValueError(f"owners[{t}] must be a rank in [0, {self.world}), got {r}")
            self._block.append(n)
            self._owner_of_block.append(torch.tensor([r], dtype=torch.int64))
        self._finish()

"""The synthetic HSTU-like model of the end-to-end benchmark: a row-wise sharded embedding table
and a dense stack of jagged causal attention blocks, all plain torch.

Every rank holds the same dense weights (data parallel: gradients are all-reduced) and one
contiguous slice of the embedding rows. A sample is a history of L item ids; its prediction is a
logit read at the last position; its label is derived from its own ids, so it travels with them
wherever load balancing sends the sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HSTUBlock", "DenseTower", "ShardedTable", "sample_labels"]


class HSTUBlock(nn.Module):
    """One HSTU-style layer on one sample x [L, dim]: x + W_o(silu(U) ⊙ causal_attn(Q, K, V))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L, dim = x.shape
        u, v, q, k = self.uvqk(self.norm(x)).chunk(4, dim=-1)
        split = lambda t: t.view(L, self.heads, dim // self.heads).transpose(0, 1)  # noqa: E731 - [H, L, d]
        attn = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        return x + self.out(F.silu(u) * attn.transpose(0, 1).reshape(L, dim))


class DenseTower(nn.Module):
    """The dense part: `layers` HSTU blocks, then a logit from the last position of each sample."""

    def __init__(self, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(HSTUBlock(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """values [ΣL, dim] jagged samples back to back → logits [samples]."""
        logits = []
        for x in values.split(lengths):
            for block in self.blocks:
                x = block(x)
            logits.append(self.head(x[-1]))
        return torch.cat(logits) if logits else values.new_zeros(0)


def sample_labels(ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """float labels [samples] in {0, 1}: the parity of each sample's first id."""
    starts = torch.tensor([0] + lengths[:-1], dtype=torch.int64).cumsum(0)
    return (ids[starts] % 2).to(torch.float32) if lengths else torch.zeros(0)


class ShardedTable:
    """Rows [rank·rows_per_rank, (rank+1)·rows_per_rank) of a row-wise sharded table [rows, dim],
    initialized from (seed, rank) so every run of the same seed starts alike."""

    def __init__(self, rank: int, rows_per_rank: int, dim: int, seed: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(seed * 7919 + rank)
        self.first_row = rank * rows_per_rank
        self.weight = (torch.randn(rows_per_rank, dim, generator=g) * 0.1).to(device)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids of this shard (global row numbers) → rows [len(ids), dim]."""
        return self.weight.index_select(0, ids.to(self.weight.device) - self.first_row)

    def sgd(self, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """weight[id] -= lr · Σ grads of that id (duplicates add up)."""
        self.weight.index_add_(0, ids.to(self.weight.device) - self.first_row, grads.to(self.weight.device), alpha=-lr)

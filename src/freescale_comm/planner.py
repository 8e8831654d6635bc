"""Load-balancing planner: which samples move to which rank so every rank does about the same
work, moving as few bytes as possible. Pure NumPy and deterministic: every rank computes the
same plan from the same inputs (no torch.distributed, no _core).

Cost of a sample of L items: quadratic·L² + linear·L + constant (HSTU attention is quadratic in
L). Objective, in order: minimize the largest rank load; then the bytes moved. A sample stays
on its home rank unless moving it lowers the largest load.

The method ("shed, fill, polish"):
1. shed: every rank above the target (the lower bound max(mean load, largest sample)) gives up
   samples worth its excess, longest first (cost grows faster than bytes, so long samples shed
   the most work per byte moved), the last one chosen by best fit so it overshoots least;
2. fill: the shed samples go, largest cost first, to the rank with the most room (LPT);
3. polish: while it lowers the largest load, the most loaded rank hands its sample closest to
   half the gap to the least loaded rank.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["CostModel", "RebalancePlan", "plan_rebalance"]


@dataclass(frozen=True)
class CostModel:
    """cost(L) = quadratic·L² + linear·L + constant, in any unit (FLOPs, seconds)."""

    quadratic: float = 1.0
    linear: float = 0.0
    constant: float = 0.0

    def __post_init__(self) -> None:
        for name in ("quadratic", "linear", "constant"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {value!r}")
        if self.quadratic == self.linear == self.constant == 0:
            raise ValueError("CostModel needs at least one positive coefficient (all three are 0)")

    def cost(self, lengths: np.ndarray | Sequence[int]) -> np.ndarray:
        """float64 cost of each sample of `lengths` (same shape)."""
        L = np.asarray(lengths, dtype=np.float64)
        return (self.quadratic * L + self.linear) * L + self.constant

    @classmethod
    def hstu(cls, num_heads: int, attn_dim: int, hidden_dim: int, model_dim: int | None = None) -> "CostModel":
        """FLOPs of one HSTU layer, forward + backward, per sample of L items.

        Attention (causal, so half of the L×L scores): fwd+bwd ≈ (4·f1 + 3·f2) / 2 with
        f1 = H·d_attn·L² (QKᵀ) and f2 = H·d_hidden·L² (scores × V). Linear: the U, V, Q, K
        projections and the output projection, 2 FLOPs per multiply-add forward, 4 backward, with
        model_dim (default H·d_hidden) inputs per item.
        """
        for name, v in (("num_heads", num_heads), ("attn_dim", attn_dim), ("hidden_dim", hidden_dim)):
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        d_model = num_heads * hidden_dim if model_dim is None else model_dim
        if d_model <= 0:
            raise ValueError(f"model_dim must be positive, got {model_dim!r}")
        quadratic = (4 * num_heads * attn_dim + 3 * num_heads * hidden_dim) / 2
        projections = d_model * num_heads * (2 * attn_dim + 2 * hidden_dim) + num_heads * hidden_dim * d_model
        return cls(quadratic=float(quadratic), linear=float(6 * projections), constant=0.0)

    @classmethod
    def fit(cls, lengths: np.ndarray | Sequence[int], seconds: np.ndarray | Sequence[float]) -> "CostModel":
        """Least-squares fit of measured per-sample (or per-batch-of-one) times, coefficients
        kept >= 0 (the best of the fits on every subset of the three terms)."""
        L = np.asarray(lengths, dtype=np.float64).ravel()
        t = np.asarray(seconds, dtype=np.float64).ravel()
        if L.size != t.size:
            raise ValueError(f"lengths has {L.size} entries but seconds has {t.size}; give one time per length")
        if L.size < 2 or not np.all(np.isfinite(t)) or np.any(L < 0):
            raise ValueError("CostModel.fit needs >= 2 finite timings at lengths >= 0")
        columns = np.stack([L * L, L, np.ones_like(L)], axis=1)
        scale = np.maximum(np.abs(columns).max(axis=0), 1e-300)  # conditioning: L² spans decades
        best: tuple[float, np.ndarray] | None = None
        for mask in range(1, 8):
            keep = [i for i in range(3) if mask >> i & 1]
            coef, *_ = np.linalg.lstsq(columns[:, keep] / scale[keep], t, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(3)
            full[keep] = coef / scale[keep]
            residual = float(np.sum((columns @ full - t) ** 2))
            if best is None or residual < best[0] - 1e-12 * max(residual, 1e-300):
                best = (residual, full)
        if best is None or not np.any(best[1] > 0):
            raise ValueError("no cost model with non-negative coefficients fits these timings (are they all zero?)")
        q, lin, c = (float(x) for x in best[1])
        return cls(quadratic=q, linear=lin, constant=c)


@dataclass(frozen=True)
class RebalancePlan:
    dest: list[np.ndarray]  # [world] int64 [samples of rank r]: destination rank of each sample
    loads_before: np.ndarray  # float64 [world]
    loads_after: np.ndarray  # float64 [world]
    lower_bound: float  # max(mean load, largest sample cost): no plan's max load is below it
    moved_samples: int
    moved_bytes: int  # Σ lengths of moved samples × bytes_per_item

    @property
    def imbalance_before(self) -> float:
        return _imbalance(self.loads_before)

    @property
    def imbalance_after(self) -> float:
        return _imbalance(self.loads_after)


def _imbalance(loads: np.ndarray) -> float:
    mean = float(loads.mean()) if loads.size else 0.0
    return float(loads.max()) / mean if mean > 0 else 1.0


def _check_lengths(lengths_per_rank: Sequence[np.ndarray | Sequence[int]]) -> list[np.ndarray]:
    if isinstance(lengths_per_rank, np.ndarray) and lengths_per_rank.dtype != object and lengths_per_rank.ndim != 2:
        raise ValueError("lengths_per_rank must be a list with one array of sample lengths per rank")
    if len(lengths_per_rank) == 0:
        raise ValueError("lengths_per_rank is empty: give one array of sample lengths per rank")
    out = []
    for r, lengths in enumerate(lengths_per_rank):
        if hasattr(lengths, "numpy") and callable(lengths.numpy):  # a CPU torch tensor
            lengths = lengths.numpy()
        a = np.asarray(lengths)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"lengths_per_rank[{r}] must be a 1-D array of integer lengths, got shape {a.shape} dtype {a.dtype}")
        if a.size and a.min() < 0:
            raise ValueError(f"lengths_per_rank[{r}] has a negative length ({int(a.min())})")
        out.append(a.astype(np.int64, copy=False))
    return out


def plan_rebalance(lengths_per_rank: Sequence[np.ndarray | Sequence[int]], *, cost_model: CostModel,
                   bytes_per_item: int = 1, tolerance: float = 1e-4) -> RebalancePlan:
    """Plans where each rank's samples go (see the module docstring for the method). A max load
    within `tolerance` (relative) of the lower bound is good enough: no sample moves for less."""
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a freescale_comm.planner.CostModel, got {type(cost_model).__name__}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1) (relative slack over the lower bound), got {tolerance!r}")
    if not isinstance(bytes_per_item, (int, np.integer)) or bytes_per_item < 0:
        raise ValueError(f"bytes_per_item must be an int >= 0 (bytes of one embedded item), got {bytes_per_item!r}")
    lengths = _check_lengths(lengths_per_rank)
    world = len(lengths)
    costs = [cost_model.cost(L) for L in lengths]
    before = np.array([c.sum() for c in costs], dtype=np.float64)
    largest = max((float(c.max()) for c in costs if c.size), default=0.0)
    bound = max(float(before.mean()), largest)
    dest = [np.full(L.size, r, dtype=np.int64) for r, L in enumerate(lengths)]

    good_enough = bound * (1 + tolerance)
    if world > 1 and before.max() > good_enough:
        loads = before.copy()
        movers = _shed(lengths, costs, loads, bound)
        _fill(movers, costs, dest, loads)
        _polish(costs, dest, loads, good_enough)

    after = np.zeros(world)
    for r in range(world):
        np.add.at(after, dest[r], costs[r])
    moved = [dest[r] != r for r in range(world)]
    return RebalancePlan(
        dest=dest,
        loads_before=before,
        loads_after=after,
        lower_bound=bound,
        moved_samples=int(sum(int(m.sum()) for m in moved)),
        moved_bytes=int(sum(int(lengths[r][moved[r]].sum()) for r in range(world)) * bytes_per_item),
    )


def _shed(lengths: list[np.ndarray], costs: list[np.ndarray], loads: np.ndarray, target: float) -> list[tuple[int, int]]:
    """(rank, sample) pairs each overloaded rank gives up; updates loads."""
    movers: list[tuple[int, int]] = []
    for r in np.flatnonzero(loads > target):
        excess = loads[r] - target
        c = costs[r]
        # Most cost per item first: the fewest bytes for the work shed. Ties: lower index first.
        order = np.lexsort((np.arange(c.size), -(c / np.maximum(lengths[r], 1))))
        taken = np.cumsum(c[order])
        k = int(np.searchsorted(taken, excess))  # order[:k] leave excess > 0 still to shed
        chosen = list(order[:k])
        rest = excess - (taken[k - 1] if k else 0.0)
        remaining = order[k:]
        if rest > 0 and remaining.size:
            # Best fit for the rest: the cheapest remaining sample that covers it, else the dearest.
            rc = c[remaining]
            cover = rc >= rest
            pick = remaining[np.argmin(np.where(cover, rc, np.inf))] if cover.any() else remaining[np.argmax(rc)]
            # Shedding more than twice the rest would overshoot more than it fixes.
            if c[pick] < 2 * rest:
                chosen.append(pick)
        for i in chosen:
            movers.append((int(r), int(i)))
            loads[r] -= c[i]
    return movers


def _fill(movers: list[tuple[int, int]], costs: list[np.ndarray], dest: list[np.ndarray], loads: np.ndarray) -> None:
    """Largest mover first to the least loaded rank (its home allowed if that is least loaded)."""
    movers.sort(key=lambda m: (-costs[m[0]][m[1]], m[0], m[1]))
    heap = [(float(loads[r]), r) for r in range(loads.size)]
    heapq.heapify(heap)
    for home, i in movers:
        load, r = heapq.heappop(heap)
        c = float(costs[home][i])
        dest[home][i] = r
        loads[r] += c
        heapq.heappush(heap, (load + c, r))


def _polish(costs: list[np.ndarray], dest: list[np.ndarray], loads: np.ndarray, good_enough: float,
            max_steps: int | None = None) -> None:
    """Moves single samples from the most to the least loaded rank while the max is above
    good_enough and a move lowers it. Each move strictly lowers Σ load², so it cannot cycle."""
    world = loads.size
    max_steps = 8 * world if max_steps is None else max_steps
    # Which samples each rank now holds: (home rank, index) pairs, as arrays per holder.
    home_of = np.concatenate([np.full(d.size, r, dtype=np.int64) for r, d in enumerate(dest)])
    index_of = np.concatenate([np.arange(d.size, dtype=np.int64) for d in dest])
    flat_cost = np.concatenate(costs)
    holder = np.concatenate(dest)
    for _ in range(max_steps):
        hi = int(np.argmax(loads))
        lo = int(np.argmin(loads))
        gap = loads[hi] - loads[lo]
        if gap <= 0 or loads[hi] <= good_enough:
            return
        held = np.flatnonzero(holder == hi)
        c = flat_cost[held]
        useful = (c > 0) & (c < gap)
        if not useful.any():
            return
        # Closest to half the gap: the new max of the pair is as low as it gets.
        best = held[useful][np.argmin(np.abs(c[useful] - gap / 2))]
        holder[best] = lo
        dest[home_of[best]][index_of[best]] = lo
        loads[hi] -= flat_cost[best]
        loads[lo] += flat_cost[best]

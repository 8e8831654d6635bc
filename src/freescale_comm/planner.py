"""Load-balancing planner: which samples move to which rank so every rank does about the same
work, moving as few bytes as possible. Pure NumPy and deterministic: every rank computes the
same plan from the same inputs (no torch.distributed, no _core).

Cost of a sample of L items: quadratic·L² + linear·L + constant (HSTU attention is quadratic in
L). Objective, in order: minimize the largest rank load; then the bytes moved. A sample stays
on its home rank unless moving it lowers the largest load.

The method ("settle the big, shed, fill"), LPT's quality at a fraction of its bytes; the target
is the lower bound max(mean load, largest sample):
1. big samples (cost > target/16), as LPT would place them first: each rank keeps its dearest
   ones while they fit under the target; the rest go, dearest first, to the rank with the least
   big load. Heavy tails are decided here: which rank holds how many of the giants.
2. shed: every rank above the target gives up small samples, dearest first (cost grows faster
   than bytes, so they shed the most work per byte moved), then the dearest that still fits the
   rest, then the cheapest that covers it;
3. fill: the shed samples, dearest first, to the least loaded rank (LPT); where one would end
   above the target, that rank displaces cheaper samples of its own back into the pool (the best
   single cover, else dearest first). The pool goes dearest first, as in LPT (a displaced
   sample is cheaper than the one placed, so none moves twice), but home samples stay where
   they fit;
4. polish: while it lowers the largest load, the most loaded rank hands its sample closest to
   half the gap to the least loaded rank.
Where that ends more than LPT_CHECK above the lower bound (coarse inputs: few samples, or a
bound out of reach), LPT's own plan is computed and taken if better, its bins relabelled so
that most bytes stay home. A plan whose largest load is not below the input's moves nothing.

Ranks of unequal speed (`speeds`: a busy or throttled device, a slower GPU model): the objective
is the largest load / speed (the rank that finishes last), the target max(total / Σ speed,
largest sample / fastest speed) with speeds scaled to mean 1, each rank's share of it in cost
its speed times that; the phases above compare each rank's load with its own share, and a
sample placed goes to the rank that would finish it first ((load + cost) / speed). Where that
ends more than SPEEDS_CHECK above the bound, the plan on load alone is checked and taken if its
last rank finishes sooner. Equal speeds plan exactly as none.

Determinism: every order is a sort on distinct integer keys (or a stable sort), so any NumPy
build on any CPU gives the same plan.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["CostModel", "RebalancePlan", "plan_rebalance", "lpt_bins"]


@dataclass(frozen=True)
class CostModel:
    """cost(L) = quadratic·L² + linear·L + constant, in any unit (FLOPs, seconds)."""

    quadratic: float = 1.0
    linear: float = 0.0
    constant: float = 0.0

    def __post_init__(self) -> None:
        for name in ("quadratic", "linear", "constant"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"CostModel.{name} must be a real number, got {type(value).__name__} {value!r}")
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {value!r}")
        if self.quadratic == self.linear == self.constant == 0:
            raise ValueError("CostModel needs at least one positive coefficient (all three are 0)")

    def cost(self, lengths: np.ndarray | Sequence[int]) -> np.ndarray:
        """float64 cost of each sample of `lengths` (same shape)."""
        L = np.asarray(lengths, dtype=np.float64)
        with np.errstate(over="ignore"):  # inf past float64's range: plan_rebalance refuses it
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
        if L.size < 2 or not np.all(np.isfinite(t)) or not np.all(np.isfinite(L)) or np.any(L < 0):
            raise ValueError("CostModel.fit needs >= 2 finite timings (seconds) at finite lengths >= 0")
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
    lower_bound: float  # max(mean load, largest sample cost): no plan's max load is below it (with
    # speeds: of load / speed, speeds scaled to mean 1)
    moved_samples: int
    moved_bytes: int  # Σ lengths of moved samples × bytes_per_item
    speeds: np.ndarray | None = None  # float64 [world], mean 1: the speeds planned for (None: equal)

    def _times(self, loads: np.ndarray) -> np.ndarray:
        """Each rank's load, or with speeds load / speed: the time it takes."""
        return loads if self.speeds is None else loads / self.speeds

    @property
    def imbalance_before(self) -> float:
        """Largest over mean of each rank's time (_times)."""
        return _imbalance(self._times(self.loads_before))

    @property
    def imbalance_after(self) -> float:
        return _imbalance(self._times(self.loads_after))


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
        if a.size and int(a.max()) > np.iinfo(np.int64).max:  # (an unsigned array's)
            raise ValueError(f"lengths_per_rank[{r}] has a length above 2**63 - 1 ({int(a.max())})")
        out.append(a.astype(np.int64, copy=False))
    return out


# A sample costing more than this share of the target is "big": placed first, as LPT would.
BIG_SHARE = 1 / 16
# A plan ending more than this (relative) above the lower bound is checked against LPT's, and
# LPT's is taken if better by more than the tolerance: never more than this worse than LPT.
LPT_CHECK = 0.002
# With uneven speeds, a plan ending more than this above the bound is checked against the plan on
# load alone (judged by load / speed) and that one taken if better: never more than this later.
SPEEDS_CHECK = 0.001


def _check_speeds(speeds: object, world: int) -> np.ndarray | None:
    """float64 [world] scaled to mean 1, or None for equal speeds (None, or all alike)."""
    if speeds is None:
        return None
    if hasattr(speeds, "numpy") and callable(speeds.numpy):  # a CPU torch tensor
        speeds = speeds.detach().numpy()
    try:
        a = np.asarray(speeds, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"speeds must be one positive number per rank, got {speeds!r}") from None
    if a.shape != (world,) or not np.isfinite(a).all() or (a <= 0).any():
        raise ValueError(f"speeds must be {world} positive finite numbers, one per rank (relative compute "
                         f"speed: a rank twice as fast takes twice the cost), got {speeds!r}")
    if (a == a[0]).all():
        return None
    return a / (math.fsum(a.tolist()) / world)


def plan_rebalance(lengths_per_rank: Sequence[np.ndarray | Sequence[int]], *, cost_model: CostModel,
                   bytes_per_item: int = 1, tolerance: float = 1e-4,
                   speeds: Sequence[float] | np.ndarray | None = None) -> RebalancePlan:
    """Plans where each rank's samples go (see the module docstring for the method). A max load
    within `tolerance` (relative) of the lower bound is good enough: no sample moves for less.
    speeds: each rank's relative compute speed (cost per second, any unit; None: all equal): the
    plan then evens load / speed."""
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a freescale_comm.planner.CostModel, got {type(cost_model).__name__}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1) (relative slack over the lower bound), got {tolerance!r}")
    if not isinstance(bytes_per_item, (int, np.integer)) or bytes_per_item < 0:
        raise ValueError(f"bytes_per_item must be an int >= 0 (bytes of one embedded item), got {bytes_per_item!r}")
    lengths = _check_lengths(lengths_per_rank)
    world = len(lengths)
    scaled = _check_speeds(speeds, world)
    speed = np.ones(world) if scaled is None else scaled  # load / speed: the time a rank takes
    items = _Items(lengths, cost_model)
    with np.errstate(over="ignore"):
        finite = bool(np.isfinite(items.cost).all()) and bool(np.isfinite(items.cost.sum()))
    if not finite:
        raise ValueError(f"{cost_model} puts these samples' costs past float64's range (longest: "
                         f"{int(items.length.max(initial=0))} items); scale its coefficients down (any unit will do)")
    before = items.loads(items.home)
    bound = max(math.fsum(before.tolist()) / math.fsum(speed.tolist()), float(items.cost.max(initial=0.0)) / speed.max())

    def peak_of(holder: np.ndarray) -> float:
        return float((items.loads(holder) / speed).max())

    holder = items.home
    peak_before = peak_of(holder)
    if world > 1 and peak_before > bound * (1 + tolerance):
        planned = _Planner(items, bound, tolerance, speed).run()
        peak = peak_of(planned)
        if peak > bound * (1 + LPT_CHECK):  # the bound may be out of reach; LPT may do better
            lpt = lpt_placement(items.cost, items.home, items.length, world)
            peak_lpt = peak_of(lpt)
            if peak_lpt * (1 + tolerance) < peak:
                planned, peak = lpt, peak_lpt
        if scaled is not None and peak > bound * (1 + SPEEDS_CHECK):  # (coarse inputs: the phases' choices
            # for uneven speeds can end behind the load-only plan's)
            blind = np.concatenate(plan_rebalance(lengths, cost_model=cost_model, bytes_per_item=bytes_per_item,
                                                  tolerance=tolerance).dest)
            peak_blind = peak_of(blind)
            if peak_blind < peak:
                planned, peak = blind, peak_blind
        if peak < peak_before:  # never worse: otherwise nothing moves
            holder = planned
    after = items.loads(holder)
    moved = holder != items.home
    return RebalancePlan(
        dest=[a.copy() for a in np.split(holder, items.starts[1:-1])],
        loads_before=before,
        loads_after=after,
        lower_bound=bound,
        moved_samples=int(moved.sum()),
        moved_bytes=int(items.length[moved].sum()) * bytes_per_item,
        speeds=scaled,
    )


class _Items:
    """Every rank's samples in one flat array, rank by rank: length, cost, home rank."""

    def __init__(self, lengths: list[np.ndarray], cost_model: CostModel) -> None:
        self.world = len(lengths)
        sizes = np.array([L.size for L in lengths], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [world + 1]
        self.length = np.concatenate(lengths) if sizes.sum() else np.zeros(0, dtype=np.int64)
        self.cost = cost_model.cost(self.length)
        self.home = np.repeat(np.arange(self.world, dtype=np.int64), sizes)
        self._span = int(self.length.max(initial=0)) + 1  # sort keys: lengths are below it
        self._n = max(int(self.length.size), 1)            # sort keys: indices are below it

    def loads(self, holder: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """float64 [world]: the cost each rank holds (of the masked samples). Sequential sums:
        the same bits on every machine."""
        if mask is None:
            return np.bincount(holder, weights=self.cost, minlength=self.world)
        return np.bincount(holder[mask], weights=self.cost[mask], minlength=self.world)

    def ordered(self, idx: np.ndarray, *, by_rank: bool, dearest_first: bool) -> np.ndarray:
        """idx ordered by (home rank if by_rank, length, index), length descending or ascending.
        Cost never falls as length grows, so this is also a cost order. Keys are distinct
        integers, so every sort algorithm gives this one order."""
        L = self.length[idx]
        home = self.home[idx] if by_rank else np.zeros_like(idx)
        if (self.world if by_rank else 1) * self._span * self._n >= 2**62:  # no room for one integer key
            return idx[np.lexsort((idx, -L if dearest_first else L, home))]
        return idx[np.argsort((home * self._span + (self._span - 1 - L if dearest_first else L)) * self._n + idx)]


def _within_rank_prefix(order: np.ndarray, items: _Items, room: np.ndarray) -> np.ndarray:
    """For `order` grouped by rank: True for the samples whose running cost, counted from the
    start of their rank's group, stays within room[rank]. Zero-cost samples are never taken."""
    if order.size == 0:
        return np.zeros(0, dtype=bool)
    c = items.cost[order]
    r = items.home[order]
    cum = np.cumsum(c)
    group_start = np.searchsorted(r, r, side="left")
    within = cum - (cum - c)[group_start]
    return (within <= room[r]) & (c > 0)


class _Planner:
    """The four phases of the module docstring over flat arrays; run() returns the holder of
    every sample (int64 [n]). target: the time every rank should finish by (a load at speed 1);
    speed: float64 [world], mean 1 (all 1.0: equal speeds, where a time is a load)."""

    def __init__(self, items: _Items, target: float, tolerance: float, speed: np.ndarray) -> None:
        self.items = items
        self.bound = target * speed  # float64 [world]: each rank's target load
        self.slack = self.bound * tolerance
        self.good = self.bound + self.slack
        self.good_time = target + target * tolerance
        self.speed = speed
        self.holder = items.home.copy()
        self.big = items.cost > BIG_SHARE * target

    def run(self) -> np.ndarray:
        loads = self._settle_big()
        pool, held = self._shed(loads)
        self._fill(pool, held, loads)
        _polish(self.items.cost, self.holder, loads, self.good_time, self.speed)
        return self.holder

    def _settle_big(self) -> np.ndarray:
        """Phase 1; returns every rank's load (big ones as placed, small ones at home)."""
        items = self.items
        big = np.flatnonzero(self.big)
        order = items.ordered(big, by_rank=True, dearest_first=True)
        keep = _within_rank_prefix(order, items, self.good)
        big_load = np.bincount(items.home[order[keep]], weights=items.cost[order[keep]], minlength=items.world)
        ranks = _FirstToFinish(big_load, self.speed)
        over = items.ordered(order[~keep], by_rank=False, dearest_first=True)
        for i, c in zip(over.tolist(), items.cost[over].tolist()):
            r = ranks.take(c)
            self.holder[i] = r
            ranks.put(r, float(big_load[r]) + c)
        return self.items.loads(self.holder)

    def _shed(self, loads: np.ndarray) -> tuple[list[tuple[float, int]], "_HeldSmall"]:
        """Phase 2: the shed samples as a heap of (-cost, index); updates loads."""
        items = self.items
        small = np.flatnonzero(~self.big)
        order = items.ordered(small, by_rank=True, dearest_first=True)
        excess = np.where(loads > self.good, loads - self.bound, 0.0)  # a rank within tolerance sheds nothing
        take = _within_rank_prefix(order, items, excess)
        shed = order[take]
        is_shed = np.zeros(items.cost.size, dtype=bool)
        is_shed[shed] = True
        loads -= items.loads(items.home, is_shed)
        held = _HeldSmall(items, small[~is_shed[small] & (items.cost[small] > 0)])  # cost 0: never moves
        pool = list(zip((-items.cost[shed]).tolist(), shed.tolist()))
        for r in np.flatnonzero(loads > self.good).tolist():
            rest = float(loads[r]) - float(self.bound[r])
            while rest > self.slack[r]:
                taken = held.take_dearest_within(r, rest)  # the dearest that still fits the rest
                if taken is None:
                    break
                pool.append((-taken[0], taken[1]))
                rest -= taken[0]
            if rest > self.slack[r]:
                taken = held.take_cheapest(r)  # all left cost more than the rest: the cheapest covers it
                if taken is not None:
                    pool.append((-taken[0], taken[1]))
                    rest -= taken[0]
            loads[r] = self.bound[r] + rest
        heapq.heapify(pool)
        return pool, held

    def _fill(self, pool: list[tuple[float, int]], held: "_HeldSmall", loads: np.ndarray) -> None:
        """Phase 3: dearest first to the least loaded rank, which displaces cheaper samples of its
        own if it would end above the target. A placed sample is never displaced (only cheaper
        ones are, and they come later), so every sample moves at most once."""
        bound, good = self.bound.tolist(), self.good.tolist()
        ranks = _FirstToFinish(loads, self.speed)
        while pool:
            neg_cost, i = heapq.heappop(pool)
            r = ranks.take(-neg_cost)
            new = float(loads[r]) - neg_cost
            if new > good[r]:
                for c, j in held.displace(r, need=new - bound[r], below=-neg_cost):
                    new -= c
                    heapq.heappush(pool, (-c, j))
            self.holder[i] = r
            ranks.put(r, new)


class _FirstToFinish:
    """Which rank takes a sample of cost c: the one that would finish it first, argmin of
    (load + c) / speed. At equal speeds that is the least loaded (lowest rank on ties), kept in a
    heap; else every rank is looked at (O(world) per sample). `loads` (float64 [world]) is
    updated in place by put()."""

    def __init__(self, loads: np.ndarray, speed: np.ndarray) -> None:
        self.loads = loads
        self.speed = None if bool((speed == 1.0).all()) else speed
        if self.speed is None:
            self.heap = list(zip(loads.tolist(), range(loads.size)))
            heapq.heapify(self.heap)

    def take(self, cost: float) -> int:
        """The rank for a sample of `cost` (at equal speeds, off the heap until put() back)."""
        if self.speed is None:
            return heapq.heappop(self.heap)[1]
        return int(np.argmin((self.loads + cost) / self.speed))

    def put(self, r: int, load: float) -> None:
        """Rank r (just taken) now holds `load`."""
        self.loads[r] = load
        if self.speed is None:
            heapq.heappush(self.heap, (load, r))


class _HeldSmall:
    """The small samples each rank still holds at home, cheapest first: parallel lists of cost
    and index, built for a rank when first needed."""

    def __init__(self, items: _Items, idx: np.ndarray) -> None:
        order = items.ordered(idx, by_rank=True, dearest_first=False)
        self._cost = items.cost[order].tolist()
        self._index = order.tolist()
        self._bounds = np.searchsorted(items.home[order], np.arange(items.world + 1)).tolist()
        self._lists: dict[int, tuple[list[float], list[int]]] = {}

    def _of(self, r: int) -> tuple[list[float], list[int]]:
        lists = self._lists.get(r)
        if lists is None:
            a, b = self._bounds[r], self._bounds[r + 1]
            lists = self._lists[r] = (self._cost[a:b], self._index[a:b])
        return lists

    def _pop(self, r: int, j: int) -> tuple[float, int]:
        costs, index = self._of(r)
        return costs.pop(j), index.pop(j)

    def take_dearest_within(self, r: int, budget: float) -> tuple[float, int] | None:
        j = bisect.bisect_right(self._of(r)[0], budget) - 1
        return self._pop(r, j) if j >= 0 else None

    def take_cheapest(self, r: int) -> tuple[float, int] | None:
        return self._pop(r, 0) if self._of(r)[0] else None

    def displace(self, r: int, need: float, below: float) -> list[tuple[float, int]]:
        """Samples of r strictly cheaper than `below` freeing `need`: the cheapest single one that
        covers it, else the dearest first until covered (or none left)."""
        costs = self._of(r)[0]
        k = bisect.bisect_left(costs, below)
        j = bisect.bisect_left(costs, need, 0, k)
        if j < k:
            return [self._pop(r, j)]
        out: list[tuple[float, int]] = []
        freed = 0.0
        while k > 0 and freed < need:
            k -= 1
            out.append(self._pop(r, k))
            freed += out[-1][0]
        return out


def _polish(cost: np.ndarray, holder: np.ndarray, loads: np.ndarray, good_enough: float,
            speed: np.ndarray, max_steps: int | None = None) -> None:
    """Phase 4: moves single samples from the slowest to finish (load / speed) to the first to
    finish while the latest finish is above good_enough (a time) and a move lowers it. At equal
    speeds each move strictly lowers Σ load², so it cannot cycle; at most max_steps moves."""
    world = loads.size
    max_steps = 8 * world if max_steps is None else max_steps
    for _ in range(max_steps):
        times = loads / speed
        hi = int(np.argmax(times))
        lo = int(np.argmin(times))
        # a sample of cost c moved hi -> lo lowers the pair's latest finish iff c < limit; the pair
        # finishes together at c = even ((loads[hi] - c) / s_hi == (loads[lo] + c) / s_lo)
        limit = loads[hi] * speed[lo] / speed[hi] - loads[lo]
        if limit <= 0 or times[hi] <= good_enough:
            return
        even = (loads[hi] * speed[lo] - loads[lo] * speed[hi]) / (speed[hi] + speed[lo])
        held = np.flatnonzero(holder == hi)
        c = cost[held]
        useful = (c > 0) & (c < limit)
        if not useful.any():
            return
        # Closest to where the pair finishes together: the new max of the pair is as low as it gets.
        best = held[useful][np.argmin(np.abs(c[useful] - even))]
        holder[best] = lo
        loads[hi] -= cost[best]
        loads[lo] += cost[best]


def lpt_bins(cost: np.ndarray, world: int) -> np.ndarray:
    """Longest Processing Time from scratch: every sample, dearest first (ties: lower index), to
    the least loaded of `world` bins (ties: lower bin). int64 [n]: each sample's bin."""
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    order = np.lexsort((np.arange(cost.size), -cost))
    bins = np.empty(cost.size, dtype=np.int64)
    heap = [(0.0, b) for b in range(world)]
    for i, c in zip(order.tolist(), cost[order].tolist()):
        load, b = heapq.heappop(heap)
        bins[i] = b
        heapq.heappush(heap, (load + c, b))
    return bins


def lpt_placement(cost: np.ndarray, home: np.ndarray, length: np.ndarray, world: int) -> np.ndarray:
    """LPT's bins given to ranks greedily by the bytes (Σ length) that stay home (largest first;
    ties: lower bin, then rank). int64 [n]: each sample's rank."""
    bins = lpt_bins(cost, world)
    pairs, where = np.unique(bins * world + home, return_inverse=True)
    stay = np.bincount(where.ravel(), weights=length.astype(np.float64), minlength=pairs.size)
    rank_of_bin = np.full(world, -1, dtype=np.int64)
    taken = np.zeros(world, dtype=bool)
    for p in pairs[np.lexsort((pairs, -stay))].tolist():
        b, r = divmod(p, world)
        if rank_of_bin[b] < 0 and not taken[r]:
            rank_of_bin[b] = r
            taken[r] = True
    rank_of_bin[rank_of_bin < 0] = np.flatnonzero(~taken)
    return rank_of_bin[bins]

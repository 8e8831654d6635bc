"""freescale-bench planner: balance quality, bytes moved and planning time of freescale's
planner against no balancing, LPT from scratch and Karmarkar–Karp repartition (the anchors),
per workload, over one seed or the worst case of a sweep of seeds.

straggler_pct estimates the idle share of a step whose time is the largest rank load: the mean
over ranks of (max load − load) / max load. Loads come from CostModel.hstu (FLOPs). The "×LPT"
columns compare with LPT on the same batch: max load, bytes moved, plan time. Every method is
timed `repeats` times per batch (median), except KK, timed once: it takes seconds at 1024 ranks
and only anchors balance and bytes.

Slow ranks (`slow_share` of the ranks at `slow_speed`, chosen by the seed: a busy or throttled
device, an older GPU): figures are then of each rank's time, load / speed, against the ideal
total / Σ speed; the anchors and "freescale" plan on load alone, "freescale+speeds" with the
speeds (plan_rebalance's speeds)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np

def _metrics(method: str, lengths: list[np.ndarray], costs: list[np.ndarray], dest: list[np.ndarray],
             bytes_per_item: int, bound: float, plan_s: list[float], speeds: np.ndarray) -> dict[str, Any]:
    """bound: the least time any plan can take (a load at speed 1); speeds: float64 [world]."""
    world = len(costs)
    loads = np.zeros(world)
    for r in range(world):
        np.add.at(loads, dest[r], costs[r])
    times = loads / speeds  # (all 1.0 without slow ranks: the loads themselves)
    mean, peak = loads.sum() / speeds.sum(), times.max()  # mean: the ideal time, every rank finishing together
    moved = [dest[r] != r for r in range(world)]
    return {
        "method": method,
        "imbalance": float(peak / mean),
        "lower_bound": float(bound / mean),
        "straggler_pct": float(100 * np.mean((peak - times) / peak)),
        "moved_samples": int(sum(int(m.sum()) for m in moved)),
        "moved_bytes": int(sum(int(lengths[r][moved[r]].sum()) for r in range(world)) * bytes_per_item),
        "plan_ms": 1e3 * statistics.median(plan_s),
    }


def _versus_lpt(rows: list[dict[str, Any]]) -> None:
    """Adds max load, bytes and plan time relative to LPT's on the same batch."""
    lpt = next(r for r in rows if r["method"] == "lpt")
    for r in rows:
        r["load_vs_lpt"] = r["imbalance"] / lpt["imbalance"]
        r["bytes_vs_lpt"] = r["moved_bytes"] / lpt["moved_bytes"] if lpt["moved_bytes"] else float("nan")
        r["time_vs_lpt"] = r["plan_ms"] / lpt["plan_ms"] if lpt["plan_ms"] > 0 else float("nan")


def slow_ranks(ranks: int, seed: int, slow_share: float, slow_speed: float) -> np.ndarray:
    """float64 [ranks]: 1.0, but `slow_share` of them (at least one if the share is above 0),
    picked by `seed`, at `slow_speed`."""
    speeds = np.ones(ranks)
    if slow_share > 0:
        count = min(ranks, max(1, round(slow_share * ranks)))
        speeds[np.random.default_rng(seed * 7919 + 17).choice(ranks, size=count, replace=False)] = slow_speed
    return speeds


def run(ranks: int, samples: int, workload: str, seed: int, repeats: int, bytes_per_item: int,
        progress: bool, slow_share: float = 0.0, slow_speed: float = 0.5) -> list[dict[str, Any]]:
    """One batch (`workload`, `seed`): a row per method (with slow ranks, "freescale+speeds" too)."""
    from freescale_comm.bench import balancing_baselines, workloads
    from freescale_comm.planner import CostModel, plan_rebalance

    lengths = [workloads.generate(workload, samples, seed=seed * 100003 + r) for r in range(ranks)]
    cm = CostModel.hstu(num_heads=4, attn_dim=128, hidden_dim=128)
    costs = [cm.cost(L) for L in lengths]
    total = sum(float(c.sum()) for c in costs)
    speeds = slow_ranks(ranks, seed, slow_share, slow_speed)
    bound = max(total / speeds.sum(), max(float(c.max()) for c in costs if c.size) / speeds.max())

    def ours() -> list[np.ndarray]:
        return plan_rebalance(lengths, cost_model=cm, bytes_per_item=bytes_per_item).dest

    planners: dict[str, Callable[[], list[np.ndarray]]] = {
        "none": lambda: balancing_baselines.none(costs),
        "lpt": lambda: balancing_baselines.lpt(costs),
        "kk": lambda: balancing_baselines.kk(costs),
        "freescale": ours,
    }
    if slow_share > 0:
        planners["freescale+speeds"] = lambda: plan_rebalance(lengths, cost_model=cm, bytes_per_item=bytes_per_item,
                                                              speeds=speeds).dest
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(planners), desc=f"planner {workload} seed {seed}", unit="method", leave=False)
    rows = []
    for method in planners:
        times, dest = [], None
        for _ in range(1 if method == "kk" else repeats):
            t0 = time.perf_counter()
            dest = planners[method]()
            times.append(time.perf_counter() - t0)
        rows.append(_metrics(method, lengths, costs, dest, bytes_per_item, bound, times, speeds))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    _versus_lpt(rows)
    for r in rows:
        r.update(workload=workload, seed=seed)
    return rows


def worst_over_seeds(per_seed: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per method: the worst of each figure over the seeds (and the mean imbalance)."""
    out = []
    for i, method in enumerate(r["method"] for r in per_seed[0]):
        rows = [seed_rows[i] for seed_rows in per_seed]
        assert all(r["method"] == method for r in rows)
        worst = {"method": method, "workload": rows[0]["workload"], "seeds": len(rows),
                 "mean_imbalance": float(np.mean([r["imbalance"] for r in rows]))}
        for key in ("imbalance", "lower_bound", "straggler_pct", "moved_samples", "moved_bytes", "plan_ms",
                    "load_vs_lpt", "bytes_vs_lpt", "time_vs_lpt"):
            values = [r[key] for r in rows if r[key] == r[key]]  # NaN (no LPT bytes) left out
            worst[key] = max(values) if values else float("nan")
        out.append(worst)
    return out


def table(rows: list[dict[str, Any]], title: str) -> str:
    """rows: one batch's (run) or a sweep's worst cases (worst_over_seeds)."""
    header = (f"{'workload':<11} {'method':<16} {'imbalance':>9} {'bound':>7} {'straggler%':>10} {'moved':>7} "
              f"{'moved MiB':>10} {'plan_ms':>9} {'load×LPT':>9} {'bytes×LPT':>9} {'time×LPT':>8}")
    lines = [f"# {title}", header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['workload']:<11} {r['method']:<16} {r['imbalance']:>9.4f} {r['lower_bound']:>7.4f} "
                     f"{r['straggler_pct']:>10.2f} {r['moved_samples']:>7d} {r['moved_bytes'] / 2**20:>10.1f} "
                     f"{r['plan_ms']:>9.2f} {r['load_vs_lpt']:>9.5f} {r['bytes_vs_lpt']:>9.3f} {r['time_vs_lpt']:>8.2f}")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """One line per workload: freescale against LPT and KK (a sweep: each figure's worst case)."""
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        by = {r["method"]: r for r in rows if r["workload"] == workload}
        ours = by["freescale"]
        lines.append(f"# {workload}: freescale imbalance {ours['imbalance']:.4f} (lpt {by['lpt']['imbalance']:.4f}, "
                     f"kk {by['kk']['imbalance']:.4f}); max load {ours['load_vs_lpt']:.5f}× LPT's, "
                     f"{100 * ours['bytes_vs_lpt']:.1f}% of LPT's bytes, planned in {ours['plan_ms']:.2f} ms "
                     f"({ours['time_vs_lpt']:.2f}× LPT's time)")
        fast = by.get("freescale+speeds")
        if fast is not None:
            lines.append(f"# {workload}, slow ranks: the last rank finishes at {fast['imbalance']:.4f}x the ideal "
                         f"planning with their speeds, {ours['imbalance']:.4f}x on load alone "
                         f"(lpt {by['lpt']['imbalance']:.4f}x, none {by['none']['imbalance']:.4f}x); "
                         f"{fast['moved_samples']} samples moved against {ours['moved_samples']}")
    return "\n".join(lines)

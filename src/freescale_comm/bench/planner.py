"""freescale-bench planner: balance quality, bytes moved and planning time of freescale's
planner against no balancing, LPT from scratch and Karmarkar–Karp repartition (the anchors).

straggler_pct estimates the idle share of a step whose time is the largest rank load: the mean
over ranks of (max load − load) / max load. Loads come from CostModel.hstu (FLOPs)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np

METHODS = ("none", "lpt", "kk", "freescale")


def _metrics(method: str, lengths: list[np.ndarray], costs: list[np.ndarray], dest: list[np.ndarray],
             bytes_per_item: int, bound: float, plan_s: list[float]) -> dict[str, Any]:
    world = len(costs)
    loads = np.zeros(world)
    for r in range(world):
        np.add.at(loads, dest[r], costs[r])
    mean, peak = loads.mean(), loads.max()
    moved = [dest[r] != r for r in range(world)]
    return {
        "method": method,
        "imbalance": float(peak / mean),
        "lower_bound": float(bound / mean),
        "straggler_pct": float(100 * np.mean((peak - loads) / peak)),
        "moved_samples": int(sum(int(m.sum()) for m in moved)),
        "moved_bytes": int(sum(int(lengths[r][moved[r]].sum()) for r in range(world)) * bytes_per_item),
        "plan_ms": 1e3 * statistics.median(plan_s),
    }


def run(ranks: int, samples: int, workload: str, seed: int, repeats: int, bytes_per_item: int,
        progress: bool) -> list[dict[str, Any]]:
    from freescale_comm.bench import balancing_baselines, workloads
    from freescale_comm.planner import CostModel, plan_rebalance

    lengths = [workloads.generate(workload, samples, seed=seed * 100003 + r) for r in range(ranks)]
    cm = CostModel.hstu(num_heads=4, attn_dim=128, hidden_dim=128)
    costs = [cm.cost(L) for L in lengths]
    total = sum(float(c.sum()) for c in costs)
    bound = max(total / ranks, max(float(c.max()) for c in costs if c.size))

    def ours() -> list[np.ndarray]:
        return plan_rebalance(lengths, cost_model=cm, bytes_per_item=bytes_per_item).dest

    planners: dict[str, Callable[[], list[np.ndarray]]] = {
        "none": lambda: balancing_baselines.none(costs),
        "lpt": lambda: balancing_baselines.lpt(costs),
        "kk": lambda: balancing_baselines.kk(costs),
        "freescale": ours,
    }
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(METHODS) * repeats, desc="planner", unit="plan", leave=False)
    rows = []
    for method in METHODS:
        times, dest = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            dest = planners[method]()
            times.append(time.perf_counter() - t0)
            if bar is not None:
                bar.update(1)
        rows.append(_metrics(method, lengths, costs, dest, bytes_per_item, bound, times))
    if bar is not None:
        bar.close()
    return rows


def table(rows: list[dict[str, Any]], title: str) -> str:
    header = (f"{'method':<10} {'imbalance':>9} {'bound':>7} {'straggler%':>10} {'moved':>7} "
              f"{'moved MiB':>10} {'plan_ms':>9}")
    lines = [f"# {title}", header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['method']:<10} {r['imbalance']:>9.4f} {r['lower_bound']:>7.4f} {r['straggler_pct']:>10.2f} "
                     f"{r['moved_samples']:>7d} {r['moved_bytes'] / 2**20:>10.1f} {r['plan_ms']:>9.2f}")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    by = {r["method"]: r for r in rows}
    ours, kk = by["freescale"], by["kk"]
    share = ours["moved_bytes"] / kk["moved_bytes"] if kk["moved_bytes"] else float("nan")
    return (f"# freescale: imbalance {ours['imbalance']:.4f} (kk {kk['imbalance']:.4f}, lpt {by['lpt']['imbalance']:.4f}), "
            f"moving {100 * share:.1f}% of kk's bytes, planned in {ours['plan_ms']:.2f} ms")

"""freescale-bench microbatch: distinct ids the micro-batches of one rank's batch send (summed
over their AllToAlls), relative to the whole batch's, for fc.microbatch's key-centric clustering
against a random split and contiguous chunks (what splitting a batch in order does), on two id
workloads:
  interests  each sample reads from one of `groups` interest pools (Zipf within the pool): the
             locality clustering is for (users with shared tastes, sessions of one user);
  zipf       every sample reads the same global Zipf popularity: no locality to find.
Lengths: kuairand x `scale` (as freescale-bench e2e), at least 1. CPU (NumPy and the compiled
core's placement pass); plan time is wall time of one split (median of `repeats`)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import numpy as np

from freescale_comm.bench import workloads
from freescale_comm.microbatch import cluster_microbatches, distinct_ids

WORKLOADS = ("interests", "zipf")
SPLITS = ("clustered", "random", "contiguous")


def batch_ids(workload: str, samples: int, seed: int, scale: float = 1 / 64, rows: int = 1_000_000,
              groups: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [Σ lengths], lengths int64 [samples]) of one rank's batch."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    gen = np.random.default_rng(seed)
    lengths = workloads.scale_lengths(workloads.kuairand(samples, seed=seed), scale).astype(np.int64)
    popularity = gen.zipf(1.2, int(lengths.sum())) - 1
    if workload == "zipf":
        return popularity % rows, lengths
    pool = rows // groups
    interest = np.repeat(gen.integers(0, groups, samples), lengths)
    return interest * pool + popularity % pool, lengths


def run(workload_names: Sequence[str], samples: int, micro_batches: Sequence[int], seed: int, repeats: int,
        scale: float) -> list[dict[str, Any]]:
    """One row per (workload, micro-batches, split): distinct ids sent, that over the whole batch's,
    the largest micro-batch cost over the mean, plan ms (clustered only)."""
    rows = []
    for name in workload_names:
        ids, lengths = batch_ids(name, samples, seed, scale)
        whole = int(np.unique(ids).size)
        cost = lengths.astype(np.float64) ** 2  # attention-like cost
        for m in micro_batches:
            times, plan = [], None
            for _ in range(repeats):
                start = time.perf_counter()
                plan = cluster_microbatches(ids, lengths, m, cost)
                times.append((time.perf_counter() - start) * 1e3)
            splits = {"clustered": plan.micro_batch,
                      "random": np.random.default_rng(seed + m).integers(0, m, samples),
                      "contiguous": np.arange(samples) * m // samples}
            for split, where in splits.items():
                loads = np.bincount(where, weights=cost, minlength=m)
                sent = distinct_ids(ids, lengths, where)
                rows.append({"workload": name, "micro_batches": m, "split": split, "distinct_ids": sent,
                             "whole_batch_ids": whole, "ratio": sent / whole, "max_over_mean_cost": loads.max() / loads.mean(),
                             "plan_ms": statistics.median(times) if split == "clustered" else None})
    return rows


def table(rows: Sequence[dict[str, Any]], title: str) -> str:
    lines = [f"# {title}", f"{'workload':<11}{'M':>3}  {'split':<11}{'distinct ids':>13}{'x whole':>9}{'max/mean cost':>15}"
             f"{'plan ms':>9}"]
    for r in rows:
        plan = f"{r['plan_ms']:>9.1f}" if r["plan_ms"] is not None else f"{'':>9}"
        lines.append(f"{r['workload']:<11}{r['micro_batches']:>3}  {r['split']:<11}{r['distinct_ids']:>13}"
                     f"{r['ratio']:>9.2f}{r['max_over_mean_cost']:>15.2f}{plan}")
    return "\n".join(lines)

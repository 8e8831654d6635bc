"""freescale-bench simulate --nestpipe: fc.TrainPipelinePEC's modes (TorchRec-like synchronous
steps, PEC, NestPipe's dual buffers, frozen-window micro-batches, and all of it with balancing) at
scale, in simulated time: an analytic model of one steady-state step, not a measurement.

Per rank r: compute C[r, m] = the cost model over its samples, cut into M micro-batches (M = 1 for
whole batches); each AllToAll takes latency + the busiest rank's bytes × (W-1)/W / bandwidth (ids
uniform over the owners, as `simulate`). Of each batch's rows a share c (the collision rate) was
read by the batch before and must wait for its update.
- sync: ids, rows, compute, gradients, one after another, every wait exposed.
- the rows that wait for the last update (all of them with prefetch "ids"; the share c with
  "pec" and "dual_buffer") move one round per micro-batch on one fabric, in order: round 0 is
  exposed, round m+1 runs while micro-batch m computes (a rank starts micro-batch m+1 once it
  finished m and round m+1 is done).
- the gradients that go first (all with "ids", the share c otherwise) leave per micro-batch as it
  finishes (after every rank finished it, on the fabric after the rows rounds); the step waits for
  the last. The rest (deferred gradients) and the early rows ("pec": the share 1-c; "dual_buffer":
  all rows, the c share again as refresh) move under the next step's compute: only what exceeds the
  shortest rank's compute shows.
- then the dense all-reduce; with balance, the lengths' all-gather, the plan and the sample move
  before the step (as `simulate`'s balance modes).
Scaling efficiency = the mean rank's compute / the step (1.0: every rank computes all the time).
Each micro-batch is charged its share of the batch's rows, as fc.TrainPipelinePEC moves them (a row
several micro-batches read moves once, with the first, and its gradient once, with the last; only
the ids message names a row once per micro-batch reading it: 8 bytes, not modelled).
Not modelled: per-micro-batch fixed costs (kernel launches, a smaller batch's lower efficiency), the
owners' lookups and updates, how unevenly the rows fall on the micro-batches (the first ones,
which move the rows they share with later ones, carry more)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freescale_comm.bench import workloads
from freescale_comm.bench.simulate import SimParams, _balanced

__all__ = ["NestMode", "NESTPIPE_MODES", "simulate_step", "run"]


@dataclass(frozen=True)
class NestMode:
    prefetch: str  # "none" (sync) | "ids" | "pec" | "dual_buffer"
    micro_batches: int = 1
    balance: bool = False


NESTPIPE_MODES: dict[str, NestMode] = {
    "sync": NestMode("none"),
    "pec": NestMode("pec"),
    "dbp": NestMode("dual_buffer"),
    "fwp1": NestMode("ids"),
    "fwp2": NestMode("ids", 2),
    "fwp4": NestMode("ids", 4),
    "fwp8": NestMode("ids", 8),
    "nestpipe": NestMode("pec", 4, balance=True),
}


def _a2a(p: SimParams, items: np.ndarray, item_bytes: float) -> float:
    """Seconds of one AllToAll moving items[r] items per rank r."""
    busiest = max(float(items.max()), float(items.mean())) if items.size else 0.0
    return p.latency_us * 1e-6 + busiest * (p.ranks - 1) / p.ranks * item_bytes / (p.bandwidth_gbps * 1e9)


def simulate_step(p: SimParams, mode: NestMode, home: list[np.ndarray], collision: float) -> dict[str, float]:
    """One steady-state step of `mode` (home[r]: rank r's sample lengths): its seconds, the mean
    and largest rank compute, and the scaling efficiency."""
    W, M = p.ranks, mode.micro_batches
    per_rank, t = home, 0.0
    if mode.balance:
        per_rank, moved = _balanced(p, home)
        gather = _a2a(p, np.full(W, p.samples), 8)
        t += gather + p.plan_us_per_sample * 1e-6 * W * p.samples + _a2a(p, moved, p.id_bytes)
    chunks = [np.array_split(x, M) for x in per_rank]
    cost = np.array([[p.cost_model.cost(c).sum() if c.size else 0.0 for c in rank] for rank in chunks])  # [W, M] s
    items = np.array([[c.sum() for c in rank] for rank in chunks], dtype=np.float64)  # [W, M]
    compute = cost.sum(axis=1)
    late = 1.0 if mode.prefetch in ("none", "ids") else collision  # rows that wait for the last update
    first = 1.0 if mode.prefetch in ("none", "ids") else collision  # gradients that go before the next fetch
    early = {"none": 0.0, "ids": 0.0, "pec": 1.0 - collision, "dual_buffer": 1.0}[mode.prefetch]
    if mode.prefetch == "none":
        t += _a2a(p, items.sum(axis=1), p.id_bytes)  # the ids, exposed
    # under the step's compute: the next step's early rows and this step's deferred gradients
    hidden = _a2a(p, early * items.sum(axis=1), p.bytes_per_item) if early else 0.0
    hidden += _a2a(p, (1.0 - first) * items.sum(axis=1), p.bytes_per_item) if first < 1.0 else 0.0
    t += max(0.0, hidden - float(compute.min()))
    rounds = [_a2a(p, late * items[:, m], p.bytes_per_item) for m in range(M)]
    rows_done = t + np.cumsum(rounds)  # rows rounds back to back on the fabric, from the step's start
    clock = np.full(W, float(rows_done[0]))  # round 0 exposed
    fabric = float(rows_done[-1])
    for m in range(M):
        start = np.maximum(clock, rows_done[m])
        clock = start + cost[:, m]
        # micro-batch m's gradients that go first: once every rank finished m, after the rows rounds
        fabric = max(fabric, float(clock.max())) + _a2a(p, first * items[:, m], p.bytes_per_item)
    reduce_s = p.latency_us * 1e-6 + 2 * (W - 1) / W * p.dense_bytes / (p.bandwidth_gbps * 1e9)
    step = max(fabric, float(clock.max())) + reduce_s
    return {"step_s": step, "compute_s": float(compute.mean()), "max_compute_s": float(compute.max()),
            "efficiency": float(compute.mean()) / step}


def run(p: SimParams, modes: list[str], collision: float) -> list[dict]:
    """One row per mode: the mean over p.steps steps (simulated seconds as ms)."""
    if not 0.0 <= collision <= 1.0:
        raise ValueError(f"collision must be in [0, 1], got {collision}")
    unknown = [m for m in modes if m not in NESTPIPE_MODES]
    if unknown:
        raise ValueError(f"unknown NestPipe modes {unknown}; choose from {list(NESTPIPE_MODES)}")
    rows = []
    for name in modes:
        steps = []
        for step in range(p.steps):
            home = [workloads.step_lengths(p.workload, p.samples, seed=p.seed, step=step, rank=r, scale=p.length_scale)
                    for r in range(p.ranks)]
            steps.append(simulate_step(p, NESTPIPE_MODES[name], home, collision))
        rows.append({"mode": name, "ranks": p.ranks, "collision_rate": collision,
                     "step_ms": 1e3 * float(np.mean([s["step_s"] for s in steps])),
                     "compute_ms": 1e3 * float(np.mean([s["compute_s"] for s in steps])),
                     "max_compute_ms": 1e3 * float(np.mean([s["max_compute_s"] for s in steps])),
                     # the slowest rank's time not computing: exposed communication (and balancing)
                     "exposed_ms": 1e3 * float(np.mean([s["step_s"] - s["max_compute_s"] for s in steps])),
                     "scaling_efficiency": float(np.mean([s["efficiency"] for s in steps]))})
    return rows


def table(rows: list[dict], title: str) -> str:
    lines = [f"# {title}", f"{'mode':<10}{'ranks':>7}{'step_ms':>10}{'compute':>10}{'max_comp':>10}{'exposed':>10}"
             f"{'scaling eff.':>14}"]
    for r in rows:
        lines.append(f"{r['mode']:<10}{r['ranks']:>7}{r['step_ms']:>10.2f}{r['compute_ms']:>10.2f}"
                     f"{r['max_compute_ms']:>10.2f}{r['exposed_ms']:>10.2f}{r['scaling_efficiency']:>14.1%}")
    return "\n".join(lines)

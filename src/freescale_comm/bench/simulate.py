"""freescale-bench simulate: the e2e step at scale (up to thousands of ranks), in simulated time.

The same stages, modes and records as `freescale_comm.bench.e2e`, with times from models instead
of clocks (docs/simulator.md writes the model up):
- compute: a CostModel (seconds of forward + backward per sample of L items), fitted from a
  measured run (`--calibration e2e.json`) or HSTU FLOPs at an assumed throughput;
- a collective takes latency + the busiest rank's bytes / bandwidth; ids are uniform over the
  row owners, so an owner serves the mean number of items;
- collectives share one fabric, served by priority (larger first, preemptive: freescale's queue
  cuts transfers into chunks), in issue order among equals; a collective starts once every rank
  issued it;
- a blocked interval is idle until the last rank issued the op, exposed comm after (the rule of
  `timeline.step_breakdown`, which computes the metrics from these records as from measured ones).
Every step starts with the ranks aligned (e2e puts a barrier there).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import numpy as np

from freescale_comm.bench import workloads
from freescale_comm.bench.e2e_config import EMBEDDING_PRIORITY, GRADIENT_PRIORITY, PREFETCH_PRIORITY, Mode
from freescale_comm.bench.e2e_config import MODES as E2E_MODES
from freescale_comm.bench.timeline import Blocked, Busy, OpSeen, StepWindow, Timeline, mode_metrics
from freescale_comm.planner import CostModel, plan_rebalance

# The step model does not simulate PEC (collision rows) yet: those modes are measured by e2e only.
MODES = {name: mode for name, mode in E2E_MODES.items() if not mode.pec}

__all__ = ["MODES", "SimParams", "h100_hstu_cost_model", "simulate_mode", "run", "fabric_schedule"]


def h100_hstu_cost_model(layers: int = 4, num_heads: int = 4, attn_dim: int = 128, hidden_dim: int = 128,
                         flops_per_s: float = 300e12) -> CostModel:
    """Seconds of forward + backward per sample: HSTU FLOPs (CostModel.hstu) of `layers` layers at
    `flops_per_s` sustained (an assumption, ~30% of an H100's dense bf16 peak; not a measurement)."""
    per_layer = CostModel.hstu(num_heads, attn_dim, hidden_dim)
    scale = layers / flops_per_s
    return CostModel(per_layer.quadratic * scale, per_layer.linear * scale, per_layer.constant * scale)


@dataclass(frozen=True)
class SimParams:
    ranks: int = 256
    samples: int = 64  # per rank and step
    workload: str = "kuairand"
    length_scale: float = 1.0
    steps: int = 3
    seed: int = 0
    modes: tuple[str, ...] = tuple(MODES)
    cost_model: CostModel = field(default_factory=h100_hstu_cost_model)  # seconds per sample
    groups: int = 4  # pipeline groups of the overlapped modes (as e2e)
    bandwidth_gbps: float = 50.0  # per rank, each direction, GB/s (400 Gb/s NIC per GPU)
    latency_us: float = 20.0  # per collective
    bytes_per_item: int = 512  # one embedded item on the wire (dim 256, bf16)
    id_bytes: int = 8
    lookup_ns_per_item: float = 1.0  # owner-side gather (lookup) or scatter-add (update) of one row
    dense_bytes: int = 16 << 20  # dense gradients all-reduced every step
    plan_us_per_sample: float = 0.5  # planner CPU time per sample of the world (measured: planner bench)

    def check(self) -> None:
        if self.ranks < 2 or self.samples < 1 or self.steps < 1 or self.groups < 1:
            raise ValueError("need ranks >= 2, samples >= 1, steps >= 1, groups >= 1")
        if self.workload not in workloads.WORKLOADS:
            raise ValueError(f"workload must be one of {sorted(workloads.WORKLOADS)}")
        rates = (self.bandwidth_gbps, self.latency_us, self.lookup_ns_per_item, self.plan_us_per_sample)
        if not all(math.isfinite(x) for x in rates) or self.bandwidth_gbps <= 0 or self.latency_us < 0 or \
                self.lookup_ns_per_item < 0 or self.plan_us_per_sample < 0:
            raise ValueError("need finite bandwidth_gbps > 0, latency_us >= 0, lookup_ns_per_item >= 0 and "
                             "plan_us_per_sample >= 0")
        if self.bytes_per_item < 1 or self.id_bytes < 1 or self.dense_bytes < 0:
            raise ValueError("need bytes_per_item and id_bytes >= 1, dense_bytes >= 0")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"modes must be a non-empty subset of {list(MODES)} (got {list(self.modes)})")


def fabric_schedule(ready: Sequence[float], duration: Sequence[float], priority: Sequence[int]) -> np.ndarray:
    """Completion time of each op on one fabric: at any moment the ready op of highest priority
    runs (preemptively; among equals, the one listed first). Lower-priority ops never delay
    higher ones."""
    n = len(ready)
    left = np.asarray(duration, dtype=np.float64).copy()
    ready_a = np.asarray(ready, dtype=np.float64)
    if not (np.isfinite(left).all() and np.isfinite(ready_a).all() and (left >= 0).all()):
        raise ValueError("fabric_schedule needs finite ready times and finite durations >= 0")  # else: no end
    done = np.full(n, np.nan)
    todo = set(range(n))
    t = float(ready_a.min()) if n else 0.0
    while todo:
        avail = [i for i in todo if ready_a[i] <= t]
        if not avail:
            t = min(ready_a[i] for i in todo)
            continue
        cur = min(avail, key=lambda i: (-priority[i], i))
        # Runs until done or until a higher-priority op becomes ready.
        nxt = [ready_a[i] for i in todo if ready_a[i] > t and priority[i] > priority[cur]]
        until = min(nxt) if nxt else np.inf
        if t + left[cur] <= until:
            t += left[cur]
            left[cur] = 0.0
            done[cur] = t
            todo.discard(cur)
        else:
            left[cur] -= until - t
            t = until
    return done


class _StepSim:
    """Builds the records of one simulated step, all ranks."""

    def __init__(self, p: SimParams, step: int, t0: float, tl: Timeline) -> None:
        self.p, self.step, self.t0, self.tl = p, step, t0, tl
        self.world = p.ranks
        self.bw = p.bandwidth_gbps * 1e9
        self.lat = p.latency_us * 1e-6
        self.counts: dict[str, int] = {}

    def key(self, name: str) -> str:
        self.counts[name] = self.counts.get(name, 0) + 1
        return f"{name}@{self.step}#{self.counts[name]}"

    def a2a_seconds(self, items_per_rank: np.ndarray, item_bytes: int) -> float:
        """Each rank's items go to owners spread uniformly: the busiest rank sends or receives
        max(max items, mean items) × (world-1)/world items."""
        busiest = max(float(items_per_rank.max()), float(items_per_rank.mean()))
        return self.lat + busiest * (self.world - 1) / self.world * item_bytes / self.bw

    def blocking_all(self, name: str, t: float, seconds: float) -> float:
        """A collective every rank issues at t (aligned): exposed comm for all. Returns its end."""
        k = self.key(name)
        for r in range(self.world):
            self.tl.ops.append(OpSeen(r, self.step, k, t, t + seconds))
            self.tl.blocked.append(Blocked(r, self.step, k, t, t + seconds))
        return t + seconds

    def busy_all(self, name: str, t: float, seconds: float) -> float:
        for r in range(self.world):
            self.tl.busy.append(Busy(r, self.step, name, t, t + seconds))
        return t + seconds


def _balanced(p: SimParams, home: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    """(samples each rank computes, in dispatch order: by source rank, then original order;
    items each rank sends or receives, whichever is more, in the id dispatch)."""
    plan = plan_rebalance(home, cost_model=p.cost_model, bytes_per_item=p.id_bytes)
    flat = np.concatenate(home)
    dest = np.concatenate(plan.dest)
    src = np.concatenate([np.full(h.size, r) for r, h in enumerate(home)])
    order = np.argsort(dest, kind="stable")
    per_rank = np.split(flat[order], np.cumsum(np.bincount(dest, minlength=p.ranks))[:-1])
    moving = dest != src
    sent = np.bincount(src[moving], weights=flat[moving], minlength=p.ranks)
    received = np.bincount(dest[moving], weights=flat[moving], minlength=p.ranks)
    return per_rank, np.maximum(sent, received)


def _simulate_step(p: SimParams, mode: Mode, step: int, t0: float, home: list[np.ndarray], tl: Timeline) -> float:
    """Appends one step's records (starting at t0, ranks aligned); returns the step's end."""
    s = _StepSim(p, step, t0, tl)
    W, t = p.ranks, t0
    per_rank = home
    if mode.balance:
        per_rank, moved_items = _balanced(p, home)
    G = p.groups if mode.overlap else 1
    parts = [np.array_split(x, G) for x in per_rank]  # [rank][group] lengths
    items = np.array([[g.sum() for g in rank] for rank in parts], dtype=np.float64)  # [W, G]
    cost = np.array([[p.cost_model.cost(g).sum() for g in rank] for rank in parts])  # [W, G] seconds
    if mode.balance:  # all-gather lengths, plan, move ids (blocking, ranks aligned)
        gather = s.lat + (W - 1) * p.samples * 8 / s.bw
        plan = p.plan_us_per_sample * 1e-6 * W * p.samples
        if mode.overlap:
            # Planned one step ahead on the host while the device computes the step before:
            # only what exceeds that compute shows (steady state: this step's shortest compute).
            plan = max(0.0, plan - float(cost.sum(axis=1).min()))
        move = s.lat + float(moved_items.max()) * p.id_bytes / s.bw
        t = s.blocking_all("balance", t, gather + plan + move)
    ids_s = [s.a2a_seconds(items[:, g], p.id_bytes) for g in range(G)]
    emb_s = [s.a2a_seconds(items[:, g], p.bytes_per_item) for g in range(G)]
    row_s = items.mean(axis=0) * p.lookup_ns_per_item * 1e-9  # owner work per group (uniform ids)
    reduce_s = s.lat + 2 * (W - 1) / W * p.dense_bytes / s.bw

    t = s.blocking_all("counts", t, s.lat)
    if not mode.overlap:
        t = s.blocking_all("ids", t, ids_s[0])
        t = s.busy_all("lookup", t, float(row_s[0]))
        t = s.blocking_all("embeddings", t, emb_s[0])
        for r in range(W):
            tl.busy.append(Busy(r, step, "forward_backward", t, t + cost[r, 0]))
        issued = t + cost[:, 0]
        done = issued.max() + emb_s[0]  # gradients: same bytes as embeddings
        k = s.key("gradients")
        for r in range(W):
            tl.ops.append(OpSeen(r, step, k, issued[r], done))
            tl.blocked.append(Blocked(r, step, k, issued[r], done))
        t = s.blocking_all("dense_allreduce", done, reduce_s)
        t = s.busy_all("update", t, float(row_s[0]))
        end = np.full(W, t)
    else:
        # The next step's ids (issued now, lowest priority; steady state: same volume as this
        # step's) and this step's embeddings by group, all issued by every rank at once.
        t_ids = t
        t = s.busy_all("lookup", t, float(row_s.sum()))
        ready = [t_ids] + [t] * G
        dur = [sum(ids_s)] + emb_s
        prio = [PREFETCH_PRIORITY] + [EMBEDDING_PRIORITY - g for g in range(G)]
        emb_done = fabric_schedule(ready, dur, prio)[1:]
        keys = [s.key("embeddings") for _ in range(G)]
        clock = np.full(W, t)
        grad_issue = np.zeros((W, G))
        for g in range(G):
            start = np.maximum(clock, emb_done[g])
            for r in range(W):
                tl.ops.append(OpSeen(r, step, keys[g], t, emb_done[g]))
                if start[r] > clock[r]:
                    tl.blocked.append(Blocked(r, step, keys[g], clock[r], start[r]))
                tl.busy.append(Busy(r, step, "forward_backward", start[r], start[r] + cost[r, g]))
            clock = start + cost[:, g]
            grad_issue[:, g] = clock
        # Gradients by group as each rank finishes them, then the dense all-reduce (async).
        ready += list(grad_issue.max(axis=0)) + [grad_issue[:, -1].max()]
        dur += [emb_s[g] for g in range(G)] + [reduce_s]
        prio += [GRADIENT_PRIORITY - g for g in range(G)] + [PREFETCH_PRIORITY]
        done = fabric_schedule(ready, dur, prio)
        grad_done, reduce_done, ids_done = done[1 + G:1 + 2 * G], done[-1], done[0]
        gkeys = [s.key("gradients") for _ in range(G)]
        rkey, ikey = s.key("dense_allreduce"), s.key("ids")
        for r in range(W):
            tl.ops.append(OpSeen(r, step, rkey, grad_issue[r, -1], reduce_done))
            tl.ops.append(OpSeen(r, step, ikey, t_ids, ids_done))
            for g in range(G):
                tl.ops.append(OpSeen(r, step, gkeys[g], grad_issue[r, g], grad_done[g]))
                if grad_done[g] > clock[r]:
                    tl.blocked.append(Blocked(r, step, gkeys[g], clock[r], grad_done[g]))
                    clock[r] = grad_done[g]
                tl.busy.append(Busy(r, step, "update", clock[r], clock[r] + row_s[g]))
                clock[r] += row_s[g]
            for k, when in ((rkey, reduce_done), (ikey, ids_done)):
                if when > clock[r]:
                    tl.blocked.append(Blocked(r, step, k, clock[r], when))
                    clock[r] = when
        end = clock
    for r in range(W):
        tl.steps.append(StepWindow(r, step, t0, float(end[r])))
    return float(end.max())


def simulate_mode(p: SimParams, mode: str, lengths: Optional[list[list[np.ndarray]]] = None) -> Timeline:
    """The records of `mode` over the steps; lengths[step][rank] overrides the workload."""
    p.check()
    tl = Timeline()
    t = 0.0
    for step in range(p.steps):
        if lengths is not None:
            home = [np.asarray(x, dtype=np.int64) for x in lengths[step]]
        else:
            home = [workloads.step_lengths(p.workload, p.samples, seed=p.seed, step=step, rank=r, scale=p.length_scale)
                    for r in range(p.ranks)]
        t = _simulate_step(p, MODES[mode], step, t, home, tl)
    return tl


def run(p: SimParams, lengths: Optional[list[list[np.ndarray]]] = None) -> list[dict]:
    """One row per mode: the e2e metrics (design.md §6 keys) of the simulated steps."""
    return [{"mode": m, **mode_metrics(simulate_mode(p, m, lengths))} for m in p.modes]


def with_calibration(p: SimParams, e2e_json: dict) -> SimParams:
    """p with what a measured e2e run (its --json output) used and fitted: its cost model, and the
    history length scale and embedded item size it was fitted at (dim × 4 bytes)."""
    cm, cfg = e2e_json.get("cost_model"), e2e_json.get("config", {})
    if not cm or "length_scale" not in cfg or "dim" not in cfg:
        raise ValueError("the calibration file has no cost_model/config: pass the --json output of freescale-bench e2e")
    return replace(p, cost_model=CostModel(**cm), length_scale=float(cfg["length_scale"]),
                   bytes_per_item=4 * int(cfg["dim"]))

"""freescale-bench pec-sweep: exposed embedding communication vs collision rate, vanilla vs PEC.

Runs the e2e training step (bench/e2e.py) in its `vanilla` and `pec` modes on ids generated with
a controlled collision rate (workloads.overlapping_ids: that share of every step's ids was read
at the step before) and measures, per mode and rate, the exposed communication of the embedding
traffic: the id, embedding and gradient AllToAlls (vanilla: counts, ids, embeddings, gradients;
PEC: what its backward() and fetch() block on). The dense all-reduce is the same data-parallel
traffic in both modes and is reported apart (exposed_dense_ms); PEC's overlap round trip runs
under it, so on a CPU host, where both share the cores, some of its cost shows there: both_ms is
the sum. FreeScale's Fig. 9 shape: vanilla flat, PEC rising with the collision rate from near
zero (the overlap rows stay exposed).
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass
from typing import Any, Optional

from freescale_comm.bench.e2e import MODES, E2EConfig, measured_rank, spawn_measured, trainer_for
from freescale_comm.bench.timeline import Timeline, mode_metrics
from freescale_comm.planner import CostModel

__all__ = ["SweepConfig", "run", "table", "summary", "plot", "EMBEDDING_OPS"]

SWEEP_MODES = ("vanilla", "pec")
# Ops of the embedding traffic (the rest: the dense all-reduce).
EMBEDDING_OPS = ("counts", "ids", "embeddings", "gradients", "pec_fetch", "pec_backward")
DENSE_OPS = ("dense_allreduce",)


@dataclass(frozen=True)
class SweepConfig:
    e2e: E2EConfig = E2EConfig(dim=256, layers=1, steps=3, length_scale=1 / 12, modes=SWEEP_MODES)
    rates: tuple[float, ...] = (0.0, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0)

    def check(self) -> None:
        if not self.rates or any(not 0 <= r <= 1 for r in self.rates):
            raise ValueError(f"rates must be collision rates in [0, 1], got {list(self.rates)}")
        dataclasses.replace(self.e2e, collision_rate=self.rates[0]).check()


def _only(tl: Timeline, names: tuple[str, ...]) -> Timeline:
    """tl with only the blocked intervals and ops whose name is in `names` (compute and steps kept)."""
    keep = lambda op: op.split("@", 1)[0] in names  # noqa: E731 - keys are name@step#n
    return Timeline(list(tl.busy), [b for b in tl.blocked if keep(b.op)], [o for o in tl.ops if keep(o.op)],
                    list(tl.steps))


def _rank_program(info: Any, sweep: SweepConfig, progress: bool, cores: Optional[tuple[int, ...]]) -> dict[str, Any]:
    with measured_rank(info, cores):
        return _sweep(info, sweep, progress)


def _sweep(info: Any, sweep: SweepConfig, progress: bool) -> dict[str, Any]:
    bar = None
    if progress and info.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(sweep.rates) * len(sweep.e2e.modes) * (sweep.e2e.warmup + sweep.e2e.steps),
                   desc=f"pec-sweep {sweep.e2e.ranks} ranks", unit="step", leave=False)
    unused = CostModel(0.0, 0.0, 1.0)  # the swept modes do not balance
    out: dict[str, Any] = {}
    for rate in sweep.rates:
        cfg = dataclasses.replace(sweep.e2e, collision_rate=rate)
        for mode in cfg.modes:
            if bar is not None:
                bar.set_postfix_str(f"{mode} {rate:.0%}")
            out[f"{mode}@{rate}"] = trainer_for(cfg, MODES[mode], info.rank, unused, bar).run()["timeline"]
    if bar is not None:
        bar.close()
    return out


def run(sweep: SweepConfig, progress: bool = True, timeout_s: float = 1200.0) -> list[dict[str, Any]]:
    """Rows `mode, collision_rate, exposed_comm_ms` (embedding traffic) + exposed_dense_ms,
    step_ms, idle_ms, per mode and rate."""
    sweep.check()
    cfg = sweep.e2e
    per_rank, _ = spawn_measured(_rank_program, cfg, sweep, progress, timeout_s=timeout_s)
    rows = []
    for rate in sweep.rates:
        for mode in cfg.modes:
            tl = Timeline()
            for r in per_rank:
                tl.extend(Timeline.from_dict(r[f"{mode}@{rate}"]).select(lambda s: s >= cfg.warmup))
            every = mode_metrics(tl)
            rows.append({"mode": mode, "collision_rate": rate,
                         "exposed_comm_ms": mode_metrics(_only(tl, EMBEDDING_OPS))["exposed_comm_ms"],
                         "exposed_dense_ms": mode_metrics(_only(tl, DENSE_OPS))["exposed_comm_ms"],
                         "step_ms": every["step_ms"], "idle_ms": every["idle_ms"], "compute_ms": every["compute_ms"]})
    return rows


def _ratio(rows: list[dict[str, Any]], rate: float) -> Optional[float]:
    by = {r["mode"]: r["exposed_comm_ms"] for r in rows if r["collision_rate"] == rate}
    if "vanilla" not in by or "pec" not in by or by["vanilla"] <= 0:
        return None
    return by["pec"] / by["vanilla"]


def table(rows: list[dict[str, Any]], title: str) -> str:
    lines = [f"# {title}",
             f"{'collision':>10} {'mode':>8} {'exposed_comm_ms':>16} {'pec/vanilla':>12} {'exposed_dense_ms':>17} "
             f"{'both_ms':>8} {'step_ms':>9}", "-" * 87]
    for r in rows:
        ratio = _ratio(rows, r["collision_rate"]) if r["mode"] == "pec" else None
        lines.append(f"{r['collision_rate']:>10.0%} {r['mode']:>8} {r['exposed_comm_ms']:>16.2f} "
                     f"{(f'{ratio:.1%}' if ratio is not None else ''):>12} {r['exposed_dense_ms']:>17.2f} "
                     f"{r['exposed_comm_ms'] + r['exposed_dense_ms']:>8.2f} {r['step_ms']:>9.1f}")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """The issue's goals: PEC's exposed embedding comm ≤ 10% of vanilla's at 0% collisions, ≤ 25% at 10%."""
    out = []
    for rate, goal in ((0.0, 0.10), (0.1, 0.25)):
        ratio = _ratio(rows, rate)
        if ratio is not None:
            verdict = "met" if ratio <= goal else "NOT met"
            out.append(f"# at {rate:.0%} collisions PEC exposes {ratio:.1%} of vanilla's embedding comm "
                       f"(goal <= {goal:.0%}: {verdict})")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> str:
    """Per mode vs collision rate: exposed_comm_ms (solid) and, dashed, exposed_comm_ms +
    exposed_dense_ms; written as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.6), dpi=120)
    for i, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["collision_rate"])
        rates = [r["collision_rate"] * 100 for r in mine]
        ax.plot(rates, [r["exposed_comm_ms"] for r in mine], marker="o", color=f"C{i}", label=f"{mode}: embedding")
        ax.plot(rates, [r["exposed_comm_ms"] + r["exposed_dense_ms"] for r in mine], marker=".", linestyle="--",
                color=f"C{i}", label=f"{mode}: + dense all-reduce")
    ax.set_xlabel("collision rate (% of a step's ids read at the step before)")
    ax.set_ylabel("exposed comm (ms / step)")
    ax.set_title(textwrap.fill(title, 80), fontsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

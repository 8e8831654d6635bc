"""Traces and plots of e2e / simulate timelines.

trace.json (Chrome trace format; open in Perfetto or chrome://tracing): one process per mode, one
thread track per rank with its compute, idle and exposed-comm slices (they never overlap: a rank
is computing or blocked); the comm each rank issued shows as async slices beside it.
timeline.png: one step of each mode, a row per rank. bubbles.png: per mode, the step time and its
bubbles together (compute, idle and exposed comm stacked).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from freescale_comm.bench.timeline import Timeline, idle_end, last_issue

__all__ = ["chrome_trace", "write_trace", "plot_timeline", "plot_bubbles", "write_all"]

COLORS = {"compute": "#4C72B0", "exposed_comm": "#DD8452", "idle": "#C44E52"}


def _slices(tl: Timeline) -> list[tuple[int, int, str, str, float, float]]:
    """(rank, step, category, name, t0, t1) of every compute, idle and exposed-comm slice."""
    last = last_issue(tl.ops)
    out = [(b.rank, b.step, "compute", b.name, b.t0, b.t1) for b in tl.busy]
    for b in tl.blocked:
        split = idle_end(b, last[(b.step, b.op)])
        op = b.op.split("@")[0]
        if split > b.t0:
            out.append((b.rank, b.step, "idle", f"idle ({op})", b.t0, split))
        if b.t1 > split:
            out.append((b.rank, b.step, "exposed_comm", f"wait {op}", split, b.t1))
    return out


def chrome_trace(timelines: dict[str, Timeline]) -> dict[str, Any]:
    """The Chrome trace-event JSON of every mode's timeline (µs from the mode's first step)."""
    events: list[dict[str, Any]] = []
    async_id = 0
    for pid, (mode, tl) in enumerate(timelines.items(), start=1):
        origin = min((w.t0 for w in tl.steps), default=0.0)
        us = lambda t: round((t - origin) * 1e6, 3)  # noqa: E731
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": mode}})
        for rank in sorted({w.rank for w in tl.steps}):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank, "args": {"name": f"rank {rank}"}})
        for rank, step, cat, name, t0, t1 in _slices(tl):
            events.append({"ph": "X", "pid": pid, "tid": rank, "cat": cat, "name": name, "ts": us(t0),
                           "dur": us(t1) - us(t0), "args": {"step": step}})
        last = last_issue(tl.ops)
        for o in tl.ops:
            start = last[(o.step, o.op)]
            if o.done > start:
                async_id += 1
                base = {"pid": pid, "tid": o.rank, "cat": "comm", "name": o.op.split("@")[0], "id": async_id}
                events.append({**base, "ph": "b", "ts": us(start)})
                events.append({**base, "ph": "e", "ts": us(o.done)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str, timelines: dict[str, Timeline]) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(timelines), f)


def plot_timeline(path: str, timelines: dict[str, Timeline], modes: Sequence[str], max_ranks: int = 16) -> None:
    """One measured step (the first) of each of `modes`, a row per rank (the first max_ranks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    modes = [m for m in modes if m in timelines]
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 1.2 + 0.35 * min(max_ranks, 32) * len(modes)),
                             sharex=True, squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        tl = timelines[mode]
        step = min(w.step for w in tl.steps)
        origin = min(w.t0 for w in tl.steps if w.step == step)
        ranks = sorted({w.rank for w in tl.steps})[:max_ranks]
        for rank, s, cat, _, t0, t1 in _slices(tl):
            if s == step and rank in ranks:
                ax.broken_barh([((t0 - origin) * 1e3, (t1 - t0) * 1e3)], (rank - 0.4, 0.8), color=COLORS[cat])
        ax.set_yticks(ranks)
        ax.set_yticklabels([f"rank {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set_title(f"{mode}: step {step}", loc="left", fontsize=10)
    axes[-1, 0].set_xlabel("ms from step start")
    fig.legend(handles=[Patch(color=c, label=k.replace("_", " ")) for k, c in COLORS.items()], loc="upper right", ncol=3)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bubbles(path: str, rows: Sequence[dict[str, Any]], title: str) -> None:
    """Per mode, the step and its bubbles together: a stacked bar of compute, idle (straggler) and
    exposed comm ms per step (means over ranks), labelled with the step time (the slowest rank's)
    and the bubbles; a dashed line at the first mode's step time (the baseline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [r["mode"] for r in rows]
    compute = [r["compute_ms"] for r in rows]
    idle = [r["idle_ms"] for r in rows]
    exposed = [r["exposed_comm_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(1.7 * len(modes) + 2, 4.5))
    ax.bar(modes, compute, color=COLORS["compute"], label="compute")
    ax.bar(modes, idle, bottom=compute, color=COLORS["idle"], label="idle (stragglers)")
    ax.bar(modes, exposed, bottom=[c + i for c, i in zip(compute, idle)], color=COLORS["exposed_comm"],
           label="exposed comm")
    for i, r in enumerate(rows):
        top = compute[i] + idle[i] + exposed[i]
        ax.text(i, top, f"step {r['step_ms']:.0f}\nbubbles {r['bubble_ms']:.0f}", ha="center", va="bottom", fontsize=8)
    if rows:
        ax.axhline(rows[0]["step_ms"], color="gray", linestyle="--", linewidth=1, label=f"{modes[0]} step")
    ax.set_ylabel("ms per step (mean over ranks)")
    ax.set_ylim(0, 1.2 * max([c + i + e for c, i, e in zip(compute, idle, exposed)] + [r["step_ms"] for r in rows] + [1.0]))
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(directory: str, timelines: dict[str, Timeline], rows: Sequence[dict[str, Any]], title: str) -> list[str]:
    """trace.json, timeline.png (vanilla vs freescale, or every mode) and bubbles.png in directory."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, n) for n in ("trace.json", "timeline.png", "bubbles.png")]
    write_trace(paths[0], timelines)
    pair = [m for m in ("vanilla", "freescale") if m in timelines] or list(timelines)
    plot_timeline(paths[1], timelines, pair)
    plot_bubbles(paths[2], rows, title)
    return paths

"""Printing and saving benchmark rows: fixed nccl-tests-like columns, JSON as design.md §6."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Optional


def mean_std(samples: Sequence[float]) -> tuple[float, float]:
    n = len(samples)
    if n == 0:
        return math.nan, math.nan
    mean = sum(samples) / n
    var = sum((s - mean) ** 2 for s in samples) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var)


def bandwidth_row(impl: str, size_bytes: int, world: int, seconds: Sequence[float], wrong: int,
                  bytes_moved: Optional[int] = None) -> dict[str, Any]:
    """One all-to-all-style row: algbw = bytes_moved (default size_bytes) per mean second,
    busbw = algbw x (world - 1) / world (nccl-tests' alltoall bus factor)."""
    mean, std = mean_std(seconds)
    algbw = (size_bytes if bytes_moved is None else bytes_moved) / mean / 1e9
    return {
        "impl": impl,
        "size_bytes": size_bytes,
        "time_us": mean * 1e6,
        "time_std_us": std * 1e6,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * (world - 1) / world,
        "wrong": wrong,
        "iters": len(seconds),
    }


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def bandwidth_table(rows: Sequence[dict[str, Any]], title: str) -> str:
    """Columns: size, impl, time ± σ, algbw, busbw, #wrong."""
    header = f"{'size':>10}  {'impl':<10} {'time_us':>10} {'± σ':>9}  {'algbw GB/s':>10} {'busbw GB/s':>10} {'#wrong':>7}"
    lines = [f"# {title}", header, "-" * len(header)]
    last_size: Optional[int] = None
    for r in rows:
        size = human_bytes(r["size_bytes"]) if r["size_bytes"] != last_size else ""
        last_size = r["size_bytes"]
        lines.append(
            f"{size:>10}  {r['impl']:<10} {r['time_us']:>10.1f} {r['time_std_us']:>9.1f}  "
            f"{r['algbw_gbps']:>10.3f} {r['busbw_gbps']:>10.3f} {r['wrong']:>7d}"
        )
    return "\n".join(lines)


def write_json(path: str, bench: str, rows: Sequence[dict[str, Any]], **meta: Any) -> None:
    with open(path, "w") as f:
        json.dump({"bench": bench, **meta, "rows": list(rows)}, f, indent=2)
        f.write("\n")


STEP_COLUMNS = ("step_ms", "straggler_pct", "idle_ms", "exposed_comm_ms", "bubble_ms", "compute_ms", "comm_ms")


def step_table(rows: Sequence[dict[str, Any]], title: str, extra: Sequence[str] = ()) -> str:
    """e2e / simulate rows: mode, then STEP_COLUMNS and `extra` keys, one row per mode."""
    columns = list(STEP_COLUMNS) + list(extra)
    header = f"{'mode':<10}" + "".join(f"{c:>16}" for c in columns)
    lines = [f"# {title}", header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['mode']:<10}" + "".join(f"{r[c]:>16.3f}" for c in columns))
    return "\n".join(lines)


def bubble_reduction(rows: Sequence[dict[str, Any]], mode: str = "freescale", baseline: str = "vanilla") -> Optional[float]:
    """Fraction of bubble ms that `mode` removes relative to `baseline` (None if either is missing)."""
    by = {r["mode"]: r for r in rows}
    if mode not in by or baseline not in by or by[baseline]["bubble_ms"] <= 0:
        return None
    return 1.0 - by[mode]["bubble_ms"] / by[baseline]["bubble_ms"]


def _change(before: float, after: float, fewer: str, more: str) -> str:
    if before <= 0:
        return "n/a"
    delta = 1.0 - after / before
    return f"{100 * abs(delta):.1f}% {fewer if delta >= 0 else more}"


def bubble_summary(rows: Sequence[dict[str, Any]], mode: str = "freescale", baseline: str = "vanilla") -> str:
    """'# vanilla -> freescale: step a -> b ms (x% faster), bubbles c -> d ms (y% fewer)', or ''
    if a mode is missing: the step time and the bubbles together, as the plot shows them."""
    by = {r["mode"]: r for r in rows}
    if mode not in by or baseline not in by:
        return ""
    a, b = by[baseline], by[mode]
    return (f"# {baseline} -> {mode}: step {a['step_ms']:.1f} -> {b['step_ms']:.1f} ms "
            f"({_change(a['step_ms'], b['step_ms'], 'faster', 'slower')}), bubbles (idle + exposed comm) "
            f"{a['bubble_ms']:.1f} -> {b['bubble_ms']:.1f} ms ({_change(a['bubble_ms'], b['bubble_ms'], 'fewer', 'more')})")


def compute_spread(rows: Sequence[dict[str, Any]]) -> float:
    """(max - min) / min of the modes' compute_ms: every mode computes the same work, so this is
    how far the measurement moved between modes (noise, or ranks sharing cores)."""
    compute = [r["compute_ms"] for r in rows]
    return max(compute) / min(compute) - 1.0 if compute and min(compute) > 0 else math.nan


def compute_line(rows: Sequence[dict[str, Any]]) -> str:
    """'# compute per step, the same work in every mode: a to b ms (spread x%)'."""
    if len(rows) < 2:
        return ""
    compute = [r["compute_ms"] for r in rows]
    return (f"# compute per step (mean over ranks), the same work in every mode: {min(compute):.1f} to "
            f"{max(compute):.1f} ms (spread {100 * compute_spread(rows):.1f}%)")


def overlap_note(rows: Sequence[dict[str, Any]]) -> str:
    """Why `overlap` shows more bubbles than `vanilla` when it does ('' otherwise): overlapping
    hides communication only; idle time is the ranks' imbalance, which it does not change."""
    by = {r["mode"]: r for r in rows}
    if "overlap" not in by or "vanilla" not in by or by["overlap"]["bubble_ms"] <= by["vanilla"]["bubble_ms"]:
        return ""
    o, v = by["overlap"], by["vanilla"]
    return (f"# overlap shows more bubbles than vanilla ({o['bubble_ms']:.1f} vs {v['bubble_ms']:.1f} ms): overlapping "
            f"hides communication only (exposed {v['exposed_comm_ms']:.1f} -> {o['exposed_comm_ms']:.1f} ms); the rest "
            f"is idle time from the ranks' imbalance, which it does not change ({v['idle_ms']:.1f} -> "
            f"{o['idle_ms']:.1f} ms) and which moves with compute noise ({v['compute_ms']:.1f} vs "
            f"{o['compute_ms']:.1f} ms of the same work)")


# Above this share of compute spent waiting for a core, the run says the machine was busy.
BUSY_SHARE = 0.05


def busy_note(rows: Sequence[dict[str, Any]]) -> str:
    """One line when other threads held the ranks' cores for more than BUSY_SHARE of their compute
    ('' otherwise, and where the rows carry no core_wait_ms): the figures then stand for slower and
    uneven devices; balancing follows each rank's measured speed, which load moving between cores
    from step to step outruns."""
    shares = [(r["core_wait_ms"] / r["compute_ms"], r["mode"]) for r in rows
              if r.get("core_wait_ms") is not None and r["compute_ms"] > 0]
    if not shares or max(shares)[0] <= BUSY_SHARE:
        return ""
    mean = sum(s for s, _ in shares) / len(shares)
    worst, mode = max(shares)
    return (f"# busy machine: other processes held the ranks' cores for {100 * mean:.0f}% of their compute "
            f"({100 * worst:.0f}% in {mode}), so ranks computed as slower, uneven devices (balancing follows each "
            f"rank's measured speed, not load that moves between cores from step to step); for one idle "
            f"device per rank, run on an idle machine")

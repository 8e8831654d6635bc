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


def bubble_summary(rows: Sequence[dict[str, Any]], mode: str = "freescale", baseline: str = "vanilla") -> str:
    """'# bubble ms per step, vanilla -> freescale: a -> b (x% fewer)', or '' if a mode is missing."""
    reduction = bubble_reduction(rows, mode, baseline)
    if reduction is None:
        return ""
    by = {r["mode"]: r for r in rows}
    a, b = by[baseline]["bubble_ms"], by[mode]["bubble_ms"]
    return (f"# bubble ms per step (idle + exposed comm), {baseline} -> {mode}: {a:.2f} -> {b:.2f} "
            f"({100 * reduction:.1f}% fewer); step {by[baseline]['step_ms']:.1f} -> {by[mode]['step_ms']:.1f} ms")

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

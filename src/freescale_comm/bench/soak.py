"""freescale-bench soak: N local ranks x M random all_to_all_single ops on CPU tensors, every
byte checked.

Every rank derives the same op list from the seed: a dtype (11 of them), a per-pair element count
(0 ... --max-bytes per peer), a priority (-10 ... 200), sync or async, a contiguous or strided
input. Async ops stay in flight (up to --window) and are waited on in random order. Element i
sent from rank s to rank d in op k is a function of (k, s, d, i), so each receiver checks what it
got without a reference run."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool", "complex64")


@dataclass(frozen=True)
class SoakOp:
    dtype: str
    counts: list[list[int]]  # [src][dst] elements
    priority: int
    async_op: bool
    strided: bool  # the input is a strided view (every other element of a larger tensor)


def plan_ops(seed: int, ops: int, world: int, max_bytes: int) -> list[SoakOp]:
    """The op list every rank derives from `seed` (same on all)."""
    import torch

    rng = random.Random(seed)
    out = []
    for _ in range(ops):
        dtype = rng.choice(DTYPES)
        item = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        cap = max(max_bytes // item, 0)
        # Mostly small, some up to the cap, some empty: the sizes real jagged traffic has.
        counts = [[rng.choice((0, rng.randint(0, 64), rng.randint(0, cap))) for _ in range(world)] for _ in range(world)]
        out.append(SoakOp(dtype, counts, rng.randint(-10, 200), rng.random() < 0.6, rng.random() < 0.3))
    return out


def pattern(k: int, src: int, dst: int, n: int, dtype: Any) -> Any:
    """What rank `src` sends rank `dst` in op `k`: n elements of `dtype`, exact in every dtype."""
    import torch

    i = torch.arange(n, dtype=torch.int64)
    v = (i * 2654435761 + k * 97 + src * 31 + dst * 7) % 101
    if dtype == torch.bool:
        return (v % 2).bool()
    if dtype.is_complex:
        return torch.complex(v.float(), -v.float()).to(dtype)
    return v.to(dtype)


def rank_main(info: Any, seed: int, ops: int, max_bytes: int, window: int) -> dict:
    import torch

    import freescale_comm as fc

    world, rank = info.world_size, info.rank
    comm = fc.Communicator()
    rng = random.Random(seed * 1000 + rank)  # the wait order differs per rank
    inflight: list[tuple[int, Any, Any, Any]] = []  # (op index, work, output, expected)
    wrong = moved = 0

    def finish(entry: tuple[int, Any, Any, Any]) -> None:
        nonlocal wrong, moved
        _, work, out, expected = entry
        work.wait()
        moved += out.numel() * out.element_size()
        if not torch.equal(out, expected):
            wrong += int((out != expected).sum()) * out.element_size()

    start = time.perf_counter()
    for k, op in enumerate(plan_ops(seed, ops, world, max_bytes)):
        dtype = getattr(torch, op.dtype)
        send = torch.cat([pattern(k, rank, d, op.counts[rank][d], dtype) for d in range(world)])
        if op.strided:  # every other element of a tensor twice as long
            holder = torch.zeros(2 * send.numel(), dtype=dtype)
            holder[::2] = send
            send = holder[::2]
        expected = torch.cat([pattern(k, s, rank, op.counts[s][rank], dtype) for s in range(world)])
        out = torch.empty_like(expected)
        work = comm.all_to_all_single(out, send, [op.counts[s][rank] for s in range(world)], op.counts[rank],
                                      priority=op.priority, async_op=op.async_op)
        inflight.append((k, work, out, expected))
        while len(inflight) > (window if op.async_op else 0):
            finish(inflight.pop(rng.randrange(len(inflight))))
    while inflight:
        finish(inflight.pop(rng.randrange(len(inflight))))
    seconds = time.perf_counter() - start
    comm.close()
    return {"rank": rank, "ops": ops, "bytes_received": moved, "wrong_bytes": wrong, "seconds": seconds}


def run(ranks: int, ops: int, seed: int, max_bytes: int, window: int, timeout_s: float = 3600) -> list[dict]:
    from freescale_comm.testing import spawn

    return spawn(rank_main, ranks, seed, ops, max_bytes, window, timeout_s=timeout_s)


def summary(rows: list[dict], ranks: int, ops: int, seed: int) -> str:
    total = sum(r["bytes_received"] for r in rows)
    wrong = sum(r["wrong_bytes"] for r in rows)
    slowest = max(r["seconds"] for r in rows)
    return (f"soak: {ranks} ranks x {ops} ops (seed {seed}): {total / 2**20:.1f} MiB received and checked, "
            f"{wrong} wrong bytes, {slowest:.1f} s ({ops / max(slowest, 1e-9):.0f} ops/s per rank)")

"""Rank programs of test_pec.py (spawned: module level, importable)."""

from __future__ import annotations

import time

import numpy as np
import torch

from freescale_comm import pec
from freescale_comm.bench import workloads


def _sharding(kind: str, world: int) -> pec.Sharding:
    rows = [300, 97, 41]
    return pec.RowWiseSharding(rows, world) if kind == "row" else pec.TableWiseSharding(rows, world)


def _batches(sh: pec.Sharding, world: int, steps: int, rate: float, seed: int) -> list[list[list[torch.Tensor]]]:
    """[step][rank][table] ids, each table at collision rate `rate` (a table's ids of every rank)."""
    per_table = []
    for t, n in enumerate(sh.num_rows):
        counts = [[12 + 3 * r + t for r in range(world)] for _ in range(steps)]
        per_table.append(workloads.overlapping_ids(counts, n, rate, seed=seed + t))
    return [[[torch.from_numpy(per_table[t][s][r]) for t in range(sh.tables)] for r in range(world)]
            for s in range(steps)]


def _grads_for(rows: torch.Tensor, step: int) -> torch.Tensor:
    """A gradient that depends on the rows read (so a stale read changes it)."""
    return torch.sin(rows * (step + 1)) + 0.1


def _synchronous_step(tables: list[torch.Tensor], batch: list[list[torch.Tensor]], step: int, lr: float) -> None:
    """Fully synchronous SGD of one step on the full tables: every rank's rows (batch[rank][table])
    are read before any is updated."""
    reads = [torch.cat([tables[t][ids] for t, ids in enumerate(per_rank)]) for per_rank in batch]
    for per_rank, rows in zip(batch, reads):
        g, at = _grads_for(rows, step), 0
        for t, ids in enumerate(per_rank):
            tables[t].index_add_(0, ids, g[at:at + ids.numel()], alpha=-lr)
            at += ids.numel()


def train_against_sync(info, kind: str, rate: float, steps: int, pipelined: bool, polls: str = "alike",
                       forward_only: tuple[int, ...] = (), reuse_grads: bool = False) -> dict:
    """Trains with PEC and, beside it, a fully synchronous reference of the whole table (every
    rank's batches are known here). Returns, per step, the largest difference between the rows
    PEC returned and those the reference read, and that of the final shard. polls="alike": every
    rank calls progress() after its prefetch; "differ": rank 0 polls after fetch() and after
    backward() instead (a poll is local: where ranks call it may differ). forward_only: steps
    without backward() (evaluation batches), no update in the reference either. reuse_grads: the
    caller writes over its gradient tensor as soon as backward() returns (a reused buffer)."""
    world, lr, dim = info.world_size, 0.5, 8
    sh = _sharding(kind, world)
    torch.manual_seed(0)
    tables = [torch.randn(n, dim) for n in sh.num_rows]  # the reference: full tables
    owner, row = sh.route([torch.arange(n) for n in sh.num_rows])
    mine = owner == info.rank
    weight = torch.empty(sh.shard_rows(info.rank), dim)
    weight[row[mine]] = torch.cat(tables)[mine]
    pe = pec.PrioritizedEmbedding(sh, weight, lr=lr)
    batches = _batches(sh, world, steps, rate, seed=7)

    def reference_rows(step: int, rank: int) -> torch.Tensor:
        return torch.cat([tables[t][batches[step][rank][t]] for t in range(sh.tables)])

    max_err = []
    pe.prefetch(batches[0][info.rank])
    rows = pe.fetch()
    for step in range(steps):
        want = reference_rows(step, info.rank)
        max_err.append(float((rows - want).abs().max()))
        rank0_elsewhere = polls == "differ" and info.rank == 0
        if rank0_elsewhere:
            pe.progress()
        if pipelined and step + 1 < steps:
            pe.prefetch(batches[step + 1][info.rank])
            if not rank0_elsewhere:
                pe.progress()
        if step not in forward_only:
            grads = _grads_for(rows, step)
            pe.backward(grads)
            if reuse_grads:
                grads.fill_(1e5)
            if rank0_elsewhere:
                pe.progress()
            _synchronous_step(tables, batches[step], step, lr)
        if not pipelined and step + 1 < steps:
            pe.prefetch(batches[step + 1][info.rank])
        if step + 1 < steps:
            rows = pe.fetch()
    pe.flush()
    final = float((weight - torch.cat(tables)[mine][torch.argsort(row[mine])]).abs().max())
    pe.close()
    return {"max_err": max_err, "final_err": final}


def stale_gap(kind: str, rate: float, steps: int, world: int) -> float:
    """Single process: the largest change, over the steps, of a row read at step s+1 between
    before and after step s's synchronous update: what a stale read would be off by."""
    lr, dim = 0.5, 8
    sh = _sharding(kind, world)
    torch.manual_seed(0)
    tables = [torch.randn(n, dim) for n in sh.num_rows]
    batches = _batches(sh, world, steps, rate, seed=7)
    gap = 0.0
    for step in range(steps - 1):
        before = [t.clone() for t in tables]
        _synchronous_step(tables, batches[step], step, lr)
        for r in range(world):
            for t in range(sh.tables):
                ids = batches[step + 1][r][t]
                gap = max(gap, float((tables[t][ids] - before[t][ids]).abs().max()) if ids.numel() else 0.0)
    return gap


def misuse(info) -> list[str]:
    """Each out-of-order call raises RuntimeError naming the fix; returns the messages."""
    sh = pec.RowWiseSharding([64], info.world_size)
    pe = pec.PrioritizedEmbedding(sh, torch.zeros(sh.shard_rows(info.rank), 4), lr=0.1)
    out = []
    for call in (pe.fetch, lambda: pe.backward(torch.zeros(1, 4))):
        try:
            call()
        except RuntimeError as err:
            out.append(str(err))
    pe.prefetch(torch.arange(3))
    try:
        pe.prefetch(torch.arange(3))
    except RuntimeError as err:
        out.append(str(err))
    rows = pe.fetch()
    try:
        pe.backward(torch.zeros(rows.shape[0] + 1, 4))
    except ValueError as err:
        out.append(str(err))
    pe.close()
    return out


def _colliding_pair(world: int) -> tuple[pec.RowWiseSharding, list[torch.Tensor]]:
    """A 64-row table and, per rank, ids that two consecutive batches both read (all collide)."""
    sh = pec.RowWiseSharding([64], world)
    return sh, [torch.tensor([r, r + 1, 32 + r, 63 - r]) for r in range(world)]


def overlap_update_without_a_call(info) -> bool:
    """After backward(), the owner applies the overlap gradients while the caller makes no call
    (the runtime's thread does it). True if this rank's shard changed within 60 s of polling."""
    sh, ids = _colliding_pair(info.world_size)
    weight = torch.zeros(sh.shard_rows(info.rank), 4)
    pe = pec.PrioritizedEmbedding(sh, weight, lr=1.0)
    pe.prefetch(ids[info.rank])
    rows = pe.fetch()
    pe.prefetch(ids[info.rank])
    before = weight.clone()
    pe.backward(torch.ones_like(rows))
    deadline = time.monotonic() + 60.0  # a hang guard, not a timing check
    while torch.equal(weight, before) and time.monotonic() < deadline:
        time.sleep(0.01)
    changed = not torch.equal(weight, before)
    rows = pe.fetch()
    pe.flush()
    pe.close()
    return changed and bool((rows != 0).all())


def failing_update_raises_in_fetch(info) -> str:
    """An update that raises on the runtime's thread: fetch() raises it."""
    sh, ids = _colliding_pair(info.world_size)

    def update(rows: torch.Tensor, grads: torch.Tensor) -> None:
        raise ValueError("optimizer state is missing")

    pe = pec.PrioritizedEmbedding(sh, torch.zeros(sh.shard_rows(info.rank), 4), update=update)
    pe.prefetch(ids[info.rank])
    rows = pe.fetch()
    pe.prefetch(ids[info.rank])
    pe.backward(torch.ones_like(rows))
    try:
        pe.fetch()
        return "no error"
    except ValueError as err:
        return str(err)
    finally:
        pe.close()


def collision_of(batches: list[list[np.ndarray]]) -> float:
    prev, cur = np.concatenate(batches[0]), np.concatenate(batches[1])
    return float(np.isin(cur, prev).mean())


def parameter_shard(info) -> list[float]:
    """An nn.Parameter shard (as nn.Embedding and TorchRec hold weights), SGD lr 0.25, each rank's
    gradient 1 for rows 0 and 4: both rows end at -0.5, updated in place (index_add_ on a leaf that
    requires grad raised in the runtime thread)."""
    sh = pec.RowWiseSharding([8], 2)
    weight = torch.nn.Parameter(torch.zeros(sh.shard_rows(info.rank), 1))
    pe = pec.PrioritizedEmbedding(sh, weight, lr=0.25)
    pe.prefetch(torch.tensor([0, 4]))
    rows = pe.fetch()
    pe.prefetch(torch.tensor([0, 4]))
    pe.backward(torch.ones_like(rows))
    rows = pe.fetch()
    pe.flush()
    pe.close()
    return rows.flatten().tolist()


def tensor_lr(info) -> list[list[float]]:
    """lr as a one-element tensor, as torch.optim takes it, read at each update: 0.25 for the first
    update (each rank's gradient 1 for rows 0 and 4: both rows at -0.5), then set in place to 0.5
    as a scheduler would (-1.5). It was refused ("lr must be a positive number")."""
    sh = pec.RowWiseSharding([8], 2)
    lr = torch.tensor(0.25)
    pe = pec.PrioritizedEmbedding(sh, torch.zeros(sh.shard_rows(info.rank), 1), lr=lr)
    seen = []
    pe.prefetch(torch.tensor([0, 4]))
    rows = pe.fetch()
    for new_lr in (0.25, 0.5):
        lr.fill_(new_lr)
        pe.prefetch(torch.tensor([0, 4]))
        pe.backward(torch.ones_like(rows))
        rows = pe.fetch()
        seen.append(rows.flatten().tolist())
    pe.flush()
    pe.close()
    return seen


def one_rank_wrong_weight(info) -> str:
    """Rank 1's weight holds a row more than its shard: what each rank raises, and whether rank 1's
    error came before its communicator was built."""
    built = []
    real = pec.Communicator
    pec.Communicator = lambda *args, **kwargs: built.append(1) or real(*args, **kwargs)  # counts the builds
    sh = pec.RowWiseSharding([8], 2)
    weight = torch.zeros(sh.shard_rows(info.rank) + info.rank, 2)
    try:
        pec.PrioritizedEmbedding(sh, weight, lr=0.1)
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        when = "after" if built else "before"
        return f"{type(e).__name__}: {e} {when}" if info.rank == 1 else f"{type(e).__name__}"
    return "built"

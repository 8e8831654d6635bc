"""Prioritized embedding communication (PEC): FreeScale's second technique, on the priority queue.

Batch N's update only touches the rows batch N read. So the rows batch N+1 reads that batch N did
not ("non-overlap", NOL) have their final values already during N's compute: their ids and rows
move then, at low priority. The rows both batches read ("overlap", OL, a.k.a. collision rows)
must wait for N's update: N's gradients for them and their fetch for N+1 go first, at high
priority, and are what remains exposed. N's gradients for the rows N+1 does not read are sent
at the lowest priority and applied later (deferred), before any batch reads those rows again.

Overlap is decided by each row's owner, which sees every rank's requests: a row is OL for N+1 if
any rank read it in N. Reads are never stale: every batch sees exactly the rows fully
synchronous training would.

One training step with a `PrioritizedEmbedding` `pe` (every rank, same order):

    pe.prefetch(ids[0]); rows = pe.fetch()          # before the first step
    for step in range(steps):
        if step + 1 < steps:
            pe.prefetch(ids[step + 1])               # ids of N+1: low priority, async
        ... forward / backward of N on `rows`, calling pe.progress() now and then ...
        pe.backward(grad_of_rows)                    # OL grads high priority, NOL grads deferred
        ... dense all-reduce: the OL update and OL rows move under it (runtime thread) ...
        if step + 1 < steps:
            rows = pe.fetch()                        # OL rows of N+1 after N's OL update
    pe.flush()                                       # applies the deferred updates

Messages per step, all AllToAllv on the module's own Communicator (program order matches them):
counts, ids, flags (which rows are OL, per pair of batches), NOL rows (low priority); OL
gradients and OL rows (high priority, skipped when no owner has any); NOL gradients (deferred).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from freescale_comm.communicator import Communicator, check_priority
from freescale_comm.sharding import RowWiseSharding, Sharding, TableWiseSharding
from freescale_comm.work import Work

__all__ = ["Sharding", "RowWiseSharding", "TableWiseSharding", "overlap_mask", "split_overlap",
           "collision_rate", "PrioritizedEmbedding"]

IdsPerTable = Sequence[torch.Tensor]


def overlap_mask(ids: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """bool [len(ids)]: True where ids[i] also appears in `previous` (a collision). Vectorized."""
    return torch.isin(ids.reshape(-1), previous.reshape(-1))


def split_overlap(next_ids: IdsPerTable, ids: IdsPerTable) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per table, batch N+1's ids split into (overlap: also read by batch N, non-overlap), each
    keeping N+1's order. `next_ids`, `ids`: one int tensor per table, for N+1 and N."""
    if len(next_ids) != len(ids):
        raise ValueError(f"next_ids and ids must hold one tensor per table: got {len(next_ids)} and {len(ids)}")
    overlap, non_overlap = [], []
    for nxt, cur in zip(next_ids, ids):
        hit = overlap_mask(nxt, cur)
        overlap.append(nxt.reshape(-1)[hit])
        non_overlap.append(nxt.reshape(-1)[~hit])
    return overlap, non_overlap


def collision_rate(next_ids: IdsPerTable, ids: IdsPerTable) -> float:
    """Share of batch N+1's ids (all tables) that batch N also read."""
    overlap, non_overlap = split_overlap(next_ids, ids)
    hits, total = sum(x.numel() for x in overlap), sum(x.numel() for x in overlap + non_overlap)
    return hits / total if total else 0.0


def _segment_counts(mask: torch.Tensor, sizes: list[int]) -> list[int]:
    """Per segment (consecutive runs of `sizes`), how many of `mask` are True."""
    if not sizes:
        return []
    seg = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.int64))
    return torch.bincount(seg[mask], minlength=len(sizes)).tolist()


def _minus(a: list[int], b: list[int]) -> list[int]:
    return [x - y for x, y in zip(a, b)]


@dataclass
class _Batch:
    """One batch, as this rank sees it both as requester (its own ids) and as owner (peers' asks).
    Requester arrays are in owner-sorted order; `order` maps them to the caller's positions."""

    size: int  # ids the caller passed (all tables)
    order: torch.Tensor  # int64 [size]: caller positions, sorted by owner (stable)
    rows: torch.Tensor  # int64 [size]: shard row of each id at its owner, owner-sorted
    send: list[int]  # [world] ids I ask of each owner
    recv: list[int] = field(default_factory=list)  # [world] ids each peer asks of me
    asked: Optional[torch.Tensor] = None  # int64 [Σ recv]: my shard rows peers ask for, by peer
    # Fetch split, from the flags exchange: OL rows wait for the previous batch's update.
    asked_ol: Optional[torch.Tensor] = None  # bool [Σ recv], as owner
    at_ol: Optional[torch.Tensor] = None  # int64: caller positions of my OL ids, owner-sorted
    at_nol: Optional[torch.Tensor] = None  # int64: the same for my NOL ids
    any_fetch_ol: bool = False  # some owner serves some OL row (all ranks agree)
    out: Optional[torch.Tensor] = None  # [size, dim]: rows in the caller's order, NOL part first
    # Gradient split, from the next batch's flags: OL gradients are read again next → first.
    asked_grad_ol: Optional[torch.Tensor] = None  # bool [Σ recv], as owner
    at_grad_ol: Optional[torch.Tensor] = None  # int64: caller positions of my gradients sent first
    at_grad_nol: Optional[torch.Tensor] = None  # int64: the deferred ones
    any_grad_ol: bool = True
    fetch_ol_counts: list[int] = field(default_factory=list)  # [world] my OL ids per owner
    asked_ol_counts: list[int] = field(default_factory=list)  # [world] OL rows each peer asks of me
    grad_ol_counts: list[int] = field(default_factory=list)  # [world] my first-sent gradients per owner
    # Buffers of the high-priority path, allocated and touched under compute (no page faults then):
    ol_rows_in: Optional[torch.Tensor] = None  # [my OL ids, dim]
    ol_rows_out: Optional[torch.Tensor] = None  # [asked OL rows, dim]
    ol_grads_out: Optional[torch.Tensor] = None  # [my first-sent gradients, dim]
    ol_rows_work: Optional[Work] = None  # the OL rows' AllToAll, once sent


@dataclass
class _Update:
    """Gradients in flight to this rank (as owner) for `rows` of its shard, applied once arrived."""

    rows: torch.Tensor  # int64 [n]
    grads: torch.Tensor  # [n, dim], filled by `work`
    work: Optional[Work]  # None: nothing was sent (empty everywhere)

    def apply(self, update: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Applies the arrived gradients (work completed); raises the exchange's error if it failed."""
        error = self.work.exception() if self.work is not None else None
        if error is not None:
            raise error
        if self.rows.numel():
            update(self.rows, self.grads)


class PrioritizedEmbedding:
    """PEC over the rows of `sharding`'s tables; this rank stores `weight` [shard_rows(rank), dim],
    its shard, and updates it in place with SGD (`lr`) or `update(rows, grads)` (int64 shard rows
    [n], with repeats: one per read). Collective: every rank of `group` (default WORLD) builds one
    with the same sharding and calls its methods in the same order (see the module doc).
    `high_priority` serves OL gradients and rows, `low_priority` the next batch's ids and NOL
    rows, `deferred_priority` the NOL gradients."""

    def __init__(self, sharding: Sharding, weight: torch.Tensor, *, lr: Optional[Union[float, torch.Tensor]] = None,
                 update: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
                 group: Optional[dist.ProcessGroup] = None, high_priority: int = 100, low_priority: int = 0,
                 deferred_priority: int = -10) -> None:
        if not isinstance(sharding, Sharding):
            raise TypeError(f"sharding must be a RowWiseSharding or TableWiseSharding, got {type(sharding).__name__}")
        if (lr is None) == (update is None):
            raise ValueError("pass exactly one of lr (plain SGD on weight) or update(rows, grads)")
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point:
            raise ValueError("weight must be a 2-D floating tensor [shard rows, dim], got "
                             + (f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor)
                                else type(weight).__name__))
        if update is not None and not callable(update):
            raise TypeError(f"update must be a callable update(rows, grads), got {type(update).__name__}")
        for name, p in (("high_priority", high_priority), ("low_priority", low_priority),
                        ("deferred_priority", deferred_priority)):
            check_priority(p, name)
        self._update = update if update is not None else self._sgd(lr)
        # local checks first: a rank that refuses its arguments must not leave its peers waiting
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if sharding.world != world:
            raise ValueError(f"sharding is for {sharding.world} ranks but the group has {world}")
        if weight.shape[0] != sharding.shard_rows(rank):
            raise ValueError(f"weight has {weight.shape[0]} rows but rank {rank}'s shard holds "
                             f"{sharding.shard_rows(rank)} (sharding.shard_rows(rank))")
        self._comm = Communicator(group)
        self.rank, self.world = self._comm.rank, self._comm.world_size
        self.sharding, self.weight = sharding, weight
        self.dim = weight.shape[1]
        self._high, self._low, self._deferred = high_priority, low_priority, deferred_priority
        self._current: Optional[_Batch] = None  # fetched; its gradients come next
        self._next: Optional[_Batch] = None  # prefetched, not fetched yet
        self._stage = 0  # of _next: 1 counts sent, 2 ids sent, 3 flags sent, 4 NOL rows sent, 5 placed
        self._works: dict[str, Work] = {}
        self._counts_in: Optional[torch.Tensor] = None
        self._flags_in: Optional[torch.Tensor] = None
        self._flags_splits: tuple[list[int], bool] = ([], False)
        self._nol_rows: Optional[torch.Tensor] = None
        # The OL gradients' exchange, whose done-callback (_serve_ol) applies them and sends the
        # next batch's OL rows; every other op is posted after it ran (program order).
        self._serving: Optional[Work] = None
        self._serve_error: Optional[BaseException] = None
        self._deferred_updates: list[_Update] = []  # applied before the next NOL lookup
        # NOL gradients backward() held back: sent by the next prefetch() (or backward(), flush())
        self._unsent_grads: Optional[tuple[_Batch, torch.Tensor]] = None
        self._backward_done = True

    def _sgd(self, lr: Union[float, torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], None]:
        # As torch.optim.SGD: a number, or a one-element tensor read at each update (a scheduler may
        # change it in place); positive and finite (NaN trained every row to NaN).
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1 or lr.is_complex() or lr.dtype == torch.bool or lr.requires_grad:
                raise ValueError(f"lr as a tensor must hold one real number and not require grad, got "
                                 f"{lr.dtype} {tuple(lr.shape)}{' requiring grad' if lr.requires_grad else ''}")
            value = float(lr)
        elif isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise TypeError(f"lr must be a positive number (or a one-element tensor), got {type(lr).__name__}")
        else:
            value = float(lr)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"lr must be a positive finite number, got {value}")

        def sgd(rows: torch.Tensor, grads: torch.Tensor) -> None:
            with torch.no_grad():  # an nn.Parameter shard too, as torch.optim.SGD updates it
                self.weight.index_add_(0, rows.to(self.weight.device), grads.to(self.weight.device), alpha=-float(lr))

        return sgd

    # -- helpers ------------------------------------------------------------------------------------
    def _a2a(self, name: str, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
             priority: int) -> Work:
        work = self._comm.all_to_all_single(out, inp, out_splits, in_splits, priority=priority, async_op=True)
        self._works[name] = work
        return work

    def _rows_buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, self.dim, dtype=self.weight.dtype)

    def _touched(self, n: int) -> torch.Tensor:
        return torch.zeros(n, self.dim, dtype=self.weight.dtype)

    @torch.no_grad()
    def _lookup(self, rows: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if out is not None and self.weight.device == out.device:
            return torch.index_select(self.weight, 0, rows, out=out)
        return self.weight.index_select(0, rows.to(self.weight.device)).cpu()

    def _apply(self, updates: list[_Update], block: bool) -> bool:
        """Applies the arrived updates in order; False if one is still in flight and not `block`."""
        while updates:
            u = updates[0]
            if u.work is not None:
                if not block and not u.work.is_completed():
                    return False
                u.work.wait()
            u.apply(self._update)
            updates.pop(0)
        return True

    # -- the pipeline ------------------------------------------------------------------------------
    def prefetch(self, ids: IdsPerTable) -> None:
        """Starts fetching the next batch: `ids`, one int tensor per table (any shape, flattened in
        order; a single tensor for one table). Sends its id counts at low priority, then the
        gradients the last backward() held back (deferred), and returns; progress() and fetch()
        move the rest."""
        if self._next is not None:
            raise RuntimeError("prefetch() called twice: fetch() the prefetched batch first")
        checked = self.sharding.check_ids(ids)
        self._finish_serving()
        owner, rows = self.sharding.route(checked)
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=self.world).tolist()
        self._next = _Batch(size=owner.numel(), order=order, rows=rows[order], send=send)
        self._counts_in = torch.empty(self.world, dtype=torch.int64)
        self._a2a("counts", self._counts_in, torch.tensor(send, dtype=torch.int64), [1] * self.world,
                  [1] * self.world, self._low)
        # Here, a point every rank reaches in the same order: a progress() poll is not (where and how
        # often ranks poll differs), and an op it posted crossed its peers' ops (ops match in order).
        self._send_deferred_grads()
        self._stage = 1

    def progress(self, block: bool = False) -> bool:
        """Advances the prefetch as far as arrived messages allow (waits for them if `block`);
        True once the next batch's NOL rows are in place. Call it between compute chunks, as often
        as you like: ranks may poll at different places and counts. (What it posts follows the
        prefetch's own messages in an order every rank keeps.)"""
        return self._advance(block)

    def _advance(self, block: bool, until: int = 5) -> bool:
        """progress() without the deferred gradients, up to stage `until` (backward() and fetch()
        wait in it)."""
        b = self._next
        if b is None:
            return True
        while self._stage < until:
            work = self._works[("counts", "ids", "flags", "nol_rows")[self._stage - 1]]
            if not block and not work.is_completed():
                return False
            work.wait()
            if self._stage == 1:
                b.recv = self._counts_in.tolist()
                b.asked = torch.empty(sum(b.recv), dtype=torch.int64)
                self._a2a("ids", b.asked, b.rows, b.recv, b.send, self._low)
            elif self._stage == 2:
                if not self._apply(self._deferred_updates, block):
                    return False  # NOL rows must see every deferred update first
                self._send_flags(b)
            elif self._stage == 3:
                self._send_nol_rows(b)
            else:
                b.out.index_copy_(0, b.at_nol, self._nol_rows)
                self._nol_rows = None
            self._stage += 1
        return True

    def _send_flags(self, b: _Batch) -> None:
        """As owner: which asked rows of b are OL (the current batch read them) and which of the
        current batch's asked rows b reads again (their gradients go first). Per peer p the flags
        message is [any OL row to serve, any OL gradient to take] + b's flags + current's flags."""
        cur = self._current
        cur_asked = cur.asked if cur is not None else torch.zeros(0, dtype=torch.int64)
        b.asked_ol = overlap_mask(b.asked, cur_asked)
        split_grads = cur is not None and not self._backward_done
        if split_grads:
            cur.asked_grad_ol = overlap_mask(cur_asked, b.asked)
        cur_recv = cur.recv if split_grads else [0] * self.world
        cur_flags = cur.asked_grad_ol if split_grads else torch.zeros(0, dtype=torch.bool)
        header = torch.tensor([bool(b.asked_ol.any()), bool(cur_flags.any())], dtype=torch.uint8)
        parts, b_at, c_at = [], 0, 0
        for p in range(self.world):
            parts += [header, b.asked_ol[b_at:b_at + b.recv[p]].to(torch.uint8),
                      cur_flags[c_at:c_at + cur_recv[p]].to(torch.uint8)]
            b_at, c_at = b_at + b.recv[p], c_at + cur_recv[p]
        cur_send = cur.send if split_grads else [0] * self.world
        in_splits = [2 + b.recv[p] + cur_recv[p] for p in range(self.world)]
        out_splits = [2 + b.send[p] + cur_send[p] for p in range(self.world)]
        self._flags_in = torch.empty(sum(out_splits), dtype=torch.uint8)
        self._flags_splits = (out_splits, split_grads)
        self._a2a("flags", self._flags_in, torch.cat(parts), out_splits, in_splits, self._low)

    def _send_nol_rows(self, b: _Batch) -> None:
        """As requester: reads the flags; as owner: sends the NOL rows of b (low priority)."""
        out_splits, split_grads = self._flags_splits
        cur = self._current
        fetch_ol, grad_ol, any_fetch, any_grad, at = [], [], False, False, 0
        for p in range(self.world):
            seg = self._flags_in[at:at + out_splits[p]].bool()
            any_fetch, any_grad = any_fetch or bool(seg[0]), any_grad or bool(seg[1])
            fetch_ol.append(seg[2:2 + b.send[p]])
            grad_ol.append(seg[2 + b.send[p]:])
            at += out_splits[p]
        ol = torch.cat(fetch_ol)
        b.at_ol, b.at_nol, b.any_fetch_ol = b.order[ol], b.order[~ol], any_fetch
        b.fetch_ol_counts = _segment_counts(ol, b.send)
        if split_grads:
            gol = torch.cat(grad_ol)
            cur.at_grad_ol, cur.at_grad_nol, cur.any_grad_ol = cur.order[gol], cur.order[~gol], any_grad
            cur.grad_ol_counts = _segment_counts(gol, cur.send)
        b.out = self._rows_buffer(b.size)
        b.ol_rows_in = self._touched(b.at_ol.numel())
        b.ol_rows_out = self._touched(int(b.asked_ol.sum()))
        if split_grads:
            cur.ol_grads_out = self._touched(cur.at_grad_ol.numel())
        self._nol_rows = self._rows_buffer(b.size - b.at_ol.numel())
        b.asked_ol_counts = _segment_counts(b.asked_ol, b.recv)
        self._a2a("nol_rows", self._nol_rows, self._lookup(b.asked[~b.asked_ol]), _minus(b.send, b.fetch_ol_counts),
                  _minus(b.recv, b.asked_ol_counts), self._low)

    def backward(self, grads: torch.Tensor) -> None:
        """Sends the gradients of the rows fetch() last returned ([ids, dim], the caller's order) to
        their owners: those the prefetched batch reads again now, at high priority; the others by
        the next prefetch() (or backward(), flush()), at the lowest (deferred). Without a
        prefetched batch, all now. Once the high-priority ones arrived, the runtime's thread
        applies them and sends the prefetched batch's OL rows: work done between backward() and
        fetch() (the dense all-reduce) hides that round trip. `update` may thus run on that thread.
        Both parts are copied out of `grads` here: it is the caller's again once this returns."""
        cur = self._current
        if cur is None or self._backward_done:
            raise RuntimeError("backward() needs a fetched batch whose gradients were not sent yet: call fetch() first")
        if not isinstance(grads, torch.Tensor) or tuple(grads.shape) != (cur.size, self.dim):
            raise ValueError(f"grads must be a tensor [{cur.size}, {self.dim}] (one row per id fetched), got "
                             f"{getattr(grads, 'shape', type(grads).__name__)}")
        grads = grads.detach().to(device="cpu", dtype=self.weight.dtype)
        self._send_deferred_grads()  # an earlier batch's, if no prefetch() ran since (one slot)
        self._advance(block=True, until=4)  # the flags say which gradients go first
        if cur.at_grad_ol is None:  # nothing prefetched: every gradient is needed before the next read
            cur.at_grad_ol, cur.at_grad_nol, cur.any_grad_ol = cur.order, cur.order[:0], True
            cur.asked_grad_ol = torch.ones(cur.asked.numel(), dtype=torch.bool)
            cur.grad_ol_counts = list(cur.send)
        recv = _segment_counts(cur.asked_grad_ol, cur.recv)
        update = _Update(cur.asked[cur.asked_grad_ol], self._rows_buffer(sum(recv)), None)
        if cur.any_grad_ol:
            send = grads.index_select(0, cur.at_grad_ol) if cur.ol_grads_out is None else \
                torch.index_select(grads, 0, cur.at_grad_ol, out=cur.ol_grads_out)
            update.work = self._a2a("ol_grads", update.grads, send, recv, cur.grad_ol_counts, self._high)
        # (nothing prefetched: all went now, none held back; every rank knows it alike)
        # the held-back part, copied now: the caller may reuse its tensor once this returns
        self._unsent_grads = (cur, grads.index_select(0, cur.at_grad_nol)) if self._next is not None else None
        self._backward_done = True
        if update.work is None:
            self._serve_ol(update)
        else:  # the OL round trip goes on without the caller (e.g. under its dense all-reduce)
            self._serving = update.work
            update.work.get_future().add_done_callback(lambda _: self._serve_ol(update))

    def _serve_ol(self, update: _Update) -> None:
        """Once the OL gradients arrived: applies them, then sends the prefetched batch's OL rows
        (high priority). Runs on a completion thread once the exchange is done (_completions), so
        the round trip needs no call of the caller; the caller's next call waits for it."""
        try:
            update.apply(self._update)
            b = self._next
            if b is not None and b.any_fetch_ol:
                self._send_ol_rows(b)
        except BaseException as e:  # noqa: BLE001 - raised again by the caller's next call
            self._serve_error = e

    def _finish_serving(self) -> None:
        """Waits until _serve_ol ran (the OL update is applied, its sends posted); raises its error."""
        if self._serving is not None:
            self._serving.wait()  # raises its error
            self._serving.wait_for_callbacks()  # CUDA: wait() returned once the copies were enqueued
            self._serving = None
        if self._serve_error is not None:
            error, self._serve_error = self._serve_error, None
            raise error

    def _send_ol_rows(self, b: _Batch) -> None:
        """As owner: b's OL rows, looked up after every update they wait for (high priority)."""
        b.ol_rows_work = self._a2a("ol_rows", b.ol_rows_in, self._lookup(b.asked[b.asked_ol], b.ol_rows_out),
                                   b.fetch_ol_counts, b.asked_ol_counts, self._high)

    def _send_deferred_grads(self) -> None:
        """The NOL gradients backward() held back, at the lowest priority."""
        if self._unsent_grads is None:
            return
        cur, nol_grads = self._unsent_grads  # [NOL entries, dim], in at_grad_nol's order
        self._unsent_grads = None
        recv = _minus(cur.recv, _segment_counts(cur.asked_grad_ol, cur.recv))
        update = _Update(cur.asked[~cur.asked_grad_ol], self._rows_buffer(sum(recv)), None)
        update.work = self._a2a("nol_grads", update.grads, nol_grads, recv,
                                _minus(cur.send, cur.grad_ol_counts), self._deferred)
        self._deferred_updates.append(update)

    def fetch(self) -> torch.Tensor:
        """Rows [ids, dim] of the prefetched batch, in the order its ids were given: NOL rows (sent
        during progress) and OL rows (looked up after the current batch's OL update, sent now at
        high priority). Every row equals what synchronous training would read."""
        b = self._next
        if b is None:
            raise RuntimeError("fetch() needs a prefetched batch: call prefetch(ids) first")
        self._finish_serving()
        self._advance(block=True)
        if b.any_fetch_ol:
            if b.ol_rows_work is None:  # no backward() since the prefetch: nothing to wait for
                self._send_ol_rows(b)
            b.ol_rows_work.wait()
            b.out.index_copy_(0, b.at_ol, b.ol_rows_in)
        b.ol_rows_in = b.ol_rows_out = b.ol_rows_work = None
        self._current, self._next, self._stage = b, None, 0
        self._backward_done = False
        self._flags_in = self._counts_in = None
        out, b.out = b.out, None
        return out

    def flush(self) -> None:
        """Sends what backward() held back and applies every gradient sent so far (waits for
        them): the shard then holds what synchronous training would. Call it before reading or
        saving `weight` directly."""
        self._finish_serving()
        self._send_deferred_grads()
        self._apply(self._deferred_updates, block=True)

    def close(self) -> None:
        """Stops the module's communicator (pending ops fail)."""
        self._comm.close()

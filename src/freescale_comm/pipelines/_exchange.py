"""PEC's per-step messages over one Communicator, for every slot of a Catalog at once.

Program order, identical on every rank (so the Communicator's sequence numbers match them):

  ask(N+1), after batch N-1's gradients (under N-1's optimizer step and N's forward):
    ids      int64  requester -> owner: the shard rows asked, by owned slot, then the counts
                    of batch N+2 per owned slot and 1 if the rank has it (announce() sends
                    batch 0's counts alone)                                                (low)
  prepare(N+1), while batch N computes:
    flags    uint8  owner -> requester: per entry of N, is its row read by N+1 (gradient
                    goes first); per entry of N+1, is its row read by N (fetch waits); then
                    whether the owner has any OL entry, any NOL row                        (low)
    NOL rows f32    owner -> requester: N+1's rows N does not read, looked up now after every
                    earlier update (N-1's deferred gradients are applied first); skipped
                    when the flags say no rank has any                                      (low)
  gradients(N), after N's backward (skipped, as the rounds below, when the flags say no rank has any):
    OL grads  f32   requester -> owner: gradients of rows N+1 reads                        (high)
  fetch_micro(N+1, None), right after (the main thread):
    OL rows   f32   owner -> requester: N+1's rows N read, looked up after N's OL update   (high)
    with M micro-batches, fetch_micro(N+1, 0) there sends micro-batch 0's only, and then
    fetch_micro(N+1, m), m = 1..M-1, on the worker while N+1's micro-batch m-1 computes, sends
    micro-batch m's                                                         (next_micro_priority)
    and the update goes in that order too: gradients(N) updates only the rows micro-batch 0 of
    N+1 reads; fetch_micro(N+1, 0) then runs on the worker while the caller applies the rest of
    N's first-going gradients (apply_later), before micro-batch 1's fetch is posted (each row's
    gradients stay together and in order: the two updates equal one)
  send_deferred(N):
    NOL grads f32   the rest, applied by the owner before it next looks a row up     (deferred)

With micro-batches, each slot's rows are its micro-batches' distinct rows one after another, and
the ids message carries how many each micro-batch has, so both sides cut every round the same way;
its ids are each distinct row of the batch once, packed with the micro-batches reading it, from
which the owner rebuilds that layout (_packed_ids; where shard rows are too large to pack, each
micro-batch's rows go as they are). A row that several micro-batches of a requester read is
asked once, moves once, in the round of the first, and its gradient goes once, in the round of
the last: both sides mark each requester's first and last entry of every row (Asks.fresh / last,
Served.fresh / last: the requester from its layout, the owner from each row's lowest and highest
micro-batch bit); the rounds that move rows move first entries only, the requester
copying the rest from there (reuse_rows: values are frozen within a batch, and the first entry's
round comes no later than the micro-batch's own), and the gradient rounds carry last entries only,
each the row's gradient summed over the micro-batches in order (accumulate_gradients).
prefetch="dual_buffer" sends every row of N+1 in the NOL round and refreshes the OL ones in the OL
rounds; prefetch="ids" sends no flags (every row of N+1 waits, every gradient of N goes first) and
no deferred gradients.

A row of N+1 is OL if any rank read it (through any feature of its table) in N; both sides see
the same flags, so sizes are known before every exchange. Updates go through the TBE's fused
backward (the optimizer TorchRec configured), one call per TBE and partition; OL and NOL rows are
disjoint, so each row gets exactly the update synchronous training gives it. One thread at a
time: the pipeline's worker, or the caller's while the worker is idle.

Host reads of tensor values (each a device sync on CUDA) happen only where sizes arrive from the
peers: once per ask() (the next batch's counts, and with micro-batches its rows per micro-batch)
and once per flags round (every size the later rounds of N and N+1 need, _host_counts.CountBatch;
with prefetch="ids" there is no flags round, and with micro-batches one read in prepare() sizes
the first entries and the update's two parts);
selections use those counts (nonzero_static), so no other round waits for the device."""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from freescale_comm.communicator import Communicator
from freescale_comm._errors import comm_error
from freescale_comm._device_copy import on_device, to_device
from freescale_comm.pipelines._catalog import Catalog, LocalShard, Slot
from freescale_comm.pipelines._host_counts import (CountBatch, first_uses, positions, select, select_into,
                                                   stable_order)
from freescale_comm.pipelines._packed_ids import packs, unpack
from freescale_comm.pipelines._table_writes import TableWatch
from freescale_comm.pipelines._tbe_update import tbe_update


@dataclass
class Asks:
    """One batch as requester: per slot, the shard rows asked and where they go."""

    rows: list[torch.Tensor]  # per slot: int64 [n_s] shard rows, in the feature's id order
    positions: list[Optional[torch.Tensor]]  # per slot: int64 positions in the feature (None: 0..n-1)
    pieces: list[torch.Tensor] = field(default_factory=list)  # per slot: float [n_s, cols] received rows
    fetch_ol: list[torch.Tensor] = field(default_factory=list)  # per slot: bool [n_s], row waits for N
    grad_ol: list[Optional[torch.Tensor]] = field(default_factory=list)  # per slot: bool [n_s] or None (all)
    step: int = 0
    micro: Optional[list["MicroAsk"]] = None  # frozen-window micro-batches (rows micro-batch-major), or None
    # host counts from the flags round, per slot [M] (M = 1 for whole batches): rows that wait for the
    # last update, per micro-batch; gradients that go first (None: all of them)
    fetch_counts: list[list[int]] = field(default_factory=list)
    grad_counts: list[Optional[list[int]]] = field(default_factory=list)
    # micro-batches (frozen window: a row's value is the same for the whole batch): per slot, bool [n_s]
    # whether the entry is its row's first in the batch (only those move; a later micro-batch's copy
    # comes from the first, reuse_rows), and int64 [n_s] where that first entry is. None: all first
    fresh: Optional[list[torch.Tensor]] = None
    source: Optional[list[torch.Tensor]] = None
    fresh_counts: list[list[int]] = field(default_factory=list)  # per slot [M]: first entries (host)
    # and whether the entry is its row's last in the batch: only those send a gradient, the row's
    # summed over the micro-batches that read it (accumulate_gradients); None: all last
    last: Optional[list[torch.Tensor]] = None
    last_counts: list[list[int]] = field(default_factory=list)  # per slot [M]: last entries (host)
    # micro-batches: per slot, what the ids message carries, each distinct row of the batch once,
    # packed with the micro-batches reading it (int64 [D], _packed_ids); None: `rows` as they are
    wire: Optional[list[torch.Tensor]] = None

    def sent(self, slot: int) -> torch.Tensor:
        """The ids this batch's message carries for `slot`."""
        return self.rows[slot] if self.wire is None else self.wire[slot]

    def bounds(self, slot: int) -> list[int]:
        """[M + 1] boundaries of each micro-batch's rows in rows[slot] (M = 1: [0, n])."""
        if self.micro is None:
            return [0, self.rows[slot].numel()]
        return [m.start[slot] for m in self.micro] + [self.micro[-1].start[slot] + self.micro[-1].count[slot]]

    def micro_counts(self, slot: int) -> list[int]:
        """Rows per micro-batch of one slot (micro-batch m's are rows[start_m : start_m + count_m])."""
        return [m.count[slot] for m in self.micro]

    def micro_slices(self, per_slot: list[torch.Tensor], m: int) -> list[torch.Tensor]:
        """Micro-batch m's rows of per-slot tensors aligned with `rows`."""
        return [t[a:a + n] for t, a, n in zip(per_slot, self.micro[m].start, self.micro[m].count)]


@dataclass
class MicroAsk:
    """One micro-batch's share of a batch's Asks: per slot, its distinct rows (a range of the
    batch's) and where each of its ids reads them."""

    start: list[int]  # per slot: first row of this micro-batch in Asks.rows[s]
    count: list[int]  # per slot: its distinct rows
    inverse: list[torch.Tensor]  # per slot: int64 [ids in the micro-batch's feature] -> its row
    positions: list[Optional[torch.Tensor]]  # per slot: positions in the feature (None: 0..n-1)


@dataclass
class Served:
    """One batch as owner: per owned slot, the shard rows every requester asked, requester after
    requester in one tensor, so a round costs a few tensor ops per slot, not per slot and rank."""

    rows: dict[int, torch.Tensor]  # slot index -> int64 [asked by all]: requester 0's, then 1's...
    counts: dict[int, list[int]]  # slot index -> [world] rows each requester asked
    touched: dict[tuple, torch.Tensor]  # table shard -> rows read by anyone (any order, repeats kept)
    fetch_ol: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> bool [asked by all]
    grad_ol: Optional[dict[int, torch.Tensor]] = None  # slot -> bool [asked by all]; None: all OL
    micro: Optional[dict[int, torch.Tensor]] = None  # slot -> int64 [asked by all] micro-batch per row (FWP)
    # FWP: slot -> [world] offsets [M + 1] of each micro-batch's rows in a requester's rows (they come
    # micro-batch-major), so a micro-batch's round touches its own rows only, not the batch's
    micro_bounds: Optional[dict[int, list[list[int]]]] = None
    # host counts from the flags round, slot -> [world * M] per (requester, micro-batch) (M = 1 for
    # whole batches): rows that wait for the last update; gradients that go first (None: all)
    fetch_counts: dict[int, list[int]] = field(default_factory=dict)
    grad_counts: Optional[dict[int, list[int]]] = None
    # micro-batches: slot -> bool [asked by all], the entry is its row's first for its requester in the
    # batch (Asks.fresh: only those are looked up and sent); None: all first. Their host counts, slot ->
    # [world * M] per (requester, micro-batch), from the flags round
    fresh: Optional[dict[int, torch.Tensor]] = None
    fresh_counts: dict[int, list[int]] = field(default_factory=dict)
    # and each requester's last entry of every row (Asks.last: the only one with a gradient)
    last: Optional[dict[int, torch.Tensor]] = None
    last_counts: dict[int, list[int]] = field(default_factory=dict)
    # micro-batches: slot -> bool [asked by all], the row's gradient goes first and the next batch's
    # first micro-batch reads it (updated before that micro-batch's fetch, the rest after); and how
    # many, slot -> int (host, from the flags round). None: one update (no next batch, whole batches)
    early: Optional[dict[int, torch.Tensor]] = None
    early_counts: Optional[dict[int, int]] = None

    def bounds(self, slot: int) -> list[int]:
        """[world * M + 1] boundaries of each (requester, micro-batch)'s rows in rows[slot]."""
        out, start = [0], 0
        for r, count in enumerate(self.counts[slot]):
            inner = self.micro_bounds[slot][r][1:] if self.micro_bounds is not None else [count]
            out += [start + b for b in inner]
            start += count
        return out

    def per_requester(self, slot: int, flat: list[int], micro: Optional[int]) -> list[int]:
        """[world] from one of slot's [world * M] per-(requester, micro-batch) counts: micro-batch
        `micro`'s, or all of them."""
        world = len(self.counts[slot])
        m = len(flat) // world
        return [sum(flat[r * m:(r + 1) * m]) if micro is None else flat[r * m + micro] for r in range(world)]

    def parts(self, slot: int, micro: Optional[int]) -> Optional[list[slice]]:
        """Per requester, where micro-batch `micro`'s rows lie in rows[slot] (None: every row)."""
        if micro is None:
            return None
        out, start = [], 0
        for count, bounds in zip(self.counts[slot], self.micro_bounds[slot]):
            out.append(slice(start + bounds[micro], start + bounds[micro + 1]))
            start += count
        return out


def _take(values: torch.Tensor, parts: Optional[list[slice]]) -> torch.Tensor:
    """values' entries in `parts` (ranges), one after another; all of them if parts is None."""
    return values if parts is None else torch.cat([values[p] for p in parts])


@dataclass
class _InFlight:
    """Gradients arriving at this rank (as owner) for one batch and partition."""

    work: object
    buffer: torch.Tensor
    splits: list[int]
    rows_of: dict[int, torch.Tensor]  # owned slot -> int64: the shard rows they are for, requester after requester
    counts_of: dict[int, list[int]]  # owned slot -> [world] rows from each requester
    step: int
    lrs: dict[int, float]
    divisor: int  # TorchRec divides embedding gradients by the world size (comm_ops.GRADIENT_DIVISION)
    micro_of: Optional[dict[int, torch.Tensor]] = None  # owned slot -> micro-batch of each row (as rows_of)
    micro: Optional[int] = None  # the one micro-batch all its rows belong to (None: any)
    early_of: Optional[dict[int, torch.Tensor]] = None  # owned slot -> bool (as rows_of): Served.early


PREFETCH = ("pec", "dual_buffer", "ids")


class PecExchange:
    """Both sides of PEC for one pipeline. Four mutations, for tests that must catch them (stale
    reads): `early_overlap_reads` sends OL rows with the NOL rows, before the update they wait for;
    `late_deferred_updates` applies deferred gradients after the NOL lookup they must precede;
    `skip_refresh` (dual_buffer) keeps the early copies of OL rows instead of refreshing them;
    `late_split_updates` (micro-batches) applies the update's second part in micro-batch 1's fetch,
    after its lookup, instead of before that fetch.

    prefetch: what of batch N+1 moves while batch N computes: "pec" its NOL rows (OL rows after
    N's update); "dual_buffer" (NestPipe's DBP) every row, into N+1's own buffer, then the OL rows
    refreshed after N's update, by the same OL round PEC fetches them with (an owner's own rows
    never cross the network: its block of the AllToAll is a local copy); "ids" nothing but the
    ids: every row after N's update, every gradient applied first (no deferred ones).
    micro_batches: Asks carry frozen-window micro-batches (Asks.micro): the ids message also
    carries each slot's rows per micro-batch, and the rows after N's update move in one round per
    micro-batch: the first in gradients(), the rest in fetch_micro()."""

    def __init__(self, comm: Communicator, catalog: Catalog, high: int, low: int, deferred: int,
                 device: torch.device, early_overlap_reads: bool = False, prefetch: str = "pec",
                 micro_batches: Optional[int] = None, micro: Optional[int] = None,
                 micro_gradients: Optional[int] = None) -> None:
        self.prefetch, self.micro_batches = prefetch, micro_batches
        self.micro_priority = micro if micro is not None else high
        self.micro_gradient_priority = micro_gradients if micro_gradients is not None else high
        self.skip_refresh = False
        self.update_ms = 0.0  # ms spent in fused TBE updates so far (any thread): compute, not communication
        # per thread (ident): ms blocked in waits for this exchange's messages (rows, gradients) so far
        self.blocked_ms: collections.defaultdict[int, float] = collections.defaultdict(float)
        self.comm, self.catalog = comm, catalog
        self.device = device  # of ids, flags, rows and gradients (the tables'); counts stay on the host
        self.rank, self.world = comm.rank, comm.world_size
        self.high, self.low, self.deferred = high, low, deferred
        self.early_overlap_reads = early_overlap_reads
        self.late_deferred_updates = False
        self.late_split_updates = False
        # micro-batches: the update is split (the rows the next batch's first micro-batch reads first)
        self.splits_update = micro_batches is not None and micro_batches > 1
        # the rest of a split update: (per TBE: feature -> (rows, undivided gradients, early mask,
        # rows not early)), batch step, learning rates, gradient divisor
        self.later: Optional[tuple[dict[int, dict[int, tuple]], int, dict[int, float], int]] = None
        # micro-batches: the ids message carries each distinct row once, packed (_packed_ids)
        self.packed = micro_batches is not None and packs(catalog, micro_batches)
        self.owned = [s.index for s in catalog.owned_by(self.rank)]  # slots I serve, in order
        self.owned_by = [[s.index for s in catalog.owned_by(r)] for r in range(self.world)]
        self.cols = [s.cols for s in catalog.slots]
        self.current: Optional[tuple[Asks, Served]] = None  # fetched batch N, gradients pending
        self.asked: collections.deque[tuple[Asks, Served]] = collections.deque()  # ids sent, not prepared
        self.next: Optional[tuple[Asks, Served]] = None  # prepared batch N+1, OL rows pending
        self.deferred_grads: Optional[_InFlight] = None
        self.any_overlap = False  # from the last flags: some rank has OL gradients or OL rows
        self.incoming: Optional[list[list[int]]] = None  # [world][owned slots]: ids each rank sends in the next ask()
        self.unsent: Optional[tuple] = None  # NOL gradients gradients() left for send_deferred()
        tbes = {id(s.tbe): s.tbe for s in catalog.local.values()}
        self.tbes = list(tbes.values())
        self.iter_base = {id(t): int(t.iter.item()) for t in self.tbes}  # the TBEs' step counters at start
        self.tables = TableWatch(catalog.local)  # in-place writes of the tables not the pipeline's
        self._marks: dict[tuple, torch.Tensor] = {}  # table shard -> bool [its rows], all clear (_members)

    # -- helpers -----------------------------------------------------------------------------------
    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
             priority: int):
        return self.comm.all_to_all_single(out, inp, out_splits, in_splits, priority=priority, async_op=True)

    def _waited(self, work) -> None:
        """work.wait(), the time it blocked added to this thread's blocked_ms."""
        start = time.perf_counter()
        try:
            work.wait()
        finally:
            self.blocked_ms[threading.get_ident()] += (time.perf_counter() - start) * 1e3

    def _slot(self, index: int) -> Slot:
        return self.catalog.slots[index]

    # -- prefetch ----------------------------------------------------------------------------------
    def _counts_of(self, asks: Optional[Asks], failed: bool = False) -> list[list[int]]:
        """Per owner: my ids per slot it owns, then 1 if I have that batch (0: out of data; 2: this
        rank could not read or route it, so every rank fails together instead of waiting)."""
        flag = 2 if failed else int(asks is not None)
        return [[asks.sent(s).numel() if asks is not None else 0 for s in self.owned_by[o]] + [flag]
                for o in range(self.world)]

    def _take_counts(self, tails: list[list[int]]) -> bool:
        """tails: [world][owned slots + 1], what each rank announced. Keeps the counts for the
        next ask(); returns whether the batch exists (every rank must agree)."""
        has = [t[-1] for t in tails]
        failed = [r for r, h in enumerate(has) if h == 2]
        if failed:
            raise comm_error(f"ranks {failed} could not read or route their next batch (their own error says why); "
                             "every rank stops", "PEER_ABORTED", failed[0])
        if any(has) and not all(has):
            short = [r for r, h in enumerate(has) if not h]
            raise comm_error(f"ranks {short} ran out of data while ranks {[r for r, h in enumerate(has) if h]} still "
                             "had a batch: every rank's dataloader must yield the same number of batches",
                             "COMM_ERROR", short[0])
        self.incoming = [t[:-1] for t in tails] if has[0] else None
        return bool(has[0])

    def announce(self, asks: Optional[Asks], failed: bool = False) -> bool:
        """The first batch's counts (low priority); every later batch's ride on the ids before it.
        Returns whether the batch exists on every rank (None: this rank has no data; `failed`: this
        rank could not make it, every rank raises)."""
        send = self._counts_of(asks, failed)
        recv = torch.empty(self.world * (len(self.owned) + 1), dtype=torch.int64)
        self._a2a(recv, torch.tensor([c for per_owner in send for c in per_owner], dtype=torch.int64),
                  [len(self.owned) + 1] * self.world, [len(c) for c in send], self.low).wait()
        return self._take_counts(recv.view(self.world, len(self.owned) + 1).tolist())

    def ask(self, asks: Asks, following: Optional[Asks], failed: bool = False) -> bool:
        """One round (low priority): `asks`' ids (their counts were announced) go to their owners,
        with the counts of the `following` batch (None: this rank has no more data). prepare()
        takes `asks` from there. Returns whether `following` exists (every rank must agree). Runs a
        step ahead of prepare(): ids need no earlier update."""
        counts = self.incoming  # [requester][owned slot]: what each rank sends me now (host ints)
        if counts is None:
            raise RuntimeError("ask() without announced counts")
        tail = self._counts_of(following, failed)
        per_micro = self.micro_batches or 0  # FWP: each owned slot's rows per micro-batch follow the ids
        send, send_splits = [], []
        for o in range(self.world):
            ids = [asks.sent(s) for s in self.owned_by[o]]
            sizes = [c for s in self.owned_by[o] for c in asks.micro_counts(s)] if per_micro else []
            send += ids + [on_device(sizes + tail[o], self.device)]
            send_splits.append(sum(i.numel() for i in ids) + len(sizes) + len(tail[o]))
        ids_from = [sum(c) for c in counts]
        extra = len(self.owned) * per_micro
        recv_splits = [n + extra + len(self.owned) + 1 for n in ids_from]
        out = torch.empty(sum(recv_splits), dtype=torch.int64, device=self.device)
        self._a2a(out, torch.cat(send), recv_splits, send_splits, self.low).wait()
        asked: dict[int, list[torch.Tensor]] = {s: [] for s in self.owned}
        sizes, tails = [], []  # per requester: [owned slots, M] rows per micro-batch (FWP); its counts
        for r, block in enumerate(out.split(recv_splits)):
            for s, rows in zip(self.owned, block[:ids_from[r]].split(counts[r])):
                asked[s].append(rows)
            sizes.append(block[ids_from[r]:ids_from[r] + extra])
            tails.append(block[ids_from[r] + extra:])
        # the next batch's counts and (FWP) these rows per micro-batch: one host read
        host = torch.cat(tails + sizes).tolist()
        tails_of = [host[r * (len(self.owned) + 1):(r + 1) * (len(self.owned) + 1)] for r in range(self.world)]
        at = self.world * (len(self.owned) + 1)
        per = {s: [host[at + r * extra + i * per_micro:at + r * extra + (i + 1) * per_micro] for r in range(self.world)]
               for i, s in enumerate(self.owned)} if per_micro else {}  # slot -> [requester][M] rows per micro-batch
        touched: dict[tuple, list[torch.Tensor]] = {}
        fresh: dict[int, torch.Tensor] = {}
        last: dict[int, torch.Tensor] = {}
        if self.packed:  # each requester's distinct rows once: its micro-batch-major rows rebuilt
            rows_of = {}
            for s in self.owned:
                unpacked = [unpack(wire, per_micro, sizes_r) for wire, sizes_r in zip(asked[s], per[s])]
                rows_of[s] = torch.cat([u[0] for u in unpacked])
                fresh[s], last[s] = torch.cat([u[2] for u in unpacked]), torch.cat([u[3] for u in unpacked])
                touched.setdefault(self._slot(s).key, []).extend(wire >> per_micro for wire in asked[s])
            entries = {s: [sum(p) for p in per[s]] for s in self.owned}
        else:
            rows_of = {s: torch.cat(asked[s]) for s in self.owned}
            for s in self.owned:
                touched.setdefault(self._slot(s).key, []).append(rows_of[s])
            entries = {s: [counts[r][i] for r in range(self.world)] for i, s in enumerate(self.owned)}
        served = Served(rows_of, entries, {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in touched.items()})
        if per_micro:  # per requester: [owned slots * M], slot-major
            served.micro, served.micro_bounds = {}, {}
            for s in self.owned:
                flat = [c for p in per[s] for c in p]
                served.micro[s] = to_device(torch.repeat_interleave(torch.arange(per_micro).repeat(self.world),
                                                                    torch.tensor(flat, dtype=torch.int64),
                                                                    output_size=sum(flat)), self.device)
                served.micro_bounds[s] = [[0] + list(itertools.accumulate(p)) for p in per[s]]
            if per_micro > 1:  # each requester's first entry of a row moves it, its last sends its gradient
                if not self.packed:
                    for s in self.owned:
                        requester = torch.repeat_interleave(torch.arange(self.world, device=self.device),
                                                            on_device(served.counts[s], self.device),
                                                            output_size=served.rows[s].numel())
                        fresh[s], _, last[s] = first_uses(served.rows[s], requester)
                served.fresh, served.last = fresh, last
        self.asked.append((asks, served))
        return self._take_counts(tails_of)

    def prepare(self) -> None:
        """The oldest asked batch (N+1) up to its NOL rows in place: flags, then N-1's deferred
        gradients applied, then N+1's NOL rows looked up and sent (low priority). Nothing when ask()
        found no batch."""
        if not self.asked:
            return
        asks, served = self.asked.popleft()
        prev = self.current
        if self.prefetch == "ids":
            nol_anywhere = self._all_after_update(asks, served, prev)
        else:
            nol_anywhere = self._flags(asks, served, prev)
        # NOL rows, after every deferred update
        if not self.late_deferred_updates:
            self.apply_deferred()
        asks.pieces = [torch.empty(asks.rows[s].numel(), self.cols[s], device=self.device)
                       for s in range(len(self.catalog.slots))]
        if self.prefetch == "dual_buffer":  # every row now; the OL ones are refreshed after N's update
            self._rows(asks, served, "all")
        elif nol_anywhere:  # at collision 1 no rank has any: one round less
            self._rows(asks, served, "nol")
        self.apply_deferred()  # (a no-op unless mutated)
        if prev is None:  # the first batch: nothing to wait for
            self.current = (asks, served)
        else:
            self.next = (asks, served)

    def _all_after_update(self, asks: Asks, served: Served, prev: Optional[tuple[Asks, Served]]) -> bool:
        """prefetch="ids": every row of N+1 waits for N's update, every gradient of N goes first;
        no flags cross (every rank knows). Returns whether NOL rows move now (the first batch)."""
        waits = prev is not None  # every (first) entry or none
        for s in self.owned:
            served.fetch_ol[s] = _waiting(served.rows[s], waits, served.fresh[s] if served.fresh is not None else None)
        asks.fetch_ol = [_waiting(rows, waits, asks.fresh[s] if asks.fresh is not None else None)
                         for s, rows in enumerate(asks.rows)]
        batch = CountBatch()
        fresh = self._count_fresh(asks, served, batch)
        if prev is not None:
            prev[0].grad_ol = [None] * len(self.catalog.slots)
            prev[0].grad_counts = [None] * len(self.catalog.slots)
            prev[1].grad_ol = prev[1].grad_counts = None
        early = self._mark_early(prev[1], served, batch) if prev is not None else None
        # (one host read, with micro-batches: the first and last entries' counts, sizes of the two parts of N's update)
        counts = batch.read()
        self._take_fresh(asks, served, fresh, counts)
        if early is not None:
            self._take_early(prev[1], early, counts)
        served.fetch_counts = {s: [n if waits else 0 for n in served.fresh_counts[s]] for s in self.owned}
        asks.fetch_counts = [[n if waits else 0 for n in asks.fresh_counts[s]] for s in range(len(asks.rows))]
        self.any_overlap = prev is not None
        return prev is None

    def _count_fresh(self, asks: Asks, served: Served, batch: CountBatch) -> Optional[tuple]:
        """Joins `batch` with the counts of the first and the last entries of both sides
        (micro-batches); None when every entry is both (whole batches: the sizes are the counts)."""
        if asks.fresh is None:
            return None
        return tuple(({s: batch.add(getattr(served, f)[s], served.bounds(s)) for s in self.owned},
                      [batch.add(getattr(asks, f)[s], asks.bounds(s)) for s in range(len(asks.rows))])
                     for f in ("fresh", "last"))

    def _take_fresh(self, asks: Asks, served: Served, requests: Optional[tuple], counts: list[list[int]]) -> None:
        if requests is None:
            served.fresh_counts = served.last_counts = {s: _sizes(served.bounds(s)) for s in self.owned}
            asks.fresh_counts = asks.last_counts = [_sizes(asks.bounds(s)) for s in range(len(asks.rows))]
        else:
            (owned, asked), (owned_last, asked_last) = requests
            served.fresh_counts = {s: counts[i] for s, i in owned.items()}
            asks.fresh_counts = [counts[i] for i in asked]
            served.last_counts = {s: counts[i] for s, i in owned_last.items()}
            asks.last_counts = [counts[i] for i in asked_last]

    def _flags(self, asks: Asks, served: Served, prev: Optional[tuple[Asks, Served]]) -> bool:
        """The flags round: which of N's gradients go first, which of N+1's rows wait (both sides
        learn both). Sets any_overlap; returns whether any rank has NOL rows to send now."""
        waits = self._members(served.rows, prev[1].touched if prev is not None and not self.early_overlap_reads else {})
        for s in self.owned:
            served.fetch_ol[s] = waits[s]
            if served.fresh is not None:  # a row waits once: its first entry's flag (the requester's too)
                served.fetch_ol[s] = served.fetch_ol[s] & served.fresh[s]
        if prev is not None:
            prev[1].grad_ol = self._members(prev[1].rows, served.touched)
            if prev[1].last is not None:  # a row's gradient goes once: its last entry's flag (the requester's too)
                prev[1].grad_ol = {s: ol & prev[1].last[s] for s, ol in prev[1].grad_ol.items()}
        # two bytes more per block: does this owner serve any OL row or OL gradient, any NOL row (every
        # requester gets the same bytes, so every rank ORs the same ones: all agree on skipping an
        # exchange no rank has anything for)
        # (on the device: no host read before the exchange)
        ol = [served.fetch_ol[s].any() for s in self.owned] + \
            ([prev[1].grad_ol[s].any() for s in self.owned] if prev is not None else [])
        nol = [_nol(served.fetch_ol[s], served.fresh[s] if served.fresh is not None else None).any() for s in self.owned]
        none = torch.zeros((), dtype=torch.bool, device=self.device)
        tail = torch.stack([torch.stack(ol).any() if ol else none, torch.stack(nol).any() if nol else none])
        # per requester: N's gradient flags, then N+1's fetch flags, of every slot I own, then the tail
        fetch = [served.fetch_ol[s].split(served.counts[s]) for s in self.owned]
        grad = [prev[1].grad_ol[s].split(prev[1].counts[s]) for s in self.owned] if prev is not None else []
        flags_out = [f[r] for r in range(self.world) for f in grad + fetch + [[tail] * self.world]]
        flags_send_splits = [sum(f[r].numel() for f in grad + fetch) + 2 for r in range(self.world)]
        flags_in_splits = [(0 if prev is None else sum(prev[0].rows[s].numel() for s in self.owned_by[o]))
                           + sum(asks.rows[s].numel() for s in self.owned_by[o]) + 2 for o in range(self.world)]
        flags_in = torch.empty(sum(flags_in_splits), dtype=torch.uint8, device=self.device)
        self._a2a(flags_in, torch.cat(flags_out).to(torch.uint8), flags_in_splits, flags_send_splits, self.low).wait()
        if prev is not None:
            prev[0].grad_ol = [None] * len(self.catalog.slots)
        asks.fetch_ol = [None] * len(self.catalog.slots)
        flags = flags_in.bool()
        offset, tails = 0, []
        for o in range(self.world):
            if prev is not None:
                for s in self.owned_by[o]:
                    n = prev[0].rows[s].numel()
                    prev[0].grad_ol[s] = flags[offset:offset + n]
                    offset += n
            for s in self.owned_by[o]:
                n = asks.rows[s].numel()
                asks.fetch_ol[s] = flags[offset:offset + n]
                offset += n
            tails.append(offset)
            offset += 2
        tail_at = on_device(tails, self.device)
        # every size the later rounds of N and N+1 need, and the owners' tails: one host read
        batch = CountBatch()
        fetch_owned = {s: batch.add(served.fetch_ol[s], served.bounds(s)) for s in self.owned}
        fetch_asked = [batch.add(asks.fetch_ol[s], asks.bounds(s)) for s in range(len(asks.rows))]
        if prev is not None:
            grad_owned = {s: batch.add(prev[1].grad_ol[s], prev[1].bounds(s)) for s in self.owned}
            grad_asked = [batch.add(prev[0].grad_ol[s], prev[0].bounds(s)) for s in range(len(prev[0].rows))]
        early = self._mark_early(prev[1], served, batch) if prev is not None else None
        fresh = self._count_fresh(asks, served, batch)
        any_ol, any_nol = batch.add(flags[tail_at], [0, self.world]), batch.add(flags[tail_at + 1], [0, self.world])
        counts = batch.read()
        self._take_fresh(asks, served, fresh, counts)
        if early is not None:
            self._take_early(prev[1], early, counts)
        served.fetch_counts = {s: counts[i] for s, i in fetch_owned.items()}
        asks.fetch_counts = [counts[i] for i in fetch_asked]
        if prev is not None:
            prev[1].grad_counts = {s: counts[i] for s, i in grad_owned.items()}
            prev[0].grad_counts = [counts[i] for i in grad_asked]
        self.any_overlap = counts[any_ol][0] > 0  # OL gradients of N or OL rows of N+1 somewhere
        return counts[any_nol][0] > 0

    def _mark_early(self, done: Served, served: Served, batch: CountBatch) -> Optional[dict[int, int]]:
        """Micro-batches: marks the rows of `done` (batch N, as owner) whose gradient goes first and
        that the first micro-batch of `served` (N+1) reads: N's update applies them before that
        micro-batch's fetch, the rest after. Their counts join `batch`: returns its requests."""
        if not self.splits_update:
            return None
        first: dict[tuple, list[torch.Tensor]] = {}  # table shard -> rows micro-batch 0 reads (any feature)
        for s in self.owned:
            first.setdefault(self._slot(s).key, []).append(_take(served.rows[s], served.parts(s, 0)))
        read_first = self._members(done.rows, {key: torch.cat(rows) for key, rows in first.items()})
        done.early = {}
        for s in self.owned:
            mark = read_first[s]
            done.early[s] = mark & done.grad_ol[s] if done.grad_ol is not None else \
                mark & done.last[s] if done.last is not None else mark
        return {s: batch.add(mark, [0, mark.numel()]) for s, mark in done.early.items()}

    def _members(self, values: dict[int, torch.Tensor], sets: dict[tuple, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Per owned slot s, bool [values[s].numel()]: whether each of its shard rows is in sets[its
        table shard] (none where the shard has no set). Each set is marked once in the shard's row
        marks, looked up by every slot of that shard, then cleared: O(rows) without a sort, one
        byte per shard row kept (the row itself is dim * 4 bytes and its optimizer state more)."""
        out = {}
        by_key: dict[tuple, list[int]] = {}
        for s in self.owned:
            by_key.setdefault(self._slot(s).key, []).append(s)
        for key, slots in by_key.items():
            rows = sets.get(key)
            if rows is None or rows.numel() == 0:
                for s in slots:
                    out[s] = torch.zeros(values[s].numel(), dtype=torch.bool, device=self.device)
                continue
            marks = self._marks.get(key)
            if marks is None:
                marks = self._marks[key] = torch.zeros(self.catalog.local[key].weight.shape[0], dtype=torch.bool,
                                                       device=self.device)
            marks.index_fill_(0, rows, True)
            for s in slots:
                out[s] = marks.index_select(0, values[s])
            marks.index_fill_(0, rows, False)  # (all clear between calls)
        return out

    @staticmethod
    def _take_early(done: Served, requests: dict[int, int], counts: list[list[int]]) -> None:
        done.early_counts = {s: counts[i][0] for s, i in requests.items()}

    def _rows(self, asks: Asks, served: Served, which: str, micro: Optional[int] = None) -> None:
        """Looks up and exchanges N+1's rows: "ol", "nol" or "all" of them (of micro-batch `micro`
        only, if given: then only its own range of rows is read, on both sides); places them in
        asks.pieces. Every size comes from the flags round's host counts: no host read here."""
        # fetch_ol marks first entries only (a row moves once per batch: Asks.fresh)
        def chosen(fetch_ol: torch.Tensor, fresh: Optional[torch.Tensor]) -> Optional[torch.Tensor]:  # None: every row
            return fetch_ol if which == "ol" else _nol(fetch_ol, fresh) if which == "nol" else fresh

        def picked(ol: list[int], totals: list[int]) -> list[int]:  # how many first entries of each total are chosen
            return ol if which == "ol" else [t - o for t, o in zip(totals, ol)] if which == "nol" else totals

        picks = []  # per owned slot: (slot, its rows to send, requester after requester; how many each)
        for s in self.owned:
            parts = served.parts(s, micro)
            totals = served.per_requester(s, served.fresh_counts[s], micro)
            counts = picked(served.per_requester(s, served.fetch_counts[s], micro), totals)
            fresh = _take(served.fresh[s], parts) if served.fresh is not None else None
            picks.append((s, select(_take(served.rows[s], parts), chosen(_take(served.fetch_ol[s], parts), fresh),
                                    sum(counts)), counts))
        send_splits = [sum(counts[r] * self.cols[s] for s, _, counts in picks) for r in range(self.world)]
        # looked up straight into the send buffer, requester-major (no copy of the rows after the lookup)
        inp, at = torch.empty(sum(send_splits), device=self.device), 0
        for r in range(self.world):
            for s, rows, counts in picks:
                first, n = sum(counts[:r]), counts[r]
                weight = self.catalog.local[self._slot(s).key].weight
                torch.index_select(weight, 0, rows[first:first + n], out=inp[at:at + n * self.cols[s]].view(n, self.cols[s]))
                at += n * self.cols[s]
        # per slot: (first row, rows, which of them, how many) of what arrives
        wanted: list[tuple[int, int, Optional[torch.Tensor], int]] = []
        for s in range(len(self.catalog.slots)):
            if micro is None:
                first, count = 0, asks.rows[s].numel()
                ol, total = sum(asks.fetch_counts[s]), sum(asks.fresh_counts[s])
            else:
                first, count = asks.micro[micro].start[s], asks.micro[micro].count[s]
                ol, total = asks.fetch_counts[s][micro], asks.fresh_counts[s][micro]
            n = picked([ol], [total])[0]
            fresh = asks.fresh[s][first:first + count] if asks.fresh is not None else None
            wanted.append((first, count, chosen(asks.fetch_ol[s][first:first + count], fresh) if n < count else None, n))
        recv_splits = [sum(wanted[s][3] * self.cols[s] for s in self.owned_by[o]) for o in range(self.world)]
        recv = torch.empty(sum(recv_splits), device=self.device)
        priority = self.low if which != "ol" else self.high if not micro else self.micro_priority
        self._waited(self._a2a(recv, inp, recv_splits, send_splits, priority))
        offset = 0
        for o in range(self.world):
            for s in self.owned_by[o]:
                first, count, mask, n = wanted[s]
                block = recv[offset:offset + n * self.cols[s]].view(n, self.cols[s])
                offset += n * self.cols[s]
                if n:
                    target = asks.pieces[s][first:first + count]  # a view: writes land in pieces
                    if mask is None:
                        target.copy_(block)
                    else:
                        target.index_copy_(0, positions(mask, n), block)

    # -- gradients ---------------------------------------------------------------------------------
    def stream_gradients(self, micro: int, grads: list[torch.Tensor], lrs: dict[int, float],
                         has_next: bool) -> Optional[_InFlight]:
        """Worker, after prepare(N+1), while N's next micro-batch computes: micro-batch `micro`'s
        gradients that go first (OL; all when nothing follows or with prefetch="ids"), posted at
        micro_gradient_priority, not waited for: gradients() applies them with the rest, once.
        grads: per slot [its rows of that micro-batch, cols]. None when no rank has any."""
        asks, served = self.current
        if not has_next:  # nothing reads next: every gradient is needed now
            asks.grad_ol = [None] * len(asks.rows)
            served.grad_ol = None
        if has_next and not self.any_overlap:
            return None
        return self._send_grads(asks, served, grads, lrs, first=True, micro=micro)

    def gradients(self, grads: Optional[list[torch.Tensor]], lrs: dict[int, float], has_next: bool,
                  streamed: tuple = ()) -> None:
        """Batch N's gradients (per slot [n_s, cols], None in eval): the OL ones are sent and applied
        (with micro-batches: the last one's sent now, `streamed` the earlier ones' in flight, all
        applied in one update), skipped when no rank has any; batch N+1 becomes current. The NOL
        gradients wait for send_deferred()."""
        asks, served = self.current
        self.unsent = None
        if grads is not None:
            if not has_next:  # nothing reads next: every gradient is needed now
                asks.grad_ol = [None] * len(asks.rows)
                served.grad_ol = None
            if not has_next or self.any_overlap:
                # with a next batch of micro-batches: the rows its first one reads now, the rest later
                first_counts = served.early_counts if has_next else None
                if streamed:  # the last micro-batch's rows only
                    last = len(asks.micro) - 1
                    final = self._send_grads(asks, served, asks.micro_slices(grads, last), lrs, first=True, micro=last)
                    self._apply(*streamed, final, first_counts=first_counts)
                else:
                    self._apply(self._send_grads(asks, served, grads, lrs, first=True), first_counts=first_counts)
            if has_next and served.grad_ol is not None:  # (prefetch="ids": every gradient went first)
                self.unsent = (asks, served, grads, lrs)
        if has_next:  # its rows that waited for this update: fetch_micro() next
            self.current, self.next = self.next, None
        else:
            self.apply_deferred()
            self.current = None
        self._pin_iterations(asks.step + 1)

    def fetch_micro(self, micro: Optional[int]) -> None:
        """The current batch's rows that waited for the last update (its OL rows; with
        dual_buffer, their refresh): those of micro-batch `micro`, or all (None). Nothing when no
        rank has any (every rank knows from the flags)."""
        if self.any_overlap and not self.skip_refresh:
            self._rows(*self.current, "ol", micro)
        if micro:  # (a no-op unless mutated: the caller applied it before posting this fetch)
            self.apply_later()

    def apply_later(self) -> None:
        """The part of the last update the next batch's first micro-batch does not read (gradients()
        applied the part it reads): after that micro-batch's fetch is posted, before any later
        lookup (apply_deferred() runs it too, so a flush never leaves it out)."""
        if self.later is not None:
            (marked, step, lrs, divisor), self.later = self.later, None
            # (positions ascending: each row's gradients keep their order)
            per_tbe = {tbe: {f: (select(rows, ~early, rest), _divided(select(grads, ~early, rest), divisor))
                             for f, (rows, grads, early, rest) in features.items()}
                       for tbe, features in marked.items()}
            self._update(per_tbe, step, lrs)

    def reset(self) -> None:
        """After the data ran out (every rank alike): applies what is deferred and forgets the
        batches, so a new dataloader iterator starts afresh."""
        self.apply_deferred()
        self.current = self.next = None
        self.asked.clear()
        self.incoming, self.unsent, self.any_overlap = None, None, False

    def send_deferred(self) -> None:
        """Posts the NOL gradients gradients() held back (lowest priority): applied by each owner
        before its next NOL lookup."""
        if self.unsent is not None:
            asks, served, grads, lrs = self.unsent
            self.deferred_grads = self._send_grads(asks, served, grads, lrs, first=False)
            self.unsent = None  # (after: a send that raised leaves them unsent, as apply_arrived says)

    def _send_grads(self, asks: Asks, served: Served, grads: list[torch.Tensor], lrs: dict[int, float],
                    first: bool, micro: Optional[int] = None) -> _InFlight:
        """Posts the OL (`first`) or NOL gradients, of micro-batch `micro` only if given (then
        grads[s] holds that micro-batch's rows of slot s); returns them in flight to the owners.
        Every size comes from the flags round's host counts: no host read here."""
        def picked(ol: int, total: int) -> int:
            return ol if first else total - ol

        def within(counts: list[int]) -> int:  # of micro-batch `micro`, or of all
            return sum(counts) if micro is None else counts[micro]

        # only an entry that is its row's last in the batch sends a gradient (grad_ol marks those only)
        send, send_splits = [], []  # per owner: (gradients, which go, how many) per slot it owns
        for o in range(self.world):
            n = 0
            for s in self.owned_by[o]:
                g, ol = grads[s], asks.grad_ol[s]
                last = asks.last[s] if asks.last is not None else None
                if micro is not None and (ol is not None or last is not None):
                    start, size = asks.micro[micro].start[s], asks.micro[micro].count[s]
                    ol = ol[start:start + size] if ol is not None else None
                    last = last[start:start + size] if last is not None else None
                total = within(asks.last_counts[s])
                if ol is not None:
                    count, mask = picked(within(asks.grad_counts[s]), total), ol if first else _nol(ol, last)
                else:  # every gradient goes now
                    count, mask = total, last
                send.append((g, mask, count))
                n += count * self.cols[s]
            send_splits.append(n)
        rows_of: dict[int, torch.Tensor] = {}
        counts_of: dict[int, list[int]] = {}
        micro_of: Optional[dict[int, torch.Tensor]] = {} if served.micro is not None else None
        early_of: Optional[dict[int, torch.Tensor]] = {} if first and served.early is not None else None
        for s in self.owned:
            parts = served.parts(s, micro)  # its own range of rows only
            rows = _take(served.rows[s], parts)
            of = _take(served.micro[s], parts) if micro_of is not None else None
            early = _take(served.early[s], parts) if early_of is not None else None
            counts = served.per_requester(s, served.last_counts[s], micro)
            last = _take(served.last[s], parts) if served.last is not None else None
            mask = last
            if served.grad_ol is not None:
                grad_ol = _take(served.grad_ol[s], parts)
                ol = served.per_requester(s, served.grad_counts[s], micro)
                counts = [picked(c, t) for c, t in zip(ol, counts)]
                mask = grad_ol if first else _nol(grad_ol, last)
            if mask is not None:
                rows = select(rows, mask, sum(counts))
                of = select(of, mask, sum(counts)) if of is not None else None
                early = select(early, mask, sum(counts)) if early is not None else None
            rows_of[s], counts_of[s] = rows, counts
            if micro_of is not None:
                micro_of[s] = of
            if early_of is not None:
                early_of[s] = early
        recv_splits = [sum(counts_of[s][r] * self.cols[s] for s in self.owned) for r in range(self.world)]
        buffer = torch.empty(sum(recv_splits), device=self.device)
        inp, at = torch.empty(sum(send_splits), device=self.device), 0
        for g, ol, count in send:  # selected straight into the send buffer
            select_into(g, ol, count, inp[at:at + count * g.shape[1]].view(count, g.shape[1]))
            at += count * g.shape[1]
        priority = self.deferred if not first else self.high if micro is None or micro == len(asks.micro) - 1 \
            else self.micro_gradient_priority
        work = self._a2a(buffer, inp, recv_splits, send_splits, priority)
        return _InFlight(work, buffer, recv_splits, rows_of, counts_of, asks.step, lrs,
                         self.world if _gradient_division() else 1, micro_of, micro, early_of)

    def apply_arrived(self) -> Optional[str]:
        """After a failure: applies what is left of the last update that needs no further message (its
        split rest; the deferred gradients, once they arrived); returns what could not be applied (the
        tables then hold part of an update), or None."""
        self.apply_later()
        if self.unsent is not None:
            return "the last trained batch's deferred gradients were never sent"
        if self.deferred_grads is not None:
            pending, self.deferred_grads = self.deferred_grads, None
            try:
                self._apply(pending)
            except Exception as e:  # noqa: BLE001 - said in what is returned
                return f"the last trained batch's deferred gradients did not arrive ({e})"
        return None

    def apply_deferred(self) -> None:
        """Applies the deferred gradients in flight, if any (every rank sent them already), and
        what is left of the last update (apply_later)."""
        self.apply_later()
        if self.deferred_grads is not None:
            pending, self.deferred_grads = self.deferred_grads, None
            self._apply(pending)

    def _apply(self, *flights: _InFlight, first_counts: Optional[dict[int, int]] = None) -> None:
        """Waits for the gradients of `flights` (one batch's) and applies them through each TBE's
        fused update (_tbe_update.py), one update. With micro-batches, each row's gradients are ordered by
        micro-batch, then requester, however they travelled (so every prefetch mode sums alike).
        first_counts (slot -> rows marked early, Served.early_counts): only the rows the flights
        mark early are updated now; the rest wait in `later` for apply_later(). Each row's
        gradients stay together and in order, so the two updates equal one."""
        rows_of: dict[int, list[torch.Tensor]] = {s: [] for s in self.owned}
        grads_of: dict[int, list[torch.Tensor]] = {s: [] for s in self.owned}
        micro_of: dict[int, list[torch.Tensor]] = {s: [] for s in self.owned}
        split = first_counts is not None and all(f.early_of is not None for f in flights)
        for flight in flights:
            self._waited(flight.work)
            for r, block in enumerate(flight.buffer.split(flight.splits)):  # requester r's, slot after slot
                offset = 0
                for s in self.owned:
                    count = flight.counts_of[s][r]
                    n = count * self.cols[s]
                    grads_of[s].append(block[offset:offset + n].view(count, self.cols[s]))
                    offset += n
            for s in self.owned:
                rows_of[s].append(flight.rows_of[s])
                if flight.micro_of is not None:
                    micro_of[s].append(flight.micro_of[s])
        # one flight per micro-batch, in order (streamed), is in order already: no gather
        in_order = all(f.micro is not None for f in flights) and all(a.micro < b.micro for a, b in zip(flights, flights[1:]))
        per_tbe: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        later: dict[int, dict[int, tuple]] = {}  # as self.later's first entry
        for s in self.owned:
            slot = self._slot(s)
            shard = self.catalog.local[slot.key]
            rows, grads = torch.cat(rows_of[s]), torch.cat(grads_of[s])
            early = torch.cat([f.early_of[s] for f in flights]) if split else None
            if micro_of[s] and not in_order:
                order = stable_order(torch.cat(micro_of[s]))
                rows, grads = rows[order], grads[order]
                early = early[order] if early is not None else None
            feature = shard.tbe_features[slot.feature]
            if early is not None:  # the rest is picked out later, off the critical path
                later.setdefault(id(shard.tbe), {})[feature] = (rows, grads, early, rows.shape[0] - first_counts[s])
                rows, grads = select(rows, early, first_counts[s]), select(grads, early, first_counts[s])
            per_tbe.setdefault(id(shard.tbe), {})[feature] = (rows, _divided(grads, flights[0].divisor))
        self._update(per_tbe, flights[0].step, flights[0].lrs)
        if later:
            self.later = (later, flights[0].step, flights[0].lrs, flights[0].divisor)

    def _update(self, per_tbe: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]], step: int,
                lrs: dict[int, float]) -> None:
        """Batch `step`'s gradients (per TBE: feature -> (rows, grads)) through each TBE's fused update."""
        start = time.perf_counter()
        with self.tables.own_writes():  # refused if someone else wrote the tables since (_table_writes)
            for tbe in self.tbes:
                work = per_tbe.get(id(tbe))
                if work and any(rows.numel() for rows, _ in work.values()):
                    tbe_update(tbe, work, self.iter_base[id(tbe)] + step, lrs[id(tbe)])
        self.update_ms += (time.perf_counter() - start) * 1e3

    def _pin_iterations(self, steps_done: int) -> None:
        for t in self.tbes:
            value = self.iter_base[id(t)] + steps_done
            t.iter.fill_(value)
            if hasattr(t, "iter_cpu"):
                t.iter_cpu.fill_(value)


def _divided(grads: torch.Tensor, divisor: int) -> torch.Tensor:
    """grads / divisor in place (a tensor of _apply's own), as TorchRec's AllToAll backward divides
    embedding gradients after the exchange."""
    return grads.div_(divisor) if divisor != 1 else grads


def _nol(flags: torch.Tensor, among: Optional[torch.Tensor]) -> torch.Tensor:
    """The entries of `among` (None: all) not flagged: the first entries whose rows do not wait for
    the update (they move before it), the last entries whose gradients do not go first (deferred)."""
    return ~flags if among is None else ~flags & among


def _waiting(rows: torch.Tensor, waits: bool, fresh: Optional[torch.Tensor]) -> torch.Tensor:
    """prefetch="ids": bool [n], the entries that move after the update (every first one, or none)."""
    if fresh is None or not waits:
        return torch.full((rows.numel(),), waits, dtype=torch.bool, device=rows.device)
    return fresh


def _sizes(bounds: list[int]) -> list[int]:
    """Segment lengths from boundaries."""
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _gradient_division() -> bool:
    from torchrec.distributed import comm_ops
    return comm_ops.get_gradient_division()

"""How many entries of device masks are set, per segment, read on the host in one transfer.

Every size PEC's later rounds need (rows per requester and micro-batch that go first or wait) is
a segment count of the flags of one batch pair. Reading each with .tolist() / int() would cost
a device sync per slot and round on CUDA; CountBatch gathers every mask's running sums at its
segment boundaries on the device and reads them all with one .tolist(). Selections then use
torch.nonzero_static with the count known, which needs no sync either."""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

import numpy as np
import torch

from freescale_comm._device_copy import on_device


class CountBatch:
    """Collects (mask, segment boundaries) requests; read() returns, per request, the count of
    set entries in each segment, all in one host read."""

    def __init__(self) -> None:
        self._upto: list[torch.Tensor] = []  # per request: int64 [n + 1], set entries before each position
        self._bounds: list[list[int]] = []

    def add(self, mask: torch.Tensor, bounds: list[int]) -> int:
        """mask: bool [n], on the device every request shares; bounds: [k + 1] nondecreasing
        positions from 0 to n (host ints), the k segments being mask[bounds[i]:bounds[i + 1]].
        Returns the request's index."""
        self._upto.append(torch.cat([mask.new_zeros(1, dtype=torch.int64), mask.cumsum(0)]))
        self._bounds.append(bounds)
        return len(self._bounds) - 1

    def read(self) -> list[list[int]]:
        if not self._upto:
            return []
        at, where = 0, []  # every boundary, as a position in the requests' running sums back to back
        for upto, bounds in zip(self._upto, self._bounds):
            where += [at + b for b in bounds]
            at += upto.numel()
        flat = torch.cat(self._upto)[on_device(where, self._upto[0].device)].tolist()  # the one host read
        out, at = [], 0
        for bounds in self._bounds:
            ends = flat[at:at + len(bounds)]
            out.append([b - a for a, b in zip(ends, ends[1:])])
            at += len(bounds)
        return out


def select(values: torch.Tensor, mask: Optional[torch.Tensor], count: int) -> torch.Tensor:
    """values' entries (along dim 0) where `mask` is set, `count` of them (known on the host: no
    sync); all of them if mask is None or every entry is set."""
    if mask is None or count == values.shape[0]:
        return values
    if count == 0:
        return values[:0]
    return values.index_select(0, positions(mask, count))


def select_into(values: torch.Tensor, mask: Optional[torch.Tensor], count: int, out: torch.Tensor) -> None:
    """select(values, mask, count) written into `out` ([count, *values.shape[1:]]) without an
    intermediate copy."""
    if mask is None or count == values.shape[0]:
        out.copy_(values)
    elif count:
        torch.index_select(values, 0, positions(mask, count), out=out)


def positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """int64 [count]: where `mask` is set (count known on the host: no sync)."""
    return torch.nonzero_static(mask, size=count).squeeze(1)


def stable_order(values: torch.Tensor, groups: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 [n]: the permutation sorting integer values [n] (with groups [n]: by (group, value)),
    equal keys in position order, as torch.argsort(stable=True). On the host, where key x n fits
    in int64, one sort of packed (key, position) integers (NumPy's: ~10x faster than torch's
    stable argsort at 5,000 entries; these sorts were most of routing a micro-batched batch)."""
    n = values.numel()
    integers = not values.is_floating_point() and (groups is None or not groups.is_floating_point())
    if values.device.type == "cpu" and n > 1 and integers:
        v = _as_int64(values)
        low = int(v.min())
        span = int(v.max()) - low + 1  # keys: (group - lowest group) x span + value - lowest value
        keys = span
        if groups is not None:
            g = _as_int64(groups)
            low_group = int(g.min())
            keys *= int(g.max()) - low_group + 1
        if keys * n < 2**62:
            key = v - low if groups is None else (g - low_group) * span + (v - low)
            packed = np.sort(key * n + np.arange(n, dtype=np.int64))
            return torch.from_numpy(packed % n)
    if groups is None:
        return torch.argsort(values, stable=True)
    order = torch.argsort(values, stable=True)
    return order.index_select(0, torch.argsort(groups.index_select(0, order), stable=True))


def distinct(groups: list[list[torch.Tensor]], union: bool = False) -> list[tuple]:
    """Per group of 1-d int64 tensors (parts): each part's distinct values, sorted, the parts'
    one after another (unique [Σ counts]); each part's count; and per part, each entry's index in
    its part's distinct values (torch.unique(part, return_inverse=True) of every part). With
    `union` (at most 62 parts), also the group's distinct values over all its parts, ascending
    (int64 [D]), and for each a bit mask of the parts holding it (int64 [D], bit p: part p).
    On CPU one NumPy sort for every group's parts (and one for the unions); on a device one sort
    per group (and one per union) and one host read for all of them."""
    device = next((p.device for parts in groups for p in parts), torch.device("cpu"))
    if device.type == "cpu":
        found = _distinct_on_host(groups, union)
        if found is not None:
            return found
    return _distinct_on_device(groups, union)


def _distinct_on_host(groups: list[list[torch.Tensor]], union: bool) -> Optional[list[tuple]]:
    """distinct() of CPU groups in NumPy, every group at once: one sort of packed (part, value,
    position) keys over all groups' parts (and, with `union`, one of (group, value, part) keys).
    None where the keys would not fit in int64 (then the device path)."""
    sizes = [p.numel() for parts in groups for p in parts]  # per part of every group
    part_base = np.cumsum([0] + [len(parts) for parts in groups])  # first part of each group
    parts_total, n = len(sizes), sum(sizes)
    v = np.concatenate([_as_int64(p) for parts in groups for p in parts] + [np.zeros(0, dtype=np.int64)])
    low = int(v.min()) if n else 0
    span = int(v.max()) - low + 1 if n else 1
    if max(parts_total, 1) * span * max(n, 1) >= 2**62 or (union and max(len(groups), 1) * span * 64 >= 2**62):
        return None
    part = np.repeat(np.arange(parts_total, dtype=np.int64), sizes)  # of every part of every group
    keys = part * span + (v - low)
    order = np.sort(keys * n + np.arange(n, dtype=np.int64)) % n if n else keys  # stable: ties by position
    ordered = keys[order]
    first = np.ones(n, dtype=bool)  # the first entry of each (part, value)
    first[1:] = ordered[1:] != ordered[:-1]
    runs = ordered[first]
    counts = np.bincount(runs // span, minlength=parts_total)  # distinct values per part
    run_base = np.concatenate(([0], np.cumsum(counts)))  # first run of each part
    index = np.empty(n, dtype=np.int64)
    index[order] = np.cumsum(first) - 1  # each entry's run among all parts' runs
    index -= np.repeat(run_base[:-1], sizes)  # ... among its own part's
    # one tensor each for every group's unique values and every part's inverse, then views
    group_runs = np.diff(run_base[part_base]).tolist()
    unique = torch.from_numpy(runs % span + low).split(group_runs)
    inverses = torch.from_numpy(index).split(sizes)
    unions = _unions_on_host(runs, part_base, low, span) if union else None
    counts = counts.tolist()
    out = []
    for g in range(len(groups)):
        a, b = part_base[g], part_base[g + 1]
        found = (unique[g], counts[a:b], list(inverses[a:b]))
        out.append(found + next(unions) if union else found)
    return out


def _unions_on_host(runs: np.ndarray, part_base: np.ndarray, low: int,
                    span: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The unions of _distinct_on_host's groups from its runs (each distinct (global part, value -
    low) once, as part * span + value - low), each group's first part: one sort of (group, value,
    part) keys for all; yields each group's (rows, masks)."""
    groups = len(part_base) - 1
    part = runs // span
    group = np.searchsorted(part_base, part, side="right") - 1
    pairs = np.sort((group * span + runs % span) * 64 + (part - part_base[group]))  # by group, value, part
    value, local = np.divmod(pairs, 64)
    start = np.flatnonzero(np.concatenate(([True], value[1:] != value[:-1]))[:value.size])
    masks = np.add.reduceat(np.left_shift(1, local), start) if start.size else start  # each part once: sum = OR
    value = value[start]
    per_group = np.diff(np.searchsorted(value, np.arange(1, groups + 1) * span), prepend=0).tolist()
    rows = torch.from_numpy(value % span + low).split(per_group)
    masks = torch.from_numpy(masks.astype(np.int64)).split(per_group)
    yield from zip(rows, masks)


def _as_int64(t: torch.Tensor) -> np.ndarray:
    """A CPU integer tensor as an int64 NumPy array (no copy when it is one already)."""
    return t.numpy() if t.dtype == torch.int64 and not t.requires_grad else t.detach().to(torch.int64).numpy()


def _distinct_on_device(groups: list[list[torch.Tensor]], union: bool = False) -> list[tuple]:
    """distinct() in torch ops: one sort per group (and per union), one host read for all."""
    batch, staged, unions = CountBatch(), [], []
    device = next((p.device for parts in groups for p in parts), torch.device("cpu"))
    for parts in groups:
        sizes = [p.numel() for p in parts]
        bounds = [0, *itertools.accumulate(sizes)]
        values = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)
        part_of = torch.repeat_interleave(torch.arange(len(parts), device=values.device),
                                          on_device(sizes, values.device), output_size=bounds[-1])
        order = stable_order(values, part_of)  # by (part, value), ties in position order
        ordered = values.index_select(0, order)
        first = torch.ones_like(ordered, dtype=torch.bool)  # the first of each run of equal values in a part
        first[1:] = ordered[1:] != ordered[:-1]
        starts = [b for b, n in zip(bounds, sizes) if n]  # a part's first entry starts a run
        if starts:
            first[on_device(starts, values.device)] = True
        staged.append((ordered, order, first, bounds, batch.add(first, bounds)))
        if union:
            unions.append(_union_staged(values, part_of, batch))
    counts = batch.read()
    out = []
    for ordered, order, first, bounds, i in staged:
        unique = ordered.index_select(0, positions(first, sum(counts[i])))
        index = torch.empty_like(order).scatter_(0, order, first.cumsum(0) - 1)  # into `unique`
        base = [0, *itertools.accumulate(counts[i])]
        inverses = [index[a:b] - base[p] for p, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        out.append((unique, counts[i], inverses))
    if union:
        out = [found + _union_read(*staged_union, counts) for found, staged_union in zip(out, unions)]
    return out


def _union_staged(values: torch.Tensor, part_of: torch.Tensor, batch: CountBatch) -> tuple:
    """distinct(union=True) before the read: the group's entries by (value, part); the first entry
    of each value and of each (value, part) pair; the count of values, requested from `batch`."""
    order = stable_order(part_of, values)  # by value, then part
    v, p = values.index_select(0, order), part_of.index_select(0, order)
    value_start = torch.ones_like(v, dtype=torch.bool)
    value_start[1:] = v[1:] != v[:-1]
    pair_start = value_start.clone()
    pair_start[1:] |= p[1:] != p[:-1]
    return v, p, value_start, pair_start, batch.add(value_start, [0, v.numel()])


def _union_read(v: torch.Tensor, p: torch.Tensor, value_start: torch.Tensor, pair_start: torch.Tensor, request: int,
                counts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """distinct(union=True) after the read: the distinct values ascending and their parts' masks."""
    count = counts[request][0]
    rows = v.index_select(0, positions(value_start, count))
    bits = torch.where(pair_start, torch.ones_like(p) << p, torch.zeros_like(p))  # each (value, part) once
    masks = torch.zeros(count, dtype=torch.int64, device=v.device).scatter_add_(0, value_start.cumsum(0) - 1, bits)
    return rows, masks


def first_uses(values: torch.Tensor, groups: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For int64 values [n] (and, if given, int64 groups [n]: entries of different groups never
    match): bool [n], whether each entry is the first of its value (in its group); int64 [n], the
    position of that first entry; and bool [n], whether it is the last. One stable_order, no host
    read."""
    n = values.numel()
    order = stable_order(values, groups)  # (group, value) lexicographic; ties keep their positions' order
    if n == 0:
        none = torch.ones(0, dtype=torch.bool, device=values.device)
        return none, order, none
    v = values.index_select(0, order)
    start = torch.ones(n, dtype=torch.bool, device=values.device)  # the first of each run of equal keys
    start[1:] = v[1:] != v[:-1]
    if groups is not None:
        g = groups.index_select(0, order)
        start[1:] |= g[1:] != g[:-1]
    # in sorted order, each entry's run start (a running max of the starts' positions); its first
    # entry is the run's smallest position, which the stable sort puts at the start, and its last
    # entry the largest, at the end (the entry before the next run's start)
    at = torch.where(start, torch.arange(n, device=values.device), torch.zeros_like(order)).cummax(0).values
    source = torch.empty_like(order).scatter_(0, order, order.index_select(0, at))
    end = torch.ones_like(start)
    end[:-1] = start[1:]
    last = torch.empty_like(end).scatter_(0, order, end)
    return source == torch.arange(n, device=values.device), source, last

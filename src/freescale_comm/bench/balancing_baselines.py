"""The balancing methods freescale's planner is compared with (benchmark-only, not library API).
Each takes lengths_per_rank and per-sample costs and returns dest: [world] int64 arrays.

lpt: Longest Processing Time from scratch: every sample, largest cost first, to the least
loaded rank, wherever it lives. kk: Karmarkar–Karp largest differencing into `world`
partitions of the whole batch, partition j → rank j, as NVIDIA recsys-examples' batch shuffler
and verl's seqlen balancing do (samples move regardless of where they are)."""

from __future__ import annotations

import heapq

import numpy as np

from freescale_comm.planner import lpt_bins


def _flat(costs: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    sizes = [c.size for c in costs]
    return (np.concatenate(costs) if costs else np.zeros(0)), sizes


def _split(flat_dest: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return [a.astype(np.int64) for a in np.split(flat_dest, np.cumsum(sizes)[:-1])]


def none(costs: list[np.ndarray]) -> list[np.ndarray]:
    return [np.full(c.size, r, dtype=np.int64) for r, c in enumerate(costs)]


def lpt(costs: list[np.ndarray]) -> list[np.ndarray]:
    flat, sizes = _flat(costs)
    return _split(lpt_bins(flat, len(costs)), sizes)


def kk(costs: list[np.ndarray]) -> list[np.ndarray]:
    """k-way largest differencing. A partial solution is k slot sums (sorted descending) with a
    group label per slot; merging the two of largest spread pairs the largest slot of one with
    the smallest of the other. Labels are unioned (union-find over samples) instead of copying
    member lists, so a merge costs O(k)."""
    world = len(costs)
    flat, sizes = _flat(costs)
    n = flat.size
    parent = np.arange(n, dtype=np.int64)
    heap = []
    for i in range(n):
        sums = np.zeros(world)
        sums[0] = flat[i]
        labels = np.full(world, -1, dtype=np.int64)
        labels[0] = i
        heap.append((-float(flat[i]), i, sums, labels))  # spread = max - min = cost
    heapq.heapify(heap)
    tick = n
    while len(heap) > 1:
        _, _, a_sums, a_labels = heapq.heappop(heap)
        _, _, b_sums, b_labels = heapq.heappop(heap)
        b_sums, b_labels = b_sums[::-1], b_labels[::-1]  # smallest of b meets largest of a
        both = (a_labels >= 0) & (b_labels >= 0)
        parent[b_labels[both]] = a_labels[both]
        labels = np.where(a_labels >= 0, a_labels, b_labels)
        sums = a_sums + b_sums
        order = np.argsort(-sums, kind="stable")
        sums, labels = sums[order], labels[order]
        heapq.heappush(heap, (-(float(sums[0] - sums[-1])), tick, sums, labels))
        tick += 1
    dest = np.zeros(n, dtype=np.int64)
    if heap:
        _, _, _, labels = heap[0]
        while True:  # pointer jumping to the roots
            grand = parent[parent]
            if np.array_equal(grand, parent):
                break
            parent = grand
        slot_of_root = np.full(n, -1, dtype=np.int64)
        roots = labels >= 0
        slot_of_root[labels[roots]] = np.flatnonzero(roots)
        dest = slot_of_root[parent]
    return _split(dest, sizes)


METHODS = {"none": none, "lpt": lpt, "kk": kk}

"""Which way each output of a balanced module goes home (combine_bundle): one row per sample, or
laid out as one of the balanced features. An output's rows (a JaggedTensor's lengths) tell, and
every rank must pick alike or their AllToAlls differ: a rank where two ways have the same size
cannot tell them apart alone (rows that equal its sample count; two features with as many rows).

Every rank can tell from the plan whether that can happen anywhere (sizes_differ_everywhere). If
not, each rank picks alone; else the ranks agree, in one AllToAll of every output's fits (a
bitmask over the ways, per rank), on the first way that fits on every rank, or all raise alike.
"""

from __future__ import annotations

import functools
import operator
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from freescale_comm._errors import comm_error, ranks_by

SAMPLE = 0  # way 0: one row per sample; way 1 + i: the i-th feature handle of its own
_BITS = 62  # fit bits per int64 word of the exchange


def sizes_differ_everywhere(dest: Sequence[np.ndarray], costs: Sequence[np.ndarray], shares: Sequence[int],
                            follows_cost: Sequence[bool]) -> bool:
    """True when every rank knows from the plan (`dest`, every rank's cost lengths) that on every
    rank the ways home differ in size: every feature with a dispatch of its own (shares < 0) has the
    cost lengths (so its rows on each rank are known; such features share one dispatch), and no
    rank computes as many of their rows as samples."""
    own = [i for i, s in enumerate(shares) if s < 0]
    if not all(follows_cost[i] for i in own) or len(own) > 1:
        return False  # some feature's rows on other ranks are not known here
    if not own:
        return True
    world = len(dest)
    samples = sum(np.bincount(d, minlength=world) for d in dest)
    rows = sum(np.bincount(d, weights=c, minlength=world) for d, c in zip(dest, costs))
    return not bool(np.any(samples == rows))


@dataclass
class _Leaf:
    path: str
    rows: int  # dim-0 entries (a JaggedTensor's values' rows); -1 for a 0-dim tensor
    jagged: bool
    fits: int  # bit w set: way w fits it here
    keyed: Optional[int] = None  # the way of the feature its dict key names, if any


class Ways:
    """A bundle's ways home: the per-sample handle, then each feature handle of its own."""

    def __init__(self, bundle: Any) -> None:
        self.bundle = bundle
        self.handles = [bundle.sample_handle]
        self.names: list[list[str]] = [[]]
        self.of_feature: dict[str, int] = {}
        for name, handle in bundle.handles.items():
            way = next((w for w, h in enumerate(self.handles) if h is handle), None)
            if way is None:
                way = len(self.handles)
                self.handles.append(handle)
                self.names.append([])
            self.names[way].append(name)
            self.of_feature[name] = way

    def fits(self, x: Any, feature: Optional[str], path: str) -> _Leaf:
        """Where `x` (a tensor or a JaggedTensor; `feature`: the dict key naming the feature it
        follows, if any) fits here."""
        keyed = self.of_feature[feature] if feature is not None else None
        candidates = [keyed] if keyed is not None else range(1, len(self.handles))
        if isinstance(x, torch.Tensor):
            rows = x.shape[0] if x.dim() else -1
            fits = int(rows == self.bundle.num_samples)
            for w in candidates:
                fits |= int(self.handles[w].rows_received == rows) << w
            return _Leaf(path, rows, False, fits, keyed)
        lengths = x.lengths().long()
        fits = 0
        for w in candidates:
            received = self.handles[w].recv_lengths
            fits |= int(received.numel() == lengths.numel() and torch.equal(received, lengths)) << w
        return _Leaf(path, x.values().shape[0], True, fits, keyed)

    def chosen(self, leaves: list[_Leaf], agree: bool, priority: int) -> list[int]:
        """Per leaf, the way it goes home: picked here alone, or agreed with every rank (`agree`)."""
        if not agree:
            here = [_View(self.bundle.num_samples, self._feature_rows(), [leaf.rows], [leaf.fits]) for leaf in leaves]
            return [self._pick(leaf, leaf.fits, [view], i=0, everywhere=False) for leaf, view in zip(leaves, here)]
        views = self._exchange(leaves, priority)
        return [self._pick(leaf, functools.reduce(operator.and_, [v.fits[i] for v in views]), views, i, everywhere=True)
                for i, leaf in enumerate(leaves)]

    def _feature_rows(self) -> list[int]:
        return [h.rows_received for h in self.handles[1:]]

    def _pick(self, leaf: _Leaf, fits: int, views: list["_View"], i: int, everywhere: bool) -> int:
        """The way in `fits` that its dict key names, else one row per sample, else the first;
        ValueError if none, or if several features of different lengths fit a tensor (it may follow
        either). (Both a named feature and per-sample rows fit only where every rank computes as
        many of its rows as samples: the key decides; with all lengths 1 the two ways move alike.)"""
        if leaf.keyed is not None and fits >> leaf.keyed & 1:
            return leaf.keyed
        if fits >> SAMPLE & 1:
            return SAMPLE
        ways = [w for w in range(len(self.handles)) if fits >> w & 1]
        where = "on every rank" if everywhere else "here"
        if not ways:
            kind = "JaggedTensor" if leaf.jagged else "tensor"
            ranks = [f"{f'rank {r}' if everywhere else 'here'}: {v.rows[i]} rows ({v.samples} samples; features' rows: "
                     + ", ".join(f"{'/'.join(self.names[w])} {n}" for w, n in enumerate(v.feature_rows, start=1))
                     + ")" for r, v in enumerate(views)]
            raise ValueError(f"{leaf.path}, a {kind}, fits no way home {where} ({'; '.join(ranks)}): an output "
                             "goes home with one row per sample on every rank, or laid out as one balanced feature "
                             "on every rank (a JaggedTensor with its lengths, or a dict entry keyed by its name)")
        if len(ways) > 1 and not leaf.jagged:
            names = [n for w in ways for n in self.names[w]]
            raise ValueError(f"{leaf.path} has as many rows as features {names} of different lengths {where}; return "
                             "a JaggedTensor or a dict keyed by feature so freescale knows which it follows")
        return ways[0]

    def _exchange(self, leaves: list[_Leaf], priority: int) -> list["_View"]:
        """Every rank's view, in rank order: one AllToAll of [layout hash, outputs, samples, each
        feature handle's rows, then per output its rows and fit words]. Outputs of different
        structures: CommError on every rank (their sizes or their hashes differ)."""
        words = -(-len(self.handles) // _BITS)
        shape = "\0".join(f"{leaf.path}:{'j' if leaf.jagged else 't'}" for leaf in leaves) + f"\0{len(self.handles)}"
        mine = [zlib.crc32(shape.encode()), len(leaves), self.bundle.num_samples, *self._feature_rows()]
        for leaf in leaves:
            mine += [leaf.rows, *((leaf.fits >> (_BITS * k)) & ((1 << _BITS) - 1) for k in range(words))]
        comm = self.bundle.sample_handle.comm
        world = comm.world_size
        vector = torch.tensor(mine, dtype=torch.int64)
        out = torch.empty(world * vector.numel(), dtype=torch.int64)
        try:
            comm.all_to_all_single(out, vector.repeat(world), priority=priority)
        except Exception as e:
            code = getattr(e, "code", None)  # the peer whose sizes differ aborts: PEER_ABORTED (SIZE_MISMATCH, ...)
            if code != "SIZE_MISMATCH" and not (code == "PEER_ABORTED" and "SIZE_MISMATCH" in str(e)):
                raise
            raise comm_error(f"ranks returned different numbers of outputs from a balanced module ({len(leaves)} "
                             f"here): every rank's module must return the same structure ({e})", code,
                             getattr(e, "culprit", None)) from e
        rows = out.view(world, -1).tolist()
        by = ranks_by([(v[0], v[1]) for v in rows])
        if len(by) > 1:
            raise comm_error("ranks returned outputs of different structures from a balanced module (" +
                             ", ".join(f"ranks {ranks}: {n} outputs, layout {h:#010x}" for (h, n), ranks in by.items())
                             + "): every rank's module must return the same structure")
        views = []
        features, at = len(self.handles) - 1, 3 + len(self.handles) - 1
        for v in rows:
            leaf_rows, fits = [], []
            for i in range(len(leaves)):
                base = at + i * (1 + words)
                leaf_rows.append(v[base])
                fits.append(sum(v[base + 1 + k] << (_BITS * k) for k in range(words)))
            views.append(_View(v[2], v[3:3 + features], leaf_rows, fits))
        return views


@dataclass
class _View:
    """One rank's sizes: samples computed there, each feature handle's rows there, and per output
    its rows and the ways that fit it there."""

    samples: int
    feature_rows: list[int]
    rows: list[int]
    fits: list[int]

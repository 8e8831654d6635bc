"""Balancing a TorchRec batch as one bundle: the EmbeddingCollection's output (a dict of
JaggedTensors, or a KeyedJaggedTensor) and per-sample tensors of any dtype (labels, timestamps,
num_targets) move under one plan, where FreeScale balances: after the embedding AllToAll, before
the sequence module; outputs come home the same way, gradients follow through autograd.

TorchRec is not a dependency: JaggedTensor-like objects are recognised by their methods (values(),
lengths(), weights_or_none()) and rebuilt with their own type.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch

from freescale_comm._output_layouts import Ways
from freescale_comm.dispatch import (DispatchHandle, Received, combine, dispatch_like, dispatch_received,
                                     grad_for_combine)
from freescale_comm.planner import RebalancePlan


def resolved(x: Any) -> Any:
    """`x`, or what it stands for if it is a TorchRec LazyAwaitable (sharded modules return them;
    they resolve on first use, which a forward pre-hook would otherwise be)."""
    wait = getattr(type(x), "_wait_async", None)
    return wait(x) if callable(wait) else x


def is_jagged(x: object) -> bool:
    """A TorchRec JaggedTensor (or alike): values(), lengths(), weights_or_none()."""
    return all(callable(getattr(x, m, None)) for m in ("values", "lengths", "weights_or_none")) and not is_keyed_jagged(x)


def is_keyed_jagged(x: object) -> bool:
    """A TorchRec KeyedJaggedTensor (or alike): to_dict(), keys() and a from_jt_dict constructor."""
    return callable(getattr(x, "to_dict", None)) and callable(getattr(x, "keys", None)) and \
        callable(getattr(type(x), "from_jt_dict", None))


def has_rows_per_sample(x: object, samples: int) -> bool:
    """A tensor with one row (dim-0 entry) per sample."""
    return isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == samples


def is_keyed_tensor(x: object) -> bool:
    """A TorchRec KeyedTensor (or alike): dense per-key columns, values() [rows, sum of lengths]."""
    return all(callable(getattr(x, m, None)) for m in ("values", "keys", "length_per_key", "key_dim")) and \
        not is_keyed_jagged(x)


def argument_leaves(x: Any, path: str) -> dict[str, Any]:
    """Every tensor (at least one dimension), KeyedTensor and jagged tensor inside a module
    argument, by path: the argument itself, or those inside dicts (by key), lists and tuples at
    any depth. (A jagged one beside the sequences cannot move with them: the caller refuses it.)"""
    if isinstance(x, torch.Tensor):
        return {path: x} if x.dim() >= 1 else {}
    if is_keyed_tensor(x) or is_jagged(x) or is_keyed_jagged(x):
        return {path: x}
    leaves: dict[str, Any] = {}
    if isinstance(x, dict):
        for k, v in sorted(x.items(), key=lambda kv: repr(kv[0])):  # the same order on every rank
            leaves.update(argument_leaves(v, f"{path}/{k!r}"))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            leaves.update(argument_leaves(v, f"{path}/{i}"))
    return leaves


def leaf_rows(leaf: Any) -> Optional[torch.Tensor]:
    """What of an argument leaf would move with its samples: a tensor itself, a KeyedTensor's
    values (key_dim 1: a row per sample); None for others (jagged ones)."""
    if isinstance(leaf, torch.Tensor):
        return leaf
    if is_keyed_tensor(leaf) and leaf.key_dim() == 1:
        return leaf.values()
    return None


def leaf_kind(leaf: Any) -> str:
    """t(ensor), k(eyed tensor) or j(agged), with the device of what would move."""
    rows = leaf_rows(leaf)
    kind = "t" if isinstance(leaf, torch.Tensor) else "k" if is_keyed_tensor(leaf) else "j"
    return kind if rows is None else f"{kind}@{rows.device.type}"


def rebuilt(x: Any, parts: Any) -> Any:
    """`x`, a dict, list or tuple, rebuilt of its own type around `parts`: a dict's entries
    replaced by `parts`' (a copy: its type and what it carries, an OrderedDict's order, a
    defaultdict's factory), a sequence's items all `parts` (a namedtuple takes its fields)."""
    if isinstance(x, dict):
        out = copy.copy(x)
        out.update(parts)
        return out
    return type(x)(*parts) if hasattr(x, "_fields") else type(x)(parts)


def with_moved(x: Any, moved: dict[str, torch.Tensor], path: str) -> Any:
    """The argument rebuilt around its moved leaves (argument_leaves' paths)."""
    if path in moved:
        if isinstance(x, torch.Tensor):
            return moved[path]
        return type(x)(keys=x.keys(), length_per_key=x.length_per_key(), values=moved[path], key_dim=x.key_dim())
    if isinstance(x, dict) and any(p.startswith(path + "/") for p in moved):
        return rebuilt(x, {k: with_moved(v, moved, f"{path}/{k!r}") for k, v in x.items()})
    if isinstance(x, (list, tuple)) and any(p.startswith(path + "/") for p in moved):
        return rebuilt(x, [with_moved(v, moved, f"{path}/{i}") for i, v in enumerate(x)])
    return x


def is_sequence_batch(x: object) -> bool:
    """What dispatch_bundle takes as `sequences`: a KJT, or a non-empty dict of JaggedTensors."""
    return is_keyed_jagged(x) or (isinstance(x, dict) and len(x) > 0 and all(is_jagged(v) for v in x.values()))


def feature_order(features: Any) -> list[Any]:
    """A batch's feature names in the order every rank moves them: sorted by repr. (A dict's or a
    KeyedJaggedTensor's own order may differ between ranks: a dict built from a set of names.)"""
    return sorted(features, key=repr)


def _jagged(like: Any, values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor]) -> Any:
    """A jagged tensor of `like`'s type."""
    return type(like)(values=values, lengths=lengths, weights=weights)


@dataclass(frozen=True)
class BalancedBundle:
    """The samples this rank computes on after LoadBalancer.dispatch_bundle, all under one plan
    (ordered by source rank, then original order)."""

    sequences: Any  # as given: dict of JaggedTensors or a KeyedJaggedTensor, balanced
    per_sample: dict[str, torch.Tensor]  # name -> [samples here, ...]
    source_ranks: torch.Tensor  # int64 [samples here]
    sample_handle: DispatchHandle  # combines per-sample outputs ([samples here, ...])
    handles: dict[str, DispatchHandle]  # feature -> combines row outputs laid out as that feature
    home_lengths: dict[str, torch.Tensor]  # feature -> its lengths before balancing
    plan: RebalancePlan  # the plan every rank computed
    # every rank knows from the plan that per-sample rows and each feature's rows differ in count
    # on every rank (_output_layouts.sizes_differ_everywhere): each rank picks an output's way home alone
    sizes_differ_everywhere: bool = False

    @property
    def num_samples(self) -> int:
        return self.source_ranks.numel()


def bundle_inputs(bundle: BalancedBundle) -> list[torch.Tensor]:
    """The tensors a bundle's dispatch delivered here: each feature's values and weights, each
    per-sample tensor."""
    jts = bundle.sequences.to_dict() if is_keyed_jagged(bundle.sequences) else bundle.sequences
    out = [t for jt in jts.values() for t in (jt.values(), jt.weights_or_none()) if t is not None]
    return out + list(bundle.per_sample.values())


def local_shares(lengths: list[torch.Tensor]) -> list[int]:
    """Per feature: the first earlier feature with equal lengths here, or -1."""
    return [next((j for j in range(i) if torch.equal(lengths[j], lengths[i])), -1) for i in range(len(lengths))]


def agreed_shares(per_rank: list[list[int]]) -> list[int]:
    """Per feature: the earlier feature whose dispatch (counts, layout) it reuses, or -1 for its
    own, from every rank's local_shares. Reuse needs equal lengths on EVERY rank: a local match
    alone would make ranks issue different collectives (a rank whose features are all empty sees
    them equal, its peers may not)."""
    mine = per_rank[0]
    return [s if all(r[i] == s for r in per_rank) else -1 for i, s in enumerate(mine)]


def dispatch_bundle(sequences: Any, per_sample: dict[str, torch.Tensor], cost_lengths: torch.Tensor,
                    dest: torch.Tensor, plan: RebalancePlan, group: Any, priority: int,
                    shares: list[int], cost_received: Received, follows_cost: list[bool],
                    sizes_differ_everywhere: bool = False, feature_grads: Optional[dict[Any, tuple[bool, bool]]] = None,
                    sample_grads: Optional[dict[str, bool]] = None) -> BalancedBundle:
    """Moves every feature of `sequences` and every per-sample tensor to `dest` (int64 [samples]).
    Features move in feature_order (`shares` and `follows_cost` index it); the result keeps this
    rank's own order. Features with equal lengths on every rank (`shares`, see agreed_shares) share one dispatch's
    counts; weights and per-sample tensors ride on handles already made (one AllToAll each).
    cost_received: the samples this rank receives (their cost lengths, their source ranks), known
    from the plan: the per-sample handle and every feature whose lengths are the cost lengths on
    every rank (`follows_cost`) need no counts or lengths exchanged. feature_grads (name -> values',
    weights' requires_grad on some rank) and sample_grads (per_sample name -> the same): what every
    rank's moved copy must require (default: each rank's own)."""
    feature_grads, sample_grads = feature_grads or {}, sample_grads or {}
    jts = sequences.to_dict() if is_keyed_jagged(sequences) else sequences
    ones = torch.ones(cost_lengths.numel(), dtype=torch.int64, device=cost_lengths.device)
    # The per-sample handle: nothing per sample moves (a handle for per-sample tensors and outputs).
    first = dispatch_received(torch.empty(ones.numel(), 0, device=cost_lengths.device), ones, dest,
                              (torch.ones_like(cost_received[0]), cost_received[1]), group=group, priority=priority,
                              move=False)
    handles: dict[str, DispatchHandle] = {}
    balanced: dict[str, Any] = {}
    made: list[tuple[torch.Tensor, DispatchHandle, torch.Tensor]] = []  # per feature: (lengths, handle, received)
    for i, name in enumerate(feature_order(jts)):
        jt = jts[name]
        lengths = jt.lengths().long()
        values_grad, weights_grad = feature_grads.get(name, (None, None))
        if shares[i] < 0:
            res = dispatch_received(jt.values(), lengths, dest, cost_received if follows_cost[i] else None,
                                    group=group, priority=priority, grad=values_grad)
            found = (lengths, res.handle, res.lengths)
            values = res.values
        else:
            found = made[shares[i]]
            values = dispatch_like(jt.values(), found[1], priority=priority, grad=values_grad)
        made.append(found)
        weights = jt.weights_or_none()
        if weights is not None:
            weights = dispatch_like(weights, found[1], priority=priority, grad=weights_grad)
        handles[name] = found[1]
        balanced[name] = _jagged(jt, values, found[2].to(jt.lengths().dtype), weights)  # (int32 stays int32)
    moved = {name: dispatch_like(per_sample[name], first.handle, priority=priority, grad=sample_grads.get(name))
             for name in sorted(per_sample, key=repr)}  # one order on every rank, whatever each dict's
    # every handle's combines require grad where anything of the bundle did on some rank: an output
    # computed from one feature may go home laid out as another, or per sample
    bundle_grad = any(any(flags) for flags in feature_grads.values()) or any(sample_grads.values()) or \
        any(t.requires_grad for t in [*moved.values(), *(jt.values() for jt in balanced.values())])
    for handle in [first.handle, *handles.values()]:
        grad_for_combine(handle, bundle_grad)
    balanced = {name: balanced[name] for name in jts}  # this rank's own order
    out = type(sequences).from_jt_dict(balanced) if is_keyed_jagged(sequences) else balanced
    home = {name: jt.lengths().long() for name, jt in jts.items()}
    return BalancedBundle(out, moved, first.source_ranks, first.handle, handles, home, plan, sizes_differ_everywhere)


def combine_bundle(output: Any, bundle: BalancedBundle, priority: int = 0) -> Any:
    """Sends `output` (computed on the bundle's samples) home. A tensor with one row per sample
    → per-sample handle; a JaggedTensor → the feature whose lengths it has; a tensor with as many
    rows as a feature (all such features alike) → that feature's handle; dicts, lists and tuples
    → each entry (a dict key naming a feature picks it); anything else is returned as is. Every
    rank picks each output's way alike (see freescale_comm._output_layouts)."""
    ways = Ways(bundle)
    leaves: list[Any] = []
    _walk(output, bundle, None, "output", lambda x, feature, path: leaves.append(ways.fits(x, feature, path)))
    chosen = iter(ways.chosen(leaves, agree=not bundle.sizes_differ_everywhere, priority=priority))

    def home(x: Any, feature: Optional[str], path: str) -> Any:
        way = next(chosen)
        handle = ways.handles[way]
        if isinstance(x, torch.Tensor):
            return combine(x, handle, priority=priority)
        weights = x.weights_or_none()
        home_lengths = bundle.home_lengths[ways.names[way][0]].to(x.lengths().dtype)  # the output's own dtype
        return _jagged(x, combine(x.values(), handle, priority=priority), home_lengths,
                       None if weights is None else combine(weights, handle, priority=priority))

    return _walk(output, bundle, None, "output", home, rebuild=True)


def _walk(x: Any, bundle: BalancedBundle, feature: Optional[str], path: str, visit: Any, rebuild: bool = False) -> Any:
    """Calls visit(leaf, feature, path) on every tensor and JaggedTensor inside `x`, in one order on
    every rank (dict entries by their keys' repr; the rebuilt dict keeps its own order);
    `feature`: the dict key naming the feature a leaf follows, if any. With `rebuild`, returns `x`
    rebuilt around what visit returned."""
    if isinstance(x, torch.Tensor) or is_jagged(x):
        out = visit(x, feature, path)
        return out if rebuild else None
    if is_keyed_jagged(x):
        parts = _walk(x.to_dict(), bundle, None, path, visit, rebuild)
        return type(x).from_jt_dict(parts) if rebuild else None
    if isinstance(x, dict):  # entries in one order on every rank (a dict built from a set may differ)
        parts = {k: _walk(x[k], bundle, k if k in bundle.handles else None, f"{path}[{k!r}]", visit, rebuild)
                 for k in sorted(x, key=repr)}
        return rebuilt(x, parts) if rebuild else None
    if isinstance(x, (list, tuple)):
        parts = [_walk(v, bundle, None, f"{path}[{i}]", visit, rebuild) for i, v in enumerate(x)]
        return rebuilt(x, parts) if rebuild else None
    return x if rebuild else None

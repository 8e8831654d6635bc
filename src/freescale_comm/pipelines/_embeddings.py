"""A batch's sparse features to per-slot asks (requester side), and received rows back to what the
sharded modules return: EmbeddingCollection -> {feature: JaggedTensor}, EmbeddingBagCollection ->
KeyedTensor. The received rows are autograd leaves: after backward their .grad is what each slot's
owner must apply."""

from __future__ import annotations

from typing import Any, Optional

import torch

from freescale_comm._device_copy import on_device
from freescale_comm.pipelines._catalog import Catalog, ModuleInfo
from freescale_comm.pipelines._exchange import Asks, MicroAsk
from freescale_comm.pipelines._host_counts import distinct, first_uses, positions, stable_order
from freescale_comm.pipelines._packed_ids import pack, packs


def route(catalog: Catalog, features: dict[str, Any], step: int) -> Asks:
    """Asks for one batch. `features`: module fqn -> the KeyedJaggedTensor it is called with.
    Reads the ids' values on the host once (every feature's id range and, row-wise, its ids per
    shard, in one transfer: one device sync on CUDA, not one per feature and shard)."""
    return _routed(catalog, [features], step)[0]


def route_micro(catalog: Catalog, micro_features: list[dict[str, Any]], step: int) -> Asks:
    """Asks for one batch cut into micro-batches (`micro_features`: per micro-batch, module fqn ->
    its KeyedJaggedTensor): per slot, each micro-batch's distinct rows, micro-batch after
    micro-batch (Asks.wire: what the ids message carries, each distinct row of the batch once with
    the micro-batches reading it, _packed_ids). A row two micro-batches read moves once, with the first (the
    values are frozen within the batch, so the later micro-batch copies it from there: Asks.fresh,
    reuse_rows), and its gradient, summed over both, goes once, with the last (Asks.last,
    accumulate_gradients). Two host reads for the batch: the
    ids' ranges and shards of every micro-batch, then the distinct rows of every micro-batch and slot."""
    parts = _routed(catalog, micro_features, step)
    micro = [MicroAsk([], [], [], p.positions) for p in parts]
    packed = packs(catalog, len(parts))
    rows, wire = [], []
    for unique, counts, inverses, *union in distinct([[part.rows[s] for part in parts]
                                                      for s in range(len(catalog.slots))], union=packed):
        start = 0
        for m, count, inverse in zip(micro, counts, inverses):
            m.start.append(start)
            m.count.append(count)
            m.inverse.append(inverse)
            start += count
        rows.append(unique)
        if packed:
            wire.append(pack(*union, len(parts)))
    asks = Asks(rows=rows, positions=[None] * len(catalog.slots), step=step, micro=micro,
                wire=wire if packed else None)
    if len(micro) > 1:
        uses = [first_uses(r) for r in rows]
        asks.fresh, asks.source, asks.last = ([u[i] for u in uses] for i in range(3))
    return asks


def _routed(catalog: Catalog, batches: list[dict[str, Any]], step: int) -> list[Asks]:
    """route() of each of `batches` (module fqn -> KeyedJaggedTensor), with one host read for all."""
    founds = [_found(catalog, features) for features in batches]
    stats = [_stats(found) for found in founds]
    flat = [t for per in stats for t in per]
    host = torch.cat(flat).tolist() if flat else []
    out, at = [], 0
    for found, per in zip(founds, stats):
        size = sum(t.numel() for t in per)
        out.append(_asks(catalog, found, host[at:at + size], step))
        at += size
    return out


def _found(catalog: Catalog, features: dict[str, Any]) -> list[tuple[Any, Any, str, torch.Tensor, Optional[torch.Tensor]]]:
    """Per sharded feature: (module, table, feature, int64 ids, row-wise: each id's shard, else None).
    ValueError naming what is missing or unsupported."""
    found = []
    for info in catalog.modules:
        kjt = features[info.fqn]
        if getattr(kjt, "variable_stride_per_key", lambda: False)():
            raise ValueError(f"the input of {info.fqn!r} has a variable batch size per feature (VBE): not supported")
        present = set(kjt.keys())
        for table in info.tables:
            for feature in table.features:
                if feature not in present:
                    raise ValueError(f"the input of {info.fqn!r} has no feature {feature!r} (table {table.name!r}); "
                                     f"it has {sorted(present)}")
                ids = kjt[feature].values().to(torch.int64)
                shard = None
                if table.sharding == "row_wise":
                    starts = on_device([s.row0 for s in table.slots[feature][1:]], ids.device)
                    shard = torch.bucketize(ids, starts, right=True)  # in [0, shards) for any id
                found.append((info, table, feature, ids, shard))
    return found


def _stats(found: list) -> list[torch.Tensor]:
    """On the device, per feature: its ids' min and max (0, 0 when it has none), then row-wise its
    ids per shard."""
    stats = []
    for _, table, feature, ids, shard in found:
        stats.append(torch.stack([ids.min(), ids.max()]) if ids.numel() else ids.new_zeros(2))
        if shard is not None:
            stats.append(torch.zeros(len(table.slots[feature]), dtype=torch.int64, device=ids.device)
                         .scatter_add_(0, shard, torch.ones_like(shard)))
    return stats


def _asks(catalog: Catalog, found: list, host: list[int], step: int) -> Asks:
    """The Asks of one batch from _found() and its _stats() read on the host; ValueError naming a
    feature with ids outside its table."""
    rows: list = [None] * len(catalog.slots)
    positions: list = [None] * len(catalog.slots)
    at = 0
    for info, table, feature, ids, shard in found:
        low, high = host[at:at + 2]
        at += 2
        if low < 0 or high >= table.num_embeddings:
            raise ValueError(f"feature {feature!r} of {info.fqn!r} has ids outside [0, {table.num_embeddings}) "
                             f"(table {table.name!r}): {low}..{high}")
        slots = table.slots[feature]
        if shard is not None:
            counts = host[at:at + len(slots)]
            at += len(slots)
            # each shard's ids in feature order: a stable sort by shard, cut by the counts read
            for slot, where in zip(slots, stable_order(shard).split(counts)):
                rows[slot.index] = ids[where] - slot.row0
                positions[slot.index] = where
        else:  # table-wise: one slot; column-wise: every column shard gets every id
            for slot in slots:
                rows[slot.index] = ids
    return Asks(rows=rows, positions=positions, step=step)


def micro_leaves(asks: Asks, m: int, requires_grad: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Micro-batch m's rows per slot as autograd leaves ([count, cols], a view of the received
    rows: their .grad is what the micro-batch adds to each row's gradient), and per slot the rows
    each of its ids reads ([ids, cols]: the leaves indexed, for module_output)."""
    micro = asks.micro[m]
    reuse_rows(asks, m)
    leaves = [asks.pieces[s][a:a + n].detach().requires_grad_(requires_grad)
              for s, (a, n) in enumerate(zip(micro.start, micro.count))]
    return leaves, [leaf.index_select(0, inverse) for leaf, inverse in zip(leaves, micro.inverse)]


def reuse_rows(asks: Asks, m: int) -> None:
    """Copies micro-batch m's rows that an earlier micro-batch of the batch also reads (they moved
    once, with that one: Asks.fresh) from there into m's own. Every first entry has arrived by then:
    micro-batches fetch in order, and each starts after its own fetch."""
    if asks.fresh is None or m == 0:
        return
    micro = asks.micro[m]
    for s, (a, n) in enumerate(zip(micro.start, micro.count)):
        repeats = n - asks.fresh_counts[s][m]
        if repeats:
            at = a + positions(~asks.fresh[s][a:a + n], repeats)
            asks.pieces[s].index_copy_(0, at, asks.pieces[s].index_select(0, asks.source[s].index_select(0, at)))


def accumulate_gradients(asks: Asks, totals: list[torch.Tensor], m: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Adds micro-batch m's gradients (per slot [its rows, cols]) to each row's total over the
    batch's micro-batches so far (totals: per slot [n_s, cols], kept at each row's first entry,
    summed in micro-batch order) and returns per slot the total of each of m's entries' rows: final
    at the rows' last entries, the ones that send it (Asks.last). Whole batches: grads as given."""
    if asks.last is None:
        return grads
    out = []
    micro = asks.micro[m]
    for s, (a, n) in enumerate(zip(micro.start, micro.count)):
        first = asks.source[s][a:a + n]  # distinct within a micro-batch: each row added once
        totals[s].index_add_(0, first, grads[s])
        out.append(totals[s].index_select(0, first))
    return out


def module_output(info: ModuleInfo, kjt: Any, leaves: list[torch.Tensor], positions: list) -> Any:
    """What the sharded module `info` returns for input `kjt`, built from the per-slot row leaves
    (`positions`: per slot, where its rows sit in their feature; None: all of them, in order)."""
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

    by_feature = {}
    keys, stride, all_lengths = kjt.keys(), kjt.stride(), kjt.lengths()
    for table in info.tables:
        for feature in table.features:
            slots = table.slots[feature]
            at = keys.index(feature) * stride  # the lengths are key-major [keys * stride] (no VBE: route refused it)
            lengths = all_lengths[at:at + stride]  # (a view: kjt[feature] would build a JaggedTensor)
            # the feature's ids, from the leaves' shapes (no host read): row-wise shards split them,
            # every other slot has them all
            n = sum(leaves[s.index].shape[0] for s in slots) if table.sharding == "row_wise" \
                else leaves[slots[0].index].shape[0]
            if info.pooled:
                bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                               output_size=n)
                parts = []
                for slot in slots:
                    where = bags if positions[slot.index] is None else bags[positions[slot.index]]
                    leaf = leaves[slot.index]
                    parts.append(leaf.new_zeros(lengths.numel(), slot.cols).index_add(0, where, leaf))
                if table.sharding == "row_wise":  # partial sums per shard, added in shard (rank) order
                    pooled = parts[0]
                    for p in parts[1:]:
                        pooled = pooled + p
                else:
                    pooled = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
                if table.pooling == "MEAN":
                    pooled = pooled * (1.0 / lengths.clamp(min=1).to(pooled.dtype)).unsqueeze(1)
                by_feature[feature] = pooled
            else:
                if table.sharding == "row_wise":
                    values = leaves[slots[0].index].new_zeros(n, table.dim)
                    for slot in slots:
                        values = values.index_copy(0, positions[slot.index], leaves[slot.index])
                elif table.sharding == "column_wise":
                    values = torch.cat([leaves[s.index] for s in slots], dim=1)
                else:
                    values = leaves[slots[0].index]
                by_feature[feature] = JaggedTensor(values=values, lengths=lengths)
    if info.pooled:
        return KeyedTensor(keys=list(info.output_keys), length_per_key=list(info.output_dims),
                           values=torch.cat([by_feature[k] for k in info.output_keys], dim=1))
    return {k: by_feature[k] for k in sequence_features(info)}


def sequence_features(info: ModuleInfo) -> list[str]:
    """An EmbeddingCollection's output features, in the order module_output gives them (TorchRec's:
    its embedding names, then any other feature table by table)."""
    features = [f for table in info.tables for f in table.features]
    order = [k for k in info.output_keys if k in features]
    return list(dict.fromkeys(order + features))  # once each (a column-wise table names its feature per shard)


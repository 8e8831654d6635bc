"""A batch's sparse features to per-slot asks (requester side), and received rows back to what the
sharded modules return: EmbeddingCollection -> {feature: JaggedTensor}, EmbeddingBagCollection ->
KeyedTensor. The received rows are autograd leaves: after backward their .grad is what each slot's
owner must apply."""

from __future__ import annotations

from typing import Any

import torch

from freescale_comm.pipelines._catalog import Catalog, ModuleInfo
from freescale_comm.pipelines._exchange import Asks, MicroAsk


def route(catalog: Catalog, features: dict[str, Any], step: int) -> Asks:
    """Asks for one batch. `features`: module fqn -> the KeyedJaggedTensor it is called with."""
    rows: list = [None] * len(catalog.slots)
    positions: list = [None] * len(catalog.slots)
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
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.num_embeddings):
                    raise ValueError(f"feature {feature!r} of {info.fqn!r} has ids outside [0, {table.num_embeddings}) "
                                     f"(table {table.name!r}): {int(ids.min())}..{int(ids.max())}")
                slots = table.slots[feature]
                if table.sharding == "row_wise":
                    starts = torch.tensor([s.row0 for s in slots[1:]], dtype=torch.int64, device=ids.device)
                    shard = torch.bucketize(ids, starts, right=True)
                    for k, slot in enumerate(slots):
                        where = torch.nonzero(shard == k).squeeze(1)
                        rows[slot.index] = ids[where] - slot.row0
                        positions[slot.index] = where
                else:  # table-wise: one slot; column-wise: every column shard gets every id
                    for slot in slots:
                        rows[slot.index] = ids
    return Asks(rows=rows, positions=positions, step=step)


def route_micro(catalog: Catalog, micro_features: list[dict[str, Any]], step: int) -> Asks:
    """Asks for one batch cut into micro-batches (`micro_features`: per micro-batch, module fqn ->
    its KeyedJaggedTensor): per slot, each micro-batch's distinct rows, micro-batch after
    micro-batch (a row two micro-batches read is asked twice: the values are frozen within the
    batch, and each micro-batch's AllToAll is its own)."""
    parts = [route(catalog, features, step) for features in micro_features]
    micro = [MicroAsk([], [], [], p.positions) for p in parts]
    rows = []
    for s in range(len(catalog.slots)):
        start = 0
        distinct = []
        for part, m in zip(parts, micro):
            unique, inverse = torch.unique(part.rows[s], return_inverse=True)
            m.start.append(start)
            m.count.append(unique.numel())
            m.inverse.append(inverse)
            distinct.append(unique)
            start += unique.numel()
        rows.append(torch.cat(distinct))
    return Asks(rows=rows, positions=[None] * len(catalog.slots), step=step, micro=micro)


def micro_leaves(asks: Asks, m: int, requires_grad: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Micro-batch m's rows per slot as autograd leaves ([count, cols], a view of the received
    rows: their .grad is what the micro-batch adds to each row's gradient), and per slot the rows
    each of its ids reads ([ids, cols]: the leaves indexed, for module_output)."""
    micro = asks.micro[m]
    leaves = [asks.pieces[s][a:a + n].detach().requires_grad_(requires_grad)
              for s, (a, n) in enumerate(zip(micro.start, micro.count))]
    return leaves, [leaf.index_select(0, inverse) for leaf, inverse in zip(leaves, micro.inverse)]


def module_output(info: ModuleInfo, kjt: Any, leaves: list[torch.Tensor], positions: list) -> Any:
    """What the sharded module `info` returns for input `kjt`, built from the per-slot row leaves
    (`positions`: per slot, where its rows sit in their feature; None: all of them, in order)."""
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

    by_feature = {}
    for table in info.tables:
        for feature in table.features:
            slots = table.slots[feature]
            lengths = kjt[feature].lengths()
            n = int(lengths.sum())
            if info.pooled:
                bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
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
    order = [k for k in info.output_keys if k in by_feature]
    return {k: by_feature[k] for k in order + [k for k in by_feature if k not in order]}


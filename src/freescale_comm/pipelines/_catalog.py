"""What a DistributedModelParallel model's sharded embeddings look like to the PEC pipeline: every
rank builds the same global list of *slots* from the sharding plan, and finds the shards it owns in
its TBEs (fbgemm's SplitTableBatchedEmbeddingBagsCodegen, whose fused backward is the optimizer).

A slot is one (sharded module, feature, table shard): the unit of every message. Ids of feature f
go to the slots of f's table: table-wise one, row-wise the shard holding the row, column-wise every
column shard. Slots are numbered identically on every rank (module, table config, feature, shard
order), so per-slot counts and blocks need no names on the wire."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

SUPPORTED_SHARDINGS = ("table_wise", "row_wise", "column_wise")
# Kernels whose TBE weights split_embedding_weights() views directly. Not "fused_uvm_caching": its
# write-back cache holds updated rows that a read of the UVM weights would miss (stale reads).
FUSED_KERNELS = ("fused", "fused_uvm")


@dataclass(frozen=True)
class Slot:
    index: int  # position in Catalog.slots (same on every rank)
    module: str  # fqn of the sharded module in the model
    feature: str
    table: str
    shard: int  # shard index within the table: row-wise by first row, column-wise by first column
    owner: int  # rank holding the shard
    row0: int  # first global row of the shard
    rows: int
    col0: int  # first column of the shard
    cols: int

    @property
    def key(self) -> tuple[str, str, int]:
        """The table shard: slots of features sharing a table share it (and its rows)."""
        return (self.module, self.table, self.shard)


@dataclass
class TableInfo:
    name: str
    features: list[str]
    dim: int
    num_embeddings: int
    sharding: str  # one of SUPPORTED_SHARDINGS
    pooling: Optional[str]  # "SUM" / "MEAN" for an EmbeddingBagCollection, None for sequences
    slots: dict[str, list[Slot]] = field(default_factory=dict)  # feature -> its slots, shard order


@dataclass
class ModuleInfo:
    fqn: str
    pooled: bool  # EmbeddingBagCollection (pooled KeyedTensor) vs EmbeddingCollection (jagged)
    tables: list[TableInfo]
    module: nn.Module  # the sharded module
    output_keys: list[str] = field(default_factory=list)  # pooled: the KeyedTensor's keys, in order
    output_dims: list[int] = field(default_factory=list)

    def table_of(self, feature: str) -> TableInfo:
        for t in self.tables:
            if feature in t.features:
                return t
        raise KeyError(feature)


@dataclass
class LocalShard:
    """A table shard this rank owns: its weights (a view of the TBE's) and how to update them
    through the TBE's fused backward."""

    weight: torch.Tensor  # [rows, cols], a view: reads see every update
    tbe: nn.Module  # SplitTableBatchedEmbeddingBagsCodegen
    tbe_features: dict[str, int]  # feature -> its index among the TBE's features


@dataclass
class Catalog:
    modules: list[ModuleInfo]
    slots: list[Slot]
    local: dict[tuple[str, str, int], LocalShard]  # slot.key -> this rank's shard
    # why this rank cannot prioritize its own shards (what only its TBEs say), None if it can: every
    # rank learns it at construction and refuses together (a rank refusing alone would leave its
    # peers waiting for it)
    refusal: Optional[str] = None

    def owned_by(self, rank: int) -> list[Slot]:
        return [s for s in self.slots if s.owner == rank]


def _sharded_types() -> tuple[type, type]:
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    return ShardedEmbeddingCollection, ShardedEmbeddingBagCollection


def sharded_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(fqn, module) of every sharded EmbeddingCollection / EmbeddingBagCollection in `model`.
    ValueError for TorchRec's own PEC collection (its sharder is a default from TorchRec 1.9 on):
    its inner collection is driven by TorchRec's TrainPipelinePEC, not by this pipeline."""
    try:
        from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection
    except ImportError:  # TorchRec without its PEC module
        ShardedPECEmbeddingCollection = ()
    ec, ebc = _sharded_types()
    found = []
    for name, m in model.named_modules():
        if ShardedPECEmbeddingCollection and isinstance(m, ShardedPECEmbeddingCollection):
            raise ValueError(f"{name!r} is TorchRec's PECEmbeddingCollection: fc.TrainPipelinePEC prioritizes plain "
                             "EmbeddingCollection / EmbeddingBagCollection modules; use an EmbeddingCollection there")
        if isinstance(m, (ec, ebc)):
            found.append((name, m))
    return found


def _owner(placement: object) -> int:
    rank = placement.rank() if hasattr(placement, "rank") else None
    if rank is None:
        raise ValueError(f"a shard has no rank in its placement {placement!r}")
    return int(rank)


def _table_info(module_fqn: str, config: object, sharding: object, pooled: bool) -> TableInfo:
    name = config.name
    kind = sharding.sharding_type
    if kind not in SUPPORTED_SHARDINGS:
        raise ValueError(f"table {name!r} of {module_fqn!r} is sharded {kind!r}: the PEC pipeline prioritizes "
                         f"{', '.join(SUPPORTED_SHARDINGS)} tables only; re-plan it with one of those "
                         "(e.g. torchrec.distributed.sharding_plan.row_wise())")
    if sharding.compute_kernel not in FUSED_KERNELS:
        raise ValueError(f"table {name!r} of {module_fqn!r} uses compute kernel {sharding.compute_kernel!r}: the PEC "
                         f"pipeline updates tables through their fused optimizer ({', '.join(FUSED_KERNELS)})")
    data_type = getattr(getattr(config, "data_type", None), "name", "FP32")
    if data_type != "FP32":  # from the config, the same on every rank (a local check could split them)
        raise ValueError(f"table {name!r} of {module_fqn!r} holds {data_type}: the PEC pipeline moves float32 rows")
    pooling = None
    if pooled:
        pooling = getattr(config.pooling, "name", str(config.pooling))
        if pooling not in ("SUM", "MEAN"):
            raise ValueError(f"table {name!r} of {module_fqn!r} pools with {pooling}: only SUM and MEAN are supported")
    return TableInfo(name=name, features=list(config.feature_names), dim=config.embedding_dim,
                     num_embeddings=config.num_embeddings, sharding=kind, pooling=pooling)


def _shards(table: TableInfo, sharding: object) -> list[tuple[int, int, int, int, int]]:
    """(owner, row0, rows, col0, cols) of each shard, in row (row-wise) or column order."""
    spec = sharding.sharding_spec
    if spec is None:  # table-wise plans may carry only ranks
        return [(int(sharding.ranks[0]), 0, table.num_embeddings, 0, table.dim)]
    shards = [(_owner(m.placement), m.shard_offsets[0], m.shard_sizes[0], m.shard_offsets[1], m.shard_sizes[1])
              for m in spec.shards]
    return sorted(shards, key=lambda s: (s[1], s[3]))


def _local_shards(module: nn.Module) -> dict[tuple[str, int, int], tuple]:
    """(table, row0, col0) -> (TBE, table index in it, {feature: TBE feature index}) for every shard
    in this rank's lookups."""
    found = {}
    for lookup in module._lookups:
        while isinstance(lookup, nn.parallel.DistributedDataParallel):  # wrapped lookups (maybe more than once)
            lookup = lookup.module
        for emb in getattr(lookup, "_emb_modules", []):
            tbe = getattr(emb, "_emb_module", None)
            if tbe is None or not hasattr(tbe, "split_embedding_weights"):
                continue
            weights = tbe.split_embedding_weights()
            feature_index = 0
            for t_index, table in enumerate(emb._config.embedding_tables):
                features = {f: feature_index + i for i, f in enumerate(table.feature_names)}
                feature_index += len(table.feature_names)
                meta = table.local_metadata
                row0, col0 = (meta.shard_offsets[0], meta.shard_offsets[1]) if meta is not None else (0, 0)
                found[(table.name, row0, col0)] = (tbe, weights[t_index], features)
    return found


def build_catalog(model: nn.Module, plan: object, rank: int) -> Catalog:
    """The catalog of `model`'s (DMP's inner module) sharded EC/EBC tables under `plan`. Raises
    ValueError naming the table for what the pipeline cannot prioritize."""
    ec_type, _ = _sharded_types()
    modules, slots, local = [], [], {}
    refusals: list[str] = []
    for fqn, module in sharded_modules(model):
        pooled = not isinstance(module, ec_type)
        configs = module._embedding_bag_configs if pooled else module._embedding_configs
        names = [c.name for c in configs]
        if pooled and getattr(module, "_is_weighted", False):
            raise ValueError(f"{fqn!r} (tables {names}) is a weighted EmbeddingBagCollection (per-id weights, as a "
                             "FeatureProcessedEmbeddingBagCollection's position weights): not supported")
        if not pooled and getattr(module, "_need_indices", False):
            raise ValueError(f"{fqn!r} is an EmbeddingCollection with need_indices=True: not supported")
        if getattr(module, "qcomm_codecs_registry", None):
            raise ValueError(f"{fqn!r} (tables {names}) sends embeddings through quantized comms (its sharder's "
                             f"qcomm_codecs_registry: {sorted(module.qcomm_codecs_registry)}): the PEC pipeline "
                             "moves float32 rows and gradients; build the sharders without qcomm_codecs_registry")
        module_plan = plan.plan.get(fqn)
        if module_plan is None:
            holders = [p for p in plan.plan if fqn.startswith(p + ".")]
            raise ValueError(f"sharded module {fqn!r} (tables {names}) is planned as part of {holders[0]!r}, a wrapper "
                             "(feature processors, managed collisions): not supported" if holders else
                             f"sharded module {fqn!r} is not in the model's sharding plan")
        tables = []
        seen: dict[str, str] = {}
        for config in configs:
            for feature in config.feature_names:
                if feature in seen:
                    raise ValueError(f"feature {feature!r} of {fqn!r} feeds tables {seen[feature]!r} and {config.name!r}: "
                                     "shared features (TorchRec names them feature@table) are not supported")
                seen[feature] = config.name
        owned = _local_shards(module)
        for config in configs:
            sharding = module_plan.get(config.name) if hasattr(module_plan, "get") else module_plan[config.name]
            table = _table_info(fqn, config, sharding, pooled)
            shards = _shards(table, sharding)
            for shard_index, (owner, row0, rows, col0, cols) in enumerate(shards):
                for feature in table.features:
                    slot = Slot(len(slots), fqn, feature, table.name, shard_index, owner, row0, rows, col0, cols)
                    slots.append(slot)
                    table.slots.setdefault(feature, []).append(slot)
                if owner == rank:
                    entry = owned.get((table.name, row0, col0))
                    if entry is None:
                        refusals.append(f"rank {rank} owns shard {shard_index} of table {table.name!r} in {fqn!r} "
                                        "but holds no fused TBE for it")
                        continue
                    tbe, weight, features = entry
                    if getattr(tbe, "output_dtype", _FP32) != _FP32:
                        refusals.append(f"table {table.name!r} in {fqn!r} looks up embeddings as "
                                        f"{_sparse_type_name(tbe.output_dtype)} (fused_params output_dtype): the PEC "
                                        "pipeline hands out float32 rows")
                    local[(fqn, table.name, shard_index)] = LocalShard(weight, tbe, features)
            tables.append(table)
        info = ModuleInfo(fqn, pooled, tables, module)
        if pooled:
            info.output_keys, info.output_dims = list(module._embedding_names), list(module._embedding_dims)
        else:  # the sharded EC's dict order: by sharding type, as TorchRec builds it
            info.output_keys = [n for names in getattr(module, "_embedding_names_per_sharding", []) for n in names]
        modules.append(info)
    if not modules:
        raise ValueError("the model holds no sharded EmbeddingCollection or EmbeddingBagCollection: nothing to "
                         "prioritize (use TorchRec's TrainPipelineSparseDist)")
    dtypes = {s.weight.dtype for s in local.values()}
    if len(dtypes) > 1 or (dtypes and torch.float32 not in dtypes):
        refusals.append(f"the PEC pipeline moves float32 embedding rows; rank {rank}'s tables hold "
                        f"{sorted(map(str, dtypes))}")
    return Catalog(modules, slots, local, refusals[0] if refusals else None)


_FP32 = 0  # fbgemm's SparseType.FP32.as_int(), a TBE's output_dtype for float32 lookups


def _sparse_type_name(code: int) -> str:
    try:
        from fbgemm_gpu.split_embedding_configs import SparseType
        return next(t.name for t in SparseType if t.as_int() == code)
    except (ImportError, StopIteration, AttributeError):
        return f"SparseType {code}"

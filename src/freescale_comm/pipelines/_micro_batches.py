"""Frozen-window pipelining's batch side: a batch cut into micro-batches by key-centric clustering
(fc.microbatch), each micro-batch a batch of the user's own type, and the micro-batches' outputs
put back in the batch's sample order.

A batch is cut along its samples: every KeyedJaggedTensor keeps its keys and takes the chosen
samples' lists, a JaggedTensor the chosen samples' lists, a KeyedTensor the chosen rows; every
tensor whose first dimension is the batch size takes the chosen rows (a [B, B] tensor too: by
its first dimension), a NumPy array too; dataclasses, dicts, lists, tuples and other objects are
cut field by field (attribute by attribute, on a shallow copy); numbers, strings, bytes, enums,
devices, dtypes and None are kept (a batch that stores its own size in an int needs split_batch).
Refused (ValueError naming the field: pass split_batch): a list of as many numbers or strings as
samples (one per sample, or a coincidence?), and a number a dataclass sets after __init__
(init=False: derived from the batch?).
Anything else: pass `split_batch` to the pipeline."""

from __future__ import annotations

import copy
import dataclasses
import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from freescale_comm._device_copy import to_device
from freescale_comm.microbatch import cluster_microbatches
from freescale_comm.pipelines._catalog import Catalog
from freescale_comm.pipelines._host_counts import stable_order

SplitBatch = Callable[[Any, torch.Tensor], Any]  # (batch, int64 sample indices) -> micro-batch
# values a batch holds that are no sample's, kept as they are (a list of as many as samples: refused)
_ATOMS = (type(None), bool, int, float, str, bytes, torch.device, torch.dtype, enum.Enum)


@dataclass
class MicroBatches:
    """One batch cut into micro-batches (every rank has the same number; some may be empty)."""

    batches: list[Any]  # the user's batch type, one per micro-batch
    inputs: list[dict[str, Any]]  # per micro-batch: sharded module fqn -> its KeyedJaggedTensor
    samples: list[torch.Tensor]  # per micro-batch: int64 indices of its samples in the batch
    size: int  # samples in the batch
    # the lengths on the host of each KeyedJaggedTensor cut and of each one cut from it
    host_lengths: "HostLengths" = field(default_factory=lambda: HostLengths())


class HostLengths:
    """KeyedJaggedTensors' lengths on the host (int64 [keys, samples]), each read from the device at
    most once. Holds the tensors it knows, so an id is never reused while its entry lives."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[Any, np.ndarray]] = {}

    def of(self, kjt: Any) -> np.ndarray:
        """kjt's lengths, key-major as TorchRec keeps them; one device read the first time."""
        entry = self._known.get(id(kjt))
        if entry is None or entry[0] is not kjt:
            lengths = kjt.lengths().to(torch.int64).cpu().numpy().reshape(len(kjt.keys()), int(kjt.stride()))
            entry = self._known[id(kjt)] = (kjt, lengths)
        return entry[1]

    def put(self, kjt: Any, lengths: np.ndarray) -> None:
        self._known[id(kjt)] = (kjt, lengths)


def batch_size(inputs: dict[str, Any]) -> int:
    """The samples in a batch, from its sparse inputs (all must agree)."""
    for fqn, kjt in inputs.items():
        if getattr(kjt, "variable_stride_per_key", lambda: False)():
            raise ValueError(f"the input of {fqn!r} has a variable batch size per feature (VBE): micro-batches "
                             "cannot cut it (not supported)")
    sizes = {fqn: int(kjt.stride()) for fqn, kjt in inputs.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the sharded modules' inputs hold different numbers of samples {sizes}: micro-batches "
                         "cut every input along the same samples")
    return next(iter(sizes.values()), 0)


def sample_keys(catalog: Catalog, inputs: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's ids over every sharded feature, as keys distinct across tables (id + the
    rows of the tables before): int64 [Σ lengths] back to back by sample, and int64 [samples]."""
    size = batch_size(inputs)
    jagged, bases = [], []
    base = 0
    for info in catalog.modules:
        kjt = inputs[info.fqn]
        for table in info.tables:
            for feature in table.features:
                jagged.append(kjt[feature])
                bases.append(base)
            base += table.num_embeddings
    # every feature's lengths and ids on the host in one copy (one device sync on CUDA)
    parts = [t for j in jagged for t in (j.lengths().to(torch.int64), j.values().to(torch.int64))]
    host = torch.cat(parts).cpu() if parts else torch.empty(0, dtype=torch.int64)
    samples, keys, at = [], [], 0
    for j, b in zip(jagged, bases):
        lengths = host[at:at + size]
        ids = host[at + size:at + size + j.values().numel()]
        at += size + ids.numel()
        samples.append(torch.repeat_interleave(torch.arange(size), lengths, output_size=ids.numel()))
        keys.append(ids + b)
    sample = torch.cat(samples) if samples else torch.empty(0, dtype=torch.int64)
    key = torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64)
    order = stable_order(sample)
    return key[order].numpy(), torch.bincount(sample, minlength=size).numpy()


def cluster(catalog: Catalog, inputs: dict[str, Any], micro_batches: int) -> list[torch.Tensor]:
    """Per micro-batch, the int64 indices of its samples (ascending): fc.microbatch's key-centric
    clustering of this rank's batch, deterministic."""
    if micro_batches == 1:  # nothing to choose
        return [torch.arange(batch_size(inputs), dtype=torch.int64)]
    keys, lengths = sample_keys(catalog, inputs)
    plan = cluster_microbatches(keys, lengths, micro_batches)
    return [torch.from_numpy(np.flatnonzero(plan.micro_batch == m)).to(torch.int64) for m in range(micro_batches)]


def select_samples(kjt: Any, samples: torch.Tensor, host_lengths: Optional[HostLengths] = None) -> Any:
    """The KeyedJaggedTensor of `kjt`'s samples `samples` (int64 [b], on the host), every key kept.
    host_lengths: for cutting the same KeyedJaggedTensor several times with one device read (the
    result's lengths join it); None: reads the kept values' count."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = kjt.keys()
    size = int(kjt.stride())
    lengths = kjt.lengths().to(torch.int64)
    total, per_key, kept = None, None, None  # values kept, in all and per key; lengths kept (host)
    if host_lengths is not None:
        kept = host_lengths.of(kjt)[:, samples.numpy()]
        per_key = kept.sum(1).tolist()
        total = sum(per_key)
    samples = to_device(samples, lengths.device)
    starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]]) if lengths.numel() else lengths
    chosen = (torch.arange(len(keys), device=lengths.device).unsqueeze(1) * size + samples.unsqueeze(0)).reshape(-1)
    new_lengths = lengths[chosen]
    new_starts = torch.cat([new_lengths.new_zeros(1), new_lengths.cumsum(0)[:-1]]) if new_lengths.numel() else new_lengths
    # position of each kept value in kjt.values(): its list's start there, plus its rank in the list
    if total is None:
        total = int(new_lengths.sum())
    shift = torch.repeat_interleave(starts[chosen] - new_starts, new_lengths, output_size=total)
    where = shift + torch.arange(total, device=lengths.device)
    weights = kjt.weights_or_none()
    # with the values per key known, TorchRec need not read them from the lengths later (a device sync)
    known = {} if per_key is None else {"length_per_key": per_key,
                                        "offset_per_key": [0, *itertools.accumulate(per_key)]}
    out = KeyedJaggedTensor(keys=keys, values=kjt.values()[where], lengths=new_lengths.to(kjt.lengths().dtype),
                            weights=weights[where] if weights is not None else None, stride=int(samples.numel()),
                            **known)
    if kept is not None:
        host_lengths.put(out, kept)
    return out


def split_batch(batch: Any, samples: torch.Tensor, size: int, where: str = "batch",
                host_lengths: Optional[HostLengths] = None) -> Any:
    """`batch`'s samples `samples` (see the module docstring); ValueError naming what cannot be cut.
    host_lengths: select_samples' cache, for cutting one batch several times (one for all its cuts)."""
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

    if isinstance(batch, KeyedJaggedTensor):
        if getattr(batch, "variable_stride_per_key", lambda: False)() or int(batch.stride()) != size:
            raise ValueError(f"{where} is a KeyedJaggedTensor of {int(batch.stride())} samples (variable per key: "
                             f"{getattr(batch, 'variable_stride_per_key', lambda: False)()}), not the batch size "
                             f"{size}: cannot cut it into micro-batches; pass split_batch=lambda batch, samples: ...")
        return select_samples(batch, samples, host_lengths)
    if isinstance(batch, JaggedTensor):  # one list per sample
        if batch.lengths().numel() != size:
            raise ValueError(f"{where} is a JaggedTensor of {batch.lengths().numel()} lists, not the batch size {size}")
        one = select_samples(KeyedJaggedTensor(keys=["_"], values=batch.values(), lengths=batch.lengths(),
                                               weights=batch.weights_or_none()), samples)
        return JaggedTensor(values=one.values(), lengths=one.lengths(), weights=one.weights_or_none())
    if isinstance(batch, KeyedTensor):  # one row per sample
        return KeyedTensor(keys=batch.keys(), length_per_key=batch.length_per_key(),
                           values=split_batch(batch.values(), samples, size, f"{where}.values()", host_lengths),
                           key_dim=batch.key_dim())
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        if batch.shape[0] != size:
            raise ValueError(f"{where} has first dimension {batch.shape[0]}, not the batch size {size}: cannot cut it "
                             "into micro-batches; pass split_batch=lambda batch, samples: ...")
        return batch.index_select(0, to_device(samples, batch.device))
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        # a shallow copy, every field cut (init=False ones too): no __init__ / __post_init__ runs again
        part = copy.copy(batch)
        for f in dataclasses.fields(batch):
            if not hasattr(batch, f.name):
                continue
            value = getattr(batch, f.name)
            if not f.init and isinstance(value, _ATOMS) and value is not None:  # derived in __post_init__?
                raise ValueError(f"{where}.{f.name} = {value!r} is set after __init__ (init=False), maybe from the "
                                 "batch's size: cannot tell what it is for a micro-batch; pass "
                                 "split_batch=lambda batch, samples: ...")
            object.__setattr__(part, f.name, split_batch(value, samples, size, f"{where}.{f.name}", host_lengths))
        return part
    if isinstance(batch, dict):  # a copy (a defaultdict keeps its factory), every value cut
        part = copy.copy(batch)
        for k, v in batch.items():
            part[k] = split_batch(v, samples, size, f"{where}[{k!r}]", host_lengths)
        return part
    if isinstance(batch, np.ndarray) and batch.ndim:
        if batch.shape[0] != size:
            raise ValueError(f"{where} has first dimension {batch.shape[0]}, not the batch size {size}: cannot cut it "
                             "into micro-batches; pass split_batch=lambda batch, samples: ...")
        return batch[samples.numpy()]
    if type(batch) is list and size and len(batch) == size and all(isinstance(v, _ATOMS) for v in batch):
        raise ValueError(f"{where} is a list of {size} values, as many as the batch's samples: one per sample (to cut) "
                         "or not (to keep)? pass split_batch=lambda batch, samples: ... (or hold per-sample values "
                         "in a tensor)")
    if isinstance(batch, (list, tuple)):
        parts = [split_batch(v, samples, size, f"{where}[{i}]", host_lengths) for i, v in enumerate(batch)]
        return type(batch)._make(parts) if hasattr(batch, "_fields") else type(batch)(parts)
    if isinstance(batch, _ATOMS) or isinstance(batch, np.ndarray):  # (a 0-d array too)
        return batch
    if hasattr(batch, "__dict__") and not callable(batch):  # a plain batch class: a copy, attribute by attribute
        part = copy.copy(batch)
        for name, value in vars(batch).items():
            setattr(part, name, split_batch(value, samples, size, f"{where}.{name}", host_lengths))
        return part
    raise ValueError(f"{where} is a {type(batch).__name__}: cannot cut it into micro-batches; pass "
                     "split_batch=lambda batch, samples: ... (samples: int64 indices of the micro-batch's samples)")


def merge_outputs(outputs: list[Any], samples: list[torch.Tensor], size: int) -> Any:
    """The micro-batches' outputs as one batch's, in the batch's sample order: tensors whose first
    dimension is each micro-batch's size are put back by sample; tuples, lists and dicts merge
    item by item; anything else comes back as the list of the micro-batches' values."""
    first = outputs[0]
    if isinstance(first, torch.Tensor) and all(
            isinstance(o, torch.Tensor) and o.dim() > 0 and o.shape[0] == s.numel() and o.shape[1:] == first.shape[1:]
            and o.dtype == first.dtype for o, s in zip(outputs, samples)):
        out = first.new_empty((size, *first.shape[1:]))
        for o, s in zip(outputs, samples):
            out[to_device(s, out.device)] = o
        return out
    if isinstance(first, dict) and all(isinstance(o, dict) and o.keys() == first.keys() for o in outputs):
        merged = copy.copy(first)  # a defaultdict keeps its factory
        for k in first:
            merged[k] = merge_outputs([o[k] for o in outputs], samples, size)
        return merged
    if isinstance(first, (list, tuple)) and all(type(o) is type(first) and len(o) == len(first) for o in outputs):
        parts = [merge_outputs([o[i] for o in outputs], samples, size) for i in range(len(first))]
        return type(first)._make(parts) if hasattr(first, "_fields") else type(first)(parts)
    return list(outputs)


def cut(batch: Any, inputs: dict[str, Any], catalog: Catalog, micro_batches: int,
        read_inputs: Callable[[Any], dict[str, Any]], split: Optional[SplitBatch]) -> MicroBatches:
    """`batch` (whose sparse inputs are `inputs`) as `micro_batches` clustered micro-batches."""
    size = batch_size(inputs)
    samples = cluster(catalog, inputs, micro_batches)
    lengths = HostLengths()  # each KeyedJaggedTensor's lengths, read once for every micro-batch
    if micro_batches == 1:  # the batch itself: nothing to cut
        return MicroBatches([batch], [inputs], samples, size, lengths)
    batches = [split(batch, s) if split is not None else split_batch(batch, s, size, host_lengths=lengths)
               for s in samples]
    micro_inputs = [read_inputs(b) for b in batches]
    for m, (b_inputs, s) in enumerate(zip(micro_inputs, samples)):
        got = batch_size(b_inputs)
        if got != s.numel():
            raise ValueError(f"split_batch gave micro-batch {m} {got} samples, not the {s.numel()} asked")
    return MicroBatches(batches, micro_inputs, samples, size, lengths)

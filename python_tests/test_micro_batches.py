"""The batch side of frozen-window micro-batches (pipelines/_micro_batches.py): cutting a batch of
the user's type along its samples, and putting the micro-batches' outputs back in order. Local,
no ranks."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

REQUIRED = os.environ.get("FREESCALE_REQUIRE_CLIENTS") == "1"  # CI: a missing torchrec fails, not skips
if not REQUIRED:
    pytest.importorskip("torchrec")

from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor  # noqa: E402

from freescale_comm.pipelines._micro_batches import batch_size, merge_outputs, select_samples, split_batch  # noqa: E402


def _kjt(gen: torch.Generator, keys: int, samples: int, weighted: bool = True) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (keys * samples,), generator=gen)
    values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=[f"f{k}" for k in range(keys)], values=values, lengths=lengths, weights=weights)


@pytest.mark.parametrize("seed", range(6))
def test_select_samples_takes_each_chosen_samples_lists_in_order(seed):
    gen = torch.Generator().manual_seed(seed)
    kjt = _kjt(gen, keys=3, samples=7)
    chosen = torch.randperm(7, generator=gen)[:int(torch.randint(0, 8, (1,), generator=gen))]
    got = select_samples(kjt, chosen)
    assert got.keys() == kjt.keys() and got.stride() == chosen.numel()
    for key in kjt.keys():
        lists = kjt[key].to_dense()
        weights = kjt[key].to_dense_weights()
        assert [x.tolist() for x in got[key].to_dense()] == [lists[i].tolist() for i in chosen.tolist()], key
        assert [x.tolist() for x in got[key].to_dense_weights()] == [weights[i].tolist() for i in chosen.tolist()], key


@dataclasses.dataclass
class _Batch:
    sparse: KeyedJaggedTensor
    dense: torch.Tensor  # [B, 3]
    history: JaggedTensor  # one list per sample
    pooled: KeyedTensor  # one row per sample
    extra: dict
    task: str = "ctr"


class _Plain:  # not a dataclass: cut attribute by attribute
    def __init__(self, labels: torch.Tensor, sizes: tuple) -> None:
        self.labels, self.sizes = labels, sizes


def test_split_batch_cuts_every_field_along_the_samples_and_names_what_it_cannot_cut():
    gen = torch.Generator().manual_seed(0)
    size = 5
    hist_lengths = torch.tensor([2, 0, 1, 3, 1])
    batch = _Batch(_kjt(gen, 2, size, weighted=False), torch.arange(15.0).view(5, 3),
                   JaggedTensor(values=torch.arange(7.0), lengths=hist_lengths),
                   KeyedTensor(keys=["a", "b"], length_per_key=[1, 2], values=torch.arange(15.0).view(5, 3)),
                   {"labels": torch.arange(5.0), "plain": _Plain(torch.arange(5), (torch.ones(5), 7))})
    chosen = torch.tensor([4, 1, 3])
    part = split_batch(batch, chosen, size)
    assert isinstance(part, _Batch) and part.task == "ctr"
    assert part.dense.tolist() == batch.dense[chosen].tolist()
    assert [x.tolist() for x in part.history.to_dense()] == [batch.history.to_dense()[i].tolist() for i in chosen.tolist()]
    assert part.pooled.values().tolist() == batch.pooled.values()[chosen].tolist() and part.pooled.keys() == ["a", "b"]
    assert part.extra["labels"].tolist() == [4.0, 1.0, 3.0]
    plain = part.extra["plain"]
    assert isinstance(plain, _Plain) and plain.labels.tolist() == [4, 1, 3] and plain.sizes[1] == 7
    assert plain.sizes[0].tolist() == [1.0, 1.0, 1.0] and batch.extra["plain"].labels.numel() == 5  # a copy
    with pytest.raises(ValueError, match=r"batch.extra\['bad'\] has first dimension 4, not the batch size 5"):
        split_batch(dataclasses.replace(batch, extra={"bad": torch.zeros(4)}), chosen, size)
    with pytest.raises(ValueError, match="split_batch="):
        split_batch({"stream": iter([])}, chosen, size)


@dataclasses.dataclass
class _Collated:
    """A collate function's batch: a field it fills after __init__, a label __post_init__ reshapes,
    a scale given to __init__ alone."""

    sparse: KeyedJaggedTensor
    label: torch.Tensor
    scale: dataclasses.InitVar[float]
    sample_weight: torch.Tensor = dataclasses.field(init=False, default=None)

    def __post_init__(self, scale: float) -> None:
        self.label = self.label.float().unsqueeze(-1) * scale


def test_a_dataclass_is_cut_on_a_copy_without_running_its_init_again():
    """Every field is cut, init=False ones too; __post_init__ does not run again on built fields;
    an InitVar needs no value (dataclasses.replace failed all three)."""
    gen = torch.Generator().manual_seed(1)
    batch = _Collated(_kjt(gen, 1, 5), torch.arange(5), 2.0)
    batch.sample_weight = torch.arange(5.0) * 10
    part = split_batch(batch, torch.tensor([1, 3]), 5)
    assert part.sample_weight.tolist() == [10.0, 30.0]
    assert part.label.tolist() == [[2.0], [6.0]]
    assert batch.label.shape == (5, 1) and batch.sample_weight.numel() == 5  # the batch itself is untouched


def test_a_defaultdict_batch_and_output_keep_their_type():
    import collections

    gen = torch.Generator().manual_seed(2)
    chosen = torch.tensor([1, 3])
    batch = collections.defaultdict(list, {"sparse": _kjt(gen, 1, 5), "label": torch.arange(5.0)})
    part = split_batch(batch, chosen, 5)
    assert type(part) is collections.defaultdict and part.default_factory is list
    assert part["label"].tolist() == [1.0, 3.0]
    samples = [torch.tensor([0, 2, 4]), chosen]
    outs = [collections.defaultdict(list, {"logits": torch.arange(5.0)[s]}) for s in samples]
    merged = merge_outputs(outs, samples, 5)
    assert type(merged) is collections.defaultdict and merged["logits"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("stride", [3, 6])
def test_a_keyed_jagged_tensor_of_another_batch_size_is_refused_by_name(stride):
    """One with fewer samples raised IndexError, one with more silently took the wrong lists."""
    gen = torch.Generator().manual_seed(3)
    batch = {"sparse": _kjt(gen, 1, 5), "other": _kjt(gen, 2, stride)}
    with pytest.raises(ValueError, match=rf"batch\['other'\] is a KeyedJaggedTensor of {stride} samples.*split_batch="):
        split_batch(batch, torch.tensor([1, 4]), 5)


def test_arrays_are_cut_other_values_kept_and_ambiguous_ones_refused():
    """A NumPy array of batch-size rows takes the chosen samples'; devices, dtypes, bytes and enums,
    which are no one's, are kept (they were refused). A list of as many ids or strings as samples
    was copied whole into every micro-batch: one per sample or not cannot be told, so it is refused
    naming the field (as a number a dataclass sets after __init__, which went stale)."""
    import enum

    import numpy as np

    class Task(enum.Enum):
        CTR = 1

    gen = torch.Generator().manual_seed(4)
    batch = {"sparse": _kjt(gen, 1, 5), "dense": np.arange(10.0).reshape(5, 2), "device": torch.device("cpu"),
             "dtype": torch.float16, "tag": b"x", "task": Task.CTR, "dims": [8, 8]}
    part = split_batch(batch, torch.tensor([4, 1]), 5)
    assert part["dense"].tolist() == [[8.0, 9.0], [2.0, 3.0]]
    assert (part["device"], part["dtype"], part["tag"], part["task"]) == (torch.device("cpu"), torch.float16, b"x", Task.CTR)
    assert part["dims"] == [8, 8]  # not one per sample: kept
    with pytest.raises(ValueError, match=r"batch\['dense'\] has first dimension 4"):
        split_batch({"dense": np.zeros((4, 2))}, torch.tensor([1]), 5)
    with pytest.raises(ValueError, match=r"batch\['request_ids'\] is a list of 5 values.*split_batch="):
        split_batch({"request_ids": ["r0", "r1", "r2", "r3", "r4"]}, torch.tensor([1]), 5)

    @dataclasses.dataclass
    class Sized:
        label: torch.Tensor
        n: int = dataclasses.field(init=False)

        def __post_init__(self) -> None:
            self.n = len(self.label)

    with pytest.raises(ValueError, match=r"batch.n = 5 is set after __init__.*split_batch="):
        split_batch(Sized(torch.arange(5.0)), torch.tensor([1]), 5)


def test_variable_batch_size_inputs_are_refused():
    vbe = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(5), lengths=torch.tensor([1, 1, 1, 1, 1]),
                            stride_per_key_per_rank=[[2], [3]])
    with pytest.raises(ValueError, match="variable batch size per feature"):
        batch_size({"ec": vbe})
    with pytest.raises(ValueError, match="different numbers of samples"):
        batch_size({"a": _kjt(torch.Generator(), 1, 3), "b": _kjt(torch.Generator(), 1, 4)})


def test_merge_outputs_puts_rows_back_in_sample_order_and_keeps_the_rest_as_lists():
    samples = [torch.tensor([0, 3]), torch.tensor([], dtype=torch.int64), torch.tensor([1, 2, 4])]
    logits = torch.arange(5.0) * 10
    outs = [(logits[s], {"emb": logits[s].unsqueeze(1).repeat(1, 2)}, "tag") for s in samples]
    merged = merge_outputs(outs, samples, 5)
    assert merged[0].tolist() == logits.tolist()
    assert merged[1]["emb"].tolist() == logits.unsqueeze(1).repeat(1, 2).tolist()
    assert merged[2] == ["tag"] * 3  # not a tensor: one per micro-batch
    scalars = [torch.tensor(float(i)) for i in range(3)]  # 0-dim: not per sample
    assert merge_outputs(scalars, samples, 5) == scalars


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6)), max_size=40), st.booleans())
def test_first_uses_marks_each_values_first_entry_in_its_group_and_points_there(entries, grouped):
    """Against a scan: an entry is fresh iff no earlier entry of its group has its value; its source
    is that value's first entry in its group (its own position when fresh); it is last iff no later
    entry of its group has its value."""
    from freescale_comm.pipelines._host_counts import first_uses

    groups = torch.tensor([g for g, _ in entries], dtype=torch.int64)
    values = torch.tensor([v for _, v in entries], dtype=torch.int64)
    fresh, source, last = first_uses(values, groups if grouped else None)
    seen: dict[tuple, int] = {}
    final: dict[tuple, int] = {}
    for i, (g, v) in enumerate(entries):
        key = (g if grouped else 0, v)
        first = seen.setdefault(key, i)
        final[key] = i
        assert bool(fresh[i]) == (first == i) and int(source[i]) == first, (entries, grouped, i)
    for i, (g, v) in enumerate(entries):
        assert bool(last[i]) == (final[(g if grouped else 0, v)] == i), (entries, grouped, i)
    assert fresh.shape == source.shape == last.shape == (len(entries),)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.sampled_from([0, 1, 5, -7, 2**40, -(2**40), 2**62])), max_size=40),
       st.booleans(), st.sampled_from([torch.int64, torch.int32]))
def test_the_host_sort_orders_as_torchs_stable_argsort(entries, grouped, dtype):
    """stable_order packs (key, position) into one int64 sort where it fits and falls back to
    torch's stable argsorts where it does not (values 2^62 apart): the same permutation either way."""
    from freescale_comm.pipelines._host_counts import stable_order

    if dtype == torch.int32:
        entries = [(g, max(min(v, 2**31 - 1), -(2**31))) for g, v in entries]
    groups = torch.tensor([g for g, _ in entries], dtype=torch.int64)
    values = torch.tensor([v for _, v in entries], dtype=dtype)
    want = sorted(range(len(entries)), key=lambda i: ((entries[i][0] if grouped else 0), entries[i][1], i))
    assert stable_order(values, groups if grouped else None).tolist() == want


def test_the_host_sort_orders_floats_as_torch_does():
    """Only integers are packed: floats 0.7 and 0.2 keep their order (not truncated to equal keys)."""
    from freescale_comm.pipelines._host_counts import stable_order

    values = torch.tensor([0.7, 0.2, 0.5])
    assert stable_order(values).tolist() == torch.argsort(values, stable=True).tolist() == [1, 2, 0]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 9), max_size=12), max_size=4), max_size=3))
def test_distinct_gives_each_parts_unique_values_and_inverse(groups):
    """Per group, one sort for all its parts: each part's torch.unique(return_inverse=True), the
    parts' values one after another; values shared by adjacent parts still count in each."""
    from freescale_comm.pipelines._host_counts import _distinct_on_device, distinct

    tensors = [[torch.tensor(part, dtype=torch.int64) for part in parts] for parts in groups]
    # on CPU NumPy, every group at once; on a device torch ops, a sort per group: both checked here
    for found in (distinct(tensors), _distinct_on_device(tensors)):
        for parts, (unique, counts, inverses) in zip(tensors, found):
            at = 0
            for part, count, inverse in zip(parts, counts, inverses):
                want, want_inverse = torch.unique(part, return_inverse=True)
                assert unique[at:at + count].tolist() == want.tolist()
                assert inverse.tolist() == want_inverse.tolist()
                at += count
            assert at == unique.numel() and len(counts) == len(inverses) == len(parts)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 9), max_size=12), min_size=1, max_size=5), max_size=3))
def test_distinct_union_gives_every_value_once_with_the_parts_holding_it(groups):
    """distinct(union=True): per group, the values of all its parts once, ascending, each with a
    bit mask of the parts that hold it (bit p: part p), beside the per-part results unchanged."""
    from freescale_comm.pipelines._host_counts import distinct

    tensors = [[torch.tensor(part, dtype=torch.int64) for part in parts] for parts in groups]
    plain = distinct(tensors)
    for parts, found, alone in zip(groups, distinct(tensors, union=True), plain):
        unique, counts, inverses, rows, masks = found
        assert unique.tolist() == alone[0].tolist() and counts == alone[1]
        assert [i.tolist() for i in inverses] == [i.tolist() for i in alone[2]]
        want = sorted({v for part in parts for v in part})
        want_masks = [sum(1 << p for p, part in enumerate(parts) if v in part) for v in want]
        assert rows.tolist() == want and masks.tolist() == want_masks
    # the device path (torch ops, the unions' counts in the same host read) gives the same
    from freescale_comm.pipelines._host_counts import _distinct_on_device

    for found, alone in zip(_distinct_on_device(tensors, union=True), distinct(tensors, union=True)):
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                   for a, b in zip(found[:2] + found[3:], alone[:2] + alone[3:]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**20), max_size=10), min_size=2, max_size=8))
def test_packed_ids_rebuild_the_requesters_layout_and_its_first_and_last_entries(parts):
    """What the owner rebuilds from each distinct row once (packed with its micro-batches' bits)
    equals the requester's micro-batch-major layout (each micro-batch's distinct rows, ascending),
    the micro-batch of every entry, and first_uses' first and last entries of each row."""
    from freescale_comm.pipelines._host_counts import distinct, first_uses
    from freescale_comm.pipelines._packed_ids import pack, unpack

    micro = len(parts)
    unique, counts, _, rows, masks = distinct([[torch.tensor(p, dtype=torch.int64) for p in parts]], union=True)[0]
    wire = pack(rows, masks, micro)
    assert wire.numel() == len({v for p in parts for v in p})  # each distinct row once
    got_rows, got_micro, fresh, last = unpack(wire, micro, counts)
    assert got_rows.tolist() == unique.tolist()
    assert got_micro.tolist() == [m for m, c in enumerate(counts) for _ in range(c)]
    want_fresh, _, want_last = first_uses(unique)
    assert fresh.tolist() == want_fresh.tolist() and last.tolist() == want_last.tolist()


def test_packing_is_refused_where_rows_or_micro_batches_would_not_fit():
    """row << M | mask must stay below 2^63: a slot of 2^(62 - M) rows packs, one row more does
    not; one micro-batch has nothing to pack."""
    from types import SimpleNamespace

    from freescale_comm.pipelines._packed_ids import packs

    def catalog(rows: int) -> SimpleNamespace:
        return SimpleNamespace(slots=[SimpleNamespace(rows=10), SimpleNamespace(rows=rows)])

    assert packs(catalog(1 << 58), 4) and not packs(catalog((1 << 58) + 1), 4)
    assert not packs(catalog(10), 1) and packs(catalog(10), 2) and not packs(catalog(10), 62)


def test_distinct_of_values_too_far_apart_to_pack_takes_the_device_path():
    """Values 2^60 apart do not fit NumPy's packed keys: distinct() answers through torch ops, the
    same as torch.unique."""
    from freescale_comm.pipelines._host_counts import _distinct_on_host, distinct

    parts = [torch.tensor([2**60, 0, 2**60]), torch.tensor([5, 2**60])]
    assert _distinct_on_host([parts], union=True) is None
    unique, counts, inverses, rows, masks = distinct([parts], union=True)[0]
    assert unique.tolist() == [0, 2**60, 5, 2**60] and counts == [2, 2]
    assert [i.tolist() for i in inverses] == [[1, 0, 1], [0, 1]]
    assert rows.tolist() == [0, 5, 2**60] and masks.tolist() == [1, 2, 3]


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 61).flatmap(lambda m: st.tuples(
    st.just(m), st.lists(st.lists(st.integers(0, 2**(62 - m) - 1), max_size=6), min_size=m, max_size=m))))
def test_packed_ids_hold_the_largest_rows_that_fit(case):
    """At the packing limit (shard rows up to 2^(62 - M) - 1, M up to 61 micro-batches) the packed
    ids stay non-negative and unpack to the same rows, micro-batches and first / last entries."""
    from freescale_comm.pipelines._host_counts import distinct, first_uses
    from freescale_comm.pipelines._packed_ids import pack, unpack

    micro, parts = case
    unique, counts, _, rows, masks = distinct([[torch.tensor(p, dtype=torch.int64) for p in parts]], union=True)[0]
    wire = pack(rows, masks, micro)
    assert bool((wire >= 0).all())
    got_rows, got_micro, fresh, last = unpack(wire, micro, counts)
    assert got_rows.tolist() == unique.tolist()
    assert got_micro.tolist() == [m for m, c in enumerate(counts) for _ in range(c)]
    want_fresh, _, want_last = first_uses(unique)
    assert fresh.tolist() == want_fresh.tolist() and last.tolist() == want_last.tolist()

"""Key-centric micro-batch clustering (NestPipe's frozen-window micro-batches): a deterministic
partition whose micro-batches send few distinct ids, with balanced costs. No ranks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import freescale_comm as fc
from freescale_comm.microbatch import cluster_microbatches, distinct_ids, expected_random_distinct_ids


def test_the_public_name():
    assert fc.microbatch.cluster_microbatches is cluster_microbatches


@st.composite
def batches(draw):
    """(ids, lengths, costs or None, micro_batches): up to 40 samples of up to 12 ids from a pool
    small enough that samples share ids."""
    samples = draw(st.integers(0, 40))
    pool = draw(st.integers(1, 60))
    lengths = np.array(draw(st.lists(st.integers(0, 12), min_size=samples, max_size=samples)), dtype=np.int64)
    ids = np.array(draw(st.lists(st.integers(0, pool - 1), min_size=int(lengths.sum()), max_size=int(lengths.sum()))),
                   dtype=np.int64)
    costs = draw(st.none() | st.lists(st.floats(0, 100, allow_nan=False), min_size=samples, max_size=samples))
    return ids, lengths, None if costs is None else np.array(costs), draw(st.integers(1, 8))


@settings(max_examples=200, deadline=None)
@given(batches())
def test_a_deterministic_partition_whose_ids_and_loads_are_as_reported(batch):
    ids, lengths, costs, m = batch
    plan = cluster_microbatches(ids, lengths, m, costs)
    again = cluster_microbatches(ids.copy(), lengths.copy(), m, None if costs is None else costs.copy())
    assert np.array_equal(plan.micro_batch, again.micro_batch)  # every rank computes the same split
    assert plan.micro_batch.shape == lengths.shape and ((plan.micro_batch >= 0) & (plan.micro_batch < m)).all()
    cost = lengths.astype(float) if costs is None else costs
    assert np.allclose(plan.loads, np.bincount(plan.micro_batch, weights=cost, minlength=m))
    assert plan.distinct_ids == distinct_ids(ids, lengths, plan.micro_batch)
    if lengths.size:  # balanced: no micro-batch above 1.1 x the mean, or the mean + one sample's cost
        mean = cost.sum() / m
        assert plan.loads.max() <= max(1.1 * mean, mean + cost.max() * (1 - 1 / m)) * (1 + 1e-9) + 1e-9


@settings(max_examples=300, deadline=None)
@given(batches())
def test_never_more_distinct_ids_than_a_random_split_sends_on_average(batch):
    """While the cost cap never binds (plan.cap_bound False: the usual case), the derandomized
    split sends at most the mean distinct ids of uniformly random splits; and, always, never more
    than splitting the batch into contiguous chunks would where every chunk holds every id (M x
    the whole batch's ids is the worst case of any split)."""
    ids, lengths, costs, m = batch
    plan = cluster_microbatches(ids, lengths, m, costs)
    whole = np.unique(ids).size
    assert whole <= plan.distinct_ids <= m * whole
    if not plan.cap_bound:
        assert plan.distinct_ids <= expected_random_distinct_ids(ids, lengths, m) + 1e-9


def reference_placement(ids, lengths, m, costs, tolerance=0.1):
    """The method of fc.microbatch's docstring in plain Python, one sample at a time: each sample's
    gain summed over its distinct ids in ascending order, ties least loaded then lowest index."""
    cost = lengths.astype(float) if costs is None else np.asarray(costs, dtype=float)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    keys = [sorted(set(ids[starts[i]:starts[i + 1]].tolist())) for i in range(lengths.size)]
    holders = {}
    for ks in keys:
        for k in ks:
            holders[k] = holders.get(k, 0) + 1
    q, mean = 1 - 1 / m, cost.sum() / m
    held, loads, where, bound = set(), [0.0] * m, [0] * lengths.size, False
    for i in sorted(range(lengths.size), key=lambda i: (-cost[i], i)):
        gain = [0.0] * m
        for k in keys[i]:
            for b in range(m):
                if (k, b) in held:
                    gain[b] += q ** (holders[k] - 1)
        cap = max(mean * (1 + tolerance), mean + cost[i] * (1 - 1 / m))
        ranked = sorted(range(m), key=lambda b: (-gain[b], loads[b], b))
        fits = [b for b in ranked if loads[b] + cost[i] <= cap * (1 + 1e-12)]
        choice = fits[0] if fits else min(range(m), key=lambda b: (loads[b], b))
        bound |= gain[choice] < gain[ranked[0]]
        where[i] = choice
        for k in keys[i]:
            held.add((k, choice))
            holders[k] -= 1
        loads[choice] += cost[i]
    # each empty micro-batch takes, from the one holding the most samples (two at least; ties: lowest
    # index), its cheapest sample (ties: lowest index) whose ids no other sample there holds
    for dst in range(m):
        counts = [where.count(b) for b in range(m)]
        if counts[dst]:
            continue
        for src in sorted((b for b in range(m) if counts[b] >= 2), key=lambda b: (-counts[b], b)):
            inside = [i for i in range(lengths.size) if where[i] == src]
            alone = [i for i in inside if all(sum(k in keys[j] for j in inside) == 1 for k in keys[i])]
            if alone:
                i = min(alone, key=lambda i: (cost[i], i))
                where[i] = dst
                held = (held - {(k, src) for k in keys[i]}) | {(k, dst) for k in keys[i]}
                break
    return np.array(where, dtype=np.int64), len(held), bound


@settings(max_examples=200, deadline=None)
@given(batches())
def test_the_compiled_placement_is_the_documented_method(batch):
    """The greedy pass runs in the compiled core (the NumPy loop took 12 ms per 512-sample batch):
    it places every sample where the method, written out in Python, does."""
    ids, lengths, costs, m = batch
    plan = cluster_microbatches(ids, lengths, m, costs)
    where, distinct, bound = reference_placement(ids, lengths, m, costs)
    assert np.array_equal(plan.micro_batch, where)
    assert (plan.distinct_ids, plan.cap_bound) == (distinct, bound)


@settings(max_examples=200, deadline=None)
@given(batches())
def test_a_micro_batch_is_empty_only_where_no_sample_could_fill_it_without_adding_an_id(batch):
    ids, lengths, costs, m = batch
    plan = cluster_microbatches(ids, lengths, m, costs)
    sizes = np.bincount(plan.micro_batch, minlength=m)
    if lengths.size >= m and (sizes == 0).any():
        starts = np.concatenate([[0], np.cumsum(lengths)])
        keys = [set(ids[starts[i]:starts[i + 1]].tolist()) for i in range(lengths.size)]
        for b in np.flatnonzero(sizes >= 2):
            inside = np.flatnonzero(plan.micro_batch == b)
            for i in inside:  # every sample shares an id with another of its micro-batch
                assert any(keys[i] & keys[j] for j in inside if j != i), (b, i)


def test_samples_without_ids_fill_every_micro_batch():
    """A rank whose four samples hold no ids: every micro-batch gets one (they all went to the
    first: three passes over nothing, and a mean loss over no samples is NaN)."""
    plan = cluster_microbatches(np.array([], dtype=np.int64), np.zeros(4, dtype=np.int64), 4)
    assert sorted(plan.micro_batch.tolist()) == [0, 1, 2, 3] and plan.distinct_ids == 0
    # a dear sample and three cheap ones sharing an id: the cheap ones stay together (moving one adds an id)
    plan = cluster_microbatches(np.array([1, 2, 2, 2]), np.array([1, 1, 1, 1]), 4, [100.0, 1.0, 1.0, 1.0])
    assert np.bincount(plan.micro_batch, minlength=4).tolist().count(0) == 2 and plan.distinct_ids == 2


def test_the_compiled_pass_refuses_inputs_it_cannot_place():
    from freescale_comm import _core

    one, offsets = np.array([1.0]), np.array([0, 1])
    with pytest.raises(ValueError, match="visit must be a permutation"):
        _core.cluster_greedy(offsets, np.array([0]), 1, one, np.array([3]), 2, 0.5, 0.1)
    with pytest.raises(ValueError, match=r"keys\[0\] = 5 is outside"):
        _core.cluster_greedy(offsets, np.array([5]), 1, one, np.array([0]), 2, 0.5, 0.1)
    with pytest.raises(ValueError, match="strictly ascending"):  # a key twice in one sample
        _core.cluster_greedy(np.array([0, 2]), np.array([0, 0]), 1, one, np.array([0]), 2, 0.5, 0.1)
    with pytest.raises(ValueError, match="key_offsets must be 1-D with 2 entries"):
        _core.cluster_greedy(np.array([0]), np.array([0]), 1, one, np.array([0]), 2, 0.5, 0.1)


def test_samples_sharing_ids_end_in_one_micro_batch():
    """Four groups of five samples, each group reading its own 30 ids (each sample 10 of them),
    shuffled: four micro-batches send each id once (a random split sends ~1.6x as many)."""
    gen = np.random.default_rng(0)
    samples = [(g, gen.choice(30, size=10, replace=False) + 100 * g) for g in range(4) for _ in range(5)]
    order = gen.permutation(len(samples))
    lengths = np.full(len(samples), 10, dtype=np.int64)
    ids = np.concatenate([samples[i][1] for i in order])
    plan = cluster_microbatches(ids, lengths, 4)
    groups = np.array([samples[i][0] for i in order])
    for g in range(4):  # one micro-batch per group, and the loads equal
        assert np.unique(plan.micro_batch[groups == g]).size == 1
    assert plan.distinct_ids == np.unique(ids).size
    assert expected_random_distinct_ids(ids, lengths, 4) > 1.5 * plan.distinct_ids
    assert np.array_equal(plan.loads, np.full(4, 50.0))


@pytest.mark.parametrize("args,message", [
    ((np.array([1, 2]), np.array([2]), 0), "micro_batches must be an int in \\[1, 1024\\]"),
    ((np.array([1, 2]), np.array([3]), 2), "lengths sum to 3, but there are 2 ids"),
    ((np.array([1.5]), np.array([1]), 2), "ids must be a 1-D integer array"),
    ((np.array([1]), np.array([-1, 2]), 2), "lengths must be a 1-D array of ints >= 0"),
])
def test_bad_input_is_refused_naming_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        cluster_microbatches(*args)
    with pytest.raises(ValueError, match="costs must be finite"):
        cluster_microbatches(np.array([1, 2]), np.array([1, 1]), 2, costs=np.array([1.0, -1.0]))


def test_the_microbatch_benchmark_writes_a_row_per_workload_count_and_split(tmp_path):
    """freescale-bench microbatch runs and reports (plan times are never asserted)."""
    import json

    from freescale_comm.bench.cli import main

    out = tmp_path / "rows.json"
    assert main(["microbatch", "--samples", "64", "--repeats", "1", "--micro-batches", "2", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["micro_batches"], r["split"]) for r in rows] == [
        (w, m, s) for w in ("interests", "zipf") for m in (2, 4) for s in ("clustered", "random", "contiguous")]
    for r in rows:
        assert r["distinct_ids"] >= r["whole_batch_ids"] > 0, r
    by = {(r["workload"], r["micro_batches"], r["split"]): r for r in rows}
    for m in (2, 4):  # the workload with locality: clustering sends fewer ids than either baseline
        assert by[("interests", m, "clustered")]["distinct_ids"] < by[("interests", m, "random")]["distinct_ids"]
        assert by[("interests", m, "clustered")]["distinct_ids"] < by[("interests", m, "contiguous")]["distinct_ids"]
    assert main(["microbatch", "--micro-batches", "0"]) == 2


def test_micro_batch_counts_beyond_the_bound_are_refused():
    """The placement keeps a flag per (distinct id, micro-batch): 200,000 micro-batches of 4 samples
    took 4 GiB before (2,000,000: about 40 GB); 2**31 failed in pybind's argument conversion."""
    ids, lengths = np.arange(8), np.array([2, 2, 2, 2])
    for m in (fc.microbatch.MAX_MICRO_BATCHES + 1, 2**31):
        with pytest.raises(ValueError, match="micro_batches must be an int in"):
            cluster_microbatches(ids, lengths, m)
    plan = cluster_microbatches(ids, lengths, 8)  # more micro-batches than samples: some stay empty
    assert sorted(np.bincount(plan.micro_batch, minlength=8).tolist()) == [0, 0, 0, 0, 1, 1, 1, 1]

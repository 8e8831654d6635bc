"""plan_rebalance(speeds=...): ranks of unequal speed (a busy or throttled device) get work in
proportion to their speed, so the rank that finishes last finishes as early as it can; equal
speeds plan exactly as none."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale_comm.planner import CostModel, plan_rebalance

CM = CostModel.hstu(num_heads=4, attn_dim=128, hidden_dim=128)

lengths_lists = st.lists(st.lists(st.integers(0, 3000), min_size=0, max_size=12), min_size=1, max_size=9)


def _times(plan, loads):
    return loads if plan.speeds is None else loads / plan.speeds


@settings(max_examples=100, deadline=None)
@given(lengths_lists, st.floats(0.01, 100.0))
def test_equal_speeds_plan_exactly_as_none(raw, speed):
    lengths = [np.array(L, dtype=np.int64) for L in raw]
    plain = plan_rebalance(lengths, cost_model=CM, bytes_per_item=4)
    even = plan_rebalance(lengths, cost_model=CM, bytes_per_item=4, speeds=[speed] * len(lengths))
    assert even.speeds is None
    assert all(np.array_equal(a, b) for a, b in zip(plain.dest, even.dest))
    assert np.array_equal(plain.loads_after, even.loads_after) and plain.lower_bound == even.lower_bound


@settings(max_examples=300, deadline=None)
@given(lengths_lists.flatmap(lambda raw: st.tuples(st.just(raw), st.lists(
    st.floats(0.1, 10.0), min_size=len(raw), max_size=len(raw)))))
def test_uneven_speeds_even_out_the_time_never_worse_and_no_later_than_a_speed_blind_plan(case):
    raw, speeds = case
    lengths = [np.array(L, dtype=np.int64) for L in raw]
    plan = plan_rebalance(lengths, cost_model=CM, bytes_per_item=2, speeds=speeds)
    world = len(lengths)
    assert [d.shape for d in plan.dest] == [L.shape for L in lengths]
    assert all(((d >= 0) & (d < world)).all() for d in plan.dest)
    assert np.isclose(plan.loads_after.sum(), plan.loads_before.sum())
    if plan.speeds is not None:
        assert plan.speeds.mean() == pytest.approx(1.0)
        assert np.allclose(plan.speeds / plan.speeds[0], np.array(speeds) / speeds[0])
    before, after = _times(plan, plan.loads_before).max(), _times(plan, plan.loads_after).max()
    assert after <= before * (1 + 1e-12)
    assert after >= plan.lower_bound * (1 - 1e-12)
    # the plan that ignores speeds never lets the last rank finish earlier (beyond 0.1 %)
    blind = plan_rebalance(lengths, cost_model=CM, bytes_per_item=2)
    assert after <= _times(plan, blind.loads_after).max() * (1 + 1e-3)
    again = plan_rebalance([L.copy() for L in lengths], cost_model=CM, bytes_per_item=2, speeds=list(speeds))
    assert all(np.array_equal(a, b) for a, b in zip(plan.dest, again.dest))


def test_a_rank_twice_as_fast_takes_twice_the_work():
    """Two ranks with the same samples: at equal speeds nothing moves; rank 1 twice as fast ends
    with twice rank 0's cost, and both finish together (the balanced plan it replaces left rank 0
    a third behind)."""
    rng = np.random.default_rng(3)
    samples = rng.integers(50, 400, 96)
    lengths = [samples.copy(), samples[::-1].copy()]
    assert plan_rebalance(lengths, cost_model=CM).moved_samples == 0
    plan = plan_rebalance(lengths, cost_model=CM, speeds=[1.0, 2.0])
    assert plan.loads_after[1] / plan.loads_after[0] == pytest.approx(2.0, rel=0.01)
    times = plan.loads_after / plan.speeds
    assert times.max() == pytest.approx(plan.lower_bound, rel=1e-3)
    assert plan.imbalance_before == pytest.approx(4 / 3, rel=1e-3)  # equal loads, unequal speeds
    assert plan.imbalance_after == pytest.approx(1.0, abs=2e-3)
    assert all(((d == r) | (d == 1)).all() for r, d in enumerate(plan.dest))  # only rank 0 sends
    # a torch tensor of speeds is taken as the list is
    again = plan_rebalance(lengths, cost_model=CM, speeds=torch.tensor([1.0, 2.0]))
    assert all(np.array_equal(a, b) for a, b in zip(plan.dest, again.dest))


def test_where_the_phases_end_behind_the_plan_on_load_alone_that_plan_is_taken():
    """Three samples on a rank of speed 5.71 beside an empty one of 8.27: the phases moved one sample
    and the last rank finished 14.6 % later than the plan on load alone would have it (found by the
    property test above); that plan is now checked and taken."""
    lengths = [np.array([948, 931, 1317]), np.array([], dtype=np.int64)]
    speeds = [5.71, 8.27]
    plan = plan_rebalance(lengths, cost_model=CM, bytes_per_item=2, speeds=speeds)
    blind = plan_rebalance(lengths, cost_model=CM, bytes_per_item=2)
    assert (plan.loads_after / plan.speeds).max() <= (blind.loads_after / plan.speeds).max()
    assert (plan.loads_after / plan.speeds).max() < (plan.loads_before / plan.speeds).max()


def test_a_giant_goes_to_the_rank_that_finishes_it_first():
    """A sample too big for its home's share goes where it finishes first: the fast rank, not the
    least loaded slow one (which would have taken 2.6x the bound to run it)."""
    lengths = [np.array([10] * 4), np.array([3000]), np.array([10] * 4), np.array([10] * 4)]
    plan = plan_rebalance(lengths, cost_model=CM, speeds=[0.5, 0.5, 3.0, 0.5])
    assert plan.dest[1].tolist() == [2]
    assert (plan.loads_after / plan.speeds).max() == pytest.approx(plan.lower_bound, rel=1e-3)


@pytest.mark.parametrize("speeds", [[1.0], [1.0, 2.0, 3.0], [1.0, 0.0], [1.0, -2.0], [1.0, float("nan")],
                                    [1.0, float("inf")], "fast", [[1.0, 2.0]]])
def test_bad_speeds_are_refused_naming_the_argument(speeds):
    with pytest.raises(ValueError, match="speeds must be"):
        plan_rebalance([np.array([5, 9]), np.array([7])], cost_model=CM, speeds=speeds)

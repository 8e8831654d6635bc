"""all_to_all_single on CPU tensors against gloo, across 2, 3 and 4 ranks."""

import pytest

from freescale_comm.testing import spawn
from rank_programs import (
    alltoall_matches_gloo,
    bad_inputs_raise_before_communicating,
    in_place_and_lazy_views_as_gloo,
    self_block_refused_locally,
    wait_releases_the_gil,
)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_random_uneven_splits_match_gloo(world):
    checked = spawn(alltoall_matches_gloo, world, 1000 + world, 21)
    assert checked == [21] * world


def test_bad_input_raises_before_any_communication():
    messages = spawn(bad_inputs_raise_before_communicating, 2)
    assert len(messages[0]) == 14  # one per bad call in rank_programs.bad_inputs_raise_before_communicating


@pytest.mark.parametrize("world", [2, 4])
def test_a_self_block_that_differs_in_bytes_is_refused_locally_and_the_communicator_stays_usable(world):
    messages = spawn(self_block_refused_locally, world)
    assert all(len(m) == 4 for m in messages), messages


def test_blocking_wait_releases_the_gil():
    ticks = spawn(wait_releases_the_gil, 2)
    # Rank 0 blocked ~1 s; a thread sleeping 1 ms per tick must have run well over 100 times.
    assert ticks[0] > 100


@pytest.mark.parametrize("world", [2, 3])
def test_in_place_and_conjugate_views_behave_as_gloo(world):
    assert spawn(in_place_and_lazy_views_as_gloo, world, 400_000) == [["in_place", "conj_input", "conj_output_refused"]] * world

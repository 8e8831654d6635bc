"""fc.dispatch / fc.combine across ranks: identity round trips, gradients, bad input."""

import pytest

from freescale_comm.testing import spawn
from dispatch_programs import (PATTERNS, ROW_CASES, bad_inputs_raise_before_communicating, gradients_match_single_process,
                               combine_requires_grad_only_where_a_dispatch_did, roundtrip_is_identity,
                               row_kinds_that_differ_fail_every_rank,
                               second_order_gradients_match_single_process,
                               side_communicator_lets_the_group_go)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dispatch_then_combine_is_the_identity(world):
    assert spawn(roundtrip_is_identity, world, 40 + world) == [len(ROW_CASES) * len(PATTERNS)] * world


@pytest.mark.parametrize("backend", ["gloo", "freescale"])
def test_gradients_equal_a_single_process_reference(backend):
    diffs = spawn(gradients_match_single_process, 3, 5, backend=backend)
    assert max(diffs) < 1e-12, diffs


def test_second_order_gradients_flow_through_the_movements():
    diffs = spawn(second_order_gradients_match_single_process, 3, 9, backend="freescale")
    assert max(diffs) < 1e-12, diffs


def test_a_combine_requires_grad_on_every_rank_exactly_where_its_dispatch_did_on_some():
    assert spawn(combine_requires_grad_only_where_a_dispatch_did, 2, backend="freescale") == [[False, True]] * 2


def test_values_of_other_dtypes_or_row_shapes_on_some_rank_fail_every_rank():
    for outcomes in spawn(row_kinds_that_differ_fail_every_rank, 3):
        for outcome in outcomes[:2]:
            assert outcome.startswith("SIZE_MISMATCH") and "ranks [0]: one kind; ranks [1, 2]" in outcome, outcome
        assert outcomes[2] == "True"  # the communicator goes on: the refusal came before any row moved


def test_bad_input_raises_before_communication():
    messages = spawn(bad_inputs_raise_before_communicating, 2)
    assert len(messages[0]) == 13
    assert "lengths sum to 7" in messages[0][0]
    assert "dest_ranks[1] = 2" in messages[0][1]
    assert "lengths[1] = -1" in messages[0][3]
    assert "lengths is on meta" in messages[0][6]
    assert "CPU and CUDA" in messages[0][7]
    assert "another dispatch" in messages[0][9]
    assert "meta" in messages[0][11]


def test_destroying_a_gloo_group_dispatch_used_frees_it_then_not_at_interpreter_exit():
    reports = spawn(side_communicator_lets_the_group_go, 2)
    for r in reports:
        assert not r["group_alive"], "the dispatch communicator kept the destroyed group alive"
        assert not r["comm_group"]
        assert "destroyed" in r["bootstrap_error"] and "new Communicator" in r["bootstrap_error"]

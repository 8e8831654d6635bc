"""A balanced module's outputs go home the same way on every rank (one row per sample, or laid
out as a feature), even where a rank's sizes cannot tell the ways apart."""

import numpy as np
import pytest

from freescale_comm.testing import spawn


def _need_torchrec():
    pytest.importorskip("torchrec")


@pytest.mark.parametrize("keyed", [False, True])
def test_per_row_output_on_a_rank_with_as_many_rows_as_samples(keyed):
    _need_torchrec()
    from bundle_programs import per_row_output_where_layout_sizes_coincide

    results = spawn(per_row_output_where_layout_sizes_coincide, 2, "samples", "items", keyed, backend="freescale",
                    timeout_s=90)
    assert results[1]["seen"] == {"samples": 3, "items": 3}, results  # the coincidence the case is about
    assert results[0]["seen"] == {"samples": 3, "items": 18}, results
    assert all(r["equal"] for r in results), results


def test_per_row_output_of_a_feature_whose_rows_equal_anothers_on_one_rank():
    _need_torchrec()
    from bundle_programs import per_row_output_where_layout_sizes_coincide

    results = spawn(per_row_output_where_layout_sizes_coincide, 2, "features", "b", False, backend="freescale",
                    timeout_s=90)
    assert results[1]["seen"] == {"samples": 3, "a": 5, "b": 5}, results
    assert all(r["equal"] for r in results), results


def test_an_output_fitting_no_layout_on_one_rank_raises_on_every_rank():
    _need_torchrec()
    from bundle_programs import output_fitting_no_layout_on_one_rank

    first, second = spawn(output_fitting_no_layout_on_one_rank, 2, backend="freescale", timeout_s=90)
    assert first == second, (first, second)
    assert "rank 1: 4 rows" in first and "rank 0: 0 rows" in first, first


@pytest.mark.parametrize("kinds", ["count", "kind"])
def test_ranks_returning_outputs_of_different_structures_all_raise(kinds):
    _need_torchrec()
    from bundle_programs import outputs_of_different_structures

    for message in spawn(outputs_of_different_structures, 2, kinds, backend="freescale", timeout_s=90):
        if kinds == "count":
            assert "ranks returned different numbers of outputs from a balanced module" in message, message
        else:
            assert "ranks [0]: 2 outputs" in message and "ranks [1]: 2 outputs" in message, message


def _dest(*ranks):
    return [np.asarray(r, dtype=np.int64) for r in ranks]


def test_sizes_differ_everywhere_only_where_the_plan_tells():
    from freescale_comm._output_layouts import sizes_differ_everywhere

    dest = _dest([0, 1, 0], [1])  # rank 0 computes its samples 0 and 2; rank 1 its own and rank 0's sample 1
    # one feature with the cost lengths: rank 1 computes 2 samples of 1 + 3 rows
    assert sizes_differ_everywhere(dest, [np.array([2, 1, 4]), np.array([3])], [-1], [True])
    # there as many rows (1 + 1) as samples
    assert not sizes_differ_everywhere(dest, [np.array([2, 1, 4]), np.array([1])], [-1], [True])
    # a feature with lengths of its own: its rows on other ranks are not known
    assert not sizes_differ_everywhere(dest, [np.array([2, 1, 4]), np.array([3])], [-1, -1], [True, False])
    # a second feature sharing the first's dispatch changes nothing; no features: only per-sample rows
    assert sizes_differ_everywhere(dest, [np.array([2, 1, 4]), np.array([3])], [-1, 0], [True, True])
    assert sizes_differ_everywhere(dest, [np.array([2, 1, 4]), np.array([3])], [], [])

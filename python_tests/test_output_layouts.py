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


def test_per_row_output_keyed_by_its_feature_where_every_rank_has_as_many_rows_as_samples():
    """Both ways fit on every rank: the dict key naming the feature decides (per-sample rows went
    to the wrong ranks, silently). Rank 1 builds its dict in another order."""
    _need_torchrec()
    from bundle_programs import per_row_output_where_layout_sizes_coincide

    results = spawn(per_row_output_where_layout_sizes_coincide, 2, "everywhere", "items", True, backend="freescale",
                    timeout_s=90)
    assert [r["seen"] for r in results] == [{"samples": 4, "items": 4}] * 2, results
    assert all(r["equal"] for r in results), results


@pytest.mark.parametrize("keyed", [False, "jagged"])
def test_per_row_output_of_a_feature_whose_rows_equal_anothers_on_one_rank(keyed):
    _need_torchrec()
    from bundle_programs import per_row_output_where_layout_sizes_coincide

    results = spawn(per_row_output_where_layout_sizes_coincide, 2, "features", "b", keyed, backend="freescale",
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
        if kinds == "count":  # the transport's code and culprit kept
            assert "ranks returned different numbers of outputs from a balanced module" in message, message
            assert message.startswith(("SIZE_MISMATCH (culprit ", "PEER_ABORTED (culprit ")), message
            assert "(culprit None)" not in message, message
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


class _OneRank:
    """A one-rank communicator: what is sent arrives."""

    world_size = 1

    def all_to_all_single(self, out, inp, priority=0):
        out.copy_(inp)


@pytest.mark.parametrize("features", [1, 61, 62, 63, 130])
def test_fits_of_many_features_cross_in_int64_words(features):
    import random
    import types

    from freescale_comm._output_layouts import Ways, _Leaf

    sample = types.SimpleNamespace(comm=_OneRank(), rows_received=5)
    handles = {f"f{i}": types.SimpleNamespace(rows_received=i) for i in range(features)}
    ways = Ways(types.SimpleNamespace(sample_handle=sample, handles=handles, num_samples=5))
    rnd = random.Random(features)
    leaves = [_Leaf(f"p{j}", j, False, rnd.getrandbits(features + 1)) for j in range(5)]
    leaves.append(_Leaf("all", 1, True, (1 << (features + 1)) - 1))
    (view,) = ways._exchange(leaves, 0)
    assert view.fits == [leaf.fits for leaf in leaves]
    assert view.feature_rows == list(range(features)) and view.samples == 5

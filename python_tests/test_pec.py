"""freescale_comm.pec: sharding, the vectorized overlap split, and PEC training that reads exactly
what synchronous training reads (row-wise and table-wise, several collision rates)."""

import numpy as np
import pytest
import torch

import pec_programs
from freescale_comm import pec
from freescale_comm.bench import e2e, pec_sweep, workloads
from freescale_comm.testing import spawn
from test_e2e import SMALL


# -- sharding -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["row", "table"])
def test_every_row_has_exactly_one_owner_and_slot(kind):
    world = 3
    sh = pec.RowWiseSharding([10, 7, 1], world) if kind == "row" else pec.TableWiseSharding([10, 7, 1], world)
    owner, row = sh.route([torch.arange(n) for n in sh.num_rows])
    assert sum(sh.shard_rows(r) for r in range(world)) == 18
    for r in range(world):
        slots = row[owner == r]
        assert sorted(slots.tolist()) == list(range(sh.shard_rows(r)))  # a bijection onto the shard


def test_row_wise_cuts_contiguous_blocks_and_table_wise_keeps_tables_whole():
    owner, row = pec.RowWiseSharding([8], 4).route([torch.arange(8)])
    assert owner.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and row.tolist() == [0, 1] * 4
    owner, _ = pec.TableWiseSharding([5, 5, 5], 2, owners=[1, 0, 1]).route([torch.arange(5)] * 3)
    assert owner.tolist() == [1] * 5 + [0] * 5 + [1] * 5


@pytest.mark.parametrize("ids, match", [
    ([torch.tensor([0, 10])], "ids\\[0\\] holds ids outside \\[0, 10\\)"),
    ([torch.tensor([1.0])], "ids\\[0\\] must be an integer"),
    ([torch.tensor([1]), torch.tensor([1])], "one id tensor per table \\(1\\)"),
])
def test_bad_ids_name_the_table_and_the_range(ids, match):
    with pytest.raises((ValueError, TypeError), match=match):
        pec.RowWiseSharding([10], 2).check_ids(ids)


def test_bad_shardings_are_refused():
    with pytest.raises(ValueError, match="num_rows"):
        pec.RowWiseSharding([], 2)
    with pytest.raises(ValueError, match="owners\\[0\\] must be a rank"):
        pec.TableWiseSharding([4], 2, owners=[2])


# -- the split ------------------------------------------------------------------------------------
def test_split_overlap_matches_a_set_definition():
    rng = np.random.default_rng(0)
    nxt = [torch.from_numpy(rng.integers(0, 50, 40)), torch.from_numpy(rng.integers(0, 9, 5))]
    cur = [torch.from_numpy(rng.integers(0, 50, 30)), torch.zeros(0, dtype=torch.int64)]
    overlap, non_overlap = pec.split_overlap(nxt, cur)
    for t in range(2):
        seen = set(cur[t].tolist())
        assert overlap[t].tolist() == [i for i in nxt[t].tolist() if i in seen]  # N+1's order kept
        assert non_overlap[t].tolist() == [i for i in nxt[t].tolist() if i not in seen]
    assert pec.collision_rate(nxt, cur) == pytest.approx(overlap[0].numel() / 45)


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5, 1.0])
def test_generated_ids_collide_at_the_asked_rate(rate):
    batches = workloads.overlapping_ids([[200, 100, 300]] * 3, 4000, rate, seed=1)
    for s in (1, 2):
        assert pec_programs.collision_of(batches[s - 1:s + 1]) == pytest.approx(rate, abs=0.01)
    with pytest.raises(ValueError, match="rate must be in"):
        workloads.overlapping_ids([[1]], 10, 1.5)


# -- PEC reads what synchronous training reads ----------------------------------------------------
@pytest.mark.parametrize("kind", ["row", "table"])
@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_pec_reads_exactly_what_synchronous_training_reads(kind, rate):
    steps = 5
    results = spawn(pec_programs.train_against_sync, 3, kind, rate, steps, True, backend="gloo")
    gap = pec_programs.stale_gap(kind, rate, steps, 3)
    if rate > 0:
        assert gap > 1e-2  # a stale read would be off by this much: the check below can fail
    for res in results:
        assert len(res["max_err"]) == steps
        assert max(res["max_err"]) <= 1e-6, res
        assert res["final_err"] <= 1e-6


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_pec_stays_synchronous_however_ranks_poll_and_with_forward_only_batches(rate):
    """progress() is local: rank 0 polls after fetch() and backward(), the others after prefetch()
    (it posted the held-back gradients, an AllToAll, wherever it ran first: crossed with a peer's
    prefetch, a SIZE_MISMATCH or bytes read as the wrong message). A batch without backward()
    (step 2) before one reading the rows an earlier batch updated: that update was still held back
    (served stale)."""
    steps = 6
    for res in spawn(pec_programs.train_against_sync, 3, "row", rate, steps, True, "differ", (2,), backend="gloo"):
        assert len(res["max_err"]) == steps
        assert max(res["max_err"]) <= 1e-6 and res["final_err"] <= 1e-6, res


def test_a_gradient_tensor_written_over_as_soon_as_backward_returns_trains_right():
    """backward() held the caller's tensor for the deferred gradients, sent by the next prefetch()
    or backward(): a training loop that reused its gradient buffer (as the README's loop allowed)
    got a silently wrong table. Now backward() keeps its own copy of them."""
    for res in spawn(pec_programs.train_against_sync, 2, "row", 0.5, 5, True, "alike", (), True, backend="gloo"):
        assert max(res["max_err"]) <= 1e-6 and res["final_err"] <= 1e-6, res


def test_a_parameter_shard_updates_in_place_as_torch_optim_does():
    assert spawn(pec_programs.parameter_shard, 2, backend="gloo") == [[-0.5, -0.5]] * 2


def test_ids_not_held_in_a_list_are_refused_naming_the_form():
    """prefetch(None) raised "object of type 'NoneType' has no len()"; a dict's keys were read as ids."""
    sh = pec.RowWiseSharding([8, 5], 2)
    for bad in (None, {"a": torch.tensor([1]), "b": torch.tensor([2])}, 3):
        with pytest.raises(TypeError, match=r"ids must be a list or tuple of int tensors, one per table \(2\)"):
            sh.check_ids(bad)


def test_lr_may_be_a_tensor_read_at_each_update_as_torch_optim_reads_it():
    assert spawn(pec_programs.tensor_lr, 2, backend="gloo") == [[[-0.5, -0.5], [-1.5, -1.5]]] * 2


def test_pec_without_pipelining_is_synchronous_too():
    for res in spawn(pec_programs.train_against_sync, 2, "row", 0.5, 4, False, backend="gloo"):
        assert max(res["max_err"]) <= 1e-6 and res["final_err"] <= 1e-6


def test_owner_applies_overlap_gradients_while_the_caller_is_elsewhere():
    assert spawn(pec_programs.overlap_update_without_a_call, 2, backend="gloo") == [True, True]


def test_an_update_failing_on_the_runtime_thread_raises_in_fetch():
    assert spawn(pec_programs.failing_update_raises_in_fetch, 2, backend="gloo") == ["optimizer state is missing"] * 2


def test_out_of_order_calls_raise_and_name_the_fix():
    messages = spawn(pec_programs.misuse, 2, backend="gloo")[0]
    assert "call prefetch(ids) first" in messages[0]
    assert "call fetch() first" in messages[1]
    assert "fetch() the prefetched batch first" in messages[2]
    assert "grads must be a tensor" in messages[3]


def test_constructor_checks_arguments_before_any_communication():
    sh = pec.RowWiseSharding([8], 2)
    with pytest.raises(ValueError, match="exactly one of lr"):
        pec.PrioritizedEmbedding(sh, torch.zeros(4, 2))
    with pytest.raises(ValueError, match="weight must be a 2-D floating tensor"):
        pec.PrioritizedEmbedding(sh, torch.zeros(4), lr=0.1)
    with pytest.raises(TypeError, match="sharding must be"):
        pec.PrioritizedEmbedding("rows", torch.zeros(4, 2), lr=0.1)
    with pytest.raises(TypeError, match="update must be a callable"):
        pec.PrioritizedEmbedding(sh, torch.zeros(4, 2), update=0.01)
    with pytest.raises(ValueError, match="torch.int64"):
        pec.PrioritizedEmbedding(sh, torch.zeros(4, 2, dtype=torch.int64), lr=0.1)
    # lr NaN trained every row to NaN; a string was a ValueError
    for bad in (float("nan"), float("inf"), 0, -0.1, torch.tensor([0.1, 0.2]), torch.tensor(float("nan"))):
        with pytest.raises(ValueError, match="lr "):
            pec.PrioritizedEmbedding(sh, torch.zeros(4, 2), lr=bad)
    with pytest.raises(TypeError, match="lr must be a positive number"):
        pec.PrioritizedEmbedding(sh, torch.zeros(4, 2), lr="0.1")


def test_a_rank_whose_shard_does_not_fit_refuses_before_building_the_communicator():
    """Only rank 1's weight has a row too many: it raises ValueError before any communication (its
    peer then fails to build the communicator, within the timeout), not after the setup exchange."""
    out = spawn(pec_programs.one_rank_wrong_weight, 2, backend="gloo", env={"FREESCALE_TIMEOUT_S": "10"}, fresh_interpreter=False)
    assert out[1] == "ValueError: weight has 5 rows but rank 1's shard holds 4 (sharding.shard_rows(rank)) before"
    assert out[0].startswith("CommError"), out


# -- e2e modes and the sweep (on test_e2e's small config, fixed cost model included) ---------------


def test_pec_modes_train_like_vanilla():
    res = e2e.run(e2e.E2EConfig(**SMALL, modes=("vanilla", "pec", "balance_pec"), collision_rate=0.3),
                  progress=False)
    for mode in ("pec", "balance_pec"):
        assert res.losses[mode] == pytest.approx(res.losses["vanilla"], rel=1e-5, abs=1e-7), mode
    assert any(n != SMALL["samples"] for rank in res.computed_samples["balance_pec"] for n in rank)


def test_pec_sweep_rows_and_plot(tmp_path):
    sweep = pec_sweep.SweepConfig(e2e.E2EConfig(**{**SMALL, "steps": 2}, modes=pec_sweep.SWEEP_MODES), (0.0, 0.5))
    rows = pec_sweep.run(sweep, progress=False)
    assert [(r["mode"], r["collision_rate"]) for r in rows] == [("vanilla", 0.0), ("pec", 0.0), ("vanilla", 0.5), ("pec", 0.5)]
    for r in rows:
        assert r["exposed_comm_ms"] >= 0 and r["step_ms"] > 0
    png = pec_sweep.plot(rows, str(tmp_path / "sweep.png"), "test")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "goal <= 10%" in pec_sweep.summary(rows)

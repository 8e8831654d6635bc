"""fc.LoadBalancer and fc.balance across ranks: balancing changes where samples are computed,
never the result (outputs and gradients), and all ranks plan alike."""

import numpy as np
import pytest
import torch

import freescale_comm as fc
from balancer_programs import (balanced_equals_unbalanced, balancing_under_torch_compile, module_hook_form,
                               measured_speeds_steer_the_plans, plans_ahead_equal_plans_at_dispatch,
                               speeds_reach_the_plan)
from freescale_comm.testing import spawn


@pytest.mark.parametrize("world, backend", [(2, "gloo"), (3, "freescale"), (4, "freescale")])
def test_balanced_step_equals_unbalanced_step(world, backend):
    stats = spawn(balanced_equals_unbalanced, world, 21, 6, backend=backend)
    assert stats[0]["after"] < stats[0]["before"]  # the straggler's samples did move
    assert stats[0]["moved"] > 0
    assert all(s == stats[0] for s in stats)


def test_module_hook_form():
    spawn(module_hook_form, 3, 5, 4, backend="freescale")


def test_balancing_runs_under_torch_compile():
    for r in spawn(balancing_under_torch_compile, 2, timeout_s=240):
        assert r == {"dispatch_combine": True, "load_balancer": True, "balance": True}, r


def test_bad_arguments():
    with pytest.raises(TypeError, match="CostModel"):
        fc.LoadBalancer("quadratic")
    with pytest.raises(ValueError, match="bytes_per_item"):
        fc.LoadBalancer(fc.planner.CostModel(), bytes_per_item=-2)
    with pytest.raises(ValueError, match="bytes_per_item"):
        fc.LoadBalancer(fc.planner.CostModel(), bytes_per_item=True)
    # a NumPy int, as plan_rebalance takes (it was refused)
    assert fc.LoadBalancer(fc.planner.CostModel(), bytes_per_item=np.int64(4)).bytes_per_item == 4
    lb = fc.LoadBalancer(fc.planner.CostModel())
    with pytest.raises(TypeError, match="int64"):
        lb.dispatch(torch.zeros(3, 2), torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="sum to 4"):
        lb.dispatch(torch.zeros(3, 2), torch.tensor([1, 3]))
    with pytest.raises(TypeError, match="nn.Module"):
        fc.balance(lambda x: x, fc.planner.CostModel())
    # Refused here, before the plan's exchange (they were found by fc.dispatch after it: one rank
    # raised while its peers waited, then it was two collectives ahead of them): a bad priority,
    # and lengths whose int64 sum wraps around to the row count.
    with pytest.raises(TypeError, match="priority must be an int"):
        lb.dispatch(torch.zeros(3, 2), torch.tensor([1, 2]), priority="high")
    with pytest.raises(ValueError, match=r"lengths\[0\] = 9223372036854775807 exceeds the 2 rows"):
        lb.dispatch(torch.zeros(2, 2), torch.tensor([2 ** 63 - 1, 2 ** 63 - 1, 4]))
    torchrec = pytest.importorskip("torchrec")
    jt = torchrec.JaggedTensor(values=torch.zeros(3, 2), lengths=torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="priority must be an int"):
        lb.dispatch_bundle({"items": jt}, priority=1.5)


def test_each_ranks_speed_reaches_every_plan():
    """LoadBalancer.speed, each rank its own, rides on the plan's all-gather: dispatch, plan_ahead
    and plan all plan with every rank's speed (rank 2 three times rank 0's), and the balanced
    output still equals the unbalanced one."""
    for r in spawn(speeds_reach_the_plan, 3, backend="freescale"):
        assert r["dispatch"] and r["ahead"] and r["plan"] and r["same_output"], r
        assert r["moved"] > 0 and r["speeds"] == pytest.approx([0.5, 1.0, 1.5]), r
    lb = fc.LoadBalancer(fc.planner.CostModel())
    assert lb.speed == 1.0
    for bad in (0, -1.0, float("nan"), float("inf"), True, "fast"):
        with pytest.raises(ValueError, match="speed must be a positive finite number"):
            lb.speed = bad


def test_a_balanced_module_measuring_its_speed_gives_a_slower_rank_less():
    """fc.balance(measure_speed=True): each forward's time (a counted clock here: rank 1 takes
    twice as long per cost) sets the speed the next plan uses; rank 1 then gets half rank 0's
    cost. Off (the default), both keep equal loads."""
    for rank, r in enumerate(spawn(measured_speeds_steer_the_plans, 2, True, backend="freescale")):
        first, *later = r["plans"]
        assert first["speeds"] is None, r  # nothing measured before the first plan
        for plan in later:
            assert plan["speeds"] == pytest.approx([4 / 3, 2 / 3]), r
            assert plan["loads"][0] / plan["loads"][1] == pytest.approx(2.0, rel=0.1), r
        assert r["speed"] == pytest.approx(1.0 if rank == 0 else 0.5), r
    for r in spawn(measured_speeds_steer_the_plans, 2, False, backend="freescale"):
        assert all(p["speeds"] is None and p["loads"][0] == pytest.approx(p["loads"][1], rel=0.05) for p in r["plans"]), r
        assert r["speed"] == 1.0
    with pytest.raises(TypeError, match="measure_speed must be True or False"):
        fc.balance(torch.nn.Identity(), fc.planner.CostModel(), measure_speed="yes")


def test_plans_made_ahead_equal_the_plans_made_at_dispatch():
    """LoadBalancer.plan_ahead (what TrainPipelinePEC's worker runs a batch early) gives, for each
    batch, the plan, feature views and cost lengths dispatch_bundle's own all-gather gives: 3 ranks,
    4 batches at once, empty batches on some ranks, features equal on some ranks only."""
    for report in spawn(plans_ahead_equal_plans_at_dispatch, 3, 4, backend="freescale"):
        assert all(b["same_plan"] and b["same_extras"] and b["same_costs"] for b in report), report
        assert any(0 in b["samples"] for b in report) and any(min(b["samples"]) > 0 for b in report), report


def test_a_plan_made_ahead_serves_only_the_sequences_it_was_made_with():
    """PlannedSequences gives its plan to the balancer it was made for, while its entries are the
    ones it was made with; a replaced entry, another balancer or a copy gets none (the all-gather)."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    first, second = fc.LoadBalancer(fc.planner.CostModel()), fc.LoadBalancer(fc.planner.CostModel())
    items = JaggedTensor(values=torch.zeros(3, 2), lengths=torch.tensor([1, 2]))
    plan = object()
    planned = fc.balancer.PlannedSequences({"items": items}, {first: plan})
    assert planned.plan_for(first) is plan and planned.plan_for(second) is None
    assert not isinstance(dict(planned), fc.balancer.PlannedSequences)
    planned["items"] = JaggedTensor(values=torch.zeros(3, 2), lengths=torch.tensor([1, 2]))
    assert planned.plan_for(first) is None


@pytest.mark.parametrize("case", ["empty_input", "short_circuit", "parameters_only"])
def test_ranks_whose_batches_differ_in_requires_grad_still_get_every_gradient(case):
    from balancer_programs import ranks_whose_batches_differ_in_requires_grad

    results = spawn(ranks_whose_batches_differ_in_requires_grad, 2, case, backend="freescale", timeout_s=60,
                    env={"FREESCALE_TIMEOUT_S": "10"}, fresh_interpreter=False)
    assert all(r["equal"] for r in results), results
    if case == "empty_input":
        assert results[0]["computed"] > 0, results  # rank 1 computed some of rank 0's samples


def test_a_gradient_penalty_beside_an_empty_rank_runs_the_same_movements_everywhere():
    from balancer_programs import a_gradient_penalty_beside_an_empty_rank

    assert spawn(a_gradient_penalty_beside_an_empty_rank, 2, backend="freescale", timeout_s=60,
                 env={"FREESCALE_TIMEOUT_S": "10"}, fresh_interpreter=False) == [True, True]

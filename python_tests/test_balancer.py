"""fc.LoadBalancer and fc.balance across ranks: balancing changes where samples are computed,
never the result (outputs and gradients), and all ranks plan alike."""

import pytest
import torch

import freescale_comm as fc
from balancer_programs import balanced_equals_unbalanced, module_hook_form
from freescale_comm.testing import spawn


@pytest.mark.parametrize("world, backend", [(2, "gloo"), (3, "freescale"), (4, "freescale")])
def test_balanced_step_equals_unbalanced_step(world, backend):
    stats = spawn(balanced_equals_unbalanced, world, 21, 6, backend=backend)
    assert stats[0]["after"] < stats[0]["before"]  # the straggler's samples did move
    assert stats[0]["moved"] > 0
    assert all(s == stats[0] for s in stats)


def test_module_hook_form():
    spawn(module_hook_form, 3, 5, 4, backend="freescale")


def test_bad_arguments():
    with pytest.raises(TypeError, match="CostModel"):
        fc.LoadBalancer("quadratic")
    with pytest.raises(ValueError, match="bytes_per_item"):
        fc.LoadBalancer(fc.planner.CostModel(), bytes_per_item=-2)
    lb = fc.LoadBalancer(fc.planner.CostModel())
    with pytest.raises(TypeError, match="int64"):
        lb.dispatch(torch.zeros(3, 2), torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="sum to 4"):
        lb.dispatch(torch.zeros(3, 2), torch.tensor([1, 3]))
    with pytest.raises(TypeError, match="nn.Module"):
        fc.balance(lambda x: x, fc.planner.CostModel())

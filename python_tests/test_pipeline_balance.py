"""fc.TrainPipelinePEC(balance=...) where users could get it wrong, 2 ranks, one spawn; each case
failed before its fix (found by a reviewer)."""

from __future__ import annotations

import pytest

from freescale_comm.testing import spawn

pytestmark = pytest.mark.usefixtures("torchrec_installed")


def test_balance_in_the_pipeline_refuses_or_trains_right():
    from balance_pipeline_programs import balance_in_the_pipeline

    for out in spawn(balance_in_the_pipeline, 2, timeout_s=300, env={"FREESCALE_TIMEOUT_S": "30"}, fresh_interpreter=False):
        # a model that pops a feature and puts it back (other key order) got the plan made for the
        # first order (dispatch reads plans by position): it crashed; now it falls back to the all-gather
        assert "error" not in out["reordered"] and out["reordered"]["diff"] == {"outputs": 0.0, "state": 0.0}, out
        # ranks with different cost models for one module planned apart (a misleading error later)
        assert out["cost_models"].startswith("ValueError at construction") and "balance" in out["cost_models"], out
        # balancing the sharded EmbeddingCollection itself moved its ids, not its embeddings
        assert out["sharded_target"].startswith("ValueError at construction"), out
        assert "holds the sharded module" in out["sharded_target"], out
        # close() after the user took fc.balance's hooks off raised AttributeError
        assert out["removed_hooks"] == "closed", out
        # measure_speed: rank 1 computes at half speed (a counted clock); the plans made once a
        # forward was timed give it less, while the unmeasured run's plans know no speeds
        speeds = out["measured_speeds"]
        plans = speeds["plans"]
        # A forward's time is read at the next forward (its start), so batch 1's forward first
        # sets the speed; batch 2's plan, made ahead, may predate that (the worker's timing) and
        # batch 3's, routed once progress() of batch 2 began, never does.
        assert plans[0]["speeds"] is None and plans[1]["speeds"] is None, speeds
        assert all(p["speeds"] is not None for p in plans[3:]), speeds
        for p in (p for p in plans if p["speeds"] is not None):
            assert p["speeds"] == pytest.approx([4 / 3, 2 / 3]), speeds
            assert p["loads"][1] < p["loads"][0], speeds
        assert all(p["speeds"] is None for p in speeds["plans_unmeasured"]), speeds
        assert speeds["ahead"] == len(plans), speeds  # every plan made ahead, none on the main thread
        # the same samples computed wherever they went: the runs agree within float rounding
        assert speeds["diff"]["outputs"] < 1e-5 and speeds["diff"]["state"] < 1e-5, speeds
        assert out["measure_without_balance"].startswith("ValueError") and "balance" in out["measure_without_balance"], out

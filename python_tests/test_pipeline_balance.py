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

"""fc.TrainPipelinePEC in the patterns of a TorchRec training loop, each against
TrainPipelineSparseDist on the same model and data (2 ranks, tiny model, few steps, one spawn).
Each of the first five failed before its fix (found by a reviewer)."""

from __future__ import annotations

import pytest

from freescale_comm.testing import spawn

pytestmark = pytest.mark.usefixtures("torchrec_installed")


def test_the_pipeline_behaves_as_sparse_dist_in_a_training_loop():
    from contract_programs import training_loop_patterns

    for out in spawn(training_loop_patterns, 2, timeout_s=300):
        # execute_all_batches=False: every epoch trains (one batch left each, as documented); before,
        # every second epoch raised StopIteration at once ([3, 0, 3])
        assert out["epochs"]["pec"] == [3, 3, 3], out["epochs"]
        # a checkpoint that reads the optimizer's state first holds every trained batch's update
        assert out["optimizer_first"]["outputs"] == out["optimizer_first"]["state_max"] == 0.0, out["optimizer_first"]
        # after a dataloader error (the worker's deferred update slowed), the checkpoint the caller
        # takes does not race the worker
        error = out["data_error"]
        assert error["raised"] == {"sparse_dist": "OSError", "pec": "OSError"} and error["state_max"] == 0.0, error
        # loading state mid-run is refused, clearly (rows already fetched); between epochs it loads
        load = out["load"]
        assert "in flight" in load["refused"]["pec"] and "in flight" in load["refused"]["optimizer"], load["refused"]
        assert load["n_outputs"][0] == load["n_outputs"][1] and load["outputs"] == load["state_max"] == 0.0, load
        # a batch that builds its KeyedJaggedTensors on every read trains (it failed: not the same object)
        props = out["property_batches"]
        assert not props["errors"] and props["outputs"] == props["state_max"] == 0.0, props
        # kept as they were: a train / eval / train loop, dataloaders of 0, 1 and 2 batches over two epochs
        loop = out["train_eval_train"]
        assert loop["n_outputs"][0] == loop["n_outputs"][1] and loop["outputs"] == loop["state_max"] == 0.0, loop
        for n, diff in out["short_loaders"].items():
            assert diff["n_outputs"] == (2 * n, 2 * n) and diff["outputs"] == diff["state_max"] == 0.0, (n, diff)

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
        # a fixed count of steps per epoch, then an eval epoch: every batch trains and evaluates;
        # before, [9 + 2, 6 + 0]: every second epoch raised StopIteration at once, the eval saw none
        fixed = out["fixed_count"]
        assert fixed["n_outputs"] == (3 * 3 + 2, 3 * 3 + 2) and fixed["outputs"] == fixed["state_max"] == 0.0, fixed
        # TorchRec's eval pipeline mid-epoch on the same model, then training on, then a new pipeline
        evals = out["torchrec_eval"]
        assert evals["n_outputs"] == (2 + 2 + 2 + 4,) * 2 and evals["outputs"] == evals["state_max"] == 0.0, evals
        assert "training forward outside TrainPipelinePEC.progress" in (evals["refused"] or ""), evals["refused"]
        # the dropped pipeline, closed by the new one, says so when called again
        assert "a new TrainPipelinePEC was built on the same model" in evals["refused"], evals["refused"]
        # the inner module's load_state_dict is refused before its dense head loads
        inner = out["inner_load"]
        assert "in flight" in (inner["refused"] or "") and inner["head_keys"] == 2 and inner["head_changed"] == [], inner
        # a constructor that fails late releases its communicator, worker and hooks
        ctor = out["ctor_failure"]
        assert ctor == {"raised": "wrap failed", "threads": [], "hooks_left": 0, "trained": 3}, ctor
        # a pipeline dropped mid-epoch gives way to a new one; one dropped unclosed with its model frees both
        dropped = out["dropped"]
        assert dropped["n_outputs"] == (2 + 4,) * 2 and dropped["outputs"] == dropped["state_max"] == 0.0, dropped
        assert dropped["trained"] == 4 and dropped["model_freed"] and dropped["pec_threads"] == [], dropped
        for n, diff in out["short_loaders"].items():
            assert diff["n_outputs"] == (2 * n, 2 * n) and diff["outputs"] == diff["state_max"] == 0.0, (n, diff)


def test_a_sharded_modules_input_must_be_the_one_read_from_the_batch():
    """A KeyedJaggedTensor rebuilt around the same tensors is the input the pipeline read; one with
    other ids or lengths of the same sizes is not (its rows were never fetched: it would train on
    the wrong ones)."""
    import torch
    from torchrec import KeyedJaggedTensor

    from freescale_comm.pipelines.pec_pipeline import _same_input

    values, lengths = torch.arange(4), torch.tensor([1, 3])
    read = KeyedJaggedTensor(keys=["f"], values=values, lengths=lengths)
    assert _same_input(KeyedJaggedTensor(keys=["f"], values=values, lengths=lengths), read)
    assert not _same_input(KeyedJaggedTensor(keys=["f"], values=values % 2, lengths=lengths), read)
    assert not _same_input(KeyedJaggedTensor(keys=["f"], values=values, lengths=torch.tensor([3, 1])), read)
    assert not _same_input(KeyedJaggedTensor(keys=["g"], values=values, lengths=lengths), read)


def test_a_deep_copy_of_a_wrapped_model_loads_into_itself():
    """The pipeline's load_state_dict / state_dict wrappers are methods bound to their holder: a
    deep copy (an EMA model) loads into the copy, without the pipeline's check (it loaded into the
    original); close() removes only its own wrapper."""
    import copy
    import types

    import torch
    from torch import nn

    from freescale_comm.pipelines.pec_pipeline import TrainPipelinePEC

    checked = []
    owner = types.SimpleNamespace(_wrapped=[])
    model = nn.Linear(2, 2)
    TrainPipelinePEC._wrap(owner, model, "load_state_dict", lambda *a, **k: checked.append(1))
    twin = copy.deepcopy(model)
    twin.load_state_dict({"weight": torch.full((2, 2), 7.0), "bias": torch.zeros(2)})
    assert float(twin.weight.sum()) == 28.0 and float(model.weight.sum()) != 28.0 and checked == []
    model.load_state_dict({"weight": torch.ones(2, 2), "bias": torch.zeros(2)})
    assert checked == [1] and float(model.weight.sum()) == 4.0


def test_a_checkpoint_loaded_in_place_mid_run_is_refused_and_a_new_pipeline_resumes_from_it(tmp_path):
    """torch.distributed.checkpoint.load into model.state_dict() with batches in flight: before, the
    next step trained them on rows fetched before the load and applied the last batch's deferred
    gradients on top of the loaded tables (a silent wrong result). Now the next progress() (or the
    next state_dict(), which would apply those gradients) refuses, the tables keep the checkpoint,
    and a new pipeline resumes from it as TrainPipelineSparseDist does."""
    from table_write_programs import checkpoint_loaded_in_place_mid_run

    for read_first in (False, True):
        where = str(tmp_path / f"read_first_{read_first}")
        for out in spawn(checkpoint_loaded_in_place_mid_run, 2, 7, 2, 4, where, read_first, timeout_s=300):
            assert "written in place outside TrainPipelinePEC" in (out["raised"] or ""), (read_first, out["raised"])
            assert out["tables_hold_the_checkpoint"], read_first
            assert out["n_outputs"] == (5, 5) and out["outputs"] == out["state_max"] == 0.0, (read_first, out)

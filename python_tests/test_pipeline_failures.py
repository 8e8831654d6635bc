"""TrainPipelinePEC's failures, 2 ranks (rank 1 the victim; the small model without DDP around its
dense part, so a survivor never waits in torch's own all-reduce): what the survivor and the victim
each see. Each failed before its fix (found by a reviewer)."""

import math

import pytest

from freescale_comm.testing import run_ranks, spawn
from pipeline_failure_programs import VICTIM, ctrl_c_in_forward, disagreeing_arguments, scenario

pytestmark = pytest.mark.usefixtures("torchrec_installed")


def test_close_raises_when_a_dead_peers_deferred_gradients_never_arrive():
    """Rank 1 dies before its third step's deferred gradients leave. Rank 0's steps succeed; its
    close() flushes, waits for them and must raise PEER_DIED naming rank 1 (it kept the error and
    returned None: the tables silently lacked the update)."""
    results = run_ranks(scenario, 2, "die_before_close", 10.0, timeout_s=120)
    survivor = results[0]
    assert survivor.error is None, survivor.error
    assert results[VICTIM].exitcode == 7
    assert survivor.value["before_close"]["error"] is None, survivor.value
    closed = survivor.value["close"]
    assert closed["error"] == "CommError" and closed["code"] == "PEER_DIED" and closed["culprit"] == VICTIM, closed
    assert closed["threads_after_close"] == [], closed  # everything released all the same


def test_one_ctrl_c_leaves_a_progress_blocked_on_a_slow_peer_at_once():
    """Rank 1's dataloader stalls for twice the timeout; rank 0, blocked waiting for it, gets one
    SIGINT 1 s in: KeyboardInterrupt leaves progress() at once (it waited out the timeout, 30 min
    with a default gloo group), and rank 1 learns rank 0 left."""
    results = run_ranks(scenario, 2, "sigint_blocked", 6.0, 6, [1.0], timeout_s=120)
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error}"
    out = results[0].value
    assert out["progress"]["error"] == "KeyboardInterrupt" and out["raised_after"] < 3.0, out
    victim = results[VICTIM].value["progress"]
    assert victim["error"] == "CommError" and victim["culprit"] == 0, victim


def test_the_pipelines_own_commerrors_carry_code_and_culprit():
    """Rank 1's split_batch raises: rank 1 its ValueError, rank 0 the pipeline's own CommError, with
    .code and .culprit as every CommError (they had none)."""
    results = run_ranks(scenario, 2, "raise_split", timeout_s=120)
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error}"
    assert results[VICTIM].value["progress"]["error"] == "ValueError"
    got = results[0].value["progress"]
    assert got["error"] == "CommError" and got["code"] == "PEER_ABORTED" and got["culprit"] == VICTIM, got


def test_progress_from_two_threads_is_refused_clearly():
    """Rank 1 calls progress() from two threads at once: one gets a RuntimeError saying so (both
    posted rounds, and every rank got SIZE_MISMATCH blaming rank 0)."""
    results = run_ranks(scenario, 2, "two_threads", timeout_s=120)
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error}"
    errors = results[VICTIM].value["all_errors"]
    assert any(e.startswith("RuntimeError") and "another thread" in e for e in errors), errors


def test_ranks_built_with_different_arguments_are_told_which_one():
    """Construction compares the arguments that shape the rounds: each mismatch is a ValueError on
    every rank naming it (it was SIZE_MISMATCH about bytes at the first step, or, for prefetch at
    low collision, nothing at all); agreeing ranks then train."""
    for out in spawn(disagreeing_arguments, 2, timeout_s=300):
        for name in ("micro_batches", "prefetch", "balance", "execute_all_batches", "low_priority"):
            assert out[name] is not None and f"different {name}" in out[name], (name, out[name])
        assert math.isfinite(out["trained"]), out  # the step ran


def test_after_ctrl_c_a_checkpoint_holds_sparse_dists_tables_or_is_refused():
    """Ctrl-C in both ranks' forward at step 2: what can still be applied of the last trained batch's
    update is (its deferred gradients, once they arrived), so the state equals TrainPipelineSparseDist's
    after the same steps; where it cannot, reading the state raises. Before, model.state_dict()
    silently lacked the deferred gradients (a checkpoint of no step)."""
    for r in run_ranks(ctrl_c_in_forward, 2, 2, timeout_s=180):
        assert r.error is None, r.error
        assert r.value["pec"] in ("equal", "refused"), r.value

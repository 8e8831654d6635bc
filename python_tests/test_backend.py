"""The torch.distributed backend "freescale": registration, every collective against gloo, async
ops under fc.priority, subgroups, barrier timeout, and a torchrun script."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import freescale_comm as fc
from freescale_comm.testing import run_ranks, spawn
from backend_programs import (
    close_from_a_done_callback,
    delegated_vs_native_out_of_step,
    collectives_checked_in_detail_mode,
    native_ops_of_different_kinds,
    a_death_then_a_survivor_leaves,
    pending_op_at_teardown,
    all_to_all_shapes_as_gloo,
    async_ops_and_priorities_interleave,
    barrier_honours_its_timeout,
    barrier_peer_never_joins,
    coalesced_gathers_and_reduce_scatters,
    communicator_peer_never_posts,
    every_collective_matches_gloo,
    future_callbacks_wait_on_other_ops,
    list_all_to_all_outputs_once_complete,
    local_refusals_are_runtime_errors,
    native_ops_are_profiler_ranges,
    pair_bytes_disagree_across_row_shapes,
    subgroup_of_some_ranks,
    dict_split_sizes_are_refused,
)

REPO = Path(__file__).resolve().parents[1]


def test_import_registers_the_backend_idempotently():
    assert "FREESCALE" in dist.Backend._plugins
    fc.register_backend()
    fc.register_backend("freescale")
    assert dist.Backend("freescale") == "freescale"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_matches_gloo(world):
    checked = spawn(every_collective_matches_gloo, world, 7 * world, backend="freescale")
    assert all(c == checked[0] for c in checked)
    for name in ("all_to_all_single[torch.float32]", "all_to_all", "barrier", "all_gather_object", "reduce_scatter_tensor"):
        assert name in checked[0]


def test_async_ops_and_priorities_interleaved():
    assert spawn(async_ops_and_priorities_interleave, 3, 11, backend="freescale") == [12, 12, 12]


def test_new_group_on_some_ranks():
    results = spawn(subgroup_of_some_ranks, 4)  # gloo world, freescale subgroup of ranks 0 and 2
    assert results[0] == [0.0, 20.0, 2.0]
    assert results[2] == [1.0, 21.0, 2.0]
    assert results[1] == results[3] == []


def test_barrier_that_a_peer_never_joins_times_out_after_the_group_timeout():
    results = run_ranks(barrier_peer_never_joins, 2, 3.0, timeout_s=60)
    assert all(r.ok for r in results), [r.error for r in results]
    waited, message = results[0].value.split("|", 1)
    assert " Timed out " in message and "CommError" in message, message
    assert "waiting on rank(s) [1]" in message, message  # the silent peer, and only it
    assert float(waited) >= 3.0, f"raised after {waited} s, before the 3 s group timeout"


def test_a_barrier_honours_its_own_timeout_and_the_group_goes_on():
    assert spawn(barrier_honours_its_timeout, 2, backend="freescale", timeout_s=60) == ["TIMEOUT", "peer"]


def test_coalesced_gathers_and_reduce_scatters_match_gloo():
    """Functional collectives, DTensor's redistribute and FSDP2's full_tensor() reach the coalesced
    forms; the freescale group handed them to its inner gloo group, where Python cannot call them
    (AttributeError on every rank)."""
    ours = spawn(coalesced_gathers_and_reduce_scatters, 2, backend="freescale", timeout_s=60)
    assert ours == spawn(coalesced_gathers_and_reduce_scatters, 2, backend="gloo", timeout_s=60)
    assert ours[1]["all_gather_tensor"] == [0.0, 0.0, 1.0, 1.0] and ours[1]["reduce_scatter_tensor"] == [5.0, 7.0]


def test_a_list_all_to_alls_outputs_hold_the_data_once_it_completes_waited_for_or_not():
    ours = spawn(list_all_to_all_outputs_once_complete, 2, backend="freescale", timeout_s=60)
    assert ours == spawn(list_all_to_all_outputs_once_complete, 2, backend="gloo", timeout_s=60)
    assert ours[0]["seen"] == ours[0]["result"] == ours[0]["dropped"] == [[0.0, 0.0], [10.0, 10.0]], ours


def test_future_callbacks_may_wait_on_other_ops_as_gloos_may():
    gloo = spawn(future_callbacks_wait_on_other_ops, 2, False, backend="gloo", timeout_s=60)
    ours = spawn(future_callbacks_wait_on_other_ops, 2, True, backend="freescale", timeout_s=60)
    expected = [[float(10 * p + rank) for p in range(2)] for rank in range(2)]  # [rank][source]
    for rank in range(2):
        beyond = {"nested_two_deep", "sync_op_inside"}
        assert gloo[rank] == {k: v for k, v in ours[rank].items() if k not in beyond}
        assert ours[rank]["nested_future"] == ours[rank]["work_posted_before"] == expected[rank]
        assert ours[rank]["nested_two_deep"] == [expected[rank], expected[rank]] == [ours[rank]["sync_op_inside"]] * 2
        assert ours[rank]["value_after_wait"] == [expected[rank]]


def test_local_refusals_are_runtime_errors_as_gloo_raises_them():
    """gloo refuses these with RuntimeError; freescale raised ValueError alone, which a client's
    `except RuntimeError` missed. Now both (and still before any communication)."""
    gloo = spawn(local_refusals_are_runtime_errors, 2, backend="gloo", timeout_s=60)[0]
    ours = spawn(local_refusals_are_runtime_errors, 2, backend="freescale", timeout_s=60)[0]
    for line in gloo[:-1]:
        assert line.endswith(": RuntimeError"), gloo
    for line in ours[:-1]:
        assert line.endswith(": RuntimeError,ValueError"), ours
    assert ours[-1] == gloo[-1] == "after: [0.0, 1.0]", (ours, gloo)


def test_split_sizes_given_as_a_dict_are_refused_as_gloo_refuses_them():
    gloo = spawn(dict_split_sizes_are_refused, 2, backend="gloo", timeout_s=60)[0]
    ours = spawn(dict_split_sizes_are_refused, 2, backend="freescale", timeout_s=60)[0]
    assert gloo[:2] == ["TypeError", "TypeError"] and ours[:2] == ["RuntimeError,TypeError"] * 2, (gloo, ours)
    assert ours[-1] == gloo[-1] == "after: [0.0, 1.0]", (ours, gloo)


@pytest.mark.parametrize("group_backend", ["freescale", "gloo"])
def test_a_communicator_on_a_group_times_out_after_the_group_timeout(group_backend):
    """fc.Communicator(group), as TrainPipelinePEC builds one on the model's group (the silent peer
    outlives the group's timeout by 2 s, then closes): a freescale group's timeout was not found (torch has no per-device backend for it), so its ops waited
    torch's default 30 minutes."""
    results = run_ranks(communicator_peer_never_posts, 2, 1.5, group_backend, timeout_s=60)
    assert all(r.ok for r in results), [r.error for r in results]
    waited, code, culprit, message = results[0].value.split("|", 3)
    assert code == "TIMEOUT" and "waiting on rank(s) [1]" in message and culprit == "1", (culprit, message)
    assert 1.5 <= float(waited) < 30, f"raised after {waited} s; the group's timeout is 1.5 s"


def test_torchrun_script_with_only_dist_calls():
    env = dict(os.environ, PYTHONPATH=str(REPO / "examples") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(REPO / "examples" / "torchrun_backend.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("torchrun_backend: rank ok") == 4, proc.stdout


def test_all_to_all_single_takes_every_shape_gloo_completes_and_refuses_what_it_refuses():
    for checked in spawn(all_to_all_shapes_as_gloo, 2, backend="freescale"):
        assert len(checked) == 13, checked


def test_pairs_whose_bytes_disagree_fail_every_rank():
    codes = spawn(pair_bytes_disagree_across_row_shapes, 2, backend="freescale")
    assert "SIZE_MISMATCH" in codes and all(c in {"SIZE_MISMATCH", "PEER_ABORTED"} for c in codes), codes


def test_native_ops_appear_in_profiler_traces_with_priority_and_bytes():
    for names in spawn(native_ops_are_profiler_ranges, 2, backend="freescale"):
        assert names[:4] == ["freescale:all_to_all_single priority=0 send=32B recv=32B",
                             "freescale:all_to_all_single priority=9 send=32B recv=32B",
                             "freescale:all_to_all priority=0 send=24B recv=24B",
                             "freescale:barrier priority=0 send=0B recv=0B"], names
        dispatch_and_combine = [n.split()[0] for n in names[4:]]
        assert "freescale:dispatch" in dispatch_and_combine and dispatch_and_combine[-1] == "freescale:combine", names


@pytest.mark.parametrize("how", ["world", "subgroup", "exit"])
def test_an_op_pending_at_teardown_finishes_as_gloos(how):
    results = run_ranks(pending_op_at_teardown, 2, how, backend="freescale" if how == "world" else "gloo", timeout_s=60)
    assert all(r.ok for r in results), results
    assert results[0].value == "True [1.0, 2.0]", results
    assert results[1].value == "[1.0, 2.0]", results


@pytest.mark.parametrize("where", ["progress", "waiter"])
def test_closing_a_communicator_from_its_done_callback_is_refused_not_a_crash(where):
    results = run_ranks(close_from_a_done_callback, 2, where, timeout_s=30, env={"FREESCALE_TIMEOUT_S": "5"}, fresh_interpreter=False)
    assert [r.exitcode for r in results] == [0, 0] and all(r.ok for r in results), results
    assert results[0].value == "InvalidUsageError", results


@pytest.mark.parametrize("case", ["agree", "dtype", "delegated_vs_native", "native_vs_native"])
def test_torch_distributed_debug_detail_checks_collectives_as_for_gloo(case):
    results = run_ranks(collectives_checked_in_detail_mode, 2, case, backend="freescale", timeout_s=60,
                        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "FREESCALE_TIMEOUT_S": "10"})
    if case == "agree":
        assert [r.value for r in results] == [
            "2.0 [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0] [0.0, 1.0]"] * 2, results
    else:
        assert [r.value for r in results] == ["CommError COMM_ERROR True"] * 2, results


def test_native_ops_of_different_kinds_fail_naming_both_or_meet_as_under_gloo():
    """Chunk headers carry the op's kind: a barrier against an all_to_all_single is a CommError on
    both ranks naming both (it was a SIZE_MISMATCH about split sizes; the rank that learns it from
    the other's abort notice reads its words there); list and single forms meet."""
    results = run_ranks(native_ops_of_different_kinds, 2, "barrier", backend="freescale", timeout_s=60,
                        env={"FREESCALE_TIMEOUT_S": "10"}, fresh_interpreter=False)
    assert [r.value for r in results] == ["CommError True True"] * 2, results
    results = run_ranks(native_ops_of_different_kinds, 2, "list_vs_single", backend="freescale", timeout_s=60)
    assert [r.value for r in results] == ["[[0.0, 0.0, 0.0, 0.0], [10.0, 10.0, 10.0, 10.0]]",
                                          "[[1.0, 1.0, 1.0, 1.0], [11.0, 11.0, 11.0, 11.0]]"], results


def test_survivors_that_see_a_death_and_a_survivors_exit_name_the_death():
    """A delegated op's failure breaks the group's communicator too, and its abort notice names the
    dead rank: a survivor that sees that rank gone and the one that left after it names the first.
    Before, ranks raising last named rank 0 (the lowest rank gone), which had only left."""
    results = run_ranks(a_death_then_a_survivor_leaves, 4, backend="freescale", timeout_s=90,
                        env={"FREESCALE_TIMEOUT_S": "10"}, fresh_interpreter=False)
    assert [r.value for r in results[2:]] == ["PEER_DIED 1 True"] * 2, results


def test_a_peer_that_left_after_its_own_op_failed_is_not_only_said_to_have_died():
    """Rank 0 in a delegated all_reduce, rank 1 in a native all_to_all (programs out of step): rank 1
    times out and leaves. Rank 0 names rank 1, and that its op had timed out waiting on rank 0
    (before: only 'rank 1 died', a crash that never happened)."""
    results = run_ranks(delegated_vs_native_out_of_step, 2, backend="freescale", timeout_s=60,
                        env={"FREESCALE_TIMEOUT_S": "3"}, fresh_interpreter=False)
    assert results[1].value == "TIMEOUT", results
    code, culprit, told = results[0].value.split()
    assert code in ("PEER_DIED", "COMM_ERROR") and (culprit, told) == ("culprit=1", "told=True"), results

"""NestPipe's pipelining in fc.TrainPipelinePEC: frozen-window micro-batches (micro_batches=) and
dual-buffer prefetch (prefetch="dual_buffer") on a TorchRec DMP model (EBC + EC; table-, row- and
column-wise; fused optimizers). Tiny models, few steps: these pay for their CI minutes."""

from __future__ import annotations

import pytest

from freescale_comm.testing import spawn

pytestmark = pytest.mark.usefixtures("torchrec_installed")


COLLISIONS = [0.0, 0.5, 1.0]


def test_micro_batches_overlapped_equal_a_synchronous_run_bit_for_bit_on_four_ranks():
    """4 ranks, 8 steps, 4 micro-batches, collision 0 / 0.5 / 1, row-wise Adagrad and a learning-rate
    schedule: PEC, dual-buffer and ids-only prefetch with the next micro-batches' rows moving under
    the current one's compute give the outputs, tables, dense weights and optimizer state of the
    same micro-batches run synchronously (every message waited for when posted), bit for bit.
    Empty micro-batches occur (batches of 2 samples at the end; a rank with no samples at step 2)."""
    from fwp_programs import MICRO, fwp_matches_synchronous

    reports = spawn(fwp_matches_synchronous, 4, 8, COLLISIONS, "rowwise_adagrad", timeout_s=600)
    for rank, report in enumerate(reports):
        assert len(report) == len(COLLISIONS) * 3, report.keys()
        for case, diff in report.items():
            assert diff["outputs"] == 0.0 and diff["state"] == 0.0, (rank, case, diff["outputs"], diff["state"])
            assert all(len(sizes) == MICRO for sizes in diff["micro_sizes"]), (case, diff["micro_sizes"])
            assert any(0 in sizes for sizes in diff["micro_sizes"]), (case, diff["micro_sizes"])
            # counted: rows that waited for an update move one round per micro-batch, the first at
            # high priority (100), the next ones at next_micro_priority (50), only when some rank has any
            rows = [p for p, dtype in diff["exchanges"] if dtype == "torch.float32"]
            steady = 8 - 1  # every batch but the first (fetched whole when the pipeline fills)
            if case.endswith("prefetch=ids") or case.startswith("collision=1.0"):
                assert rows.count(50) == (MICRO - 1) * steady, (case, rows)
            if case.startswith("collision=0.0") and not case.endswith("prefetch=ids"):
                assert rows.count(50) == 0, (case, rows)
                # no gradient goes first but the last batch's (nothing reads after it): streamed then
                assert rows.count(25) == MICRO - 1, (case, rows)
            # every micro-batch's gradients but the last's go out under the next one's compute, at
            # micro_gradient_priority (25), whenever some rank has gradients that go first
            if case.endswith("prefetch=ids"):
                assert rows.count(25) == (MICRO - 1) * 8, (case, rows)


def test_a_row_two_micro_batches_read_is_asked_once_moves_once_and_so_does_its_gradient():
    """Embeddings are frozen within a batch, so a row that several micro-batches read is asked
    once (with the micro-batches reading it), moves once, with the first, and the later ones copy
    it; its gradient, summed over them, goes once, with the last. Counted on 2 ranks, 5 steps,
    collision 0.5 and 1 (the data has rows micro-batches share), every prefetch mode: the ids
    received in ask rounds, the floats received in row rounds and in gradient rounds with 4
    micro-batches equal those with one micro-batch (each row of the batch once)."""
    from fwp_programs import MICRO, fwp_rows_moved

    for rank, report in enumerate(spawn(fwp_rows_moved, 2, 5, [0.5, 1.0], timeout_s=300)):
        for case, runs in report.items():
            whole, micro, unpacked = runs[1], runs[MICRO], runs["unpacked"]
            assert micro["ids"] == whole["ids"] > 0 and micro["asked"] == whole["asked"] > 0, (rank, case, runs)
            assert micro["fetched"] == whole["fetched"] > 0, (rank, case, runs)
            assert micro["gradients"] == whole["gradients"] > 0, (rank, case, runs)
            # where shard rows are too large to pack, each micro-batch names its rows (rows they
            # share more than once), the same rows and gradients move and training is bit for bit the same
            assert unpacked["ids"] > micro["ids"] and unpacked["asked"] > micro["asked"], (rank, case, runs)
            assert unpacked["fetched"] == micro["fetched"] and unpacked["gradients"] == micro["gradients"], runs
            assert unpacked["outputs"] == unpacked["state"] == 0.0, (rank, case, runs)


def test_micro_batches_match_sparse_dist_within_float_rounding():
    """2 ranks, 8 steps, collision 0.5, fused SGD: the pipeline with 1, 2 and 4 micro-batches is
    within 1e-6 (max |a-b| / max |a| per tensor) of TrainPipelineSparseDist on whole batches; whole
    batches (micro_batches=None) are bit-identical. Where the sums differ: each micro-batch sums its
    ids' gradients per row (autograd of the gather), each rank sums those over its micro-batches
    and sends a row's once, and the owner's fused update sums the ranks', where TorchRec's TBE sums
    every id's gradient at once; dense gradients are
    sums over micro-batches (DDP all-reduces each micro-batch's, or with static_graph=False the sum
    once, on the last: "4 no_sync"); outputs differ only downstream of these (the dense head's
    weights). A DDP that skipped an all-reduce would fail both (an experiment that bypassed DDP's
    forward on all but the last micro-batch did: 0.3 off, silently)."""
    from fwp_programs import fwp_near_sparse_dist

    for report in spawn(fwp_near_sparse_dist, 2, 8, 0.5, "sgd", [None, 1, 2, 4], timeout_s=300):
        assert report["None"] == {"outputs": 0.0, "state": 0.0}, report
        for m in ("1", "2", "4", "4 no_sync"):
            assert report[m]["outputs"] <= 1e-6 and report[m]["state"] <= 1e-6, (m, report[m])
        assert report["dense spread"] == 0.0, report
        # a mean loss: right with loss_reduction="mean", far off when left at "sum"
        assert report["4 mean loss, loss_reduction=mean"]["state"] <= 1e-6, report
        assert report["4 mean loss, loss_reduction=mean"]["outputs"] <= 1e-6, report
        assert report["4 mean loss, loss_reduction=sum"]["state"] > 1e-3, report
        # a term of the loss no sample carries (a learned loss weight) trains as on whole batches, with
        # empty micro-batches too (their loss is NaN: they train nothing instead of making every weight NaN)
        assert report["learned finite"] and report["learned empty micro-batches"] > 0, report
        assert report["4 learned loss weight"]["state"] <= 1e-6, report["4 learned loss weight"]
        assert report["4 learned loss weight"]["outputs"] <= 1e-6, report["4 learned loss weight"]


def test_micro_batches_with_gradient_clipping_are_refused_on_every_rank():
    """FBGEMM clips the gradient it is given: micro-batches give it each row's sum over its uses,
    TrainPipelineSparseDist each use (weights ~1 % apart after 6 steps, row-wise Adagrad's state
    13-29 %, silently). Whole batches stay bit-identical with clipping (a helper checked)."""
    from pec_pipeline_programs import micro_batches_with_gradient_clipping_are_refused

    for refused, built in spawn(micro_batches_with_gradient_clipping_are_refused, 2, backend="freescale"):
        assert refused.startswith("micro_batches=2 with gradient clipping (tables ['"), refused
        assert "pass micro_batches=None" in refused and built == "built", refused


def test_every_micro_batch_read_is_fresh_and_skipping_the_dual_buffer_refresh_is_caught():
    """The staleness oracle (every row a batch reads equals the number of its earlier reads) holds
    for 4 micro-batches with PEC, dual-buffer and ids-only prefetch, at every collision rate; keeping
    dual-buffer's early copies without the refresh after the update is caught at every collision
    rate above 0 (and harmless at 0, where no row waits), and so are PEC's OL rows sent early and
    the second part of a split update (the rows the next batch's first micro-batch does not read)
    applied after micro-batch 1's fetch instead of before."""
    from pec_pipeline_programs import staleness_oracle

    mutations = {"pec": ["early_overlap_reads", "late_split_updates"], "dual_buffer": ["skip_refresh"],
                 "ids": ["late_split_updates"]}
    for prefetch, wrong in mutations.items():
        cases = [(c, m) for c in COLLISIONS for m in ["", *wrong]]
        for report in spawn(staleness_oracle, 2, 8, cases, {"micro_batches": 4, "prefetch": prefetch},
                            timeout_s=300):
            for c in COLLISIONS:
                assert report[f"{c} "]["checked"] > 100 and report[f"{c} "]["stale"] == 0, (prefetch, report)
                for mutation in wrong:
                    caught = report[f"{c} {mutation}"]["stale"]  # rows read before the update they wait for
                    assert (caught > 0) == (c > 0), (prefetch, mutation, c, report)


def test_the_benchmark_runs_nestpipes_modes_and_checks_their_goals(tmp_path, capsys):
    """freescale-bench torchrec-pec with NestPipe's modes runs, counts the rows each asks for and
    moves and prints the goals' lines (its figures are for benchmarks, never asserted here): every
    split asks for the whole batch's distinct rows once and moves them once."""
    import json

    from freescale_comm.bench.cli import main

    out, png = tmp_path / "rows.json", tmp_path / "plot.png"
    assert main(["torchrec-pec", "--ranks", "2", "--rates", "0.5", "--steps", "2", "--warmup", "1", "--rounds", "1",
                 "--samples", "8", "--pipelines", "pec", "fwp1", "fwp4", "fwp4_random", "nestpipe",
                 "--json", str(out), "--plot", str(png)]) == 0
    rows = {r["pipeline"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["fwp1", "fwp4", "fwp4_random", "nestpipe", "pec"], rows
    for r in rows.values():
        assert "note" not in r and r["step_ms"] > 0 and r["ids_sent"] > 0 and r["update_ms"] >= 0, r
    assert rows["fwp4"]["ids_sent"] == rows["fwp1"]["ids_sent"] == rows["fwp4_random"]["ids_sent"], rows
    assert rows["pec"]["ids_sent"] >= rows["fwp1"]["ids_sent"], rows  # every id vs each distinct id once
    # a row several micro-batches read moves once, however the batch is split
    assert rows["fwp4"]["rows_moved"] == rows["fwp1"]["rows_moved"] == rows["fwp4_random"]["rows_moved"], rows
    printed = capsys.readouterr().out
    assert "4 micro-batches expose" in printed and "4 micro-batches move clustered" in printed, printed
    assert "collision 0.50: nestpipe" in printed, printed


def test_micro_batches_compose_with_balance():
    """fc.balance on the tower (rank 0's histories long) inside each of 4 micro-batches, on 2 ranks,
    6 steps, collision 0.5: PEC prefetch equals the synchronous run of the same micro-batches bit
    for bit, the tower computed the same samples per call in both, and balancing moved work
    (rank 0, whose histories are long, computed less of the cost than its batches held). Counted: every
    micro-batch's balance plan was made a batch ahead, none all-gathered on the main thread."""
    from fwp_programs import fwp_with_balance_matches_synchronous

    results = spawn(fwp_with_balance_matches_synchronous, 2, 6, 0.5, timeout_s=300)
    for r in results:
        assert r["diff"] == {"outputs": 0.0, "state": 0.0} and r["same_samples"], r
        assert len(r["samples"]) >= 6 * 4, r  # every micro-batch ran the tower, empty ones too
        # every micro-batch's plan was made a batch ahead: no all-gather of lengths on the main thread
        assert r["gathered"] == 0 and r["ahead"] == 6 * 4, r
    assert results[0]["samples"] != results[1]["samples"], results
    # rank 0 (long histories) gave work away, rank 1 took it (in samples either way, by micro-batch)
    assert results[0]["computed_cost"] < results[0]["home_cost"], results
    assert results[1]["computed_cost"] > results[1]["home_cost"], results

"""fc.TrainPipelinePEC on a TorchRec DistributedModelParallel model (EmbeddingBagCollection +
EmbeddingCollection, table-, row- and column-wise, fused optimizers): equal to TrainPipelineSparseDist
on the same data, never stale (an oracle the two mutations must fail), clear errors for what it
cannot prioritize. Tiny models, few steps: these pay for their CI minutes."""

from __future__ import annotations

import pytest

from freescale_comm.testing import spawn

pytestmark = pytest.mark.usefixtures("torchrec_installed")


COLLISIONS = [0.0, 0.5, 1.0]


def test_pec_pipeline_is_bit_identical_to_sparse_dist_on_two_ranks():
    """8 steps (fill, steady state, drain, an uneven last batch, a rank without ids at step 2) at
    collision rates 0, 0.5, 1, with fused SGD and row-wise Adagrad and a learning-rate schedule:
    every step's output, every table shard, dense weight and optimizer state equal bit for bit.
    Also two epochs (a new iterator after StopIteration) and the state read after 5 of 8 steps
    (deferred gradients flushed by the model's state_dict())."""
    from pec_pipeline_programs import pec_matches_sparse_dist

    for report in spawn(pec_matches_sparse_dist, 2, 8, COLLISIONS, ["sgd", "rowwise_adagrad"], timeout_s=300):
        assert len(report) == len(COLLISIONS) * 2 + 2, report  # + two epochs, + stopped after 5 steps
        for case, diff in report.items():
            assert diff["outputs"] == 0.0, (case, diff)
            if "adagrad" in case:  # the momentum is compared too (SGD keeps no state)
                assert any(k.startswith("state:") for k in diff["state"]), (case, sorted(diff["state"]))
            assert all(v == 0.0 for v in diff["state"].values()), (case, {k: v for k, v in diff["state"].items() if v})
            if "updates" in diff:  # on CPU every fused update skips the TBE forward (FBGEMM's op directly)
                assert diff["updates"]["direct"] > 0 and diff["updates"]["forward_backward"] == 0, (case, diff["updates"])
            # counted: the exchanges no rank has anything for are skipped, on every rank alike
            rows_or_grads = [p for p, dtype in diff.get("exchanges", []) if dtype == "torch.float32"]
            if case.startswith("collision=0.0"):  # no row is read twice in a row: no high-priority
                assert rows_or_grads.count(100) == 1, (case, rows_or_grads)  # round but the last batch's gradients
            if case.startswith("collision=1.0"):  # every row is: no NOL rows but the first batch's
                assert rows_or_grads.count(0) == 1, (case, rows_or_grads)


def test_pec_pipeline_matches_sparse_dist_on_four_ranks():
    """The same on 4 ranks with fused Adagrad and row-wise Adagrad. Equal within 1e-6 (max |a-b| /
    max |a| per tensor), not bit for bit, in one place only: a row-wise EmbeddingBagCollection
    table's pooled sums, which TrainPipelineSparseDist adds across ranks with gloo's
    reduce-scatter (its own order) and the PEC pipeline in rank order; the rest differs only
    downstream of that sum (the dense head, then every gradient)."""
    from pec_pipeline_programs import pec_matches_sparse_dist

    for report in spawn(pec_matches_sparse_dist, 4, 8, COLLISIONS, ["adagrad", "rowwise_adagrad"], timeout_s=400):
        for case, diff in report.items():
            assert diff["outputs"] <= 1e-6, (case, diff["outputs"])
            assert all(d <= 1e-6 for d in diff["state"].values()), (case, diff["state"])


def test_every_read_is_fresh_and_both_mutations_are_caught():
    """Tables whose rows count their updates (fused SGD at lr 1 on loss = -sum of embeddings): every
    row every batch reads equals the number of earlier reads. Sending OL rows before the update
    they wait for is caught whenever batches collide; applying deferred gradients after the next
    lookup is caught whenever they are not all overlap. A rank has no samples at step 2."""
    from pec_pipeline_programs import staleness_oracle

    mutations = ["", "early_overlap_reads", "late_deferred_updates"]
    cases = [(c, m) for c in COLLISIONS for m in mutations]
    for report in spawn(staleness_oracle, 2, 8, cases, timeout_s=300):
        for c in COLLISIONS:
            assert report[f"{c} "]["checked"] > 100 and report[f"{c} "]["stale"] == 0, report
            early = report[f"{c} early_overlap_reads"]["stale"]
            assert (early > 0) == (c > 0), (c, report)
        assert report["0.0 late_deferred_updates"]["stale"] > 0 and report["0.5 late_deferred_updates"]["stale"] > 0, report


def test_what_the_pipeline_cannot_prioritize_is_refused_clearly():
    from pec_pipeline_programs import refusals

    for out in spawn(refusals, 2, timeout_s=300):
        assert "DistributedModelParallel" in out["not_dmp"], out
        assert "high_priority > low_priority" in out["priorities"], out
        assert "'nope'" in out["balance_name"] and "CostModel" in out["balance_cost"], out
        for bad in ("0", "True", "2.5", "5000"):
            assert "micro_batches must be an int in [1, 1024]" in out[f"micro_batches={bad}"], out
        assert "sparse_inputs must be callable" in out["sparse_inputs"], out
        assert "high_priority must be an int" in out["priority_type"], out
        assert "prefetch must be one of 'pec', 'dual_buffer', 'ids'" in out["prefetch"], out
        assert "next_micro_priority > micro_gradient_priority" in out["micro_priorities"], out
        assert "split_batch must be callable" in out["split_batch"], out
        assert "loss_reduction must be 'sum' or 'mean'" in out["loss_reduction"], out
        assert "batch.label has first dimension" in out["uncuttable"] and "split_batch=" in out["uncuttable"], out
        assert "'t_ctx'" in out["data_parallel"] and "data_parallel" in out["data_parallel"], out
        assert "'t_ctx'" in out["dense_kernel"] and "'dense'" in out["dense_kernel"], out
        assert "ranks [0] ran out of data while ranks [1] still had a batch" in out["lengths"], out
        assert "disk gone" in out["data_error"] or "ranks [0] could not read" in out["data_error"], out
        assert "failed at step" in out["after_failure"], out


def test_the_torchrec_pec_benchmark_writes_a_row_per_pipeline_and_rate(tmp_path, monkeypatch, capsys):
    """The command runs and reports (its figures are for benchmarks, never asserted here). Its ranks
    stand for one device each, as the e2e demo's: every thread of a rank on the rank's core; with
    more ranks than usable cores (one, here) they share, and a line above the table says so."""
    import json

    from freescale_comm.bench import placement
    from freescale_comm.bench.cli import main

    core = placement.usable_cores()[-1]
    monkeypatch.setattr(placement, "usable_cores", lambda: [core])
    out, png = tmp_path / "rows.json", tmp_path / "plot.png"
    assert main(["torchrec-pec", "--ranks", "2", "--rates", "0", "1", "--steps", "1", "--warmup", "0", "--rounds", "1", "--samples", "8",
                 "--pipelines", "sparse_dist", "pec", "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "# oversubscribed: 2 ranks share 1 CPU cores" in printed and "(sharing cores)" in printed, printed
    report = json.loads(out.read_text())
    assert report["placement"]["rank_cores"] == [[core], [core]], report["placement"]
    rows = report["rows"]
    assert [(r["pipeline"], r["collision_rate"]) for r in rows] == [
        ("sparse_dist", 0.0), ("pec", 0.0), ("sparse_dist", 1.0), ("pec", 1.0)], rows
    for r in rows:
        assert "note" not in r and r["step_ms"] > 0 and r["exposed_comm_ms"] >= 0, r
        if r["pipeline"] == "pec":  # its own work in the rounds it runs, apart from what blocked it
            assert r["round_ms"] >= 0 and r["update_ms"] >= 0, r
    assert png.stat().st_size > 0


def test_the_benchmark_finds_torchrecs_own_pec_pipeline_where_torchrec_has_one():
    """TorchRec 1.9 defines TrainPipelinePEC in train_pipeline.pec_train_pipeline and exports it
    from neither the package nor train_pipelines: the benchmark reported it "not in the installed
    TorchRec" there. Skips on a TorchRec without the module (1.8, CI's)."""
    import importlib.util

    if importlib.util.find_spec("torchrec.distributed.train_pipeline.pec_train_pipeline") is None:
        pytest.skip("this TorchRec has no TrainPipelinePEC (1.9+ has)")
    from torchrec.distributed.train_pipeline.pec_train_pipeline import TrainPipelinePEC

    from freescale_comm.bench.torchrec_pipelines import torchrec_pec_class

    assert torchrec_pec_class() is TrainPipelinePEC


def test_pec_with_balance_and_in_eval_mode_equals_sparse_dist():
    """TrainPipelinePEC(balance={"tower": cost}) equals TrainPipelineSparseDist with fc.balance on
    the same tower bit for bit, and the balancer did move samples (rank 0's histories are long);
    in eval mode both give the same outputs and leave the model unchanged. Counted: with the
    pipeline, the balancer's plans were made a batch ahead, every one of the 6 balanced forwards
    used one, and none all-gathered lengths on the main thread (6 with TrainPipelineSparseDist)."""
    from pec_pipeline_programs import balance_and_eval

    results = spawn(balance_and_eval, 2, 6, timeout_s=300)
    assert any(r["balance"]["computed"] != r["balance"]["home"] for r in results), results
    for r in results:
        assert r["balance"]["same_as_reference"] and r["eval_steps"] == 4, r
        assert r["balance"]["gathered"] == {"sparse_dist": 6, "pec": 0}, r
        assert r["balance"]["ahead"] == {"sparse_dist": 0, "pec": 6}, r


def test_the_pipeline_reads_the_device_only_where_sizes_arrive():
    """Counted: the pipeline reads tensor values on the host (a device sync each, on CUDA: the CPU
    would stop running ahead of the GPU) only where sizes arrive. In the exchange's rounds: the ids
    round (the next batch's counts) and the flags round (every later round's sizes, in one read):
    2 per steady-state step with PEC or DBP, whole batches or micro-batches; with every row after
    the update (prefetch="ids": no flags) and micro-batches, the ids round and one read of what
    the flags round would count: each row's first and last entries and the sizes of the update's
    two parts (the rows the next batch's first micro-batch reads, updated first). In the rest of the pipeline's own work (routing and
    cutting each batch on the worker, the sharded modules' outputs): routing the next batch (its
    ids' ranges and shards: 1; with micro-batches also their distinct rows: 2) and TorchRec's
    KeyedJaggedTensor reading each input's lengths per key once (2). Before, about 150 per step in
    the exchange alone (a read per slot and round: mask sums, boolean-mask selections, per-slot
    any()), and reads per feature, shard and micro-batch in routing, cutting and the outputs."""
    from pec_pipeline_programs import exchange_host_reads

    modes = {"pec": {}, "dual_buffer": {"prefetch": "dual_buffer"}, "pec_micro": {"micro_batches": 2},
             "ids_micro": {"prefetch": "ids", "micro_batches": 2}}
    exchange = {"pec": 2, "dual_buffer": 2, "pec_micro": 2, "ids_micro": 2}
    routing = {"pec": 1, "dual_buffer": 1, "pec_micro": 2, "ids_micro": 2}
    for report in spawn(exchange_host_reads, 2, modes, timeout_s=300):
        for mode, reads in report.items():
            assert reads["exchange"]["per_step"] == exchange[mode], (mode, reads)
            assert reads["pipeline"]["per_step"] == routing[mode] + 2, (mode, reads)


def test_the_pipelines_copy_host_values_to_the_device_without_a_sync():
    """A blocking host-to-device copy (torch.tensor(..., device=d), t.to(d)) makes the CPU wait for
    the stream's queued work on CUDA, as a host read does; the pipelines' own code copies host lists
    and indices through freescale_comm._device_copy.to_device (staged in pinned memory, then
    non_blocking). Checked in the source (no CUDA here): before, 9 sites copied blocking, each per
    round, batch or micro-batch (the ids round's counts, the rows per micro-batch, the flags' tail
    positions, every CountBatch boundary list, the routing's shard starts, the fused update's
    counts, the micro-batch cuts' and the merged outputs' sample indices). The balancer and
    dispatch code the pipelines call are checked too (the plan's destinations were copied
    blocking, the one copy left once plans are made ahead). In the pipelines, a non_blocking copy
    of a host tensor must come from pinned memory too (the owner's micro-batch index did not)."""
    import ast
    import pathlib

    import freescale_comm.pipelines as pipelines

    blocking = []
    package = pathlib.Path(pipelines.__file__).parent.parent
    for path in sorted(pathlib.Path(pipelines.__file__).parent.glob("*.py")) + \
            [package / name for name in ("balancer.py", "bundle.py", "dispatch.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            kwargs = {k.arg for k in node.keywords}
            func = node.func
            name = ast.unparse(func)
            if name == "torch.tensor" and "device" in kwargs:
                blocking.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(func, ast.Attribute) and func.attr == "to" and "non_blocking" not in kwargs and any(
                    ast.unparse(a).endswith("device") for a in [*node.args, *(k.value for k in node.keywords)]):
                blocking.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            elif path.parent.name == "pipelines" and isinstance(func, ast.Attribute) and func.attr == "to" \
                    and "non_blocking" in kwargs and ast.unparse(func.value) != "batch" \
                    and not ast.unparse(func.value).endswith(".pin_memory()"):
                # non_blocking from pageable memory is staged by the driver, not asynchronous: through
                # to_device (pinned). The user's batch is theirs to pin (TorchRec's dataloaders do)
                blocking.append(f"{path.name}:{node.lineno} pageable {ast.unparse(node)}")
    assert not blocking, blocking


def test_mean_pooling_is_the_mean_on_every_sharding():
    """All-ones tables: every bag pools to 1 through the pipeline, row-, table- and column-wise (to
    float rounding). TorchRec 1.8's own sharded forward on CPU is asserted only where it is right
    (row-wise): its table- and column-wise bags come out 1/L (README: TorchRec)."""
    from pec_pipeline_programs import mean_pooling

    for out in spawn(mean_pooling, 2, 3, timeout_s=300):
        assert set(out["pec"]) == {"row_wise", "table_wise", "column_wise"}, out
        assert max(out["pec"].values()) < 1e-5, out
        assert out["torchrec"]["row_wise"] < 1e-5, out

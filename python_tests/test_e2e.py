"""freescale-bench e2e: every mode does the same math; traces are valid; the CLI writes its rows."""

import json
import os

import pytest
import torch

from freescale_comm.bench import cli, e2e, trace
from freescale_comm.bench import placement as placement_module
from freescale_comm.planner import CostModel

# A fixed cost model (attention-like, quadratic in length): which samples move must not hang on
# this machine's timings (a model fitted under load, constant-dominated, once planned no move).
SMALL = dict(ranks=2, steps=3, warmup=0, samples=4, length_scale=1 / 64, dim=32, rows_per_rank=1024, groups=2,
             cost_model=CostModel(quadratic=1.0, linear=0.0, constant=0.0))


@pytest.fixture(scope="module")
def small_run():
    return e2e.run(e2e.E2EConfig(**SMALL), progress=False)


def test_every_mode_gives_the_same_losses(small_run):
    losses = small_run.losses
    assert set(losses) == set(e2e.MODES)
    base = losses["vanilla"]
    assert len(base) == 3
    assert len(set(round(v, 6) for v in base)) > 1  # the steps differ: it trains on new data
    for mode, values in losses.items():
        assert values == pytest.approx(base, rel=1e-5, abs=1e-7), mode


def test_balanced_modes_really_move_samples(small_run):
    per_rank = small_run.computed_samples
    assert all(n == SMALL["samples"] for rank in per_rank["vanilla"] for n in rank)
    assert any(n != SMALL["samples"] for rank in per_rank["freescale"] for n in rank)
    assert [sum(step) for step in zip(*per_rank["freescale"])] == [2 * SMALL["samples"]] * len(per_rank["freescale"][0])


def test_every_mode_computes_a_ranks_samples_in_the_same_chunks(small_run):
    # Chunking changes compute time (the working set): vanilla computed each rank's samples in one
    # piece and the overlapped modes in `groups`, so the same work took different times by mode.
    for mode, tl in small_run.timelines.items():
        chunks: dict[tuple[int, int], int] = {}
        for b in tl.busy:
            if b.name == "forward_backward":
                chunks[(b.rank, b.step)] = chunks.get((b.rank, b.step), 0) + 1
        computed = small_run.computed_samples[mode]
        for (rank, step), n in chunks.items():
            assert n == min(SMALL["groups"], computed[rank][step]), (mode, rank, step)


def test_each_rank_runs_on_its_own_core(small_run):
    placement = small_run.placement
    assert placement.ranks == SMALL["ranks"]
    # Read in each rank at its end: every thread (the communicator's and gloo's too) on its core.
    assert small_run.rank_cores == [[c] for c in placement.cores]
    if len(os.sched_getaffinity(0)) >= SMALL["ranks"]:
        assert len(set(placement.cores)) == SMALL["ranks"] and not placement.oversubscribed


def test_modes_take_turns_in_a_rotated_order():
    names = list(e2e.MODES)
    orders = [e2e.rotated(names, k) for k in range(len(names))]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert [o[0] for o in orders] == names  # every mode leads a round: no mode always follows another
    assert e2e.rotated(names, len(names)) == names


def test_more_ranks_than_cores_are_placed_round_robin_and_the_cli_says_so(monkeypatch, capsys):
    monkeypatch.setattr(placement_module, "usable_cores", lambda: [0])
    code = cli.main(["e2e", "--ranks", "2", "--steps", "1", "--warmup", "0", "--samples", "2", "--length-scale", "0.01",
                     "--dim", "16", "--modes", "vanilla", "--no-progress"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# oversubscribed: 2 ranks share 1 CPU cores")
    assert lines[1].startswith("# e2e, 2 ranks (sharing cores)")


def test_a_different_seed_gives_different_losses(small_run):
    other = e2e.run(e2e.E2EConfig(**{**SMALL, "seed": 1, "modes": ("vanilla",)}), progress=False)
    assert other.losses["vanilla"] != pytest.approx(small_run.losses["vanilla"], rel=1e-3)


def test_rows_have_the_metrics(small_run):
    for row in small_run.rows:
        for key in ("mode", "step_ms", "straggler_pct", "exposed_comm_ms", "bubble_ms", "idle_ms", "sparsity"):
            assert key in row
        assert row["bubble_ms"] == pytest.approx(row["idle_ms"] + row["exposed_comm_ms"])
        assert 0 <= row["straggler_pct"] < 100 and row["step_ms"] > 0 and row["compute_ms"] > 0


def test_trace_is_json_with_one_track_per_rank(small_run, tmp_path):
    paths = trace.write_all(str(tmp_path), small_run.timelines, small_run.rows, "test")
    with open(paths[0]) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    modes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(modes.values()) == sorted(e2e.MODES)
    for pid in modes:
        slices = [e for e in events if e["pid"] == pid and e["ph"] == "X"]
        assert {e["tid"] for e in slices} == {0, 1}
        assert {e["cat"] for e in slices} >= {"compute", "exposed_comm"}
        named = {e["tid"]: e["args"]["name"] for e in events if e["pid"] == pid and e["name"] == "thread_name"}
        assert named == {0: "rank 0", 1: "rank 1"}
        for tid in (0, 1):  # a rank computes or waits, never both: its slices do not overlap
            spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in slices if e["tid"] == tid)
            assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))
    for png in paths[1:]:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_writes_rows_and_the_fitted_cost_model(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    code = cli.main(["e2e", "--ranks", "2", "--steps", "1", "--warmup", "0", "--samples", "2", "--length-scale", "0.01",
                     "--dim", "16", "--modes", "vanilla", "freescale", "--json", str(out), "--no-progress"])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "e2e" and [r["mode"] for r in doc["rows"]] == ["vanilla", "freescale"]
    assert set(doc["cost_model"]) == {"quadratic", "linear", "constant"}
    out = capsys.readouterr().out
    assert "# vanilla -> freescale: step " in out and " ms (" in out and "bubbles (idle + exposed comm)" in out
    assert "# compute per step (mean over ranks), the same work in every mode" in out


@pytest.mark.parametrize("argv", [["--ranks", "1"], ["--modes", "fast"], ["--workload", "nope"], ["--length-scale", "2"]])
def test_cli_rejects_bad_arguments(argv, capsys):
    try:
        code = cli.main(["e2e", *argv, "--no-progress"])
    except SystemExit as exit_:  # argparse's refusal of a flag's value (--ranks 1)
        code = exit_.code
    assert code == 2
    assert "freescale-bench e2e:" in capsys.readouterr().err


def test_config_check_names_the_problem():
    with pytest.raises(ValueError, match="dim must be a positive multiple of heads"):
        e2e.E2EConfig(dim=30, heads=4).check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_before_spawning():
    with pytest.raises(ValueError, match="no CUDA device"):
        e2e.run(e2e.E2EConfig(device="cuda"), progress=False)

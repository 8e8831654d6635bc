"""freescale-bench overlap: its PyTorch layout references agree with the CPU planner (so its
#wrong column means something), and the command refuses clearly where it cannot run. The
measurements themselves need a GPU (test_overlap_bench_gpu below)."""

import json

import pytest
import torch

from freescale_comm import _core
from freescale_comm.bench import cli, layout


def _planned_rows(values, lengths, dest, world):
    """Rows in send order, from the compiled CPU planner (the reference of the references)."""
    plan = _core.plan_jagged_dispatch(lengths.data_ptr(), dest.data_ptr(), lengths.numel(), world)
    starts = torch.cumsum(lengths, 0) - lengths
    parts = [values[int(starts[i]):int(starts[i] + lengths[i])] for i in plan.order.tolist()]
    packed = torch.cat(parts) if parts else values[:0]
    return packed, plan.sample_counts.tolist(), plan.row_counts.tolist()


@pytest.mark.parametrize("reference", [layout.torch_sort, layout.torch_loop])
@pytest.mark.parametrize("world,samples", [(1, 5), (4, 0), (7, 200), (64, 50)])
def test_torch_references_match_the_planner(reference, world, samples):
    gen = torch.Generator().manual_seed(world + samples)
    lengths = torch.randint(0, 9, (samples,), generator=gen)
    dest = torch.randint(0, world, (samples,), generator=gen)
    values = torch.randn(int(lengths.sum()), 3, generator=gen)
    packed, sample_counts, row_counts = reference(values, lengths, dest, world)
    want_packed, want_samples, want_rows = _planned_rows(values, lengths, dest, world)
    assert torch.equal(packed, want_packed)
    assert sample_counts == want_samples and row_counts == want_rows


def test_a_benchmark_that_counted_wrong_elements_exits_1_naming_the_row(capsys):
    """alltoall, overlap and layout printed rows with #wrong > 0 and exited 0: a GPU checklist's
    summary (the last line and the exit code) showed nothing wrong."""
    assert cli._fails_on_wrong("alltoall", [{"impl": "sm_copy", "wrong": 0}]) == 0
    assert cli._fails_on_wrong("overlap", [{"impl": "ce", "size_bytes": 64, "wrong": 0}],
                               [{"case": "layout_kernels", "world": 32, "wrong": 3}]) == 1
    assert "3 wrong elements" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--ranks", "0"], ["--reps", "0"], ["--sizes", "4"], ["--layout-samples", "0"]])
def test_overlap_refuses_bad_arguments(argv, capsys):
    try:
        code = cli.main(["overlap", *argv, "--no-progress"])
    except SystemExit as exit_:  # argparse's refusal of a flag's value (--ranks 0)
        code = exit_.code
    assert code == 2
    assert "freescale-bench overlap:" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
@pytest.mark.parametrize("argv", [["overlap"], ["overlap", "--transport", "nvshmem"], ["alltoall", "--transport", "ce"],
                                  ["alltoall", "--transport", "nvshmem"]])
def test_cuda_benchmarks_say_they_need_a_gpu(argv, capsys):
    assert cli.main([*argv, "--no-progress"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def _transports():
    import freescale_comm as fc

    return [t for t in ("ce", "nvshmem") if t in fc.build_info()["transports"]]


@pytest.mark.gpu
@pytest.mark.parametrize("transport", _transports())
def test_overlap_bench_runs_and_writes_its_rows(transport, tmp_path):
    out = tmp_path / "overlap.json"
    ranks = "1" if transport == "nvshmem" else "2"  # several NVSHMEM PEs on one GPU may need MPS
    assert cli.main(["overlap", "--transport", transport, "--ranks", ranks, "--sizes", "8M", "--busbw-sizes", "1M",
                     "--reps", "2", "--warmup", "1", "--layout-worlds", "8", "--layout-samples", "32", "--no-progress",
                     "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["case"] for r in data["rows"]] == ["gemm_alone", "sm_copy", transport]
    assert {"case", "gemm_ms", "slowdown_pct", "comm_ms"} <= set(data["rows"][0])
    assert all(r["wrong"] == 0 for r in data["busbw_rows"] + data["layout_rows"])


@pytest.mark.gpu
@pytest.mark.parametrize("transport", _transports())
def test_alltoall_bench_on_cuda_tensors_writes_its_rows(transport, tmp_path):
    out = tmp_path / "alltoall.json"
    ranks = "1" if transport == "nvshmem" else "2"
    assert cli.main(["alltoall", "--transport", transport, "--ranks", ranks, "--sizes", "1M", "4M", "--iters", "3",
                     "--warmup", "1", "--no-progress", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["sm_copy", transport] * 2 and all(r["wrong"] == 0 for r in rows)

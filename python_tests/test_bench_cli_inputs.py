"""freescale-bench and the demo refuse bad flags up front (argparse's exit 2, one line naming the
flag), before any rank is spawned or any measurement runs."""

import math

import numpy as np
import pytest

from freescale_comm.__main__ import main as demo_main
from freescale_comm.bench import cli, simulate


@pytest.mark.parametrize("argv, flag", [
    (["simulate", "--bandwidth-gbps", "nan"], "--bandwidth-gbps"),  # looped forever in the fabric model
    (["simulate", "--latency-us", "inf"], "--latency-us"),          # a table of inf / NaN, exit 0
    (["simulate", "--dense-bytes=-1G"], "--dense-bytes"),           # a negative step time, exit 0
    (["simulate", "--plan-us-per-sample", "-100"], "--plan-us-per-sample"),
    (["dispatch", "--iters", "0"], "--iters"),                      # UnboundLocalError in every rank
    (["dispatch", "--warmup", "-1"], "--warmup"),
    (["alltoall", "--iters", "-1"], "--iters"),                     # NaN rows, exit 0
    (["alltoall", "--sizes", "inf"], "--sizes"),                    # OverflowError
    (["planner", "--seed", "-1"], "--seed"),                        # numpy's ValueError traceback
    (["e2e", "--seed", "-1"], "--seed"),                            # ... in every spawned rank
    (["e2e", "--ranks", "100000"], "--ranks"),                      # spawned ranks for hours
    (["torchrec-pec", "--ranks", "100000"], "--ranks"),
    (["soak", "--ranks", "1"], "--ranks"),
    (["simulate", "--nestpipe", "--collision", "nan"], "--collision"),
])
def test_bad_flags_are_refused_before_anything_runs(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--json", "{missing}/rows.json"), ("--trace", "{file}/trace"),
                                         ("--plot", "{dir}")])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, flag, value, capsys):
    """Checked first: the results of a long run were lost to a typo in --json / --plot / --trace."""
    (tmp_path / "file").write_text("")
    path = value.format(missing=tmp_path / "missing", file=tmp_path / "file", dir=tmp_path)
    argv = ["torchrec-pec", flag, path] if flag == "--plot" else ["simulate", flag, path]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_the_demo_refuses_an_out_directory_it_cannot_make(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        demo_main(["demo", "--out", str(tmp_path / "file" / "demo")])
    assert exit_.value.code == 2 and "--out" in capsys.readouterr().err


def test_the_fabric_model_refuses_durations_that_never_end():
    with pytest.raises(ValueError, match="finite"):
        simulate.fabric_schedule([0.0, 0.0], [1.0, math.nan], [0, 1])
    with pytest.raises(ValueError, match="finite"):
        simulate.SimParams(bandwidth_gbps=math.nan).check()
    assert np.allclose(simulate.fabric_schedule([0.0, 0.0], [1.0, 2.0], [0, 1]), [3.0, 2.0])


def test_spawning_benchmarks_take_at_most_a_few_ranks_per_usable_core(monkeypatch, capsys):
    monkeypatch.setattr(cli, "usable_cores", lambda: [0, 1, 2, 3])
    assert cli._local_ranks(2)("16") == 16
    with pytest.raises(SystemExit) as exit_:
        demo_main(["demo", "--ranks", "17"])
    assert exit_.value.code == 2
    assert "at most 16 processes on this host (4 per usable core, 4 here), got 17" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    (["simulate", "--nestpipe", "--ranks", "8"], "--ranks"),      # ran 256 and 1536 ranks anyway
    (["simulate", "--nestpipe", "--modes", "vanilla"], "--modes"),  # ran every NestPipe mode anyway
    (["simulate", "--nestpipe", "--calibration", "x.json"], "--calibration"),
    (["simulate", "--collision", "0.3"], "--collision"),          # no effect without --nestpipe
    (["simulate", "--nestpipe-ranks", "8"], "--nestpipe-ranks"),
    (["simulate", "--nestpipe", "--collision", "2"], "--collision"),
    (["torchrec-pec", "--nestpipe", "--pipelines", "pec"], "--pipelines"),  # --nestpipe was ignored
])
def test_flags_that_would_be_ignored_are_refused_naming_them(argv, named, capsys):
    assert cli.main(argv) == 2
    assert named in capsys.readouterr().err

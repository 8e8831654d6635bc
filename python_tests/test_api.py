"""The package surface: build_info, error mapping, configuration errors."""

import pytest
import torch

import freescale_comm as fc
from freescale_comm import _core


def test_build_info_reports_what_was_compiled():
    info = fc.build_info()
    assert set(info) >= {"version", "cuda", "nvshmem", "cuda_archs", "transports", "layout_kernels"}
    assert info["layout_kernels"].startswith("triton: ")
    assert info["version"] == fc.__version__
    assert isinstance(info["cuda"], bool) and isinstance(info["nvshmem"], bool)
    assert all(isinstance(a, int) for a in info["cuda_archs"])
    assert "host" in info["transports"]
    assert bool(info["cuda_archs"]) == info["cuda"]


@pytest.mark.parametrize(
    "code, cls",
    [
        (_core.ErrorCode.PEER_DIED, fc.CommError),
        (_core.ErrorCode.TIMEOUT, fc.CommError),
        (_core.ErrorCode.SIZE_MISMATCH, fc.CommError),
        (_core.ErrorCode.INVALID_ARGUMENT, ValueError),
        (_core.ErrorCode.INVALID_USAGE, fc.InvalidUsageError),
        (_core.ErrorCode.UNSUPPORTED, fc.UnsupportedError),
        (_core.ErrorCode.INTERNAL, fc.InternalError),
    ],
)
def test_core_errors_map_to_python_classes_with_codes(code, cls):
    with pytest.raises(cls) as info:
        _core._raise_for_test(code, "boom")
    assert info.value.code == code.name
    assert "boom" in str(info.value)
    assert info.value.culprit is None  # unknown


def test_a_commerror_names_its_culprit_rank():
    with pytest.raises(fc.CommError) as info:
        _core._raise_for_test(_core.ErrorCode.PEER_DIED, "rank 3 died", 3)
    assert (info.value.code, info.value.culprit) == ("PEER_DIED", 3)


def test_commerror_is_a_runtime_error():
    assert issubclass(fc.CommError, RuntimeError)


def test_malformed_env_knob_names_the_variable(monkeypatch):
    monkeypatch.setenv("FREESCALE_ARENA_BYTES", "plenty")
    with pytest.raises(ValueError, match="FREESCALE_ARENA_BYTES"):
        _core.Config.from_env()


def test_communicator_needs_torch_distributed():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fc.Communicator()


def test_the_lazily_loaded_pipeline_is_listed_by_dir():
    """TrainPipelinePEC loads on first use (it imports torchrec); dir() lists it all the same (it
    did not), and `import *` (__all__) does not need torchrec."""
    assert "TrainPipelinePEC" in dir(fc) and "Communicator" in dir(fc)
    assert "TrainPipelinePEC" not in fc.__all__

"""Transport selection as the Python layer sees it (CPU only: what CI can check of the ce path)."""

import pytest
import torch.distributed as dist

from freescale_comm import _core
from freescale_comm._bootstrap import StoreBootstrap


def _core_over(config: "_core.Config") -> "_core.Communicator":
    return _core.Communicator(StoreBootstrap(dist.HashStore(), 0, 1), config)


def test_cpu_communicators_take_the_host_transport():
    comm = _core_over(_core.Config())
    assert comm.transport == "host"
    assert comm.data_path.startswith("host: CPU copies")  # fc.Communicator.data_paths()["cpu"]
    comm.close()


def test_host_forced_on_cuda_tensors_names_the_knob_and_the_fix():
    config = _core.Config()
    config.transport, config.cuda_device = "host", 0
    with pytest.raises(ValueError, match="FREESCALE_TRANSPORT.*CPU tensors only.*ce, nvshmem or auto"):
        _core_over(config)


def test_cuda_tensors_without_a_gpu_are_refused_clearly():
    if "ce" not in _core.build_info()["transports"]:
        pytest.skip("built without nvcc: no ce transport to refuse")
    if _core.cuda_device_count() > 0:
        pytest.skip("a GPU is present: test_ce_gpu.py covers it")
    config = _core.Config()
    config.cuda_device = 0
    with pytest.raises(_core.UnsupportedError, match="needs a CUDA GPU"):
        _core_over(config)


def test_a_forced_gpu_transport_leaves_cpu_tensors_on_host(monkeypatch):
    monkeypatch.setenv("FREESCALE_TRANSPORT", "ce")
    config = _core.Config.from_env()
    assert config.transport == "ce"
    import datetime

    from freescale_comm.communicator import Communicator

    comm = Communicator._over(StoreBootstrap(dist.HashStore(), 0, 1), datetime.timedelta(seconds=30))
    assert comm.transport == "host"
    comm.close()


def test_build_info_says_whether_nvshmem_is_compiled_in_and_why():
    info = _core.build_info()
    assert isinstance(info["nvshmem_detail"], str) and info["nvshmem_detail"]
    assert ("nvshmem" in info["transports"]) == info["nvshmem"]
    if not info["nvshmem"]:
        assert "not" in info["nvshmem_detail"] or "OFF" in info["nvshmem_detail"]


def test_nvshmem_host_library_loads_without_a_gpu():
    if not _core.build_info()["nvshmem"]:
        pytest.skip("built without NVSHMEM: " + _core.build_info()["nvshmem_detail"])
    assert _core.nvshmem_library().endswith(("libnvshmem_host.so.3", "libnvshmem_host.so"))


def test_nvshmem_forced_without_a_gpu_is_refused_clearly():
    if not _core.build_info()["nvshmem"]:
        pytest.skip("built without NVSHMEM")
    if _core.cuda_device_count() > 0:
        pytest.skip("a GPU is present: the gpu tests run the transport")
    config = _core.Config()
    config.transport, config.cuda_device = "nvshmem", 0
    with pytest.raises(_core.UnsupportedError, match="needs a CUDA GPU"):
        _core_over(config)

"""freescale_comm.driver_probe: an independent view of the CUDA driver (cuda-python). Without a
driver or without cuda-python it reports why, never raises; on a GPU it agrees with data_paths."""

import sys

import pytest

from freescale_comm.driver_probe import ATTRIBUTES, probe
from freescale_comm.testing import spawn
import ce_programs


def test_without_cuda_python_it_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails as if not installed
    report = probe()
    assert report["available"] is False
    assert "freescale_comm[probe]" in report["why"]


def test_without_a_driver_it_says_why_instead_of_raising():
    pytest.importorskip("cuda.bindings")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the gpu test below covers it")
    report = probe()
    assert report["available"] is False
    assert report["why"].startswith("the CUDA driver cannot be probed here"), report


def test_attribute_numbers_are_cudas():
    driver = pytest.importorskip("cuda.bindings.driver")
    for name, number in ATTRIBUTES.items():
        assert int(getattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")) == number, name


@pytest.mark.gpu
def test_the_probe_agrees_with_the_data_path():
    pytest.importorskip("cuda.bindings")
    report = probe()
    assert report["available"], report
    [(name, path)] = spawn(ce_programs.cuda_transport_and_data_path, 1, timeout_s=300)
    v = report["driver_version"]
    assert f"(driver {v // 1000}.{v % 1000 // 10})" in path, (v, path)
    attrs = report["attributes"]
    assert attrs["ASYNC_ENGINE_COUNT"] >= 1
    if name == "ce":  # the ce transport refuses without these (then the backend runs NCCL)
        assert attrs["CAN_USE_64_BIT_STREAM_MEM_OPS"] and attrs["VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"]
        assert attrs["HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"]

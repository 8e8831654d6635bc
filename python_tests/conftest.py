import importlib.util
import os

import pytest
import torch

# Without a GPU, Triton kernels (the dispatch layout kernels) run on CPU tensors through Triton's
# interpreter; the mode is fixed when triton is first imported, so set it before any test does.
# With a GPU the kernels compile, and test_layout_kernels.py skips.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ranks fork from a server that imported these once (after TRITON_INTERPRET is set above): most
# rank programs import torchrec, ~1.6 s of CPU per rank per test otherwise.
from freescale_comm import testing  # noqa: E402 (imports triton: after TRITON_INTERPRET)

testing.preload_in_ranks("freescale_comm", *(["torchrec"] if importlib.util.find_spec("torchrec") else []))


def _our_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("freescale-")} if os.path.isdir("/dev/shm") else set()


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    """Every test leaves /dev/shm as it found it."""
    before = _our_segments()
    yield
    assert _our_segments() - before == set(), "shared-memory segments left in /dev/shm"


@pytest.fixture
def torchrec_installed():
    """TorchRec is importable: CI (FREESCALE_REQUIRE_CLIENTS=1) fails without it, elsewhere the test skips."""
    if os.environ.get("FREESCALE_REQUIRE_CLIENTS") == "1":
        import torchrec  # noqa: F401
    else:
        pytest.importorskip("torchrec")


@pytest.fixture
def emulated_device_built():
    """_core._emulated (test equipment, FREESCALE_TEST_SUPPORT=ON builds such as scripts/setup.sh's)
    is there: CI (FREESCALE_REQUIRE_CLIENTS=1) fails without it, elsewhere the test skips."""
    from freescale_comm import _core

    if hasattr(_core, "_emulated"):
        return
    why = "_core has no _emulated: reinstall with FREESCALE_TEST_SUPPORT=ON (scripts/setup.sh does)"
    if os.environ.get("FREESCALE_REQUIRE_CLIENTS") == "1":
        pytest.fail(why)
    pytest.skip(why)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

import importlib.util
import os
import re

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


_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # set in pytest-xdist's workers (scripts/test.sh runs two)
_CREATOR = re.compile(r"freescale-(\d+)-")  # a segment's name: /freescale-<creator pid>-<random> (shm_segment.cc)


def _parent(pid: int) -> int:
    """pid's parent, or 0 once it is gone (/proc/<pid>/stat: "pid (comm) state ppid ...")."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _created_here(name: str) -> bool:
    """The segment's creator is this process or a live descendant of it. With two workers side by
    side, the other one's segments (its ranks are not ours) are none of this test's business."""
    m = _CREATOR.match(name)
    pid = int(m.group(1)) if m else 0
    while pid > 1:
        if pid == os.getpid():
            return True
        pid = _parent(pid)
    return False


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    """Every test leaves /dev/shm as it found it. Beside another worker, a test answers for the
    segments of its own live processes; a dead rank's leftover is caught by the session's check
    below, after every worker ended."""
    before = _our_segments()
    yield
    left = _our_segments() - before
    if _XDIST_WORKER is not None:
        left = {n for n in left if _created_here(n)}
    assert left == set(), f"shared-memory segments left in /dev/shm: {sorted(left)}"


def pytest_sessionstart(session):
    session.config._freescale_segments = _our_segments()


def pytest_sessionfinish(session, exitstatus):
    """The whole run (the only process, or xdist's controller once its workers ended) leaves
    /dev/shm as it found it: a failure, naming the segments (their creator pid is in each name)."""
    if _XDIST_WORKER is not None:
        return
    left = sorted(_our_segments() - session.config._freescale_segments)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(f"shared-memory segments left in /dev/shm by this run: {left}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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

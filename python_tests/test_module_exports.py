"""The compiled module exports its init alone (cpp/bindings/core_exports.map). An exported
symbol of a statically linked library binds to the process's own copy half-way: on a GPU machine
whose g++ links libstdc++.a, every Communicator crashed in its first std::ostream << integer,
torch's libstdc++.so.6 being loaded first (H200, 2026-11-27)."""
import shutil
import subprocess
import sys

import pytest

import freescale_comm._core as core


def test_the_compiled_module_exports_only_its_init():
    nm = shutil.which("nm")
    if nm is None or not sys.platform.startswith("linux"):
        pytest.skip("reads the dynamic symbol table with binutils' nm (Linux)")
    listing = subprocess.run([nm, "-D", "--defined-only", core.__file__], capture_output=True, text=True, check=True)
    exported = sorted(line.split()[-1] for line in listing.stdout.splitlines() if line.strip())
    assert exported == ["PyInit__core"], f"{len(exported)} symbols exported, e.g. {exported[:8]}"

#!/usr/bin/env bash
# Builds the package once the way a user does: a fresh venv, `pip install .` with build isolation
# and without the NVSHMEM wheel in the build environment (NVSHMEM_HOME unset), then imports it and
# prints fc.build_info(); the module must not carry the emulated device (test equipment). torch and
# numpy come from the environment this script runs in (the system Python, a venv or a conda env:
# its site-packages follow the new venv's own on its path), and --no-deps keeps pip from resolving
# a CUDA torch of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/plain-venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
# (--system-site-packages would see the base interpreter's packages, not an active venv's)
python3 -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
  > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/outer-environment.pth"
env -u NVSHMEM_HOME -u FREESCALE_TEST_SUPPORT "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
  --config-settings=build-dir="$(dirname "$venv")/build" . > plain-install.log 2>&1 \
  || { cat plain-install.log; rm -f plain-install.log; exit 1; }
rm -f plain-install.log
cd "$(dirname "$venv")"  # import the installed package, not the source tree
"$venv/bin/python" -c 'import freescale_comm as fc, sys; assert fc.__file__.startswith(sys.prefix), f"imported {fc.__file__}, not the venv'"'"'s copy (an editable install shadows it)"; info = fc.build_info(); print("plain install:", info); assert info["transports"][0] == "host" and info["nvshmem_detail"]
assert not hasattr(fc._core, "_emulated"), "a plain install carries the emulated device (test equipment)"'
# Test equipment stays out of what users install: not a byte of the emulated device (its class
# name, in its RTTI and its binding) in the module.
if grep -qa EmulatedDevice "$(find "$venv" -name '_core*.so' | head -1)"; then
  echo "plain install: _core carries the emulated device (testing/); it must be test-only" >&2
  exit 1
fi

#!/usr/bin/env bash
# Installs everything the tests and the demo need on a fresh machine (idempotent):
# GoogleTest, torch 2.13.0 (CPU), NVSHMEM's wheel, this package with its test and nvshmem extras,
# and TorchRec (a real client the tests run against the backend).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ ! -f /usr/include/gtest/gtest.h ]; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq libgtest-dev
fi
python3 -m pip install -q --disable-pip-version-check torch==2.13.0
# NVSHMEM's wheel (headers + host library) first, so that the build compiles the nvshmem transport;
# the package builds in an isolated environment, so tell CMake where the wheel is.
python3 -m pip install -q --disable-pip-version-check "nvidia-nvshmem-cu13>=3.4"
NVSHMEM_HOME="$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])')"
export NVSHMEM_HOME
# FREESCALE_TEST_SUPPORT: the tests' build carries the emulated device (_core._emulated); a
# user's `pip install .` does not.
FREESCALE_TEST_SUPPORT=ON python3 -m pip install -q --disable-pip-version-check ".[test,nvshmem]"
# torchrec declares a dependency on the CUDA fbgemm-gpu wheel, which does not load on a CPU torch
# and shares its import name with fbgemm-gpu-cpu: install the CPU one and torchrec without deps.
python3 -m pip install -q --disable-pip-version-check fbgemm-gpu-cpu==1.8.0 tensordict "torchmetrics==1.0.3" tqdm pyre-extensions
python3 -m pip install -q --disable-pip-version-check --no-deps torchrec==1.8.0
# The Triton that torch 2.11's CUDA wheels pin, beside this environment's: the layout kernels must
# compile with it too (python_tests/test_layout_kernels.py; its compiler rejected a kernel 3.9 took).
if [ ! -d build/compat/triton-3.6.0/triton ]; then
  python3 -m pip install -q --disable-pip-version-check --no-deps --target build/compat/triton-3.6.0 triton==3.6.0
fi

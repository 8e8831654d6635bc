#!/usr/bin/env bash
# Builds and runs the C++ tests (GoogleTest via ctest; the CUDA transports run there on the emulated
# device), then again under ASan + UBSan and TSan, checks that a plain `pip install .` builds and
# imports (from this Python's environment, and from inside a venv holding torch itself), then runs
# the Python tests (pytest) against the installed package. Run scripts/setup.sh first on a fresh
# machine.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() { echo "[test.sh +${SECONDS}s] $*"; }  # where CI's minutes go
phase "Release build (CUDA compiled), ctest"
cmake -S . -B build/ctest -DFREESCALE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release > build-ctest.log 2>&1 || { cat build-ctest.log; exit 1; }
cmake --build build/ctest -j2 >> build-ctest.log 2>&1 || { cat build-ctest.log; exit 1; }
rm -f build-ctest.log
ctest --test-dir build/ctest -j2 --output-on-failure
# The CUDA transports (copy engines, NVSHMEM) and the emulator again with every stream on ONE
# hardware queue (the default above is 8, a GPU's): a device-side wait that depends on work
# enqueued after it hangs here (design.md §4). Once, in this build only.
phase "one hardware queue rerun"
FREESCALE_EMULATED_HW_QUEUES=1 ctest --test-dir build/ctest -j2 --output-on-failure -R '(^|/)(Ce|Nvshmem|EmulatedDevice|EmulatedShmem|SubmitGate)'
# GoogleTest again under ASan + UBSan, any report failing the run (CUDA off: the emulated device
# still runs the transports' logic, which needs no nvcc). -O1 -g1 as ASan's docs advise: reports
# keep their file:line, and the build takes half the minutes of -O2 -g.
phase "ASan + UBSan build and ctest"
cmake -S . -B build/asan -DFREESCALE_BUILD_TESTS=ON -DFREESCALE_BUILD_PYTHON=OFF -DFREESCALE_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" \
  "-DCMAKE_CXX_FLAGS=-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" \
  > build-asan.log 2>&1 || { cat build-asan.log; exit 1; }
cmake --build build/asan -j2 >> build-asan.log 2>&1 || { cat build-asan.log; exit 1; }
rm -f build-asan.log
ctest --test-dir build/asan -j2 --output-on-failure
# And under TSan: the CPU engine (scheduler, host transport, communicator, progress lock) and the
# CUDA transports on the emulated device. Its DMA moves whole words atomically (as the hardware
# does) and the host reads mapped mirrors with acquire loads, so TSan follows the protocols; what
# it cannot see is ordering through another process (forked ranks), which no op relies on alone.
phase "TSan build and ctest"
cmake -S . -B build/tsan -DFREESCALE_BUILD_TESTS=ON -DFREESCALE_BUILD_PYTHON=OFF -DFREESCALE_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" \
  "-DCMAKE_CXX_FLAGS=-fsanitize=thread" > build-tsan.log 2>&1 || { cat build-tsan.log; exit 1; }
cmake --build build/tsan -j2 >> build-tsan.log 2>&1 || { cat build-tsan.log; exit 1; }
rm -f build-tsan.log
# The bulk-volume emulated tests (up to 256 MiB / 64 MiB per peer, the 32 MiB and 256 MiB priority
# races (whether the urgent op wins depends on timing TSan slows ten-fold: one lost beside a build), the
# 3- and 4-rank soaks (ctest names parameters by value), hundreds of chunks through a 16-deep
# queue) run in the Release and ASan builds only: under TSan they took minutes of CI (and ran
# near their op timeouts) for no path the smaller tests there (2-rank soaks, failures, ordering)
# do not take. AStalledNetworkPeer... mostly waits out its bounded settles (seconds of wall time);
# the code it reaches (drain, settle) runs under TSan in every nvshmem test. Likewise the ones
# whose bytes TSan slows 15- to 40-fold (its checked word-by-word DMA): 64 MiB of hostile header
# (its 512 KiB twin stays), 16 MiB per peer behind a compute kernel, 4 MiB x 4 back-to-back
# synchronous ops and hundreds of ops through a 4-deep queue on ce (nvshmem's back-to-back stays):
# 73 s of TSan's 103 here. -g1: line tables are what a report needs (a quarter of the build).
# Two test processes at a time, as the other phases (131 -> 93 s here; the count tests skip under TSan).
TSAN_OPTIONS=halt_on_error=1 ctest --test-dir build/tsan -j2 --output-on-failure \
  -E 'RandomSplitsFromZeroTo256MiB|Moves64MiBPerPeer|LaterUrgentOp|AnUrgentOpDuringABulkOp|NvshmemEmulatedStreams.ManyChunks|Emulated.EveryOpHasAllItsBytesWhenItCompletes/[34]$|AStalledNetworkPeer|CeEmulatedStreams.BackToBackSynchronousOps|HundredsOfOpsInFlightWithAFourDeepStreamQueue|AComputeKernelHoldingEverySmStallsOnlySmCopies|AHeaderClaimingMoreThanTheSlotHolds'
phase "plain pip install"
bash scripts/check_plain_install.sh
phase "plain pip install inside a venv"
bash scripts/check_plain_install_in_venv.sh
phase "CUDA 12.8 headers"
bash scripts/check_cuda_12_8.sh
phase "pytest"
# Two test processes (pytest-xdist; a test's ranks fork from its own process's server), each taking
# the next test when free (worksteal: the long tests do not leave one process idle at the end).
FREESCALE_REQUIRE_CLIENTS=1 python3 -m pytest python_tests -q -p no:cacheprovider -n 2 --dist worksteal --durations=15
phase "done"

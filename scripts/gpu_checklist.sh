#!/usr/bin/env bash
# One device-tool call's worth of ../shared/gpu-checklist.md, for a lent GPU machine (never CI):
# builds against the machine's own torch (CUDA) and NVSHMEM wheel, then runs the list in order,
# each step under its own time limit, logging to $OUT/NN-name.log (benchmarks also write JSON
# there) and one line per step to $OUT/summary.txt. A failed step does not stop the next ones.
# Usage (device tool): bash scripts/gpu_checklist.sh [first step number, default 1]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?run through the device tool: it sets OUT}"
FIRST="${1:-1}"
summary="$OUT/summary.txt"
{ date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } \
  > "$OUT/machine.txt" 2>&1

step() {  # step NUMBER NAME SECONDS COMMAND...
  local n="$1" name="$2" limit="$3"; shift 3
  [ "$n" -gt 0 ] && [ "$n" -lt "$FIRST" ] && return 0  # step 0 (the build) always runs
  local log="$OUT/$(printf '%02d' "$n")-$name.log" start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  echo "step $n $name: rc=$rc ($((SECONDS - start)) s) $(tail -n 1 "$log" | cut -c1-160)" >> "$summary"
}

NVSHMEM_HOME="$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])' 2>/dev/null)"
export NVSHMEM_HOME
step 0 build 420 python3 -m pip install -q --no-build-isolation --no-deps .
step 0 build-info 60 python3 -c 'import json, freescale_comm as fc; print(json.dumps(fc.build_info()))'
# NVSHMEM with several PEs on one GPU needs MPS (else its signal waits exit()); best effort.
nvidia-cuda-mps-control -d > "$OUT/mps.log" 2>&1 || echo "MPS did not start (see mps.log)" >> "$summary"

step 1 ce-tests 420 python3 -m pytest -m gpu -q -p no:cacheprovider python_tests/test_ce_gpu.py
# Item 2 (failure paths on a GPU) has no GPU test yet: its logic runs on the emulated device in CI.
step 3 overlap-ce 420 freescale-bench overlap --transport ce --no-progress --json "$OUT/overlap-ce.json"
step 3 alltoall-ce 300 freescale-bench alltoall --transport ce --no-progress --json "$OUT/alltoall-ce.json"
step 4 layout-kernels 420 python3 -m pytest -m gpu -q -p no:cacheprovider python_tests/test_dispatch_gpu.py
step 5 e2e-cuda 420 freescale-bench e2e --device cuda --ranks 4 --no-progress --trace "$OUT/e2e-trace" --json "$OUT/e2e-cuda.json"
step 6 nvshmem-tests 420 python3 -m pytest -m gpu -q -p no:cacheprovider python_tests/test_nvshmem_gpu.py
step 6 alltoall-nvshmem 300 freescale-bench alltoall --transport nvshmem --no-progress --json "$OUT/alltoall-nvshmem.json"
step 7 memcheck 420 compute-sanitizer --tool memcheck python3 -m pytest -m gpu -q -p no:cacheprovider python_tests/test_dispatch_gpu.py
cat "$summary"

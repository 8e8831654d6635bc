#!/usr/bin/env bash
# One device-tool call's worth of ../shared/gpu-checklist.md, for a lent GPU machine (never CI):
# builds against the machine's own torch (CUDA) and NVSHMEM wheel, then runs the list's items
# FIRST..LAST, each step under its own time limit, within one call's budget: the items that never
# ran on a GPU first (1, 2, 3, 5, 6, 8, 9), then those lease 1 ran (4; 7 over item 4's kernels).
# Usage (device tool): CHECKLIST_COMMIT=<hash> bash scripts/gpu_checklist.sh [FIRST item, default 1] [LAST item, default 9]
# A lease is 15 device-minutes: CHECKLIST_SKIP_BUILD=1 on a warm machine keeps the last call's build;
# every pytest step runs each test under PYTEST_TIMEOUT_S (default 90) so one hang costs one test.
# What comes back (the tool returns at most 8 files from $OUT): summary.txt (a line per step: rc,
# seconds, last log line; "not started" when the call's budget ran short: start there next call),
# machine.txt, and logs.tgz (every step's log and the benchmarks' JSON, re-packed after each step,
# so a call cut off at its limit still brings back what ran). A failed step does not stop the next.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?run through the device tool: it sets OUT}"
FIRST="${1:-1}"
LAST="${2:-9}"
BUDGET_S="${CHECKLIST_BUDGET_S:-570}"  # the device tool kills a call at 600 s
LOGS=/tmp/gpu-checklist  # packed into $OUT/logs.tgz
rm -rf "$LOGS" && mkdir -p "$LOGS"
summary="$OUT/summary.txt"
# The device tool sends the working tree, maybe without .git: name the commit in CHECKLIST_COMMIT.
{ date -u; echo "commit ${CHECKLIST_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (set CHECKLIST_COMMIT)')}"
  git status --short 2>/dev/null | head -20
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -VV
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'; } > "$OUT/machine.txt" 2>&1

step() {  # step ITEM NAME SECONDS COMMAND...: item 0 (the build) always runs
  local n="$1" name="$2" limit="$3"; shift 3
  if [ "$n" -gt 0 ] && { [ "$n" -lt "$FIRST" ] || [ "$n" -gt "$LAST" ]; }; then return 0; fi
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 45 ]; then
    echo "step $n $name: not started (${left} s of this call's budget left): next call starts at item $n" >> "$summary"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  local log="$LOGS/$(printf '%02d' "$n")-$name.log" start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  echo "step $n $name: rc=$rc ($((SECONDS - start)) s, limit $limit) $(tail -n 1 "$log" | cut -c1-160)" >> "$summary"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
}

NVSHMEM_HOME="$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])' 2>/dev/null)"
export NVSHMEM_HOME CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-16}" PYTHONUNBUFFERED=1
if [ -z "${CHECKLIST_SKIP_BUILD:-}" ]; then
  step 0 build 300 python3 -m pip install -q --no-build-isolation --no-deps .
fi
step 0 build-info 60 python3 -c 'import json, freescale_comm as fc; print(json.dumps(fc.build_info()))'
# One rank, one CUDA AllToAll per transport; on a crash, cuda-gdb's native stack (the first lease
# spent two calls finding a crash that every later step repeated).
step 0 smoke-ce 60 python3 -X faulthandler scripts/gpu_smoke.py 29511
if ! grep -q "^ok" "$LOGS/00-smoke-ce.log"; then
  step 0 smoke-ce-stack 120 cuda-gdb -q -batch -ex "set pagination off" -ex "handle SIGPIPE nostop noprint" -ex run -ex bt \
    --args python3 scripts/gpu_smoke.py 29512
fi
FREESCALE_TRANSPORT=nvshmem step 0 smoke-nvshmem 60 python3 -X faulthandler scripts/gpu_smoke.py 29513

step 1 ce-tests 240 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout="${PYTEST_TIMEOUT_S:-90}" python_tests/test_ce_gpu.py
# Item 2: the failure paths' cuda cases (their cpu cases run in CI); 64 streams is in item 1's file.
step 2 failure-paths 300 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout="${PYTEST_TIMEOUT_S:-90}" python_tests/test_failures.py
step 3 overlap-ce 150 freescale-bench overlap --transport ce --no-progress --json "$LOGS/overlap-ce.json"
step 3 alltoall-ce 90 freescale-bench alltoall --transport ce --no-progress --sizes 1M 16M 64M 256M --iters 5 --warmup 2 \
  --json "$LOGS/alltoall-ce.json"
step 5 e2e-cuda 150 freescale-bench e2e --device cuda --ranks 4 --no-progress --trace "$LOGS/e2e-trace" --json "$LOGS/e2e-cuda.json"
# NVSHMEM with several PEs on one GPU needs MPS with thread percentages summing to <= 100 (else it
# runs "limited MPG", which the transport refuses); the ce items ran without MPS, as users run them.
if [ "$FIRST" -le 6 ] && [ "$LAST" -ge 6 ]; then
  nvidia-cuda-mps-control -d > "$LOGS/mps.log" 2>&1 || echo "MPS did not start (see mps.log)" >> "$summary"
  trap 'echo quit | nvidia-cuda-mps-control > /dev/null 2>&1' EXIT  # a warm machine's next call runs without it
  # 4 ranks at most; NVSHMEM's figures then come from 25 % of the SMs each: not comparable with ce's
  export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25
  step 6 mps-check 30 bash -c 'python3 -c "import torch; torch.ones(1, device=\"cuda\"); print(\"cuda ok under MPS\")" &&
    echo get_server_list | nvidia-cuda-mps-control'
fi
step 6 nvshmem-tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout="${PYTEST_TIMEOUT_S:-90}" python_tests/test_nvshmem_gpu.py
# Issue 43: beside torch's NVSHMEM symmetric memory and nvshmem4py (each test skips what is missing).
step 6 nvshmem-coexistence 90 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout="${PYTEST_TIMEOUT_S:-90}" python_tests/test_nvshmem_coexistence_gpu.py
step 6 alltoall-nvshmem 90 freescale-bench alltoall --transport nvshmem --no-progress --sizes 1M 16M 64M 256M --iters 5 \
  --warmup 2 --json "$LOGS/alltoall-nvshmem.json"
if [ "$FIRST" -le 6 ] && [ "$LAST" -ge 6 ]; then
  echo quit | nvidia-cuda-mps-control > /dev/null 2>&1; unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
fi
# Item 8 (issue 41): what the failure handling relies on, read from the GPU and recorded: VMM and
# POSIX-handle support (the ce arenas; the ce transport refuses without them), the GPUDirect
# RDMA flush options / write ordering (the nvshmem network flush), 64-bit stream memory ops. The
# failure cases themselves are item 2's (a SIGKILLed rank leaves the survivors' contexts healthy).
step 8 capabilities 30 python3 -c 'import cupy
names = {98: "CAN_FLUSH_REMOTE_WRITES", 102: "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", 103: "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
         116: "GPU_DIRECT_RDMA_SUPPORTED", 117: "GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS", 118: "GPU_DIRECT_RDMA_WRITES_ORDERING",
         122: "CAN_USE_64_BIT_STREAM_MEM_OPS"}
for n, name in names.items(): print(n, name, cupy.cuda.runtime.deviceGetAttribute(n, 0))'
# ... and cuda-python's view of them against Communicator.data_paths (skips without cuda-bindings).
step 8 driver-probe 60 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout="${PYTEST_TIMEOUT_S:-90}" python_tests/test_driver_probe.py
# Item 9 (issue 38): TrainPipelinePEC's worker stream: its host reads do not wait for the main
# stream's kernels (and did on the legacy default stream); a join orders the main stream after it;
# a pageable batch copy makes the main thread wait for its stream's kernels only when issued there.
step 9 pipeline-streams 90 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout="${PYTEST_TIMEOUT_S:-90}" python_tests/test_pipeline_streams_gpu.py
# ... and its fused Adam (FBGEMM's Adam is CUDA-only): equal to TrainPipelineSparseDist, one rank.
step 9 pipeline-adam 120 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=110 python_tests/test_pec_adam_gpu.py
# Run on lease 1 already (figures in docs/benchmarks.md): after the items that never ran.
step 4 layout-kernels 120 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout="${PYTEST_TIMEOUT_S:-90}" python_tests/test_dispatch_gpu.py
# the kernels vs PyTorch at training sizes, then each kernel's compiled variants, registers, spills
step 4 layout-bench 120 freescale-bench layout --json "$LOGS/layout.json"
# --error-exitcode: else it exits 0 whatever it finds; application-only and the single-process
# kernel tests: the ranks' forkserver children are not worth the step's minutes.
step 7 memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 1 --target-processes application-only \
  python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=150 python_tests/test_dispatch_gpu.py \
  -k "plan_kernel or gather_and_scatter or bad_samples"
tar czf "$OUT/logs.tgz" -C "$LOGS" .
cat "$summary"

#!/usr/bin/env bash
# The CUDA host sources must compile against CUDA 12.8's headers too, the oldest toolkit CMake
# takes (cudaMemcpyBatchAsync's signature changed in 13.0; nvcc here is 13.0). Uses the 12.8
# headers the Triton 3.6.0 wheel bundles (scripts/setup.sh puts it in build/compat): a syntax
# check of every file that includes only CUDA's runtime and driver headers. The NVSHMEM ones
# (shmem_ops_nvshmem.cu, nvshmem_api.cu) need CCCL headers the wheel lacks; nvcc 13.0 compiles them.
set -euo pipefail
cd "$(dirname "$0")/.."
headers=build/compat/triton-3.6.0/triton/backends/nvidia/include
grep -q 'define CUDART_VERSION  12080' "$headers/cuda_runtime_api.h" \
  || { echo "check_cuda_12_8: CUDA 12.8 headers not found under $headers (run scripts/setup.sh)" >&2; exit 1; }
for f in cuda/device_ops_cuda.cu cuda/driver_api.cu cuda/device_util.cc cuda/ce_transport.cc cuda/submit_gate.cc \
         cuda/device_transports.cc cuda/nvshmem_transport.cc; do
  g++ -std=c++17 -fsyntax-only -x c++ -I. -I"$headers" "$f"
done
echo "check_cuda_12_8: the CUDA host sources compile against CUDA 12.8's headers"

#include <cuda_runtime.h>

#include "cuda/device_probe.h"

namespace freescale {

int probe_cuda_device_count() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later CUDA users start clean
    return 0;
  }
  return count;
}

}  // namespace freescale

// The real device ops in a build without CUDA: every use refuses, naming the fix.
#include "cpp/errors.h"
#include "cuda/device_ops.h"

namespace freescale {

DeviceOps& cuda_device_ops() {
  throw Error(ErrorCode::kUnsupported,
              "this build of freescale_comm has no CUDA support (nvcc was not found at build time); "
              "reinstall with nvcc on PATH (FREESCALE_CUDA=ON) to move CUDA tensors");
}

}  // namespace freescale

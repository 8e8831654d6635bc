// NVSHMEM's ops in a build without the NVSHMEM transport: every use refuses, naming the fix.
#include "cpp/errors.h"
#include "cuda/device_ops.h"
#include "freescale_build_config.h"

namespace freescale {

ShmemOps& nvshmem_ops() {
  throw Error(ErrorCode::kUnsupported, std::string("the nvshmem transport is not in this build: ") + kNvshmemBuildDetail);
}

}  // namespace freescale

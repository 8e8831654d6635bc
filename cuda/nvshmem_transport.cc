#include "cuda/nvshmem_transport.h"
#include "cpp/errors.h"
namespace freescale {
std::unique_ptr<Transport> make_nvshmem_transport(Bootstrap&, const Config&, DeviceOps&, ShmemOps&) {
  throw Error(ErrorCode::kUnsupported, "placeholder");
}
}  // namespace freescale

// The factory seam of cpp/device_transports.h: the CUDA transports over the real device ops.
// Plain C++: in a build without CUDA (or NVSHMEM) the real ops refuse with kUnsupported.
#include "cpp/device_transports.h"

#include "cpp/errors.h"
#include "cuda/ce_transport.h"
#include "cuda/device_ops.h"
#include "cuda/nvshmem_transport.h"

namespace freescale {

bool device_transport_built(TransportKind kind) {
  switch (kind) {
#ifdef FREESCALE_WITH_CUDA
    case TransportKind::kCe:
      return true;
#endif
#ifdef FREESCALE_WITH_NVSHMEM
    case TransportKind::kNvshmem:
      return true;
#endif
    default:
      return false;
  }
}

std::unique_ptr<Transport> make_device_transport(TransportKind kind, Bootstrap& bootstrap, const Config& config) {
  if (!device_transport_built(kind)) {
    throw Error(ErrorCode::kUnsupported, std::string("the ") + transport_kind_name(kind) + " transport is not in this build");
  }
  if (kind == TransportKind::kCe) return make_ce_transport(bootstrap, config, cuda_device_ops());
  // The NVSHMEM library exits the process without a GPU: look for one first.
  DeviceOps& ops = cuda_device_ops();
  if (ops.device_count() == 0) {
    throw Error(ErrorCode::kUnsupported, "the nvshmem transport needs a CUDA GPU and driver; none is visible here");
  }
  return make_nvshmem_transport(bootstrap, config, ops, nvshmem_ops());
}

int cuda_device_count() {
#ifdef FREESCALE_WITH_CUDA
  return cuda_device_ops().device_count();
#else
  return 0;
#endif
}

std::string nvshmem_library_path() { return nvshmem_ops().library(); }

}  // namespace freescale

// The CUDA transports as cpp/ sees them: one factory seam (implemented in cuda/), so the
// communicator, build info and bindings never include cuda/ headers.
#pragma once

#include <memory>
#include <string>

#include "cpp/bootstrap.h"
#include "cpp/config.h"
#include "cpp/transport.h"
#include "cpp/transport_select.h"

namespace freescale {

// Whether this build can construct the transport `kind` (kCe / kNvshmem) on a real device.
bool device_transport_built(TransportKind kind);
// Collective over `bootstrap`: the ce or nvshmem transport on the real device (config.cuda_device).
// Throws Error(kUnsupported) when this build lacks it or no GPU is visible.
std::unique_ptr<Transport> make_device_transport(TransportKind kind, Bootstrap& bootstrap, const Config& config);

// CUDA devices visible to this process; 0 without CUDA support, a driver or a GPU. Never throws.
int cuda_device_count();
// The NVSHMEM host library this process loads (dlopen at first use, no GPU needed): its path.
// Throws Error(kUnsupported) naming what was tried and the fix.
std::string nvshmem_library_path();

}  // namespace freescale

// NVSHMEM transport: CUDA tensors of ranks on any node, moved by host-initiated on-stream puts
// (no kernels: copy engines to NVLink peers, the NVSHMEM proxy to network peers). Plain C++
// interface: callers never include CUDA or NVSHMEM headers.
#pragma once

#include <memory>
#include <string>

#include "cpp/bootstrap.h"
#include "cpp/config.h"
#include "cpp/transport.h"

namespace freescale {

// Collective over `bootstrap`; config.cuda_device is this rank's GPU. NVSHMEM serves one
// communicator per process (it is initialized once, over that communicator's ranks). Throws
// kUnsupported without a GPU, without libnvshmem_host or for a second communicator, kSystem
// when NVSHMEM fails to start (on every rank alike).
std::unique_ptr<Transport> make_nvshmem_transport(Bootstrap& bootstrap, const Config& config);

// The NVSHMEM host library this process loads (dlopen at first use, no GPU needed): its path.
// Throws Error(kUnsupported) naming what was tried and the fix when it cannot be loaded.
std::string nvshmem_library_path();

}  // namespace freescale

// Copy-engine transport: CUDA tensors of ranks on one node (several processes may share a GPU).
// Plain C++ interface: callers never include CUDA headers.
#pragma once

#include <memory>

#include "cpp/bootstrap.h"
#include "cpp/config.h"
#include "cpp/transport.h"

namespace freescale {

// Collective over `bootstrap`; config.cuda_device is this rank's GPU. Throws kUnsupported when
// there is no GPU / driver, kSystem on a CUDA failure during setup (on every rank).
std::unique_ptr<Transport> make_ce_transport(Bootstrap& bootstrap, const Config& config);

}  // namespace freescale

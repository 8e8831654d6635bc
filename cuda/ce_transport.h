// Copy-engine transport: CUDA tensors of ranks on one node (several processes may share a GPU).
// Plain C++ interface over the DeviceOps seam: it runs on a real GPU or the emulated device.
#pragma once

#include <memory>

#include "cpp/bootstrap.h"
#include "cpp/config.h"
#include "cpp/transport.h"
#include "cuda/device_ops.h"

namespace freescale {

// Collective over `bootstrap`; config.cuda_device is this rank's device. Throws kUnsupported
// when `ops` sees no device, kSystem on a device failure during setup (on every rank). `ops`
// must outlive the transport.
std::unique_ptr<Transport> make_ce_transport(Bootstrap& bootstrap, const Config& config, DeviceOps& ops);

}  // namespace freescale

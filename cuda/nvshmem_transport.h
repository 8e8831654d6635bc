// NVSHMEM transport: CUDA tensors of ranks on any node, moved by host-initiated on-stream puts
// and signals, driven by the host (no device-side waits). No SM kernels to P2P-mapped peers
// (copy engines, stream memory writes); NVSHMEM's proxy posts each put and signal to a peer
// without P2P from a one-thread kernel (Transport::data_path() says which, at setup). Plain C++
// interface over the DeviceOps / ShmemOps seam: it runs on a real GPU or the emulated device.
#pragma once

#include <memory>

#include "cpp/bootstrap.h"
#include "cpp/config.h"
#include "cpp/transport.h"
#include "cuda/device_ops.h"

namespace freescale {

// Collective over `bootstrap`; config.cuda_device is this rank's device. NVSHMEM serves one
// communicator per process (it is initialized once, over that communicator's ranks). Throws
// kUnsupported (on every rank alike) without a device, for a second communicator, or when
// NVSHMEM starts in a mode whose on-stream calls would exit the process; kSystem when it fails to
// start. `ops` and `shmem` must outlive the transport.
std::unique_ptr<Transport> make_nvshmem_transport(Bootstrap& bootstrap, const Config& config, DeviceOps& ops,
                                                  ShmemOps& shmem);

}  // namespace freescale

// GoogleTest helpers for the CUDA transports on the emulated device: each forked rank owns an
// emulated device (its "GPU context") and a Communicator over the transport under test.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "cpp/communicator.h"
#include "cuda/ce_transport.h"
#include "cuda/emulated_device.h"
#include "cuda/nvshmem_transport.h"

namespace freescale::testing {

// A Communicator whose transport is the ce transport on `device` (device 0 of each rank).
inline std::unique_ptr<Communicator> ce_communicator(Bootstrap& bootstrap, Config config, EmulatedDevice& device) {
  config.cuda_device = 0;
  return std::make_unique<Communicator>(bootstrap, config, [&device](Bootstrap& b, const Config& c) {
    return make_ce_transport(b, c, device);
  });
}

// A Communicator whose transport is the nvshmem transport on `device` and `shmem`.
inline std::unique_ptr<Communicator> nvshmem_communicator(Bootstrap& bootstrap, Config config, EmulatedDevice& device,
                                                          EmulatedShmem& shmem) {
  config.cuda_device = 0;
  return std::make_unique<Communicator>(bootstrap, config, [&device, &shmem](Bootstrap& b, const Config& c) {
    return make_nvshmem_transport(b, c, device, shmem);
  });
}

// True once `stream` ran everything queued on it, within `limit` (false: still blocked).
inline bool drains_within(EmulatedDevice& device, Stream stream, std::chrono::milliseconds limit) {
  auto until = std::chrono::steady_clock::now() + limit;
  while (!device.stream_idle(stream)) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace freescale::testing

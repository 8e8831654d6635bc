// GoogleTest helpers for the CUDA transports on the emulated device: each forked rank owns an
// emulated device (its "GPU context") and a Communicator over the transport under test.
#pragma once

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cpp/communicator.h"
#include "cuda/ce_transport.h"
#include "cuda/emulated_device.h"
#include "cuda/nvshmem_transport.h"
#include "cpp_tests/exchange.h"

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

// How failed_output_left_alone fails rank 0's op.
enum class FailBy { kClose, kPeerKilled };

// The device options of a two-rank failure test: rank 0's device is slow, so the transport's
// copies into its output stay queued while rank 1 keeps sending.
inline EmulatedDeviceOptions slow_on_rank_0(int rank, size_t queue_depth = 64) {
  return EmulatedDeviceOptions{1, queue_depth, rank == 0 ? std::chrono::microseconds(20000) : std::chrono::microseconds(0)};
}

// Rank 1 sends rank 0 8 MiB (nothing else moves).
inline std::vector<std::vector<uint64_t>> one_way_counts() { return {{0, 0}, {8 << 20, 0}}; }

// Two ranks, `x` from one_way_counts(): rank 0's op fails by `how` (its close() while the op is
// pending, or rank 1's SIGKILL) while copies into its output are queued on its slow device. A
// failed op's buffers are the caller's again once it reports the failure (Python drops them then,
// and the allocator reuses them): nothing the transport queued may write them afterwards, up to
// and through its destruction. Returns "" if so (rank 1: "", or it dies).
inline std::string failed_output_left_alone(int rank, Bootstrap& bootstrap, std::unique_ptr<Communicator> comm,
                                            Exchange& x, FailBy how) {
  auto op = comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, false);
  if (rank == 1) {
    if (how == FailBy::kPeerKilled) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      raise(SIGKILL);
    }
    bootstrap.allgather("");  // rank 0 closed and checked
    return "";
  }
  if (how == FailBy::kClose) {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));  // rank 1 keeps our rings full meanwhile
    comm->close();
  } else {
    try {
      comm->wait(op, std::chrono::microseconds(-1));
    } catch (const CommError&) {
    }
  }
  if (!op->failed()) return "the op did not fail";
  const std::vector<uint8_t> seen = x.recv;
  comm.reset();  // ends every piece of device work the transport queued
  std::string result;
  if (seen == std::vector<uint8_t>(seen.size(), 0xEE)) result = "nothing had landed when the op failed: this proves nothing";
  if (x.recv != seen) result = "device work queued before the failure wrote the output after the op reported it";
  if (how == FailBy::kClose) bootstrap.allgather("");
  return result;
}

}  // namespace freescale::testing

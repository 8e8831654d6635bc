// GoogleTest helpers for the CUDA transports on the emulated device: each forked rank owns an
// emulated device (its "GPU context") and a Communicator over the transport under test.
#pragma once

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cpp/communicator.h"
#include "cuda/ce_transport.h"
#include "testing/emulated_device.h"
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

// `ops` random AllToAllv ops (up to `max_bytes` per pair, priorities -5..20, submitted on one of
// 4 user streams with a stream wait after some, waited on the host in another order), each
// checked in its done callback, at the moment it completes: an op must never complete before
// every byte of it landed (a completion flag or event that fires early), and no op's bytes may
// land in another's output. Returns the first problem, or "".
inline std::string every_op_complete_when_it_completes(int rank, int world, Communicator& comm, EmulatedDevice& device,
                                                       int ops, uint64_t max_bytes, uint32_t seed) {
  std::mt19937 rng(seed);  // the same on every rank: the same ops in the same order
  std::vector<Stream> streams;
  for (int i = 0; i < 4; ++i) streams.push_back(device.create_stream());
  std::vector<std::unique_ptr<Exchange>> xs;
  std::vector<std::shared_ptr<OpState>> pending;
  std::mutex mu;
  std::string problem;
  for (int i = 0; i < ops; ++i) {
    xs.push_back(std::make_unique<Exchange>(random_counts(world, max_bytes, seed * 1000 + i), rank, i));
    Exchange* x = xs.back().get();
    Stream s = streams[rng() % streams.size()];
    int priority = static_cast<int>(rng() % 26) - 5;
    auto op = comm.all_to_all(x->send.data(), x->recv.data(), x->layout, priority, false, s);
    op->add_done_callback([&mu, &problem, x, rank, op = op.get()] {
      std::string e = op->failed() ? "op " + std::to_string(op->seq) + " failed" : x->check(rank);
      std::lock_guard<std::mutex> lock(mu);
      if (problem.empty() && !e.empty()) problem = "at completion: " + e;
    });
    if (rng() % 3 == 0) comm.stream_wait(op, s);  // as Work.wait() on CUDA: later ops queue behind it
    pending.push_back(op);
    if (pending.size() > 24 || rng() % 8 == 0) {  // wait on a random earlier op, as a training loop would
      size_t k = rng() % pending.size();
      comm.wait(pending[k], std::chrono::microseconds(-1));
      pending.erase(pending.begin() + static_cast<long>(k));
    }
  }
  for (auto& op : pending) comm.wait(op, std::chrono::microseconds(-1));
  for (Stream s : streams)
    if (!drains_within(device, s, std::chrono::seconds(30))) return "a user stream never drained";
  std::lock_guard<std::mutex> lock(mu);
  return problem;
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

// Every FREESCALE_* environment knob, read in exactly one place (Config::from_env).
#pragma once

#include <cstdint>
#include <string>

namespace freescale {

struct Config {
  // FREESCALE_CHUNK_BYTES: a transfer is cut into chunks of at most this many bytes; a
  // higher-priority transfer submitted later starts within one chunk. Default 256 KiB.
  uint64_t chunk_bytes = 256ull << 10;
  // FREESCALE_ARENA_BYTES: shared-memory staging per rank (all its outgoing rings together);
  // larger ops stream through it with flow control. Default 4 MiB (small enough to stay in
  // cache), at least 2 chunks per peer.
  uint64_t arena_bytes = 4ull << 20;
  static constexpr uint64_t kMaxArenaBytes = 64ull << 30;  // validate() refuses more
  // FREESCALE_TIMEOUT_S: an op not complete after this long fails with CommError on every rank.
  // 0 = not set in the environment: the caller (the group's timeout) decides. Milliseconds.
  uint64_t timeout_ms = 0;
  // FREESCALE_AGING_US: a waiting transfer gains one priority level per this many microseconds,
  // so nothing starves. Default 5000 (5 ms per level).
  uint64_t aging_us = 5000;
  // FREESCALE_TRANSPORT: auto | host | ce | nvshmem.
  std::string transport = "auto";
  // Not from the environment: the CUDA device whose tensors this communicator moves; -1 = CPU
  // tensors. Set by the Python layer (torch's current device).
  int cuda_device = -1;

  // Reads the environment; a malformed value throws InvalidArgument naming the variable.
  static Config from_env();
  // Throws InvalidArgument naming the field when a value is out of range.
  void validate() const;
};

}  // namespace freescale

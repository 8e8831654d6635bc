// GoogleTest helpers shared by the transport tests: AllToAllv buffers with a checkable byte
// pattern, and outcome checks.
#pragma once

#include <gtest/gtest.h>

#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cpp/config.h"
#include "cpp/errors.h"
#include "cpp/layout.h"
#include "cpp_tests/fork_ranks.h"

namespace freescale::testing {

// Byte i of what `src` sends `dst` in the op tagged `salt`: a hash, so a chunk landing in the
// wrong place, from the wrong op or the wrong peer never matches by accident (no short period).
inline uint8_t pattern(int src, int dst, uint64_t i, uint64_t salt = 0) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(src) * 0x632BE59BD9B4E019ull +
               static_cast<uint64_t>(dst) * 0x85EBCA77C2B2AE63ull + salt * 0xC2B2AE3D27D4EB4Full;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x >> 24);
}

inline Config small_config(uint64_t timeout_ms = 20000) {
  Config c;
  c.chunk_bytes = 64 * 1024;
  c.arena_bytes = 512 * 1024;
  c.timeout_ms = timeout_ms;
  return c;
}

// Random counts[src][dst] in [0, max_bytes] (a quarter of them 0), the same on every rank (seeded).
inline std::vector<std::vector<uint64_t>> random_counts(int world, uint64_t max_bytes, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<uint64_t>> counts(world, std::vector<uint64_t>(world));
  for (auto& row : counts)
    for (auto& c : row) c = rng() % 4 == 0 ? 0 : rng() % (max_bytes + 1);
  return counts;
}

inline std::vector<std::vector<uint64_t>> uniform_counts(int world, uint64_t bytes) {
  return std::vector<std::vector<uint64_t>>(world, std::vector<uint64_t>(world, bytes));
}

// counts[src][dst] bytes; fills the send buffer and checks what arrived.
struct Exchange {
  AllToAllLayout layout;
  std::vector<uint8_t> send, recv;
  uint64_t salt = 0;

  Exchange(const std::vector<std::vector<uint64_t>>& counts, int rank, uint64_t salt_ = 0) : salt(salt_) {
    int world = static_cast<int>(counts.size());
    std::vector<uint64_t> s(world), r(world);
    for (int p = 0; p < world; ++p) {
      s[p] = counts[rank][p];
      r[p] = counts[p][rank];
    }
    layout = AllToAllLayout::packed(s, r);
    send.resize(layout.total_send());
    recv.assign(layout.total_recv(), 0xEE);
    for (int p = 0; p < world; ++p)
      for (uint64_t i = 0; i < s[p]; ++i) send[layout.send_offsets[p] + i] = pattern(rank, p, i, salt);
  }
  // "k of n bytes wrong, u never written" for what came from `src`: tells a missed landing from
  // a misplaced one.
  std::string wrong_bytes(size_t src, int rank) const {
    uint64_t wrong = 0, unwritten = 0, n = layout.recv_bytes[src];
    for (uint64_t i = 0; i < n; ++i) {
      uint8_t b = recv[layout.recv_offsets[src] + i];
      if (b == pattern(static_cast<int>(src), rank, i, salt)) continue;
      ++wrong;
      unwritten += b == 0xEE;
    }
    return std::to_string(wrong) + " of " + std::to_string(n) + " bytes wrong, " + std::to_string(unwritten) +
           " never written";
  }
  std::string check(int rank) const {
    for (size_t p = 0; p < layout.recv_bytes.size(); ++p)
      for (uint64_t i = 0; i < layout.recv_bytes[p]; ++i)
        if (recv[layout.recv_offsets[p] + i] != pattern(static_cast<int>(p), rank, i, salt))
          return "op tagged " + std::to_string(salt) + ": wrong byte " + std::to_string(i) + " from rank " + std::to_string(p) +
                 " (" + wrong_bytes(p, rank) + ")";
    return "";
  }
};

inline void expect_all_ok(const std::vector<RankOutcome>& outcomes) {
  for (size_t r = 0; r < outcomes.size(); ++r) {
    EXPECT_FALSE(outcomes[r].timed_out) << "rank " << r << " hung";
    EXPECT_EQ(outcomes[r].signal, 0) << "rank " << r << " crashed";
    EXPECT_EQ(outcomes[r].exit_code, 0) << "rank " << r << ": " << outcomes[r].message;
  }
  EXPECT_TRUE(leftover_segments(outcomes).empty()) << "segments left in /dev/shm";
}

// Returns "" if `fn` throws CommError with `code` (any code if none is given), else a
// description of what happened.
template <typename Fn>
std::string expect_comm_error(Fn fn, std::optional<ErrorCode> code = std::nullopt) {
  try {
    fn();
  } catch (const CommError& e) {
    if (!code || e.code() == *code) return "";
    return std::string("CommError with the wrong code: ") + e.what();
  }
  return "no CommError";
}

}  // namespace freescale::testing

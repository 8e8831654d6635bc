// Timeouts as long as users give them (a group timeout of timedelta.max, FREESCALE_TIMEOUT_S=1e10)
// without overflowing a clock: anything from kForeverTimeout (100 years) on means "no timeout".
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>

namespace freescale {

inline constexpr std::chrono::microseconds kForeverTimeout = std::chrono::hours(24 * 365 * 100);

// `ms` milliseconds, capped at kForeverTimeout (a steady_clock deadline this far out cannot overflow).
inline std::chrono::microseconds capped_timeout_ms(uint64_t ms) {
  constexpr uint64_t kForeverMs = static_cast<uint64_t>(kForeverTimeout.count() / 1000);
  return ms >= kForeverMs ? kForeverTimeout : std::chrono::microseconds(static_cast<int64_t>(ms) * 1000);
}

// Seconds (finite, >= 0) as microseconds; -1 (no timeout) from kForeverTimeout on.
inline std::chrono::microseconds timeout_from_seconds(double seconds) {
  constexpr double kForeverSeconds = static_cast<double>(kForeverTimeout.count()) / 1e6;
  if (seconds >= kForeverSeconds) return std::chrono::microseconds(-1);
  return std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
}

// Milliseconds for a config from seconds (finite, > 0), rounded up, capped at kForeverTimeout.
inline uint64_t timeout_ms_from_seconds(double seconds) {
  constexpr double kForeverSeconds = static_cast<double>(kForeverTimeout.count()) / 1e6;
  if (seconds >= kForeverSeconds) return static_cast<uint64_t>(kForeverTimeout.count() / 1000);
  return static_cast<uint64_t>(std::ceil(seconds * 1000.0));
}

}  // namespace freescale

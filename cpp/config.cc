#include "cpp/config.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "cpp/errors.h"
#include "cpp/timeouts.h"

namespace freescale {
namespace {

// Parses a non-negative integer (optionally with a K/M/G binary suffix) from `name`.
bool read_u64(const char* name, uint64_t* out, bool allow_suffix) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') return false;
  errno = 0;
  char* end = nullptr;
  unsigned long long value = std::strtoull(raw, &end, 10);
  uint64_t scale = 1;
  if (allow_suffix && end != nullptr && *end != '\0' && end[1] == '\0') {
    switch (*end) {
      case 'K': case 'k': scale = 1ull << 10; ++end; break;
      case 'M': case 'm': scale = 1ull << 20; ++end; break;
      case 'G': case 'g': scale = 1ull << 30; ++end; break;
      default: break;
    }
  }
  // strtoull skips leading blanks and negates a '-': " -1" would read as 2^64 - 1.
  if (errno != 0 || end == raw || *end != '\0' || !std::isdigit(static_cast<unsigned char>(raw[0]))) {
    throw InvalidArgument(std::string(name) + "='" + raw + "' is not a non-negative integer" +
                          (allow_suffix ? " (a K, M or G suffix is allowed)" : "") +
                          "; fix or unset it");
  }
  if (value > std::numeric_limits<uint64_t>::max() / scale) {
    throw InvalidArgument(std::string(name) + "='" + raw + "' does not fit in 64 bits; fix or unset it");
  }
  *out = static_cast<uint64_t>(value) * scale;
  return true;
}

}  // namespace

Config Config::from_env() {
  Config c;
  read_u64("FREESCALE_CHUNK_BYTES", &c.chunk_bytes, true);
  read_u64("FREESCALE_ARENA_BYTES", &c.arena_bytes, true);
  read_u64("FREESCALE_AGING_US", &c.aging_us, false);
  if (const char* raw = std::getenv("FREESCALE_TIMEOUT_S"); raw != nullptr && *raw != '\0') {
    char* end = nullptr;
    double seconds = std::strtod(raw, &end);
    // digits first, as the size knobs (strtod alone takes blanks, signs and hex)
    const bool plain = std::isdigit(static_cast<unsigned char>(raw[0])) &&
                       std::strpbrk(raw, "xXpP") == nullptr;
    if (!plain || end == raw || *end != '\0' || !std::isfinite(seconds) || seconds <= 0) {
      throw InvalidArgument(std::string("FREESCALE_TIMEOUT_S='") + raw +
                            "' must be a positive number of seconds; fix or unset it");
    }
    c.timeout_ms = timeout_ms_from_seconds(seconds);
  }
  if (const char* raw = std::getenv("FREESCALE_TRANSPORT"); raw != nullptr && *raw != '\0') {
    c.transport = raw;
  }
  c.validate();
  return c;
}

void Config::validate() const {
  if (chunk_bytes < 4096 || chunk_bytes > (1ull << 30)) {
    throw InvalidArgument("chunk_bytes (FREESCALE_CHUNK_BYTES) = " + std::to_string(chunk_bytes) +
                          " must be between 4 KiB and 1 GiB");
  }
  if (arena_bytes > kMaxArenaBytes) {
    throw InvalidArgument("arena_bytes (FREESCALE_ARENA_BYTES) = " + std::to_string(arena_bytes) +
                          " is above the 64 GiB a rank may stage; use a smaller value (the default is 4 MiB)");
  }
  if (arena_bytes < 2 * chunk_bytes) {
    throw InvalidArgument("arena_bytes (FREESCALE_ARENA_BYTES) = " + std::to_string(arena_bytes) +
                          " must hold at least two chunks (2 x FREESCALE_CHUNK_BYTES = " +
                          std::to_string(2 * chunk_bytes) + ")");
  }
  if (aging_us == 0) {
    throw InvalidArgument("aging_us (FREESCALE_AGING_US) must be > 0 microseconds per priority level");
  }
  if (transport != "auto" && transport != "host" && transport != "ce" && transport != "nvshmem") {
    throw InvalidArgument("transport (FREESCALE_TRANSPORT) = '" + transport +
                          "' must be one of auto, host, ce, nvshmem");
  }
}

}  // namespace freescale

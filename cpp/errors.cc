#include "cpp/errors.h"

#include <cstring>

namespace freescale {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case ErrorCode::kInvalidUsage: return "INVALID_USAGE";
    case ErrorCode::kCommError: return "COMM_ERROR";
    case ErrorCode::kTimeout: return "TIMEOUT";
    case ErrorCode::kPeerDied: return "PEER_DIED";
    case ErrorCode::kPeerAborted: return "PEER_ABORTED";
    case ErrorCode::kSizeMismatch: return "SIZE_MISMATCH";
    case ErrorCode::kSystem: return "SYSTEM";
    case ErrorCode::kUnsupported: return "UNSUPPORTED";
    case ErrorCode::kInternal: return "INTERNAL";
  }
  return "UNKNOWN";
}

Error::Error(ErrorCode code, const std::string& message, int culprit)
    : std::runtime_error("[" + std::string(error_code_name(code)) + "] " + message),
      code_(code),
      message_(message),
      culprit_(culprit) {}

SystemError::SystemError(const std::string& what, int err)
    : Error(ErrorCode::kSystem, what + " failed: " + std::strerror(err) + " (errno " + std::to_string(err) + ")") {}

bool is_comm_code(ErrorCode code) {
  switch (code) {
    case ErrorCode::kCommError:
    case ErrorCode::kTimeout:
    case ErrorCode::kPeerDied:
    case ErrorCode::kPeerAborted:
    case ErrorCode::kSizeMismatch:
    case ErrorCode::kSystem:
      return true;
    default:
      return false;
  }
}

}  // namespace freescale

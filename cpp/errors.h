// One exception hierarchy for the whole core. Every error carries an ErrorCode; the bindings
// map codes to Python classes (InvalidArgument -> ValueError, the Comm* codes -> fc.CommError).
#pragma once

#include <stdexcept>
#include <string>

namespace freescale {

enum class ErrorCode : int {
  kInvalidArgument = 1,  // bad argument detected locally, before any communication
  kInvalidUsage = 2,     // API misuse: call on a closed communicator, wrong order, ...
  kCommError = 3,        // generic collective failure
  kTimeout = 4,          // an operation did not complete within the timeout
  kPeerDied = 5,         // a peer process exited or was killed
  kPeerAborted = 6,      // a peer hit an error and aborted the communicator
  kSizeMismatch = 7,     // sender and receiver disagree on a byte count
  kSystem = 8,           // an OS call failed (errno in the message)
  kUnsupported = 9,      // the requested transport / layout cannot serve this group
  kInternal = 10,        // a broken invariant: a bug in freescale_comm
};

const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  // culprit: the rank at the root of the failure (which died, disagreed, ...), -1 if unknown.
  Error(ErrorCode code, const std::string& message, int culprit = -1);
  ErrorCode code() const { return code_; }
  int culprit() const { return culprit_; }
  // The message without the "[CODE] " prefix that what() carries.
  const std::string& message() const { return message_; }

 private:
  ErrorCode code_;
  std::string message_;
  int culprit_;
};

// Bad arguments: raised before any communication.
class InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& message) : Error(ErrorCode::kInvalidArgument, message) {}
};

// Collective failures: peer died, mismatch between ranks, timeout. Raised on every survivor.
class CommError : public Error {
 public:
  CommError(ErrorCode code, const std::string& message, int culprit = -1) : Error(code, message, culprit) {}
};

// An OS call failed; `what` names the call, errno is appended.
class SystemError : public Error {
 public:
  SystemError(const std::string& what, int err);
};

// True for the codes that mean "the collective failed" (mapped to fc.CommError).
bool is_comm_code(ErrorCode code);

// The end of a kSizeMismatch message: what the user gave that disagrees across ranks.
inline constexpr const char* kSizesDisagree =
    "the ranks' sizes for this pair disagree (all_to_all_single: its split sizes; all_to_all: its list's tensors)";

}  // namespace freescale

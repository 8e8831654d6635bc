// What a rank raises when a peer aborted: the root cause, the same on every survivor.
#pragma once

#include <functional>
#include <string>

#include "cpp/errors.h"

namespace freescale {

// On rank `me`: rank `aborter` failed with `code` because of rank `culprit` (-1: unknown). A
// death stays PEER_DIED naming the dead rank (whoever saw it first); anything else is
// PEER_ABORTED naming the aborter, its code and the culprit. `pid_of(rank)`: for the message.
[[noreturn]] inline void throw_peer_abort(int aborter, ErrorCode code, int culprit, int me,
                                          const std::function<int(int)>& pid_of) {
  if (code == ErrorCode::kPeerDied && culprit >= 0) {
    throw CommError(ErrorCode::kPeerDied, "rank " + std::to_string(culprit) + " (pid " + std::to_string(pid_of(culprit)) +
                                              ") died while an op that needs it was pending (rank " +
                                              std::to_string(aborter) + " saw it first)",
                    culprit);
  }
  std::string because = culprit >= 0 ? ", caused by rank " + std::to_string(culprit) : "";
  throw CommError(ErrorCode::kPeerAborted, "rank " + std::to_string(aborter) + " aborted the communicator (" +
                                               error_code_name(code) + because + "), so rank " + std::to_string(me) +
                                               " fails too",
                  culprit >= 0 ? culprit : aborter);
}

}  // namespace freescale

// The root cause of a collective failure, chosen from what a survivor sees of its peers, so that
// every survivor names the first cause (the rank that died, or the rank that disagreed) whatever
// the timing: also when the rank that saw it first wrote its notice and exited at once.
//
// Why a dead peer's notice is always visible: a rank writes its abort notice before its error
// reaches its caller (Communicator::fail_all), so before it can exit. A survivor therefore reads
// liveness first and notices second: a peer seen dead has its notice, if it left one, in view.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "cpp/errors.h"

namespace freescale {

// What this rank sees of one peer (its own entry is ignored).
struct PeerSight {
  bool died = false;     // its process is gone (ranks this rank can watch: same host)
  bool closed = false;   // it closed its communicator cleanly
  bool aborted = false;  // it left an abort notice: `code`, because of `culprit` (-1 unknown)
  bool left = false;     // aborted, then closed its communicator: it waits on no collective any more
  ErrorCode code = ErrorCode::kCommError;
  int culprit = -1;
  std::string why;       // aborted: its own message, where the transport carries it (else empty)
  bool needed = false;   // a pending op of this rank needs it
};

struct RootCause {
  enum class Kind { kNone, kNotice, kDeath, kClosed };
  Kind kind = Kind::kNone;
  int rank = -1;     // kNotice: the aborter whose notice names the cause; kDeath / kClosed: that rank
  ErrorCode code = ErrorCode::kCommError;  // kNotice: the notice's code
  int culprit = -1;  // kNotice: the notice's culprit
  int witness = -1;  // kDeath: the rank whose notice reported the death (-1: seen here)
  std::string why;   // kNotice: the aborter's own message (empty if not carried)
};

// The first cause among `peers` ([world], seen by rank `me`); kNone if nothing is wrong yet.
// - A notice is followed to where it points: a PEER_DIED or PEER_ABORTED notice names a culprit;
//   if that culprit left a notice of its own, its notice is the cause (a chain, cycle-safe); if
//   it died without one, its death is. So a rank that saw a mismatch and exited is named for
//   the mismatch, not for its exit, and a rank that saw a death and exited names that death.
// - A peer that closed is a cause when an op needs it, also once it exited (closing is its
//   notice); a peer that died without a notice (killed, crashed) is a cause when an op needs it
//   or when any notice exists.
// - Among several causes, the most telling wins, then the lowest rank: a disagreement or death
//   over a timeout (often its symptom), over a notice that could not be followed, over a close.
RootCause find_root_cause(const std::vector<PeerSight>& peers, int me);

// Throws the CommError that names `cause` on rank `me` (PEER_DIED naming a death, PEER_ABORTED
// naming the aborter, its code and culprit, COMM_ERROR naming a close). `pid_of(rank)`: for the
// message, -1 if unknown. Does nothing for kNone.
void throw_root_cause(const RootCause& cause, int me, const std::function<int(int)>& pid_of);

}  // namespace freescale

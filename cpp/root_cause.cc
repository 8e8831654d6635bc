#include "cpp/root_cause.h"

#include <algorithm>
#include <tuple>

namespace freescale {
namespace {

using Kind = RootCause::Kind;

bool in_world(int r, const std::vector<PeerSight>& peers) { return r >= 0 && r < static_cast<int>(peers.size()); }

// Where p's notice leads: along PEER_DIED / PEER_ABORTED culprits that left notices of their
// own, to the notice at the end, or to the death of a culprit that left none.
RootCause follow_notice(const std::vector<PeerSight>& peers, int p, int me) {
  std::vector<bool> seen(peers.size(), false);
  while (true) {
    seen[p] = true;
    const PeerSight& s = peers[p];
    const int c = s.culprit;
    const bool points = (s.code == ErrorCode::kPeerDied || s.code == ErrorCode::kPeerAborted) && in_world(c, peers) &&
                        c != p && c != me;
    if (points && peers[c].aborted && !seen[c]) {
      p = c;
      continue;
    }
    if (points && !peers[c].aborted && (s.code == ErrorCode::kPeerDied || peers[c].died)) {
      return RootCause{Kind::kDeath, c, ErrorCode::kPeerDied, c, p, {}};
    }
    return RootCause{Kind::kNotice, p, s.code, c, -1, s.why};
  }
}

// Lower is more telling: a disagreement or a death; a timeout (often a death's symptom); a
// notice that names no cause we can see; a clean close.
int weight(const RootCause& r) {
  if (r.kind == Kind::kClosed) return 3;
  if (r.kind == Kind::kDeath) return 0;
  if (r.code == ErrorCode::kPeerAborted || r.code == ErrorCode::kPeerDied) return 2;
  return r.code == ErrorCode::kTimeout ? 1 : 0;
}

[[noreturn]] void throw_peer_abort(int aborter, ErrorCode code, int culprit, int me, const std::string& why) {
  std::string because = culprit >= 0 ? ", caused by rank " + std::to_string(culprit) : "";
  std::string said = why.empty() ? "" : "; rank " + std::to_string(aborter) + " said: " + why;
  throw CommError(ErrorCode::kPeerAborted, "rank " + std::to_string(aborter) + " aborted the communicator (" +
                                               error_code_name(code) + because + "), so rank " + std::to_string(me) +
                                               " fails too" + said,
                  // a TIMEOUT naming no one: the aborter only waited (for several ranks), not a cause
                  culprit >= 0 ? culprit : code == ErrorCode::kTimeout ? -1 : aborter);
}

}  // namespace

RootCause find_root_cause(const std::vector<PeerSight>& peers, int me) {
  const int world = static_cast<int>(peers.size());
  bool any_notice = false;
  for (int p = 0; p < world; ++p) any_notice |= p != me && peers[p].aborted;
  std::vector<RootCause> causes;
  for (int p = 0; p < world; ++p) {
    const PeerSight& s = peers[p];
    if (p == me) continue;
    if (s.aborted) {
      causes.push_back(follow_notice(peers, p, me));
    } else if (s.closed) {  // its notice that it left, which wins over its later exit
      if (s.needed) causes.push_back(RootCause{Kind::kClosed, p, ErrorCode::kCommError, p, -1, {}});
    } else if (s.died && (s.needed || any_notice)) {
      causes.push_back(RootCause{Kind::kDeath, p, ErrorCode::kPeerDied, p, -1, {}});
    }
  }
  if (causes.empty()) return RootCause{};
  // The same order on every survivor that sees the same: weight, then the rank it names.
  return *std::min_element(causes.begin(), causes.end(), [](const RootCause& a, const RootCause& b) {
    return std::make_tuple(weight(a), a.rank) < std::make_tuple(weight(b), b.rank);
  });
}

void throw_root_cause(const RootCause& cause, int me, const std::function<int(int)>& pid_of) {
  if (cause.kind == Kind::kNone) return;  // (cause.rank is -1: no pid to look up)
  const std::string who = "rank " + std::to_string(cause.rank) + " (pid " + std::to_string(pid_of(cause.rank)) + ")";
  switch (cause.kind) {
    case Kind::kNone:
      return;
    case Kind::kDeath: {
      std::string seen = cause.witness >= 0 ? " (rank " + std::to_string(cause.witness) + " saw it first)" : "";
      throw CommError(ErrorCode::kPeerDied, who + " died while an op that needs it was pending" + seen, cause.rank);
    }
    case Kind::kClosed:
      throw CommError(ErrorCode::kCommError, who + " closed its communicator while an op that needs it was pending",
                      cause.rank);
    case Kind::kNotice:
      throw_peer_abort(cause.rank, cause.code, cause.culprit, me, cause.why);
  }
}

}  // namespace freescale

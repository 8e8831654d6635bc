// One pending send: the bytes one op sends to one peer.
#pragma once

#include <cstdint>
#include <memory>

#include "cpp/op_state.h"

namespace freescale {

struct Transfer {
  std::shared_ptr<OpState> op;  // the op this send belongs to
  int peer = 0;                 // destination rank
  uint64_t bytes = 0;           // bytes of the whole block (0 still sends one empty chunk)
  uint64_t sent = 0;            // bytes handed to the transport so far
  int priority = 0;             // larger = sooner (the scheduler's business, not the transport's)
  uint64_t order = 0;           // submission order: FIFO among equal effective priorities
  Clock::time_point submitted;  // aging starts here
};

}  // namespace freescale

// The CUDA transports' event pool (SubmitGate), on the emulated device.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>

#include "cpp/errors.h"
#include "testing/emulated_device.h"
#include "cuda/submit_gate.h"

namespace freescale {
namespace {

// An event in the pool twice goes to two users at once: the later record of one completes the
// other's wait early. The ce transport gave its send fences back twice (event_done already had),
// and an op could complete before its copies landed (1 run in ~10 of the back-to-back test).
TEST(SubmitGate, AnEventGivenBackTwiceIsRefusedRatherThanHandedToTwoUsers) {
  EmulatedDevice device;
  SubmitGate gate(device, 0);
  Event ev = gate.take_event();
  gate.give_event(ev);
  try {
    gate.give_event(ev);
    FAIL() << "the second give was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInternal);
  }
  Event a = gate.take_event(), b = gate.take_event();
  EXPECT_NE(a, b) << "one event handed out twice";
  gate.give_event(a);
  gate.give_event(b);
}

TEST(SubmitGate, AnEventIsBackInThePoolOnceItIsSeenDoneAndNotBefore) {
  EmulatedDevice device;
  SubmitGate gate(device, 0);
  Stream s = device.create_stream();
  // Both events made before the wait: creation may block while a wait runs (as on a GPU).
  Event ev = gate.take_event(), spare = gate.take_event();
  gate.give_event(spare);
  std::atomic<uint64_t> hold{0};
  device.wait_value64(s, reinterpret_cast<DevicePtr>(&hold), 1, WaitCmp::kGeq);
  device.record_event(ev, s);
  EXPECT_FALSE(gate.event_done(ev, "test"));
  Event next = gate.take_event();
  EXPECT_NE(next, ev) << "a pending event was in the pool";
  gate.give_event(next);
  hold.store(1);
  device.synchronize(s);
  EXPECT_TRUE(gate.event_done(ev, "test"));
  EXPECT_EQ(gate.take_event(), ev);
}

// reserve() made its events one by one; one failing left the ones before it made and owned by
// nobody (a leak on the ce transport's setup path).
TEST(SubmitGate, AReservationThatRunsOutOfEventsDestroysTheOnesItMade) {
  EmulatedDeviceOptions options;
  options.max_events = 3;  // the fourth cudaEventCreate fails
  EmulatedDevice device(options);
  {
    SubmitGate gate(device, 0);
    EXPECT_THROW(gate.reserve(8), Error);
    EXPECT_EQ(device.live_events(), 0u);
  }
  EXPECT_EQ(device.live_events(), 0u);
}

}  // namespace
}  // namespace freescale

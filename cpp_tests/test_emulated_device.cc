// The emulated device keeps the CUDA semantics the transports' logic depends on.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "cpp/errors.h"
#include "cuda/emulated_device.h"

namespace freescale {
namespace {

using namespace std::chrono_literals;

TEST(EmulatedDevice, StreamRunsInOrderAndAsynchronously) {
  EmulatedDevice device;
  Stream s = device.create_stream();
  std::atomic<uint64_t> gate{0};
  std::vector<int> order;
  device.wait_value64(s, reinterpret_cast<DevicePtr>(&gate), 1, WaitCmp::kGeq);
  for (int i = 0; i < 5; ++i) device.enqueue(s, [&order, i] { order.push_back(i); });
  std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(order.empty()) << "work ran before the wait ahead of it was satisfied";
  EXPECT_FALSE(device.stream_idle(s));
  gate.store(1);
  device.synchronize(s);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
}

TEST(EmulatedDevice, FullQueueBlocksTheEnqueuerAndAWaitBlocksOnlyItsStream) {
  EmulatedDevice device(EmulatedDeviceOptions{1, 2});
  Stream blocked = device.create_stream(), free = device.create_stream();
  std::atomic<uint32_t> gate{0};
  device.wait_value32(blocked, reinterpret_cast<DevicePtr>(&gate), 3, WaitCmp::kEq);
  while (device.queued(blocked) != 0) std::this_thread::yield();  // the wait runs (and blocks)
  device.enqueue(blocked, [] {});
  device.enqueue(blocked, [] {});  // the queue (depth 2) is full now
  std::atomic<bool> third_enqueued{false};
  std::thread t([&] {
    device.enqueue(blocked, [] {});
    third_enqueued.store(true);
  });
  std::atomic<uint64_t> word{0};
  device.write_value64(free, reinterpret_cast<DevicePtr>(&word), 7);
  device.synchronize(free);  // the other stream is not held up
  EXPECT_EQ(word.load(), 7u);
  std::this_thread::sleep_for(5ms);
  EXPECT_FALSE(third_enqueued.load()) << "enqueue on a full queue must block";
  gate.store(1);
  std::this_thread::sleep_for(2ms);
  EXPECT_FALSE(third_enqueued.load()) << "EQ 3 is not satisfied by 1";
  gate.store(3);
  t.join();
  device.synchronize(blocked);
}

TEST(EmulatedDevice, EventsCompleteWhenTheStreamReachesThemAndCarryFailures) {
  EmulatedDevice device;
  Stream s = device.create_stream();
  Event never_recorded = device.create_event(), ev = device.create_event();
  EXPECT_TRUE(device.event_done(never_recorded, "x"));
  std::atomic<uint64_t> gate{0};
  device.wait_value64(s, reinterpret_cast<DevicePtr>(&gate), 0x4, WaitCmp::kAnd);
  device.record_event(ev, s);
  std::this_thread::sleep_for(2ms);
  EXPECT_FALSE(device.event_done(ev, "x"));
  gate.store(0x6);
  device.synchronize(s);
  EXPECT_TRUE(device.event_done(ev, "x"));
  device.fail_next_task(s, "injected");
  device.enqueue(s, [] {});
  device.record_event(ev, s);
  EXPECT_THROW(device.synchronize(s), Error);
  EXPECT_THROW(device.event_done(ev, "after the failure"), Error);  // sticky, like a CUDA error
}

TEST(EmulatedDevice, IpcHandlesOpenInAForkedPeerAndCopiesReallyCopy) {
  EmulatedDevice device;
  auto* arena = static_cast<uint8_t*>(device.device_alloc(1 << 16));
  std::string handle = device.ipc_handle(arena);
  pid_t child = fork();
  if (child == 0) {
    int code = 1;
    {
      EmulatedDevice peer;
      auto* mapped = static_cast<uint8_t*>(peer.ipc_open(handle));
      std::vector<uint8_t> src(1 << 16);
      for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7);
      Stream s = peer.create_stream();
      CopyBatch batch;
      batch.add(mapped, src.data(), src.size());
      peer.copy_batch(s, batch);
      peer.synchronize(s);
      peer.ipc_close(mapped);
      code = 0;
    }
    _exit(code);
  }
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (size_t i = 0; i < (1u << 16); ++i) ASSERT_EQ(arena[i], static_cast<uint8_t>(i * 7)) << i;
  device.device_free(arena);
  EXPECT_EQ(device.live_allocations(), 0u);
}

TEST(EmulatedDevice, TeardownEndsWaitsThatCanNeverBeSatisfied) {
  auto device = std::make_unique<EmulatedDevice>();
  Stream s = device->create_stream();
  std::atomic<uint64_t> never{0};
  device->wait_value64(s, reinterpret_cast<DevicePtr>(&never), 1, WaitCmp::kGeq);
  device.reset();  // joins the stream thread: returns instead of hanging
  SUCCEED();
}

}  // namespace
}  // namespace freescale

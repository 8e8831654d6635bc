// The copy-engine transport on the emulated device, across forked ranks: its host logic (flow
// control, ordering, stream gating, failure paths) runs here; drivers and bandwidth do not.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "cpp/communicator.h"
#include "cpp_tests/device_ranks.h"
#include "cpp_tests/exchange.h"
#include "cpp_tests/fork_ranks.h"

namespace freescale {
namespace {

using namespace std::chrono_literals;
using testing::ce_communicator;
using testing::drains_within;
using testing::Exchange;
using testing::random_counts;
using testing::uniform_counts;
using testing::expect_all_ok;
using testing::expect_comm_error;
using testing::FailBy;
using testing::run_forked_ranks;
using testing::small_config;
constexpr std::chrono::microseconds kForever{-1};

// Random counts[src][dst] in [0, max_bytes], the same on every rank (seeded).
class CeEmulated : public ::testing::TestWithParam<int> {};

TEST_P(CeEmulated, RandomSplitsFromZeroTo256MiBMatchTheReference) {
  const int world = GetParam();
  auto outcomes = run_forked_ranks(world, [world](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device;
    Stream user = device.create_stream();
    auto comm = ce_communicator(bootstrap, small_config(), device);
    // Empty, tiny, chunk-straddling and large random layouts, then 256 MiB in all.
    std::vector<uint64_t> maxima = {0, 1, 1000, 64 * 1024 + 3, 3 << 20};
    for (size_t i = 0; i < maxima.size(); ++i) {
      Exchange x(random_counts(world, maxima[i], 17 + static_cast<uint32_t>(i)), rank, i);
      auto op = comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, true, user);
      comm->wait(op, kForever);
      if (std::string e = x.check(rank); !e.empty()) return "layout " + std::to_string(i) + ": " + e;
    }
    const uint64_t per_pair = (256ull << 20) / (static_cast<uint64_t>(world) * world);
    Exchange big(uniform_counts(world, per_pair), rank, 99);
    comm->wait(comm->all_to_all(big.send.data(), big.recv.data(), big.layout, 0, true, user), kForever);
    if (std::string e = big.check(rank); !e.empty()) return "256 MiB: " + e;
    comm->close();
    return "";
  });
  expect_all_ok(outcomes);
}

INSTANTIATE_TEST_SUITE_P(Worlds, CeEmulated, ::testing::Values(2, 3, 4));

// A soak: an op that completed before its bytes landed (as when an event served two users) or
// took another op's bytes fails here, checked at the moment each op completes.
TEST_P(CeEmulated, EveryOpHasAllItsBytesWhenItCompletes) {
  const int world = GetParam();
  auto outcomes = run_forked_ranks(world, [world](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device(EmulatedDeviceOptions{1, 8});
    auto comm = ce_communicator(bootstrap, small_config(), device);
    return testing::every_op_complete_when_it_completes(rank, world, *comm, device, 300, 200 * 1024, 7);
  });
  expect_all_ok(outcomes);
}

// Review defect 1: the host rings had 65 536 slots (sized for headers) over a 16-slot device arena,
// so a sender overwrote slots the receiver had not copied out: wrong bytes above ~4 MiB per peer.
TEST(CeEmulatedFlowControl, DefaultConfigMoves64MiBPerPeerWithoutOverwritingUnreadSlots) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device;
    Config config;  // the defaults: 256 KiB chunks, 4 MiB arena
    config.timeout_ms = 60000;
    auto comm = ce_communicator(bootstrap, config, device);
    Exchange x(uniform_counts(2, 64ull << 20), rank, 5);
    comm->wait(comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, true), kForever);
    return x.check(rank);
  });
  expect_all_ok(outcomes);
}

// Who executes the ce transport's copies, counted (issue 37 item 1): each chunk into the sender's
// own arena slot and the block a rank sends itself are copies within a device, SM kernels before
// driver 13.1 (or without the batch API); copies from a peer's arena run on copy engines; and
// data_path() says so (it said "no SM kernels" whatever the driver).
TEST(CeEmulatedDataPath, CountsTheCopiesThatTakeSmsAndSaysWhichAndWhy) {
  struct Case {
    int driver;
    bool batch_api;
    const char* path;
  };
  for (Case c : {Case{13000, true, "ce (driver 13.0): SM kernels for copies within a device"},
                 Case{13010, true, "ce (driver 13.1): no SM kernels"},
                 Case{13010, false, "ce (driver 13.1): SM kernels for copies within a device"}}) {
    auto outcomes = run_forked_ranks(2, [c](int rank, Bootstrap& bootstrap) -> std::string {
      EmulatedDeviceOptions options;
      options.driver_version = c.driver;
      options.batch_api = c.batch_api;
      EmulatedDevice device(options);
      auto comm = ce_communicator(bootstrap, small_config(), device);
      Exchange x(uniform_counts(2, 1 << 20), rank, 3);
      comm->wait(comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, false), kForever);
      if (std::string e = x.check(rank); !e.empty()) return e;
      const CopyCounts counts = device.copy_counts();
      const std::string path = comm->data_path();
      comm->close();
      const bool sm = c.driver < 13010 || !c.batch_api;
      if (path.rfind(c.path, 0) != 0) return "expected \"" + std::string(c.path) + "...\", got: " + path;
      if (path.find("Work.wait() returns to the CPU once this rank's last copy of the op is enqueued") == std::string::npos)
        return "the data path does not say what the CPU waits for: " + path;
      if (counts.ce_copies == 0) return "no copy-engine copy counted (the copies from the peer's arena)";
      if (sm && counts.sm_copies == 0) return "no SM copy counted for the copies within the device";
      if (!sm && counts.sm_copies != 0) return std::to_string(counts.sm_copies) + " SM copies on a 13.1 driver";
      return "";
    });
    expect_all_ok(outcomes);
  }
}

TEST(CeEmulatedPriority, LaterUrgentOpCompletesBeforeABulkOneInProgress) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device;
    auto comm = ce_communicator(bootstrap, small_config(), device);
    Exchange bulk(uniform_counts(2, 64ull << 20), rank, 1), urgent(uniform_counts(2, 4096), rank, 2);
    std::mutex mu;
    std::vector<std::string> order;
    auto a = comm->all_to_all(bulk.send.data(), bulk.recv.data(), bulk.layout, 0);
    a->add_done_callback([&] { std::lock_guard<std::mutex> l(mu); order.push_back("bulk"); });
    auto b = comm->all_to_all(urgent.send.data(), urgent.recv.data(), urgent.layout, 100);
    b->add_done_callback([&] { std::lock_guard<std::mutex> l(mu); order.push_back("urgent"); });
    comm->wait(a, kForever);
    comm->wait(b, kForever);
    if (order != std::vector<std::string>{"urgent", "bulk"}) return "the urgent op did not overtake the bulk one";
    std::string e = bulk.check(rank);
    return e.empty() ? urgent.check(rank) : e;
  });
  expect_all_ok(outcomes);
}

TEST(CeEmulatedStreams, BackToBackSynchronousOpsOnOneStreamDoNotDeadlock) {
  auto outcomes = run_forked_ranks(3, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device;
    Stream user = device.create_stream();
    auto comm = ce_communicator(bootstrap, small_config(), device);
    std::vector<std::unique_ptr<Exchange>> xs;
    std::vector<std::shared_ptr<OpState>> ops;
    for (int i = 0; i < 4; ++i) {
      xs.push_back(std::make_unique<Exchange>(uniform_counts(3, 4ull << 20), rank, 10 + i));
      // Like Work.wait() on CUDA: the user's stream waits for op i before op i + 1 is submitted.
      ops.push_back(comm->all_to_all(xs.back()->send.data(), xs.back()->recv.data(), xs.back()->layout, 0, false, user));
      comm->stream_wait(ops.back(), user);
    }
    if (!drains_within(device, user, 30s)) return "the user's stream never drained";
    for (auto& x : xs)
      if (std::string e = x->check(rank); !e.empty()) return e;
    // This rank's device work is done, not the ops: closing now would fail peers still waiting
    // for our receipts (a drained stream never implied completion on the host).
    for (auto& op : ops) comm->wait(op, kForever);
    return "";
  });
  expect_all_ok(outcomes);
}

// GPU review (2026-11-27): a user's thread that posts an op or drives a wait runs transport work;
// it kept our device and a relaxed capture mode for good after, and a DeviceGuard restored "device
// 0" to a thread that had no context with cudaSetDevice(0), which makes GPU 0's primary context
// (~500 MB there, in every rank on another GPU). Now the thread's own context and mode come back.
std::unique_ptr<Communicator> ce_on_device(Bootstrap& bootstrap, int cuda_device, EmulatedDevice& device) {
  Config config = small_config();
  config.cuda_device = cuda_device;
  return std::make_unique<Communicator>(bootstrap, config, [&device](Bootstrap& b, const Config& c) {
    return make_ce_transport(b, c, device);
  });
}

TEST(CeEmulatedThreads, AThreadWithNoContextIsLeftWithNoneAndNoContextIsMadeOnGpu0) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDeviceOptions options;
    options.devices = 2;
    EmulatedDevice device(options);
    device.set_current_context(nullptr);  // a thread that never touched a GPU (fork kept the parent's)
    auto comm = ce_on_device(bootstrap, 1, device);
    Exchange x(uniform_counts(2, 1 << 20), rank);
    comm->wait(comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, true), kForever);
    if (std::string e = x.check(rank); !e.empty()) return e;
    if (device.current_context() != nullptr) return "the caller's thread was left with a context";
    if (device.made_context(0)) return "a primary context was made on GPU 0";
    return device.made_context(1) ? "" : "no context on the communicator's GPU";
  });
  expect_all_ok(outcomes);
}

// The driver's cuMemGetAddressRange acts in the calling thread's current context (cuda.h lists
// CUDA_ERROR_INVALID_CONTEXT): the emulator refuses it on a thread with none, and registering a
// buffer from such a thread (a user's fresh thread) still works, because the transport's scope
// makes its device's context current first.
TEST(CeEmulatedThreads, RegisteringFromAThreadWithNoContextRunsInTheCommunicatorsContext) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDeviceOptions options;
    options.devices = 2;
    EmulatedDevice device(options);
    auto comm = ce_on_device(bootstrap, 1, device);
    Exchange x(uniform_counts(2, 1 << 20), rank);
    device.set_device(1);
    auto* recv = static_cast<uint8_t*>(device.device_alloc(x.recv.size()));
    device.set_current_context(nullptr);  // a thread that never touched a GPU
    size_t bytes = 0;
    try {
      device.allocation_base(recv, &bytes);
      return "the emulator looked an address up with no current context";
    } catch (const Error& e) {
      if (std::string(e.what()).find("CUDA_ERROR_INVALID_CONTEXT") == std::string::npos) return e.what();
    }
    comm->register_buffer(recv, x.recv.size());
    if (device.current_context() != nullptr) return "the caller's thread was left with a context";
    bootstrap.allgather("");
    comm->wait(comm->all_to_all(x.send.data(), recv, x.layout, 0, true), kForever);
    std::memcpy(x.recv.data(), recv, x.recv.size());
    return x.check(rank);
  });
  expect_all_ok(outcomes);
}

TEST(CeEmulatedThreads, ACallersDeviceAndCaptureModeComeBackAfterItsOpsAndWaits) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDeviceOptions options;
    options.devices = 2;
    EmulatedDevice device(options);
    device.set_device(0);  // the user's own GPU; the communicator's is 1
    auto comm = ce_on_device(bootstrap, 1, device);
    for (int i = 0; i < 3; ++i) {
      Exchange x(uniform_counts(2, 256 << 10), rank, i);
      comm->wait(comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, true), kForever);
      if (std::string e = x.check(rank); !e.empty()) return e;
      if (device.current_device() != 0) return "the caller's device became " + std::to_string(device.current_device());
      const int mode = device.relax_capture_mode();
      device.restore_capture_mode(mode);
      if (mode != 0) return "the caller's capture mode stayed relaxed";
    }
    return "";
  });
  expect_all_ok(outcomes);
}

// Issue 29 item 2: Work.wait() on CUDA put a wait for a host-set completion flag on the user's
// stream before the progress thread had queued the op's copies on the comm stream. On one
// hardware queue (shared by both streams, as streams share a GPU's connections) that wait sat
// ahead of the copies it depended on, and nothing moved again. Now the user's stream waits on an
// event recorded after the op's last copy, once that copy is enqueued.
TEST(CeEmulatedStreams, AUsersStreamWaitOnOneHardwareQueueWithTheCommStreamDoesNotDeadlock) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device(EmulatedDeviceOptions{1, 64, {}, /*hardware_queues=*/1});
    Stream user = device.create_stream();
    auto comm = ce_communicator(bootstrap, small_config(), device);
    std::vector<std::unique_ptr<Exchange>> xs;
    std::vector<std::shared_ptr<OpState>> ops;
    std::atomic<uint64_t> after{0};
    for (int i = 0; i < 3; ++i) {
      xs.push_back(std::make_unique<Exchange>(uniform_counts(2, 1 << 20), rank, 40 + i));
      auto op = comm->all_to_all(xs.back()->send.data(), xs.back()->recv.data(), xs.back()->layout, 0, false, user);
      ops.push_back(op);
      if (!comm->stream_wait(op, user, std::chrono::microseconds(30000000))) return "stream_wait timed out";
      // More work on the user's stream, behind its wait: it runs once op i's bytes landed.
      device.write_value64(user, reinterpret_cast<DevicePtr>(&after), i + 1);
    }
    if (!drains_within(device, user, 30s)) return "the user's stream never drained (a wait stalled its queue)";
    if (after.load() != 3) return "work after the waits did not run";
    for (auto& x : xs)
      if (std::string e = x->check(rank); !e.empty()) return e;
    // The device work of this rank is done, not the op: peers may still need our receipts.
    for (auto& op : ops) comm->wait(op, kForever);
    return "";
  }, std::chrono::seconds(60));
  expect_all_ok(outcomes);
}

// A user's stream that waited for an op is ordered after every byte of it: work queued behind the
// wait sees the output complete (checked on the device, in stream order).
TEST(CeEmulatedStreams, WorkQueuedAfterAStreamWaitSeesTheWholeOutput) {
  auto outcomes = run_forked_ranks(3, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device(EmulatedDeviceOptions{1, 64, std::chrono::microseconds(200), /*hardware_queues=*/1});
    Stream user = device.create_stream();
    auto comm = ce_communicator(bootstrap, small_config(), device);
    std::string seen;
    std::vector<std::unique_ptr<Exchange>> xs;
    std::vector<std::shared_ptr<OpState>> ops;
    for (int i = 0; i < 4; ++i) {
      xs.push_back(std::make_unique<Exchange>(random_counts(3, 300 * 1024, 70 + i), rank, 70 + i));
      Exchange* x = xs.back().get();
      auto op = comm->all_to_all(x->send.data(), x->recv.data(), x->layout, 0, false, user);
      ops.push_back(op);
      comm->stream_wait(op, user);
      device.enqueue(user, [x, rank, &seen] {  // a "kernel" reading the output
        if (std::string e = x->check(rank); !e.empty() && seen.empty()) seen = "on the user's stream: " + e;
      });
    }
    if (!drains_within(device, user, 30s)) return "the user's stream never drained";
    for (auto& op : ops) comm->wait(op, kForever);  // before closing: peers may still need our receipts
    return seen;
  }, std::chrono::seconds(60));
  expect_all_ok(outcomes);
}

// Review defect 7: all_to_all recorded the submission event under the communicator's lock; with
// the user's stream queue full (behind a wait for the previous op), the record blocked, the
// progress thread blocked on that lock, and the previous op never completed.
TEST(CeEmulatedStreams, SubmittingOnAFullStreamQueueDoesNotStallProgress) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device(EmulatedDeviceOptions{1, 4});
    Stream user = device.create_stream();
    auto comm = ce_communicator(bootstrap, small_config(), device);
    Exchange a(uniform_counts(2, 1 << 20), rank, 1), b(uniform_counts(2, 1 << 20), rank, 2);
    auto first = comm->all_to_all(a.send.data(), a.recv.data(), a.layout, 0, false, user);
    comm->stream_wait(first, user);
    while (device.queued(user) != 0) std::this_thread::yield();  // the wait runs
    for (int i = 0; i < 4; ++i) device.enqueue(user, [] {});  // queue full behind it
    auto second = comm->all_to_all(b.send.data(), b.recv.data(), b.layout, 0, false, user);
    comm->wait(second, kForever);
    std::string e = a.check(rank);
    return e.empty() ? b.check(rank) : e;
  });
  expect_all_ok(outcomes);
}

TEST(CeEmulatedStreams, HundredsOfOpsInFlightWithAFourDeepStreamQueue) {
  auto outcomes = run_forked_ranks(3, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device(EmulatedDeviceOptions{1, 4});
    Stream user = device.create_stream();
    auto comm = ce_communicator(bootstrap, small_config(), device);
    std::vector<std::unique_ptr<Exchange>> xs;
    std::vector<std::shared_ptr<OpState>> ops;
    for (int i = 0; i < 200; ++i) {  // > the 64-op window: later ops wait for admission
      xs.push_back(std::make_unique<Exchange>(random_counts(3, 200 * 1024, 100 + i), rank, i));
      ops.push_back(comm->all_to_all(xs.back()->send.data(), xs.back()->recv.data(), xs.back()->layout, i % 7, false, user));
    }
    for (auto& op : ops) comm->stream_wait(op, user);
    for (auto& op : ops) comm->wait(op, kForever);
    if (!drains_within(device, user, 30s)) return "the user's stream never drained";
    for (auto& x : xs)
      if (std::string e = x->check(rank); !e.empty()) return e;
    return "";
  });
  expect_all_ok(outcomes);
}

TEST(CeEmulatedStreams, SixtyFourUserStreams) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device(EmulatedDeviceOptions{1, 8});
    std::vector<Stream> streams;
    for (int i = 0; i < 64; ++i) streams.push_back(device.create_stream());
    auto comm = ce_communicator(bootstrap, small_config(), device);
    std::vector<std::unique_ptr<Exchange>> xs;
    std::vector<std::shared_ptr<OpState>> ops;
    for (int i = 0; i < 128; ++i) {
      Stream s = streams[static_cast<size_t>(i) % streams.size()];
      xs.push_back(std::make_unique<Exchange>(random_counts(2, 100 * 1024, 300 + i), rank, i));
      ops.push_back(comm->all_to_all(xs.back()->send.data(), xs.back()->recv.data(), xs.back()->layout, 0, false, s));
      comm->stream_wait(ops.back(), s);
    }
    for (Stream s : streams)
      if (!drains_within(device, s, 30s)) return "a user stream never drained";
    for (auto& x : xs)
      if (std::string e = x->check(rank); !e.empty()) return e;
    for (auto& op : ops) comm->wait(op, kForever);  // before closing: peers may still need our receipts
    comm.reset();
    if (device.live_streams() != streams.size()) return "the transport left streams behind";
    return "";
  });
  expect_all_ok(outcomes);
}

// Issue 41 item 1: legacy IPC memory (cudaIpcGetMemHandle) goes away for every importer when
// its owner frees it: a rank that closed freed its arena while a slow peer still drained what it
// had sent, and that peer's copies faulted its whole CUDA context (an MMU fault, on the emulated
// device too). Arenas are now shareable memory (cuMem, POSIX handles): the peer's copies read
// pages that live until it releases them, and its context stays healthy whatever the op's fate.
TEST(CeEmulatedFailures, ARankThatClosesAndFreesItsArenaNeverFaultsAPeerStillCopyingFromIt) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDeviceOptions d;
    d.hardware_queues = 1;  // rank 1: a user's kernel ahead of its lanes holds their copies
    EmulatedDevice device(d);
    std::atomic<bool> gate{false};
    if (rank == 1) {
      Stream user = device.create_stream();
      device.enqueue(user, [&] {  // a long kernel (not a stream wait)
        while (!gate.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
      });
    }
    auto x = std::make_unique<Exchange>(uniform_counts(2, 4 * small_config().chunk_bytes), rank);
    auto comm = ce_communicator(bootstrap, small_config(), device);
    auto op = comm->all_to_all(x->send.data(), x->recv.data(), x->layout, 0, false);
    if (rank == 0) {
      std::this_thread::sleep_for(50ms);  // our chunks are in our arena, rank 1's copies of them queued
      comm.reset();                        // closes, and frees the arena
      bootstrap.allgather("freed");
      bootstrap.allgather("");
      return "";
    }
    bootstrap.allgather("");  // rank 0 freed its arena: now rank 1's copies from it run
    gate.store(true);
    try {
      comm->wait(op, std::chrono::seconds(20));
    } catch (const CommError&) {  // rank 0 left with the op pending: a failure is fine, a fault is not
    }
    comm.reset();
    bootstrap.allgather("");
    if (!device.fault().empty()) return "rank 1's context faulted: " + device.fault();
    return "";
  });
  expect_all_ok(outcomes);
}

TEST(CeEmulatedFailures, SplitMismatchByBytesWithEqualChunkCountsFailsEveryRank) {
  auto outcomes = run_forked_ranks(3, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device;
    auto counts = uniform_counts(3, 1000);
    if (rank == 1) counts[1][0] = 800;  // sends 800 bytes to rank 0, which expects 1000: one chunk either way
    Exchange x(counts, rank);  // outlives the transport's queued device work
    auto comm = ce_communicator(bootstrap, small_config(), device);
    return expect_comm_error([&] { comm->wait(comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, true), kForever); });
  });
  expect_all_ok(outcomes);
}

TEST(CeEmulatedFailures, KilledRankFailsEverySurvivorWithPeerDied) {
  auto outcomes = run_forked_ranks(3, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device;
    Exchange x(uniform_counts(3, 8 << 20), rank);  // outlives the transport's queued device work
    auto comm = ce_communicator(bootstrap, small_config(), device);
    if (rank == 2) raise(SIGKILL);
    auto op = comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, true);
    // Every survivor names the root cause, whoever saw it first (issue 22 item 11).
    try {
      comm->wait(op, kForever);
    } catch (const CommError& e) {
      bool named = e.code() == ErrorCode::kPeerDied && std::string(e.what()).find("rank 2 ") != std::string::npos;
      return named ? "" : std::string("wrong root cause: ") + e.what();
    }
    return "no CommError";
  });
  EXPECT_EQ(outcomes[2].signal, SIGKILL);
  for (int r : {0, 1}) EXPECT_EQ(outcomes[r].exit_code, 0) << "rank " << r << ": " << outcomes[r].message;
  EXPECT_TRUE(testing::leftover_segments(outcomes).empty());
}

// Issue 29 item 1c: an asynchronous fault anywhere on a GPU (here: a user's kernel on another
// stream) poisons the context, the transport's comm stream included. Every pending op fails with
// CommError on every rank (the faulted rank names the device error, peers its abort), promptly,
// and nothing hangs: not the faulted rank's teardown, not a user's stream that waited for an op.
TEST(CeEmulatedFailures, AContextWideFaultFailsEveryPendingOpOnEveryRank) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    // Declared before the device, so destroyed after it: the device joins its stream threads, and
    // a copy already running when the context faulted may still write into these (nothing can
    // wait for it on a faulted context; TSan saw the buffers freed under such a copy).
    std::vector<std::unique_ptr<Exchange>> xs;
    EmulatedDevice device;
    Stream user = device.create_stream(), kernels = device.create_stream();
    auto comm = ce_communicator(bootstrap, small_config(/*timeout_ms=*/60000), device);
    std::vector<std::shared_ptr<OpState>> ops;
    auto submit = [&] {
      for (int i = 0; i < 6; ++i) {
        xs.push_back(std::make_unique<Exchange>(uniform_counts(2, 2 << 20), rank, 90 + i));
        ops.push_back(comm->all_to_all(xs.back()->send.data(), xs.back()->recv.data(), xs.back()->layout, 0, false, user));
      }
    };
    auto start = std::chrono::steady_clock::now();
    if (rank == 0) {
      submit();  // pending: rank 1 has not posted them (rank 0 may have sent ahead into its ring)
      device.fail_next_task(kernels, "an illegal memory access");
      device.enqueue(kernels, [] {});
      bootstrap.allgather("");  // rank 1 submits only after the fault
      for (auto& op : ops) {
        std::string why = expect_comm_error([&] { comm->wait(op, kForever); });
        if (!why.empty()) return "rank 0: " + why;
        try {
          op->rethrow_if_failed();
        } catch (const CommError& e) {
          if (std::string(e.what()).find("illegal memory access") == std::string::npos) return "the fault is not named: " + std::string(e.what());
        }
      }
    } else {
      bootstrap.allgather("");
      try {
        submit();
      } catch (const CommError& e) {  // rank 0's abort may already be known
        if (e.code() != ErrorCode::kPeerAborted) return "rank 1 at submission: " + std::string(e.what());
      }
      for (auto& op : ops) {
        std::string why = expect_comm_error([&] { comm->wait(op, kForever); }, ErrorCode::kPeerAborted);
        if (!why.empty()) return "rank 1: " + why;
      }
    }
    if (std::chrono::steady_clock::now() - start > 20s) return "the failure took more than 20 s";
    comm.reset();  // teardown on a faulted device returns
    return "";
  }, std::chrono::seconds(60));
  expect_all_ok(outcomes);
  EXPECT_TRUE(testing::leftover_segments(outcomes).empty());
}

// Issue 29 item 1d: the ce transport wrote 64-bit counters with stream memory operations without
// asking whether the GPU supports them; where it does not, the first op failed with a system
// error and broke the communicator. Now setup refuses on every rank (kUnsupported: the backend
// falls back to NCCL), naming the attribute and the rank, even when only one GPU lacks it.
TEST(CeEmulatedSetup, AGpuWithoutA64BitStreamMemOpsRefusesOnEveryRankNamingTheAttribute) {
  // (Issue 41 item 1: and without memory that outlives its owner for peers, cuMem with POSIX handles.)
  for (DeviceAttribute missing : {DeviceAttribute::kCanUse64BitStreamMemOps, DeviceAttribute::kHostRegisterSupported,
                                  DeviceAttribute::kVirtualMemoryManagement, DeviceAttribute::kPosixFdHandles}) {
    auto outcomes = run_forked_ranks(2, [missing](int rank, Bootstrap& bootstrap) -> std::string {
      EmulatedDeviceOptions options;
      if (rank == 1) options.unsupported = {missing};
      EmulatedDevice device(options);
      try {
        auto comm = ce_communicator(bootstrap, small_config(), device);
        return "setup succeeded";
      } catch (const Error& e) {
        const std::string what = e.what();
        if (e.code() != ErrorCode::kUnsupported) return "not a refusal: " + what;
        if (what.find(device_attribute_name(missing)) == std::string::npos) return "the attribute is not named: " + what;
        if (what.find("rank 1") == std::string::npos) return "the rank is not named: " + what;
      }
      // A peer's refusal came after this rank made its stream, arena and registrations: freed.
      if (device.live_streams() != 0 || device.live_allocations() != 0) return "a refused setup leaked device resources";
      return "";
    });
    expect_all_ok(outcomes);
  }
}

// Review defect 5: an op not yet admitted when the communicator closed (or failed) never moved
// its completion flag, so a stream waiting on it waited forever.
TEST(CeEmulatedFailures, CloseWithOpsPendingReleasesTheUsersStream) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device;
    Stream user = device.create_stream();
    std::vector<std::unique_ptr<Exchange>> xs;  // outlives the transport's queued device work
    auto comm = ce_communicator(bootstrap, small_config(), device);
    std::string result;
    if (rank == 0) {  // 70 ops the peer never matches: 64 admitted, 6 waiting for the window
      std::vector<std::shared_ptr<OpState>> ops;
      for (int i = 0; i < 70; ++i) {
        xs.push_back(std::make_unique<Exchange>(uniform_counts(2, 4096), rank, i));
        ops.push_back(comm->all_to_all(xs.back()->send.data(), xs.back()->recv.data(), xs.back()->layout, 0, false, user));
      }
      // stream_wait blocks the host until an op's copies are enqueued, which never happens
      // here: close() on another thread fails the ops, and the waits return (no device wait).
      std::thread closer([&] {
        std::this_thread::sleep_for(50ms);
        comm->close();
      });
      comm->stream_wait(ops[3], user);
      comm->stream_wait(ops[69], user);
      closer.join();
      for (auto& op : ops) {
        std::string why = expect_comm_error([&] { op->rethrow_if_failed(); }, ErrorCode::kCommError);
        if (!why.empty()) result = "op " + std::to_string(op->seq) + " was not failed by close(): " + why;
      }
      if (!drains_within(device, user, 10s)) result = "the user's stream still waits on ops that failed at close()";
      for (auto& op : ops)
        if (!op->failed()) result = "an op pending at close() did not fail";
    }
    bootstrap.allgather("");  // rank 1 closes only once rank 0 is done
    return result;
  });
  expect_all_ok(outcomes);
}

// A failed op's output is the caller's once the failure is reported. Before, copies already
// queued on the comm stream went on landing in it after close() or a peer's death failed the op.
TEST(CeEmulatedFailures, NothingWritesAFailedOpsOutputAfterItReportsTheFailure) {
  for (FailBy how : {FailBy::kClose, FailBy::kPeerKilled}) {
    auto outcomes = run_forked_ranks(2, [how](int rank, Bootstrap& bootstrap) -> std::string {
      EmulatedDevice device(testing::slow_on_rank_0(rank));
      Exchange x(testing::one_way_counts(), rank);
      return testing::failed_output_left_alone(rank, bootstrap, ce_communicator(bootstrap, small_config(), device), x, how);
    });
    EXPECT_TRUE(outcomes[0].exit_code == 0 && outcomes[0].signal == 0) << outcomes[0].message;
    if (how == FailBy::kClose) EXPECT_EQ(outcomes[1].exit_code, 0) << outcomes[1].message;
    EXPECT_TRUE(testing::leftover_segments(outcomes).empty());
  }
}

// A lane stuck behind work it cannot see end (a user's stream on the one hardware queue waits on a
// host word: design.md §4) cannot be cancelled: close() gives up on it after the timeout. Before,
// the failed op's output was called the caller's (its copies went on landing in it: in Python,
// in memory the caching allocator had handed out again), and the control segments were unmapped
// while still registered with CUDA (a new communicator on the device failed at setup:
// cudaErrorHostMemoryAlreadyRegistered). Now the communicator says the device work was
// abandoned, the op's error says its buffers must never be freed, and the segments stay mapped.
TEST(CeEmulatedFailures, AnAbandonedLaneIsSaidAndWhatItTouchesStaysMapped) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    // rank 1 sends rank 0 8 MiB; x outlives the device, whose abandoned copies write it until it goes
    Exchange x(testing::one_way_counts(), rank);
    EmulatedDeviceOptions options = testing::slow_on_rank_0(rank);
    options.hardware_queues = 1;
    EmulatedDevice device(options);
    Stream user = device.create_stream();
    auto comm = ce_communicator(bootstrap, small_config(/*timeout_ms=*/2000), device);
    auto op = comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, false);
    std::string result;
    static uint64_t flag = 0;  // the user's stream waits for this host word
    if (rank == 1) {
      try {
        comm->wait(op, std::chrono::microseconds(-1));
      } catch (const CommError&) {  // rank 0 closed
      }
    } else {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      // the first chunk lands first; read as the device writes it (atomically: it lands meanwhile)
      auto landed = [&] {
        return __atomic_load_n(reinterpret_cast<const uint64_t*>(x.recv.data()), __ATOMIC_ACQUIRE) != 0xEEEEEEEEEEEEEEEEull;
      };
      while (!landed() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (!landed()) return "setup: nothing landed";
      device.wait_value64(user, reinterpret_cast<DevicePtr>(&flag), 1, WaitCmp::kGeq);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // more landings queue behind it
      comm->close();
      if (!comm->device_work_abandoned()) result += "device_work_abandoned() is false; ";
      try {
        op->rethrow_if_failed();
        result += "the op did not fail; ";
      } catch (const CommError& e) {
        if (std::string(e.what()).find("must never be freed") == std::string::npos) result += "its error: " + std::string(e.what());
      }
    }
    __atomic_store_n(&flag, 1, __ATOMIC_RELEASE);  // the user's wait ends: the stuck copies run
    comm.reset();
    bootstrap.allgather("");
    try {
      auto again = ce_communicator(bootstrap, small_config(/*timeout_ms=*/5000), device);
      Exchange y(uniform_counts(2, 4096), rank);
      again->wait(again->all_to_all(y.send.data(), y.recv.data(), y.layout, 0, true), std::chrono::seconds(10));
      result += y.check(rank);
      if (again->device_work_abandoned()) result += "a new communicator says abandoned; ";
    } catch (const std::exception& e) {
      result += "a new communicator on the device failed: " + std::string(e.what());
    }
    return result;
  }, std::chrono::seconds(90));
  expect_all_ok(outcomes);
  EXPECT_TRUE(testing::leftover_segments(outcomes).empty());
}

}  // namespace
}  // namespace freescale

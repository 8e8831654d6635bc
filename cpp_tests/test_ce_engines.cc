// Issue 37: what the copy-engine transport asks of the device, counted on the emulated device
// (never timed): who executes its copies, how many driver calls an op takes, and how many bytes
// it keeps enqueued ahead of the engines (the window an urgent op waits behind).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
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
using testing::Exchange;
using testing::expect_all_ok;
using testing::run_forked_ranks;
using testing::uniform_counts;
constexpr std::chrono::microseconds kForever{-1};

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
// The same logic on fewer bytes (sanitizers copy slowly), and a window as much smaller.
constexpr uint64_t kPerPeer = 2ull << 20;
constexpr uint64_t kWindow = 512ull << 10, kChunk = 64ull << 10;
#else
constexpr uint64_t kPerPeer = 16ull << 20;  // the op: 4 ranks x 16 MiB per peer
constexpr uint64_t kWindow = 4ull << 20, kChunk = 256ull << 10;  // the product's defaults
#endif

Config default_config(uint64_t chunk_bytes = 256 << 10, uint64_t window_bytes = 4 << 20) {
  Config c;  // the product's defaults: 256 KiB chunks, a 4 MiB window (arena_bytes)
  c.chunk_bytes = chunk_bytes;
  c.arena_bytes = window_bytes;
  c.timeout_ms = 60000;
  return c;
}

// A compute kernel holds every SM for the whole op. From driver 13.1 (the overlap flag honored
// within a device) no copy of ours needs an SM: the op completes under the kernel. On 13.0 the
// copies into our own arena are SM kernels: the op cannot finish until the kernel ends.
TEST(CeEngines, AComputeKernelHoldingEverySmStallsOnlySmCopies) {
  for (int driver : {13010, 13000}) {
    auto outcomes = run_forked_ranks(4, [driver](int rank, Bootstrap& bootstrap) -> std::string {
      EmulatedDeviceOptions options;
      options.driver_version = driver;
      EmulatedDevice device(options);
      auto comm = ce_communicator(bootstrap, default_config(), device);
      Exchange x(uniform_counts(4, kPerPeer), rank, 5);
      device.occupy_every_sm(true);
      auto op = comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, false);
      std::string e;
      if (driver >= 13010) {
        if (!comm->wait(op, std::chrono::seconds(60))) e = "13.1: the op did not complete while a kernel held every SM";
        device.occupy_every_sm(false);
      } else {
        if (comm->wait(op, 300ms)) e = "13.0: the op completed although its SM copies could not start";
        device.occupy_every_sm(false);
        comm->wait(op, kForever);
      }
      if (e.empty()) e = x.check(rank);
      const CopyCounts counts = device.copy_counts();
      comm->close();
      if (!e.empty()) return e;
      if (driver >= 13010 && (counts.sm_copies != 0 || counts.sm_copies_delayed != 0))
        return std::to_string(counts.sm_copies) + " SM copies on a 13.1 driver";
      // (Which of them waited for the kernel depends on what else holds their hardware queue.)
      if (driver < 13010 && counts.sm_copies == 0) return "13.0: no SM copy counted";
      if (counts.ce_copies == 0) return "no copy-engine copy counted";
      return "";
    });
    expect_all_ok(outcomes);
  }
}

// Driver calls per op follow the windows and the peers, not the chunks: a progress round's copies
// go in one batch per lane, its counter updates in one write per ring, one event per lane. Before
// (one batch + one counter write + one event per chunk): 1030 calls per rank at 256 KiB chunks.
TEST(CeEngines, DriverCallsPerOpGrowWithWindowsNotChunks) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "counts, not memory or thread safety: the Release run has them";
#endif
  // Each rank's count, written by the forked ranks into memory shared with this process.
  void* shared = mmap(nullptr, 4 * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(shared, MAP_FAILED);
  auto* per_rank = static_cast<uint64_t*>(shared);
  std::vector<uint64_t> most;  // [chunk size] the largest count of any rank
  for (auto [chunk, window] : {std::pair{256ull << 10, 4ull << 20}, std::pair{64ull << 10, 4ull << 20},
                                std::pair{256ull << 10, 16ull << 20}}) {
    std::fill(per_rank, per_rank + 4, 0);
    auto outcomes = run_forked_ranks(4, [chunk = chunk, window = window, per_rank](int rank, Bootstrap& bootstrap) -> std::string {
      // Copies slower than a host round, as on a GPU at these sizes (engines busy, host ahead).
      EmulatedDeviceOptions options;
      options.op_latency = 200us;
      EmulatedDevice device(options);
      auto comm = ce_communicator(bootstrap, default_config(chunk, window), device);
      Exchange x(uniform_counts(4, kPerPeer), rank, 6);
      const DriverCalls before = device.driver_calls();
      comm->wait(comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, false), kForever);
      const DriverCalls after = device.driver_calls();
      std::string e = x.check(rank);
      comm->close();
      if (!e.empty()) return e;
      const size_t total = after.total() - before.total();
      const uint64_t chunks_moved = 2 * 3 * ((kPerPeer + chunk - 1) / chunk);  // sent + received, 3 peers
      if (rank == 0) {  // the figures for the issue note
        std::fprintf(stderr, "window %llu MiB, chunk %llu KiB, %llu chunks moved: %zu driver calls (%zu copy batches, %zu copies, "
                     "%zu value writes, %zu value waits, %zu event records, %zu event waits)\n",
                     static_cast<unsigned long long>(window >> 20), static_cast<unsigned long long>(chunk >> 10),
                     static_cast<unsigned long long>(chunks_moved),
                     total, after.copy_batches - before.copy_batches, after.copies - before.copies,
                     after.value_writes - before.value_writes, after.value_waits - before.value_waits,
                     after.event_records - before.event_records,
                     after.event_waits - before.event_waits);
      }
      per_rank[rank] = total;
      if (after.copies != before.copies) return "copies went one by one although the batch API is there";
      if (total * 2 > 5 * chunks_moved) {  // before: 2.7 per chunk moved at 256 KiB, 4102 calls at 64 KiB
        return std::to_string(total) + " driver calls for " + std::to_string(chunks_moved) + " chunks moved";
      }
      return "";
    });
    expect_all_ok(outcomes);
    most.push_back(*std::max_element(per_rank, per_rank + 4));
  }
  munmap(shared, 4 * sizeof(uint64_t));
  // A quarter of the chunk size: four times the chunks, and at most three times the calls (calls
  // per chunk would make it four; rounds vary with timing: 2.07x seen beside another test, ctest -j2).
  std::fprintf(stderr, "most calls of any rank: %llu at 256 KiB, %llu at 64 KiB, %llu at 256 KiB in a 16 MiB window\n",
               static_cast<unsigned long long>(most[0]), static_cast<unsigned long long>(most[1]),
               static_cast<unsigned long long>(most[2]));
  EXPECT_LE(most[1], most[0] * 3) << most[0] << " calls at 256 KiB chunks, " << most[1] << " at 64 KiB";
}

// The CPU runs ahead of the device: Work.wait() (a stream wait) returns once the op's copies on
// this rank are enqueued, which no longer needs any of them to have run. Here none can run: on a
// 13.0 driver the copies into our own arena are SM kernels and a compute kernel holds every SM,
// and the landings wait (on the device) for the peers' copies. Work queued on the caller's
// stream after the wait, a copy-engine copy of the output to the host that is not held, runs
// only after the op and sees the whole output. Before: the host waited to see each peer's chunk
// land before it enqueued its landing, so the stream wait never returned while copies were held.
TEST(CeEngines, WorkWaitReturnsWhileTheOpsCopiesAreHeldAndLaterWorkSeesTheWholeOutput) {
  auto outcomes = run_forked_ranks(4, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDeviceOptions options;
    options.driver_version = 13000;
    EmulatedDevice device(options);
    Stream user = device.create_stream();
    auto comm = ce_communicator(bootstrap, default_config(), device);
    Exchange x(uniform_counts(4, 256 << 10), rank, 7);  // 1 MiB per rank: within one window
    const size_t bytes = x.recv.size();
    DevicePtr unused = 0;
    auto* snapshot = static_cast<uint8_t*>(device.host_alloc_mapped(bytes, &unused));
    std::memset(snapshot, 0, bytes);
    device.occupy_every_sm(true);
    const size_t executed_before = device.copy_counts().executed_bytes;
    auto op = comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, false, user);
    std::string e;
    if (!comm->stream_wait(op, user, std::chrono::seconds(20))) {
      e = "the stream wait did not return while the op's copies were held";
    } else if (size_t ran = device.copy_counts().executed_bytes - executed_before; ran != 0) {
      e = std::to_string(ran) + " bytes of the op were copied before the CPU returned: nothing could run";
    } else {
      CopyBatch read_back;  // to the host: a copy engine, not held by the kernel
      read_back.add(snapshot, x.recv.data(), bytes);
      device.copy_batch(user, read_back);
      std::this_thread::sleep_for(20ms);
      if (device.stream_idle(user)) e = "the caller's stream did not wait for the op";
    }
    device.occupy_every_sm(false);
    comm->wait(op, kForever);
    device.synchronize(user);
    if (e.empty()) e = x.check(rank);
    if (e.empty() && std::memcmp(snapshot, x.recv.data(), bytes) != 0) e = "work queued after the wait saw a partial output";
    device.host_free(snapshot);
    comm->close();
    return e;
  });
  expect_all_ok(outcomes);
}

// The price of running ahead: a lane may wait (on the device) for a counter a peer's device was
// to write. A peer that dies with that write still queued never writes it; the survivors' hosts
// end those waits themselves once the peer is gone (quiesce, before the op reports the failure),
// so a caller's stream that waited on the failed op is released, and nothing hangs.
TEST(CeEngines, APeerThatDiesWithItsCopiesHeldReleasesTheSurvivorsStreams) {
  auto outcomes = run_forked_ranks(3, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDeviceOptions options;
    options.driver_version = 13000;  // rank 2's copies into its arena: SM kernels, held below
    EmulatedDevice device(options);
    Stream user = device.create_stream();
    auto comm = ce_communicator(bootstrap, default_config(/*chunk_bytes=*/256 << 10), device);
    Exchange x(uniform_counts(3, 256 << 10), rank, 8);  // outlives the transport's device work
    if (rank == 2) device.occupy_every_sm(true);
    auto op = comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, false, user);
    if (!comm->stream_wait(op, user, std::chrono::seconds(20))) return "the stream wait did not return";
    if (rank == 2) {
      bootstrap.allgather("");  // the survivors' lanes now wait for our heads
      raise(SIGKILL);
    }
    // Rank 2's copies are held until it dies, so the landings from it wait on our device.
    std::this_thread::sleep_for(20ms);
    const bool waited = !device.stream_idle(user);
    bootstrap.allgather("");
    if (!waited) return "the caller's stream did not wait for the landings from rank 2";
    std::string e = testing::expect_comm_error([&] { comm->wait(op, kForever); }, ErrorCode::kPeerDied);
    if (!e.empty()) return "rank 2 died: " + e;
    if (!testing::drains_within(device, user, 10s)) return "the caller's stream still waits on the failed op";
    comm->close();
    return "";
  }, std::chrono::seconds(120));
  EXPECT_EQ(outcomes[2].signal, SIGKILL);
  for (int r : {0, 1}) EXPECT_EQ(outcomes[r].exit_code, 0) << "rank " << r << ": " << outcomes[r].message;
  EXPECT_TRUE(testing::leftover_segments(outcomes).empty());
}

// Registered buffers on a 13.0 driver (copies within a device on SMs): a peer's chunks go
// straight into this rank's registered receive buffer, one cross-device copy on a copy engine,
// so an op whose ranks send themselves nothing completes while a kernel holds every SM, with 0 SM
// copies; with a self block, that block's copy is the only SM copy. data_paths says so.
TEST(CeEngines, RegisteredBuffersAt13_0TakeNoSmCopyButTheSelfBlock) {
  auto outcomes = run_forked_ranks(4, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDeviceOptions options;
    options.driver_version = 13000;
    EmulatedDevice device(options);
    auto comm = ce_communicator(bootstrap, default_config(), device);
    std::string e;
    for (bool self_block : {false, true}) {
      auto counts = uniform_counts(4, kPerPeer);
      if (!self_block)
        for (int r = 0; r < 4; ++r) counts[r][r] = 0;
      Exchange x(counts, rank, self_block ? 11 : 10);
      auto* recv = static_cast<uint8_t*>(device.device_alloc(x.recv.size()));
      comm->register_buffer(recv, x.recv.size());
      bootstrap.allgather("");  // (registered before any peer sends: else early chunks may go via arenas)
      const CopyCounts before = device.copy_counts();
      if (!self_block) device.occupy_every_sm(true);
      auto op = comm->all_to_all(x.send.data(), recv, x.layout, 0, false);
      const bool done = comm->wait(op, std::chrono::seconds(60));
      device.occupy_every_sm(false);
      if (!done) comm->wait(op, kForever);
      const CopyCounts after = device.copy_counts();
      std::memcpy(x.recv.data(), recv, x.recv.size());
      const std::string what = self_block ? "with a self block: " : "without a self block: ";
      if (e.empty() && !done) e = what + "the op did not complete while a kernel held every SM";
      if (e.empty()) e = x.check(rank);
      const size_t sm_bytes = after.sm_bytes - before.sm_bytes;
      const size_t self_bytes = self_block ? kPerPeer : 0;
      if (e.empty() && sm_bytes != self_bytes) {
        e = what + std::to_string(sm_bytes) + " bytes copied by SMs, expected " + std::to_string(self_bytes) +
            " (the self block)";
      }
      if (e.empty() && after.ce_bytes - before.ce_bytes != 3 * kPerPeer) {
        e = what + std::to_string(after.ce_bytes - before.ce_bytes) + " bytes on copy engines: not one copy per block";
      }
    }
    const std::string path = comm->data_path();
    if (e.empty() && path.find("registered with Communicator.register_buffer are written by the sender directly") ==
                         std::string::npos) {
      e = "the data path does not say what registered buffers change: " + path;
    }
    comm->close();
    return e;
  }, std::chrono::seconds(120));
  expect_all_ok(outcomes);
}

// Issue 41 item 1: a registered receive buffer is the receiver's legacy IPC memory: it goes away
// with its owner, and a copy into it faults the sender's whole context. A peer seen gone gets
// nothing into its buffer (direct_target checks; the arena takes the chunks, the op fails naming
// the dead rank). The emulator used to keep a dead owner's pages, so dropping that check went
// unseen; now it fails here. (A death after the check, with copies queued, stays a race.)
TEST(CeEngines, NoCopyGoesIntoTheRegisteredBufferOfAReceiverThatDied) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device;
    auto comm = ce_communicator(bootstrap, testing::small_config(), device);
    Exchange x(uniform_counts(2, 4 * testing::small_config().chunk_bytes), rank);
    const std::vector<std::string> pids = bootstrap.allgather(std::to_string(getpid()));
    auto* recv = static_cast<uint8_t*>(device.device_alloc(x.recv.size()));
    if (rank == 1) comm->register_buffer(recv, x.recv.size());
    bootstrap.allgather("");
    // A first op: rank 0 maps rank 1's buffer and writes its chunks straight into it.
    comm->wait(comm->all_to_all(x.send.data(), rank == 1 ? recv : x.recv.data(), x.layout, 0, false), 20s);
    if (rank == 1) {
      auto op = comm->all_to_all(x.send.data(), recv, x.layout, 0, false);  // posted: peers may write into recv
      std::this_thread::sleep_for(50ms);
      bootstrap.allgather("");
      raise(SIGKILL);
    }
    bootstrap.allgather("");  // rank 1 posted the second op; it dies now
    testing::wait_until_gone(std::stoi(pids[1]));
    auto op = comm->all_to_all(x.send.data(), x.recv.data(), x.layout, 0, false);
    std::string e = testing::expect_comm_error([&] { comm->wait(op, std::chrono::seconds(20)); }, ErrorCode::kPeerDied);
    if (!e.empty()) return e;
    if (!device.fault().empty()) return "rank 0's context faulted: " + device.fault();
    return "";
  });
  EXPECT_EQ(outcomes[1].signal, SIGKILL);
  EXPECT_EQ(outcomes[0].exit_code, 0) << outcomes[0].message;
}

// Registered and unregistered receivers in one group: a rank's chunks go straight into the peers
// that registered the buffer they receive in, through the arena to the others, and a receive
// block outside the registered buffer goes through the arena too. Random splits, every byte checked.
TEST(CeEngines, RegisteredAndUnregisteredReceiversMixInOneOp) {
  auto outcomes = run_forked_ranks(3, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device;
    auto comm = ce_communicator(bootstrap, testing::small_config(), device);
    auto* registered = static_cast<uint8_t*>(device.device_alloc(8 << 20));
    if (rank != 2) comm->register_buffer(registered, 4 << 20);  // rank 2 registers nothing
    std::vector<uint8_t> host(64);  // not device memory: refused, naming the argument
    try {
      comm->register_buffer(host.data(), host.size());
      return "host memory was registered";
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidArgument || std::string(e.what()).find("register_buffer: ptr") == std::string::npos)
        return std::string("host memory refused with the wrong error: ") + e.what();
    }
    try {
      comm->register_buffer(registered + (8 << 20) - 16, 64);
      return "a buffer past its allocation's end was registered";
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidArgument) return std::string("past the end: ") + e.what();
    }
    bootstrap.allgather("");
    for (int i = 0; i < 6; ++i) {
      Exchange x(testing::random_counts(3, 700 << 10, 40 + static_cast<uint32_t>(i)), rank, 30 + i);
      // Ops 0-3 receive inside the registered 4 MiB; 4-5 past it (the arena path again).
      uint8_t* recv = registered + (i < 4 ? 0 : (4 << 20));
      auto op = comm->all_to_all(x.send.data(), recv, x.layout, i % 2, false);
      comm->wait(op, kForever);
      std::memcpy(x.recv.data(), recv, x.recv.size());
      if (std::string e = x.check(rank); !e.empty()) return "op " + std::to_string(i) + ": " + e;
    }
    comm->close();
    return "";
  }, std::chrono::seconds(120));
  expect_all_ok(outcomes);
}

// Ranks that disagree on a split never write past a registered receive block: a sender whose
// block is not the size the receiver expects sends it through its arena, where the receiver's
// size audit fails the op (both ranks) before a byte lands. Rank 0's registered buffer has
// guard bytes right after its block from rank 1, which sends 64 KiB more than rank 0 expects.
TEST(CeEngines, ASplitMismatchNeverWritesPastARegisteredBlock) {
  auto outcomes = run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device;
    auto counts = uniform_counts(2, 256 << 10);
    if (rank == 1) counts[1][0] += 64 << 10;  // rank 1 sends 320 KiB to rank 0, which expects 256 KiB
    Exchange x(counts, rank, 12);
    auto comm = ce_communicator(bootstrap, testing::small_config(), device);
    const size_t guard = 128 << 10;
    auto* recv = static_cast<uint8_t*>(device.device_alloc(x.recv.size() + guard));
    std::memset(recv, 0xAB, x.recv.size() + guard);
    comm->register_buffer(recv, x.recv.size() + guard);
    bootstrap.allgather("");
    // (rank 0 finds the mismatch; rank 1 learns it from rank 0's abort)
    std::string e = testing::expect_comm_error(
        [&] { comm->wait(comm->all_to_all(x.send.data(), recv, x.layout, 0, false), kForever); },
        rank == 0 ? std::optional<ErrorCode>(ErrorCode::kSizeMismatch) : std::nullopt);
    if (!e.empty()) return e;
    for (size_t i = x.recv.size(); i < x.recv.size() + guard; ++i)
      if (recv[i] != 0xAB) return "byte " + std::to_string(i - x.recv.size()) + " past the receive buffer was written";
    return "";
  }, std::chrono::seconds(120));
  expect_all_ok(outcomes);
}

// An urgent op issued while a 256 MiB bulk op (4 ranks x 16 MiB per peer) is under way, on a
// slowed device, completes first: the bulk op keeps at most a window (plus a chunk per ring and
// lane) enqueued and not yet executed, so the urgent op's copies wait behind that, not behind
// every slot of every ring (before: up to 16 slots x 3 peers x 256 KiB and the landings).
TEST(CeEngines, AnUrgentOpDuringABulkOpWaitsBehindOneWindow) {
  auto outcomes = run_forked_ranks(4, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDeviceOptions options;
    options.op_latency = 100us;
    EmulatedDevice device(options);
    const Config config = default_config(kChunk, kWindow);
    auto comm = ce_communicator(bootstrap, config, device);
    Exchange bulk(uniform_counts(4, kPerPeer), rank, 1), urgent(uniform_counts(4, 4096), rank, 2);
    std::atomic<bool> sampling{true};
    std::atomic<uint64_t> most_queued{0};
    std::thread sampler([&] {  // bytes the device was given and has not copied yet
      while (sampling.load()) {
        const CopyCounts c = device.copy_counts();
        const uint64_t queued = c.ce_bytes + c.sm_bytes - c.executed_bytes;
        if (queued > most_queued.load()) most_queued.store(queued);
        std::this_thread::sleep_for(20us);
      }
    });
    std::mutex mu;
    std::vector<std::string> order;
    auto a = comm->all_to_all(bulk.send.data(), bulk.recv.data(), bulk.layout, 0);
    a->add_done_callback([&] { std::lock_guard<std::mutex> l(mu); order.push_back("bulk"); });
    // Issue the urgent op once the bulk op's copies are well under way (a quarter of this rank's).
    const uint64_t started = 4 * kPerPeer / 4;
    while (device.copy_counts().executed_bytes < started && !a->is_completed()) std::this_thread::sleep_for(50us);
    auto b = comm->all_to_all(urgent.send.data(), urgent.recv.data(), urgent.layout, 100);
    b->add_done_callback([&] { std::lock_guard<std::mutex> l(mu); order.push_back("urgent"); });
    comm->wait(b, kForever);
    comm->wait(a, kForever);
    sampling.store(false);
    sampler.join();
    comm->close();
    if (order != std::vector<std::string>{"urgent", "bulk"}) return "the urgent op did not complete first";
    if (std::string e = bulk.check(rank); !e.empty()) return e;
    if (std::string e = urgent.check(rank); !e.empty()) return e;
    const uint64_t bound = config.arena_bytes + 2 * 4 * config.chunk_bytes;
    if (most_queued.load() > bound) {
      return std::to_string(most_queued.load() >> 10) + " KiB enqueued ahead of the engines; the window allows " +
             std::to_string(bound >> 10) + " KiB";
    }
    if (rank == 0) std::fprintf(stderr, "most bytes queued on the device: %llu KiB\n",
                                static_cast<unsigned long long>(most_queued.load() >> 10));
    return "";
  }, std::chrono::seconds(120));
  expect_all_ok(outcomes);
}

}  // namespace
}  // namespace freescale

namespace freescale {
namespace {

// cudaIpcCloseMemHandle synchronizes the device (tensorpipe#321 saw it); the emulator makes
// cudaIpcOpenMemHandle do so too, the harsher reading where CUDA's documentation is silent. A
// sender maps a peer's registered buffer the first time it sends into it, while its lanes may
// still hold copies and stream waits of the ops before: here each rank registers a new buffer for
// every op and posts every op before waiting on any, with rings smaller than a block (waits on
// the peer's tail queued), so each first mapping meets busy streams. The mapping must not wait
// for work that only this rank's later progress could release: an emulated hang throws, which
// the transport catches (the chunks go through the arena), so the test reads device.hangs().
TEST(CeEngines, MappingAPeersNewBufferWhileOpsAreInFlightDoesNotDeadlock) {
  auto outcomes = run_forked_ranks(3, [](int rank, Bootstrap& bootstrap) -> std::string {
    EmulatedDevice device;
    const Config config = testing::small_config();
    auto comm = ce_communicator(bootstrap, config, device);
    constexpr int kOps = 6;
    std::vector<std::unique_ptr<Exchange>> exchanges;
    std::vector<uint8_t*> buffers;
    std::vector<std::shared_ptr<OpState>> ops;
    for (int i = 0; i < kOps; ++i) {
      exchanges.push_back(std::make_unique<Exchange>(uniform_counts(3, 2 * config.arena_bytes), rank, i));
      Exchange& x = *exchanges.back();
      buffers.push_back(static_cast<uint8_t*>(device.device_alloc(x.recv.size())));
      comm->register_buffer(buffers.back(), x.recv.size());
      ops.push_back(comm->all_to_all(x.send.data(), buffers.back(), x.layout, 0, false));
    }
    for (int i = 0; i < kOps; ++i) {
      if (!comm->wait(ops[i], std::chrono::seconds(60))) return "op " + std::to_string(i) + " did not complete";
      Exchange& x = *exchanges[i];
      std::memcpy(x.recv.data(), buffers[i], x.recv.size());
      if (std::string e = x.check(rank); !e.empty()) return "op " + std::to_string(i) + ": " + e;
    }
    if (!device.hangs().empty()) return device.hangs().front();
    return device.fault();
  });
  expect_all_ok(outcomes);
  EXPECT_TRUE(testing::leftover_segments(outcomes).empty());
}

}  // namespace
}  // namespace freescale

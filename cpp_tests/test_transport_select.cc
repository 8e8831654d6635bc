#include <gtest/gtest.h>

#include "cpp/errors.h"
#include "cpp/transport_select.h"

namespace freescale {
namespace {

TransportNeeds needs(const char* requested, bool cuda, bool same_host, bool ce = true, bool nvshmem = true) {
  TransportNeeds n;
  n.requested = requested;
  n.cuda_tensors = cuda;
  n.same_host = same_host;
  n.ce_built = ce;
  n.nvshmem_built = nvshmem;
  return n;
}

ErrorCode code_of(const TransportNeeds& n) {
  try {
    select_transport(n);
  } catch (const Error& e) {
    return e.code();
  }
  return ErrorCode::kInternal;  // did not throw
}

TEST(TransportSelect, AutoFollowsDeviceAndPlacement) {
  EXPECT_EQ(select_transport(needs("auto", false, true)).kind, TransportKind::kHost);
  EXPECT_EQ(select_transport(needs("auto", true, true)).kind, TransportKind::kCe);
  EXPECT_EQ(select_transport(needs("auto", true, false)).kind, TransportKind::kNvshmem);
  EXPECT_EQ(select_transport(needs("auto", true, true, /*ce=*/false)).kind, TransportKind::kNvshmem);
}

TEST(TransportSelect, AutoFallsBackToTheInnerGroupWithAWarning) {
  TransportChoice cpu = select_transport(needs("auto", false, false));
  EXPECT_EQ(cpu.kind, TransportKind::kInner);
  EXPECT_NE(cpu.warning.find("gloo"), std::string::npos);
  TransportChoice cuda = select_transport(needs("auto", true, false, true, /*nvshmem=*/false));
  EXPECT_EQ(cuda.kind, TransportKind::kInner);
  EXPECT_NE(cuda.warning.find("NCCL"), std::string::npos);
  EXPECT_TRUE(select_transport(needs("auto", true, true)).warning.empty());
}

TEST(TransportSelect, ForcedTransportsServeWhatTheyCan) {
  EXPECT_EQ(select_transport(needs("host", false, true)).kind, TransportKind::kHost);
  EXPECT_EQ(select_transport(needs("ce", true, true)).kind, TransportKind::kCe);
  EXPECT_EQ(select_transport(needs("nvshmem", true, true)).kind, TransportKind::kNvshmem);
  EXPECT_EQ(select_transport(needs("nvshmem", true, false)).kind, TransportKind::kNvshmem);
}

TEST(TransportSelect, ForcedTransportsRefuseWhatTheyCannot) {
  EXPECT_EQ(code_of(needs("host", true, true)), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of(needs("host", false, false)), ErrorCode::kUnsupported);
  EXPECT_EQ(code_of(needs("ce", false, true)), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of(needs("ce", true, false)), ErrorCode::kUnsupported);
  EXPECT_EQ(code_of(needs("ce", true, true, /*ce=*/false)), ErrorCode::kUnsupported);
  EXPECT_EQ(code_of(needs("nvshmem", true, true, true, /*nvshmem=*/false)), ErrorCode::kUnsupported);
  EXPECT_EQ(code_of(needs("shm", false, true)), ErrorCode::kInvalidArgument);
}

TEST(TransportSelect, RefusalsNameTheKnobAndTheFix) {
  try {
    select_transport(needs("ce", true, true, /*ce=*/false));
    FAIL() << "no exception";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("FREESCALE_TRANSPORT"), std::string::npos) << what;
    EXPECT_NE(what.find("nvcc"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace freescale

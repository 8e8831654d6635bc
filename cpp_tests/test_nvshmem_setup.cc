// The NVSHMEM transport's setup on machines without a GPU (CI): it must refuse with kUnsupported
// before NVSHMEM can exit the process, and its host library must load with every symbol we use.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cpp/bootstrap.h"
#include "cpp/build_info.h"
#include "cpp/config.h"
#include "cpp/device_transports.h"
#include "cpp/errors.h"
#include "cuda/device_ops.h"

namespace freescale {
namespace {

#ifdef FREESCALE_WITH_NVSHMEM
class SoloBootstrap : public Bootstrap {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::vector<std::string> allgather(const std::string& mine) override { return {mine}; }
};

TEST(NvshmemSetup, RefusesWithoutAGpuInsteadOfExiting) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present: the gpu-marked Python tests cover setup";
  SoloBootstrap bootstrap;
  Config config;
  config.cuda_device = 0;
  try {
    make_device_transport(TransportKind::kNvshmem, bootstrap, config);
    FAIL() << "expected kUnsupported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("GPU"), std::string::npos) << e.what();
  }
}

TEST(NvshmemSetup, HostLibraryLoadsWithEveryEntryPoint) {
  // The build found NVSHMEM's headers; the library beside them must load and resolve (dlsym).
  std::string path = nvshmem_library_path();
  EXPECT_NE(path.find("libnvshmem_host.so"), std::string::npos) << path;
  // Issue 43: the file the symbols came from (a realpath), its version, and no second copy loaded.
  EXPECT_EQ(path.front(), '/') << path;
  const std::string version = nvshmem_ops().version();
  EXPECT_EQ(version.rfind("3.", 0), 0u) << version;
  EXPECT_TRUE(nvshmem_ops().other_copies().empty());
}
#else
TEST(NvshmemSetup, NotCompiledInSaysWhy) {
  BuildInfo info = build_info();
  EXPECT_FALSE(info.nvshmem);
  EXPECT_FALSE(info.nvshmem_detail.empty());
}
#endif

}  // namespace
}  // namespace freescale

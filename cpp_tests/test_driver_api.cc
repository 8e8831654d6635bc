// The driver entry points the CUDA device ops resolve at run time (CUDA builds only; no GPU needed).
#include <gtest/gtest.h>

#include <string>

#include "cpp/errors.h"
#include "cuda/driver_api.h"

namespace freescale {

TEST(DriverApi, AFailedLookupNamesTheDriverStatusNotTheRuntimesNoError) {
  // cudaGetDriverEntryPointByVersion succeeds (cudaSuccess) yet finds no symbol: its string
  // would read "no error".
  std::string missing = driver_entry_point_failure(cudaSuccess, cudaDriverEntryPointSymbolNotFound);
  EXPECT_EQ(missing.find("no error"), std::string::npos) << missing;
  EXPECT_NE(missing.find("does not export"), std::string::npos) << missing;
  std::string old_driver = driver_entry_point_failure(cudaSuccess, cudaDriverEntryPointVersionNotSufficent);
  EXPECT_NE(old_driver.find("older than CUDA 12.0"), std::string::npos) << old_driver;
  std::string runtime = driver_entry_point_failure(cudaErrorInsufficientDriver, cudaDriverEntryPointSuccess);
  EXPECT_NE(runtime.find("cudaErrorInsufficientDriver"), std::string::npos) << runtime;
}

TEST(DriverApi, ResolvesEveryEntryPointOrRefusesNamingTheSymbol) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    const DriverApi& api = DriverApi::get();
    EXPECT_NE(api.stream_write_value32, nullptr);
    EXPECT_NE(api.stream_write_value64, nullptr);
    EXPECT_NE(api.stream_wait_value32, nullptr);
    EXPECT_NE(api.stream_wait_value64, nullptr);
    return;
  }
  cudaGetLastError();
  try {
    DriverApi::get();
    ADD_FAILURE() << "no usable driver here, yet the entry points resolved";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << what;
    EXPECT_NE(what.find("the CUDA driver has no cuStreamWriteValue32"), std::string::npos) << what;
    EXPECT_EQ(what.find("no error"), std::string::npos) << what;
  }
}

}  // namespace freescale

#include "cuda/driver_api.h"

#include <mutex>
#include <string>

#include "cpp/errors.h"

namespace freescale {

std::string driver_entry_point_failure(cudaError_t err, cudaDriverEntryPointQueryResult status) {
  if (err != cudaSuccess) return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
  switch (status) {
    case cudaDriverEntryPointSymbolNotFound:
      return "the driver does not export it";
    case cudaDriverEntryPointVersionNotSufficent:
      return "the driver is older than CUDA 12.0";
    default:
      return "the driver returned no entry point (status " + std::to_string(static_cast<int>(status)) + ")";
  }
}

namespace {

template <class Fn>
void resolve(const char* symbol, Fn*& out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    throw Error(ErrorCode::kUnsupported, std::string("the CUDA driver has no ") + symbol +
                                             " (freescale_comm needs a CUDA 12+ driver): " +
                                             driver_entry_point_failure(err, status));
  }
  out = reinterpret_cast<Fn*>(fn);
}

}  // namespace

const DriverApi& DriverApi::get() {
  static DriverApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    resolve("cuStreamWriteValue32", api.stream_write_value32);
    resolve("cuStreamWriteValue64", api.stream_write_value64);
    resolve("cuStreamWaitValue32", api.stream_wait_value32);
    resolve("cuStreamWaitValue64", api.stream_wait_value64);
    resolve("cuDeviceGet", api.device_get);
    resolve("cuCtxGetCurrent", api.ctx_get_current);
    resolve("cuCtxSetCurrent", api.ctx_set_current);
    resolve("cuGetErrorName", api.get_error_name);
    resolve("cuDeviceGetAttribute", api.device_get_attribute);
    resolve("cuMemGetAddressRange", api.mem_get_address_range);
    resolve("cuMemGetAllocationGranularity", api.mem_get_allocation_granularity);
    resolve("cuMemCreate", api.mem_create);
    resolve("cuMemRelease", api.mem_release);
    resolve("cuMemAddressReserve", api.mem_address_reserve);
    resolve("cuMemAddressFree", api.mem_address_free);
    resolve("cuMemMap", api.mem_map);
    resolve("cuMemUnmap", api.mem_unmap);
    resolve("cuMemSetAccess", api.mem_set_access);
    resolve("cuMemExportToShareableHandle", api.mem_export_to_shareable_handle);
    resolve("cuMemImportFromShareableHandle", api.mem_import_from_shareable_handle);
    resolve("cuMemGetAllocationPropertiesFromHandle", api.mem_get_allocation_properties_from_handle);
  });
  return api;
}

void check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // not sticky: later calls start clean
  throw Error(ErrorCode::kSystem, std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

void check_cu(CUresult res, const char* what) {
  if (res == CUDA_SUCCESS) return;
  const char* name = nullptr;  // e.g. CUDA_ERROR_NOT_PERMITTED; the number alone where unknown
  if (DriverApi::get().get_error_name(res, &name) != CUDA_SUCCESS) name = nullptr;
  throw Error(ErrorCode::kSystem, std::string(what) + ": " + (name != nullptr ? name : "CUresult") + " (" +
                                      std::to_string(static_cast<int>(res)) + ")");
}

}  // namespace freescale

// The few CUDA driver entry points the device ops need, found at run time through
// cudaGetDriverEntryPointByVersion: there is no libcuda stub to link against on build machines,
// and the driver is only present where a GPU is. Include from .cu sources only.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

namespace freescale {

struct DriverApi {
  CUresult (*stream_write_value32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*stream_write_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*stream_wait_value32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*stream_wait_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*mem_get_address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  // Virtual memory management (shareable allocations): CUDA 10.2+ drivers.
  CUresult (*mem_get_allocation_granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long) = nullptr;
  CUresult (*mem_release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*mem_address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*mem_address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*mem_unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*mem_export_to_shareable_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                             unsigned long long) = nullptr;
  CUresult (*mem_import_from_shareable_handle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) = nullptr;
  CUresult (*mem_get_allocation_properties_from_handle)(CUmemAllocationProp*, CUmemGenericAllocationHandle) = nullptr;

  // Resolved once per process; throws Error(kUnsupported) naming the missing symbol when the
  // driver lacks it (64-bit stream memory operations need CUDA 12.0+ drivers).
  static const DriverApi& get();
};

// Why cudaGetDriverEntryPointByVersion gave no entry point: the runtime's error if it failed,
// else the driver's status (err is cudaSuccess then: its string would read "no error").
std::string driver_entry_point_failure(cudaError_t err, cudaDriverEntryPointQueryResult status);

// Throws Error(kSystem) with `what` and CUDA's error string unless err == cudaSuccess.
void check_cuda(cudaError_t err, const char* what);
void check_cu(CUresult res, const char* what);

}  // namespace freescale

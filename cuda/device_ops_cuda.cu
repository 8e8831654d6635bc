// DeviceOps over the CUDA runtime and the driver's stream memory operations: a thin layer, no
// logic (that lives in the transports, which run on the emulated device in CI).
#include <cuda.h>
#include <cuda_runtime.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <string>

#include "cpp/errors.h"
#include "cuda/device_ops.h"
#include "cuda/device_util.h"
#include "cuda/driver_api.h"

namespace freescale {
namespace {

cudaStream_t as_stream(Stream s) { return reinterpret_cast<cudaStream_t>(s); }
CUstream as_custream(Stream s) { return reinterpret_cast<CUstream>(s); }
cudaEvent_t as_event(Event e) { return reinterpret_cast<cudaEvent_t>(e); }

unsigned int wait_flags(WaitCmp cmp) {
  switch (cmp) {
    case WaitCmp::kGeq:
      return CU_STREAM_WAIT_VALUE_GEQ;
    case WaitCmp::kEq:
      return CU_STREAM_WAIT_VALUE_EQ;
    case WaitCmp::kAnd:
      return CU_STREAM_WAIT_VALUE_AND;
  }
  return CU_STREAM_WAIT_VALUE_GEQ;
}

// DeviceAttribute carries the driver's numbers: one cast, checked here against cuda.h.
constexpr bool same(DeviceAttribute a, CUdevice_attribute b) { return static_cast<int>(a) == static_cast<int>(b); }
static_assert(same(DeviceAttribute::kCanMapHostMemory, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY) &&
              same(DeviceAttribute::kUnifiedAddressing, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING) &&
              same(DeviceAttribute::kCanFlushRemoteWrites, CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES) &&
              same(DeviceAttribute::kHostRegisterSupported, CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED) &&
              same(DeviceAttribute::kVirtualMemoryManagement, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) &&
              same(DeviceAttribute::kPosixFdHandles, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) &&
              same(DeviceAttribute::kCanUse64BitStreamMemOps, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS) &&
              same(DeviceAttribute::kGpuDirectRdmaFlushWritesOptions,
                   CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS) &&
              same(DeviceAttribute::kGpuDirectRdmaWritesOrdering, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING),
              "DeviceAttribute values must be the driver's CUdevice_attribute numbers");
static_assert(kFlushWritesOptionHost == CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST &&
                  kFlushWritesOptionMemops == CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_MEMOPS &&
                  kRdmaWritesOrderingOwner == CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER,
              "flush options and ordering scopes must be cuda.h's");

class CudaDeviceOps final : public DeviceOps {
 public:
  const char* name() const override { return "cuda"; }
  int driver_version() override {
    int version = 0;
    check_cuda(cudaDriverGetVersion(&version), "cudaDriverGetVersion");
    return version;
  }
  bool batch_copies() const override { return batch_api_.load(std::memory_order_relaxed); }

  int device_count() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return count;
  }
  int current_device() override {
    int d = 0;
    check_cuda(cudaGetDevice(&d), "cudaGetDevice");
    return d;
  }
  void set_device(int device) override { check_cuda(cudaSetDevice(device), "cudaSetDevice"); }
  int attribute(int device, DeviceAttribute attr) override {
    const DriverApi& api = DriverApi::get();
    CUdevice dev = 0;
    check_cu(api.device_get(&dev, device), "cuDeviceGet");
    int value = 0;
    check_cu(api.device_get_attribute(&value, static_cast<CUdevice_attribute>(attr), dev), "cuDeviceGetAttribute");
    return value;
  }
  void* current_context() override {
    CUcontext ctx = nullptr;
    check_cu(DriverApi::get().ctx_get_current(&ctx), "cuCtxGetCurrent");
    return ctx;
  }
  void set_current_context(void* context) override {
    check_cu(DriverApi::get().ctx_set_current(static_cast<CUcontext>(context)), "cuCtxSetCurrent");
  }
  int relax_capture_mode() override {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    check_cuda(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
    return static_cast<int>(mode);
  }
  void restore_capture_mode(int mode) override {
    auto m = static_cast<cudaStreamCaptureMode>(mode);
    check_cuda(cudaThreadExchangeStreamCaptureMode(&m), "cudaThreadExchangeStreamCaptureMode");
  }
  bool is_capturing(Stream stream) override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(as_stream(stream), &status), "cudaStreamIsCapturing");
    return status != cudaStreamCaptureStatusNone;
  }

  Stream create_stream() override {
    cudaStream_t s = nullptr;
    check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return reinterpret_cast<Stream>(s);
  }
  void destroy_stream(Stream stream) override { check_cuda(cudaStreamDestroy(as_stream(stream)), "cudaStreamDestroy"); }
  bool stream_idle(Stream stream) override {
    cudaError_t err = cudaStreamQuery(as_stream(stream));
    if (err == cudaErrorNotReady) return false;
    check_cuda(err, "cudaStreamQuery");
    return true;
  }
  void synchronize(Stream stream) override { check_cuda(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize"); }
  Event create_event() override {
    cudaEvent_t ev = nullptr;
    check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    return reinterpret_cast<Event>(ev);
  }
  void destroy_event(Event event) override { check_cuda(cudaEventDestroy(as_event(event)), "cudaEventDestroy"); }
  void record_event(Event event, Stream stream) override {
    check_cuda(cudaEventRecord(as_event(event), as_stream(stream)), "cudaEventRecord");
  }
  void wait_event(Stream stream, Event event) override {
    check_cuda(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0), "cudaStreamWaitEvent");
  }
  bool event_done(Event event, const char* what) override {
    cudaError_t err = cudaEventQuery(as_event(event));
    if (err == cudaErrorNotReady) return false;
    check_cuda(err, what);
    return true;
  }

  void copy_batch(Stream stream, const CopyBatch& batch) override {
    if (batch.empty()) return;
    if (batch_api_.load(std::memory_order_relaxed)) {
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;  // copy engines, not SMs
      size_t attr_index = 0;
#if CUDART_VERSION >= 13000
      cudaError_t err = cudaMemcpyBatchAsync(const_cast<void**>(batch.dsts.data()), const_cast<const void**>(batch.srcs.data()),
                                             const_cast<size_t*>(batch.sizes.data()), batch.dsts.size(), &attr,
                                             &attr_index, 1, as_stream(stream));
#else  // CUDA 12.8 / 12.9: non-const arrays and the index of a failed copy (CMake requires 12.8+)
      size_t failed_index = 0;
      cudaError_t err = cudaMemcpyBatchAsync(const_cast<void**>(batch.dsts.data()), const_cast<void**>(batch.srcs.data()),
                                             const_cast<size_t*>(batch.sizes.data()), batch.dsts.size(), &attr,
                                             &attr_index, 1, &failed_index, as_stream(stream));
#endif
      if (err == cudaSuccess) return;
      if (err != cudaErrorNotSupported && err != cudaErrorStreamCaptureUnsupported) check_cuda(err, "cudaMemcpyBatchAsync");
      cudaGetLastError();
      if (err == cudaErrorNotSupported) batch_api_.store(false);  // under capture only: keep trying later
    }
    for (size_t i = 0; i < batch.dsts.size(); ++i) {
      check_cuda(cudaMemcpyAsync(batch.dsts[i], batch.srcs[i], batch.sizes[i], cudaMemcpyDefault, as_stream(stream)),
                 "cudaMemcpyAsync");
    }
  }

  // The default flags order a write after the stream's earlier copies (a memory barrier).
  void write_value32(Stream stream, DevicePtr addr, uint32_t value) override {
    check_cu(DriverApi::get().stream_write_value32(as_custream(stream), addr, value, CU_STREAM_WRITE_VALUE_DEFAULT),
             "cuStreamWriteValue32");
  }
  void write_value64(Stream stream, DevicePtr addr, uint64_t value) override {
    check_cu(DriverApi::get().stream_write_value64(as_custream(stream), addr, value, CU_STREAM_WRITE_VALUE_DEFAULT),
             "cuStreamWriteValue64");
  }
  void wait_value32(Stream stream, DevicePtr addr, uint32_t value, WaitCmp cmp) override {
    check_cu(DriverApi::get().stream_wait_value32(as_custream(stream), addr, value, wait_flags(cmp)), "cuStreamWaitValue32");
  }
  void wait_value64(Stream stream, DevicePtr addr, uint64_t value, WaitCmp cmp) override {
    check_cu(DriverApi::get().stream_wait_value64(as_custream(stream), addr, value, wait_flags(cmp)), "cuStreamWaitValue64");
  }

  void* device_alloc(size_t bytes) override {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, bytes), "cudaMalloc");
    return p;
  }
  void device_free(void* ptr) override { check_cuda(cudaFree(ptr), "cudaFree"); }
  void* host_alloc_mapped(size_t bytes, DevicePtr* device) override {
    void* p = nullptr;
    check_cuda(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
    void* d = nullptr;
    if (cudaError_t err = cudaHostGetDevicePointer(&d, p, 0); err != cudaSuccess) {
      cudaFreeHost(p);  // not left allocated behind the error
      check_cuda(err, "cudaHostGetDevicePointer");
    }
    *device = reinterpret_cast<DevicePtr>(d);
    return p;
  }
  void host_free(void* ptr) override { check_cuda(cudaFreeHost(ptr), "cudaFreeHost"); }
  DevicePtr host_register(void* ptr, size_t bytes) override {
    check_cuda(cudaHostRegister(ptr, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable), "cudaHostRegister");
    void* d = nullptr;
    if (cudaError_t err = cudaHostGetDevicePointer(&d, ptr, 0); err != cudaSuccess) {
      cudaHostUnregister(ptr);  // the caller records only a registration that returned
      check_cuda(err, "cudaHostGetDevicePointer");
    }
    return reinterpret_cast<DevicePtr>(d);
  }
  void host_unregister(void* ptr) override { check_cuda(cudaHostUnregister(ptr), "cudaHostUnregister"); }
  void memset_async(Stream stream, void* ptr, size_t bytes) override {
    check_cuda(cudaMemsetAsync(ptr, 0, bytes, as_stream(stream)), "cudaMemsetAsync");
  }

  void flush_remote_writes() override {
    check_cuda(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                                  cudaFlushGPUDirectRDMAWritesToOwner),
               "cudaDeviceFlushGPUDirectRDMAWrites");
  }

  std::string ipc_handle(void* ptr) override {
    cudaIpcMemHandle_t handle;
    check_cuda(cudaIpcGetMemHandle(&handle, ptr), "cudaIpcGetMemHandle");
    return to_hex(&handle, sizeof(handle));
  }
  void* ipc_open(const std::string& hex) override {
    cudaIpcMemHandle_t handle;
    from_hex(hex, &handle, sizeof(handle));
    void* p = nullptr;
    check_cuda(cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    return p;
  }
  void ipc_close(void* ptr) override { check_cuda(cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle"); }
  void* shareable_alloc(size_t bytes, int* fd) override {
    const DriverApi& api = DriverApi::get();
    const CUmemAllocationProp prop = shareable_prop();
    const size_t granularity = granularity_of(prop);
    const size_t size = round_up(bytes, granularity);
    CUmemGenericAllocationHandle handle = 0;
    check_cu(api.mem_create(&handle, size, &prop, 0), "cuMemCreate");
    int exported = -1;
    CUresult res = api.mem_export_to_shareable_handle(&exported, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (res != CUDA_SUCCESS) {
      api.mem_release(handle);
      check_cu(res, "cuMemExportToShareableHandle");
    }
    try {
      void* ptr = map(handle, size, granularity);
      *fd = exported;
      return ptr;
    } catch (...) {
      ::close(exported);
      throw;
    }
  }
  void* shareable_import(int fd, size_t bytes) override {
    const DriverApi& api = DriverApi::get();
    CUmemGenericAllocationHandle handle = 0;
    check_cu(api.mem_import_from_shareable_handle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
             "cuMemImportFromShareableHandle");
    size_t granularity = 0;
    try {  // the owner's allocation rounded `bytes` by its own properties' granularity: use them
      CUmemAllocationProp prop = {};
      check_cu(api.mem_get_allocation_properties_from_handle(&prop, handle), "cuMemGetAllocationPropertiesFromHandle");
      granularity = granularity_of(prop);
    } catch (...) {
      api.mem_release(handle);
      throw;
    }
    return map(handle, round_up(bytes, granularity), granularity);
  }
  void shareable_release(void* ptr) override {
    const DriverApi& api = DriverApi::get();
    Shareable s;
    {
      std::lock_guard<std::mutex> lock(shareable_mu_);
      auto it = shareables_.find(ptr);
      if (it == shareables_.end()) throw Error(ErrorCode::kInternal, "shareable_release: not a shareable mapping");
      s = it->second;
      shareables_.erase(it);
    }
    const auto va = reinterpret_cast<CUdeviceptr>(ptr);
    CUresult unmap = api.mem_unmap(va, s.size);
    CUresult free_va = api.mem_address_free(va, s.size);
    CUresult release = api.mem_release(s.handle);  // the pages go once every process released them
    check_cu(unmap, "cuMemUnmap");
    check_cu(free_va, "cuMemAddressFree");
    check_cu(release, "cuMemRelease");
  }

  void* allocation_base(const void* ptr, size_t* bytes) override {
    CUdeviceptr base = 0;
    check_cu(DriverApi::get().mem_get_address_range(&base, bytes, reinterpret_cast<CUdeviceptr>(ptr)),
             "cuMemGetAddressRange");
    return reinterpret_cast<void*>(base);
  }

  Event create_ipc_event() override {
    cudaEvent_t ev = nullptr;
    check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess),
               "cudaEventCreateWithFlags(cudaEventInterprocess)");
    return reinterpret_cast<Event>(ev);
  }
  std::string ipc_event_handle(Event event) override {
    cudaIpcEventHandle_t handle;
    check_cuda(cudaIpcGetEventHandle(&handle, as_event(event)), "cudaIpcGetEventHandle");
    return to_hex(&handle, sizeof(handle));
  }
  Event ipc_open_event(const std::string& hex) override {
    cudaIpcEventHandle_t handle;
    from_hex(hex, &handle, sizeof(handle));
    cudaEvent_t ev = nullptr;
    check_cuda(cudaIpcOpenEventHandle(&ev, handle), "cudaIpcOpenEventHandle");
    return reinterpret_cast<Event>(ev);
  }

 private:
  struct Shareable {
    CUmemGenericAllocationHandle handle = 0;
    size_t size = 0;  // mapped bytes (a multiple of the granularity)
  };
  // Pinned device memory on the current device, exportable as a POSIX file descriptor.
  CUmemAllocationProp shareable_prop() {
    CUdevice dev = 0;
    check_cu(DriverApi::get().device_get(&dev, current_device()), "cuDeviceGet");
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return prop;
  }
  static size_t granularity_of(const CUmemAllocationProp& prop) {
    size_t granularity = 0;
    check_cu(DriverApi::get().mem_get_allocation_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
             "cuMemGetAllocationGranularity");
    return granularity;
  }
  static size_t round_up(size_t bytes, size_t granularity) {
    return (std::max<size_t>(bytes, 1) + granularity - 1) / granularity * granularity;
  }
  // Maps `handle` (size bytes) at a fresh address aligned to `granularity`, read-write for the
  // current device; takes the handle (released on failure).
  void* map(CUmemGenericAllocationHandle handle, size_t size, size_t granularity) {
    const DriverApi& api = DriverApi::get();
    CUdevice dev = 0;
    CUdeviceptr va = 0;
    int device = 0;
    try {
      device = current_device();
    } catch (...) {
      api.mem_release(handle);  // taken: released on every failure
      throw;
    }
    CUresult res = api.device_get(&dev, device);
    if (res == CUDA_SUCCESS) res = api.mem_address_reserve(&va, size, granularity, 0, 0);
    if (res == CUDA_SUCCESS) {
      res = api.mem_map(va, size, 0, handle, 0);
      if (res == CUDA_SUCCESS) {
        CUmemAccessDesc access = {};
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = dev;  // this process's device (the memory may live on a peer's)
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        res = api.mem_set_access(va, size, &access, 1);
        if (res != CUDA_SUCCESS) api.mem_unmap(va, size);
      }
      if (res != CUDA_SUCCESS) api.mem_address_free(va, size);
    }
    if (res != CUDA_SUCCESS) {
      api.mem_release(handle);
      check_cu(res, "cuMemAddressReserve / cuMemMap / cuMemSetAccess");
    }
    std::lock_guard<std::mutex> lock(shareable_mu_);
    shareables_[reinterpret_cast<void*>(va)] = Shareable{handle, size};
    return reinterpret_cast<void*>(va);
  }
  std::mutex shareable_mu_;
  std::map<void*, Shareable> shareables_;  // shareable_alloc / shareable_import mappings

  std::atomic<bool> batch_api_{true};  // cudaMemcpyBatchAsync works here (else per-copy)
};

}  // namespace

DeviceOps& cuda_device_ops() {
  static CudaDeviceOps ops;
  return ops;
}

}  // namespace freescale

// ShmemOps over NVSHMEM's host library (dlopen'ed: see nvshmem_api.h): a thin layer, no logic.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "cpp/errors.h"
#include "cuda/device_ops.h"
#include "cuda/device_util.h"
#include "cuda/nvshmem_api.h"

namespace freescale {
namespace {

cudaStream_t as_stream(Stream s) { return reinterpret_cast<cudaStream_t>(s); }
int signal_op(ShmemSignalOp op) { return op == ShmemSignalOp::kSet ? NVSHMEM_SIGNAL_SET : NVSHMEM_SIGNAL_ADD; }

const char* status_name(int status) {
  switch (status) {
    case NVSHMEM_STATUS_NOT_INITIALIZED:
      return "NVSHMEM_STATUS_NOT_INITIALIZED";
    case NVSHMEM_STATUS_IS_BOOTSTRAPPED:
      return "NVSHMEM_STATUS_IS_BOOTSTRAPPED";
    case NVSHMEM_STATUS_IS_INITIALIZED:
      return "NVSHMEM_STATUS_IS_INITIALIZED";
    case NVSHMEM_STATUS_LIMITED_MPG:
      return "NVSHMEM_STATUS_LIMITED_MPG";
    case NVSHMEM_STATUS_FULL_MPG:
      return "NVSHMEM_STATUS_FULL_MPG";
    default:
      return "NVSHMEM_STATUS_INVALID";
  }
}

class NvshmemOps final : public ShmemOps {
 public:
  NvshmemOps() : api_(NvshmemApi::get()) {}
  const char* name() const override { return "nvshmem"; }
  std::string library() const override { return api_.path; }
  std::string version() const override {
    if (api_.version_info == nullptr) return "unknown";
    int major = 0, minor = 0, patch = 0;
    api_.version_info(&major, &minor, &patch);
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
  }
  std::vector<std::string> other_copies() const override {
    std::vector<std::string> others;
    for (const std::string& file : loaded_nvshmem_libraries())
      if (file != api_.path) others.push_back(file);
    return others;
  }

  std::string unique_id() override {
    nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (api_.get_uniqueid(&uid) != 0) throw Error(ErrorCode::kSystem, "nvshmemx_get_uniqueid failed");
    return to_hex(&uid, sizeof(uid));
  }
  int init(const std::string& unique_id, int rank, int world) override {
    nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
    from_hex(unique_id, &uid, sizeof(uid));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (int status = api_.set_attr_uniqueid_args(rank, world, &uid, &attr); status != 0) return status;
    return api_.hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  }
  // Full MPG (MPS with thread percentages summing to at most 100) and a plain init are usable;
  // limited MPG is not: NVSHMEM 3.8's on-stream calls may exit() the process there.
  bool fully_initialized() override {
    int status = api_.init_status();
    return status == NVSHMEM_STATUS_IS_INITIALIZED || status == NVSHMEM_STATUS_FULL_MPG;
  }
  bool limited_mpg() override { return api_.init_status() == NVSHMEM_STATUS_LIMITED_MPG; }
  std::string init_status_text() override { return status_name(api_.init_status()); }
  bool running() override {
    const int status = api_.init_status();
    return status != NVSHMEM_STATUS_NOT_INITIALIZED && status != NVSHMEM_STATUS_INVALID;
  }
  int my_pe() override { return api_.my_pe(); }
  int add_reference(int rank, int world) override {
    nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;  // ignored: the runtime runs already
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (int status = api_.set_attr_uniqueid_args(rank, world, &uid, &attr); status != 0) return status;
    return api_.hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  }
  void finalize() override { api_.hostlib_finalize(); }
  int n_pes() override { return api_.n_pes(); }

  void* malloc(size_t bytes) override { return api_.malloc(bytes); }
  bool is_mapped(const void* symmetric, int pe) override { return api_.ptr(symmetric, pe) != nullptr; }
  void* peer_pointer(const void* symmetric, int pe) override { return api_.ptr(symmetric, pe); }
  void put_signal_on_stream(void* dest, const void* src, size_t bytes, uint64_t* signal, uint64_t value, ShmemSignalOp op,
                            int pe, Stream stream) override {
    api_.putmem_signal_on_stream(dest, src, bytes, signal, value, signal_op(op), pe, as_stream(stream));
  }
  void signal_op_on_stream(uint64_t* signal, uint64_t value, ShmemSignalOp op, int pe, Stream stream) override {
    api_.signal_op_on_stream(signal, value, signal_op(op), pe, as_stream(stream));
  }
  void quiet_on_stream(Stream stream) override { api_.quiet_on_stream(as_stream(stream)); }

 private:
  const NvshmemApi& api_;
};

}  // namespace

ShmemOps& nvshmem_ops() {
  static NvshmemOps* ops = new NvshmemOps();  // throws (kUnsupported) until the library loads
  return *ops;
}

}  // namespace freescale

#include "cuda/cuda_util.h"

#include <string>

#include "cpp/errors.h"
#include "cpp/op_state.h"
#include "cpp/segment_map.h"
#include "cuda/driver_api.h"

namespace freescale {

DeviceGuard::DeviceGuard(int device) {
  check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ == device) {
    previous_ = -1;
  } else {
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
}

DeviceGuard::DeviceGuard(int device, std::nothrow_t) {
  if (cudaGetDevice(&previous_) != cudaSuccess || previous_ == device || cudaSetDevice(device) != cudaSuccess) {
    previous_ = -1;
  }
  cudaGetLastError();
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

void use_device_on_progress_thread(int device) {
  static thread_local int current = -1;
  if (current == device) return;
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  if (current == -1) {
    cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
    check_cuda(cudaThreadExchangeStreamCaptureMode(&relaxed), "cudaThreadExchangeStreamCaptureMode");
  }
  current = device;
}

void copy_on_copy_engines(cudaStream_t stream, std::vector<void*>& dsts, std::vector<const void*>& srcs,
                          std::vector<size_t>& sizes, bool* batch_api) {
  if (dsts.empty()) return;
  if (*batch_api) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;  // copy engines, not SMs
    size_t attr_index = 0;
    cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attr, &attr_index, 1, stream);
    if (err == cudaSuccess) return;
    if (err != cudaErrorNotSupported && err != cudaErrorStreamCaptureUnsupported) check_cuda(err, "cudaMemcpyBatchAsync");
    cudaGetLastError();
    *batch_api = err != cudaErrorNotSupported;  // under graph capture only: keep trying later
  }
  for (size_t i = 0; i < dsts.size(); ++i) {
    check_cuda(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream), "cudaMemcpyAsync");
  }
}

void check_cuda_device(int device, const char* transport) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    throw Error(ErrorCode::kUnsupported,
                std::string("the ") + transport + " transport needs a CUDA GPU and driver; none is visible here");
  }
  if (device < 0 || device >= count) {
    throw InvalidArgument("cuda_device " + std::to_string(device) + " is not one of the " + std::to_string(count) +
                          " visible GPUs");
  }
}

void CopyList::from_send_block(const OpState& op, int peer, uint64_t offset, uint64_t bytes, uint8_t* to) {
  for_each_piece(op.send, op.layout.send_offsets[peer], op.layout.send_segments, peer, offset, bytes,
                 [&](const uint8_t* piece, uint64_t n) {
                   dsts.push_back(to);
                   srcs.push_back(piece);
                   sizes.push_back(n);
                   to += n;
                 });
}

void CopyList::to_recv_block(const OpState& op, int src, uint64_t offset, uint64_t bytes, const uint8_t* from) {
  for_each_piece(op.recv, op.layout.recv_offsets[src], op.layout.recv_segments, src, offset, bytes,
                 [&](uint8_t* piece, uint64_t n) {
                   dsts.push_back(piece);
                   srcs.push_back(from);
                   sizes.push_back(n);
                   from += n;
                 });
}

std::string to_hex(const void* data, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

void from_hex(const std::string& hex, void* data, size_t n) {
  if (hex.size() != 2 * n) throw CommError(ErrorCode::kCommError, "transport setup: a malformed handle from a peer");
  auto* p = static_cast<unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
}

}  // namespace freescale

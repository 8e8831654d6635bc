#include "cpp/transport_select.h"

#include "cpp/errors.h"

namespace freescale {
namespace {

[[noreturn]] void refuse(ErrorCode code, const std::string& why) {
  throw Error(code, "FREESCALE_TRANSPORT: " + why);
}

}  // namespace

const char* transport_kind_name(TransportKind kind) {
  switch (kind) {
    case TransportKind::kHost: return "host";
    case TransportKind::kCe: return "ce";
    case TransportKind::kNvshmem: return "nvshmem";
    case TransportKind::kInner: return "inner";
  }
  return "?";
}

TransportChoice select_transport(const TransportNeeds& n) {
  const std::string& r = n.requested;
  if (r != "auto" && r != "host" && r != "ce" && r != "nvshmem") {
    refuse(ErrorCode::kInvalidArgument, "'" + r + "' is not one of auto, host, ce, nvshmem");
  }
  const char* device = n.cuda_tensors ? "CUDA" : "CPU";
  if (r == "host") {
    if (n.cuda_tensors) refuse(ErrorCode::kInvalidArgument, "host moves CPU tensors only; these are CUDA: use ce, nvshmem or auto");
    if (!n.same_host) refuse(ErrorCode::kUnsupported, "host needs every rank on one host; use auto (gloo across hosts)");
    return {TransportKind::kHost, ""};
  }
  if (r == "ce" || r == "nvshmem") {
    if (!n.cuda_tensors) refuse(ErrorCode::kInvalidArgument, r + " moves CUDA tensors only; these are CPU: use host or auto");
    bool built = r == "ce" ? n.ce_built : n.nvshmem_built;
    if (!built) {
      refuse(ErrorCode::kUnsupported, r + " is not compiled into this build (see freescale_comm.build_info()); rebuild " +
                                          (r == "ce" ? std::string("with nvcc on PATH") : std::string("with the [nvshmem] extra")) +
                                          " or use auto");
    }
    if (r == "ce" && !n.same_host) refuse(ErrorCode::kUnsupported, "ce reaches ranks of one node only; use nvshmem or auto");
    return {r == "ce" ? TransportKind::kCe : TransportKind::kNvshmem, ""};
  }
  // auto
  if (!n.cuda_tensors) {
    if (n.same_host) return {TransportKind::kHost, ""};
    return {TransportKind::kInner, std::string(device) + " tensors on ranks of several hosts: the inner gloo group moves them"};
  }
  if (n.same_host && n.ce_built) return {TransportKind::kCe, ""};
  if (n.nvshmem_built) return {TransportKind::kNvshmem, ""};
  return {TransportKind::kInner, std::string(device) + " tensors with neither " + (n.same_host ? "ce" : "ce (ranks span nodes)") +
                                     " nor nvshmem available: the inner NCCL group moves them (not SM-free)"};
}

}  // namespace freescale

// Which transport moves a communicator's bytes (design.md §5), decided from FREESCALE_TRANSPORT,
// the tensors' device, where the ranks are and what this build has. Pure: no I/O, no CUDA.
#pragma once

#include <string>

namespace freescale {

enum class TransportKind {
  kHost,     // CPU tensors, ranks on one host: shared memory
  kCe,       // CUDA tensors, ranks on one node: copy engines
  kNvshmem,  // CUDA tensors, any node: NVSHMEM host-initiated puts
  kInner,    // none of ours fits: the inner group (gloo for CPU, NCCL for CUDA) moves the bytes
};

const char* transport_kind_name(TransportKind kind);

struct TransportChoice {
  TransportKind kind = TransportKind::kHost;
  std::string warning;  // non-empty when `auto` fell back to the inner group: log it once
};

struct TransportNeeds {
  std::string requested = "auto";  // auto | host | ce | nvshmem
  bool cuda_tensors = false;        // the communicator moves CUDA tensors (else CPU)
  bool same_host = true;            // every rank is on this host / node
  bool ce_built = false;            // the copy-engine transport is compiled in
  bool nvshmem_built = false;       // the NVSHMEM transport is compiled in
};

// auto: CPU → host (several hosts → inner gloo, with a warning); CUDA → ce when all ranks share
// a node, else nvshmem when built, else inner NCCL with a warning. A forced transport that cannot
// serve `needs` throws InvalidArgument (wrong device) or Unsupported (not built / wrong placement),
// naming FREESCALE_TRANSPORT and the fix.
TransportChoice select_transport(const TransportNeeds& needs);

}  // namespace freescale

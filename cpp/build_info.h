// What this build of the core contains.
#pragma once

#include <string>
#include <vector>

namespace freescale {

struct BuildInfo {
  std::string version;
  bool cuda = false;                // CUDA sources compiled in
  bool nvshmem = false;             // NVSHMEM transport compiled in
  std::string nvshmem_detail;       // where its headers came from, or why it is not compiled in
  std::vector<int> cuda_archs;      // architectures compiled for (empty without CUDA)
  std::vector<std::string> transports;  // transports this build can construct
};

BuildInfo build_info();

}  // namespace freescale

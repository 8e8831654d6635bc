#include "cpp/build_info.h"

#include <sstream>

#ifdef FREESCALE_WITH_CUDA
#include "cuda/device_probe.h"
#endif

#ifndef FREESCALE_NVSHMEM_WHY
#define FREESCALE_NVSHMEM_WHY "not configured by CMake"
#endif

#ifndef FREESCALE_VERSION
#define FREESCALE_VERSION "0.0.0"
#endif

namespace freescale {

BuildInfo build_info() {
  BuildInfo info;
  info.version = FREESCALE_VERSION;
  info.transports = {"host"};
#ifdef FREESCALE_WITH_CUDA
  info.cuda = true;
  info.transports.push_back("ce");
  std::istringstream archs(FREESCALE_CUDA_ARCHS);
  std::string arch;
  while (std::getline(archs, arch, ';')) {
    if (!arch.empty()) info.cuda_archs.push_back(std::stoi(arch));  // "90a" -> 90
  }
#endif
#ifdef FREESCALE_WITH_NVSHMEM
  info.nvshmem = true;
  info.transports.push_back("nvshmem");
#endif
  info.nvshmem_detail = FREESCALE_NVSHMEM_WHY;
  return info;
}

int cuda_device_count() {
#ifdef FREESCALE_WITH_CUDA
  return probe_cuda_device_count();
#else
  return 0;
#endif
}

}  // namespace freescale

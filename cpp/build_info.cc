#include "cpp/build_info.h"

#include <sstream>

#include "cpp/device_transports.h"
#include "freescale_build_config.h"

namespace freescale {

BuildInfo build_info() {
  BuildInfo info;
  info.version = kBuildVersion;
  info.transports = {"host"};
  if (device_transport_built(TransportKind::kCe)) {
    info.cuda = true;
    info.transports.push_back("ce");
    std::istringstream archs(kBuildCudaArchs);
    std::string arch;
    while (std::getline(archs, arch, ';')) {
      if (!arch.empty()) info.cuda_archs.push_back(std::stoi(arch));  // "90a" -> 90
    }
  }
  if (device_transport_built(TransportKind::kNvshmem)) {
    info.nvshmem = true;
    info.transports.push_back("nvshmem");
  }
  info.nvshmem_detail = kNvshmemBuildDetail;
  return info;
}

}  // namespace freescale

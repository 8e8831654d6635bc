#include "cuda/nvshmem_api.h"

#include <dlfcn.h>
#include <link.h>
#include <climits>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include "cpp/errors.h"
#include "freescale_build_config.h"


namespace freescale {
namespace {

// <site-packages>/nvidia/nvshmem/lib/libnvshmem_host.so.3, from where this module was loaded
// (<site-packages>/freescale_comm/_core...so): the [nvshmem] extra installs it there.
std::string beside_this_package() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&beside_this_package), &info) == 0 || info.dli_fname == nullptr) return "";
  std::string self = info.dli_fname;
  size_t pkg = self.rfind('/');
  if (pkg == std::string::npos) return "";
  size_t site = self.rfind('/', pkg - 1);
  if (site == std::string::npos) return "";
  return self.substr(0, site) + "/nvidia/nvshmem/lib/libnvshmem_host.so.3";
}

template <typename F>
void resolve(void* lib, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
}

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  return ::realpath(path.c_str(), buf) != nullptr ? std::string(buf) : path;
}

NvshmemApi load() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("FREESCALE_NVSHMEM_LIB"); env != nullptr && *env != '\0') candidates.push_back(env);
  for (const std::string& loaded : loaded_nvshmem_libraries()) candidates.push_back(loaded);
  if (*kNvshmemBuildLibrary != '\0') candidates.push_back(kNvshmemBuildLibrary);
  candidates.push_back(beside_this_package());
  candidates.push_back("libnvshmem_host.so.3");
  std::string tried;
  void* lib = nullptr;
  NvshmemApi api;
  for (const std::string& path : candidates) {
    if (path.empty()) continue;
    // RTLD_GLOBAL: NVSHMEM's own plugins (bootstrap, transports) resolve symbols of the host library.
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (lib != nullptr) {
      api.path = path;
      break;
    }
    const char* why = dlerror();
    tried += "\n  " + path + ": " + (why != nullptr ? why : "not loadable");
  }
  if (lib == nullptr) {
    throw Error(ErrorCode::kUnsupported, "the nvshmem transport could not load libnvshmem_host.so.3; tried:" + tried +
                                             "\ninstall it with `pip install freescale_comm[nvshmem]` (nvidia-nvshmem-cu13) "
                                             "or point FREESCALE_NVSHMEM_LIB at it");
  }
  std::string missing;
  resolve(lib, "nvshmemx_hostlib_init_attr", &api.hostlib_init_attr, &missing);
  resolve(lib, "nvshmemx_hostlib_finalize", &api.hostlib_finalize, &missing);
  resolve(lib, "nvshmemx_init_status", &api.init_status, &missing);
  resolve(lib, "nvshmem_my_pe", &api.my_pe, &missing);
  resolve(lib, "nvshmem_n_pes", &api.n_pes, &missing);
  resolve(lib, "nvshmemx_get_uniqueid", &api.get_uniqueid, &missing);
  resolve(lib, "nvshmemx_set_attr_uniqueid_args", &api.set_attr_uniqueid_args, &missing);
  resolve(lib, "nvshmem_malloc", &api.malloc, &missing);
  resolve(lib, "nvshmem_free", &api.free, &missing);
  resolve(lib, "nvshmem_ptr", &api.ptr, &missing);
  resolve(lib, "nvshmemx_putmem_signal_on_stream", &api.putmem_signal_on_stream, &missing);
  resolve(lib, "nvshmemx_signal_op_on_stream", &api.signal_op_on_stream, &missing);
  resolve(lib, "nvshmemx_quiet_on_stream", &api.quiet_on_stream, &missing);
  if (!missing.empty()) {
    throw Error(ErrorCode::kUnsupported, api.path + " lacks " + missing + ": it is not an NVSHMEM 3.x host library");
  }
  std::string optional;
  resolve(lib, "nvshmemx_vendor_get_version_info", &api.version_info, &optional);
  Dl_info info{};  // the file the symbols came from, whatever name found it
  if (dladdr(reinterpret_cast<void*>(api.init_status), &info) != 0 && info.dli_fname != nullptr) api.path = info.dli_fname;
  api.path = real_path(api.path);
  return api;  // the library stays loaded for the life of the process
}

}  // namespace

std::vector<std::string> loaded_nvshmem_libraries() {
  std::vector<std::string> found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        auto* list = static_cast<std::vector<std::string>*>(out);
        const std::string name = info->dlpi_name != nullptr ? info->dlpi_name : "";
        if (name.find("libnvshmem_host.so") == std::string::npos) return 0;
        const std::string file = real_path(name);
        for (const std::string& f : *list)
          if (f == file) return 0;
        list->push_back(file);
        return 0;
      },
      &found);
  return found;
}

const NvshmemApi& NvshmemApi::get() {
  static std::mutex mu;
  static std::unique_ptr<NvshmemApi> api;
  std::lock_guard<std::mutex> lock(mu);
  if (!api) api = std::make_unique<NvshmemApi>(load());  // a failure is retried by the next call
  return *api;
}

}  // namespace freescale

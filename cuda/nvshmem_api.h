// The NVSHMEM host entry points the transport uses, loaded at run time with dlopen: the module
// then imports (and serves CPU / copy-engine traffic) where libnvshmem_host is absent, and the
// init call is one that returns its status (nvshmemx_init_attr exits the process on failure).
// Include from the NVSHMEM sources only (they see the NVSHMEM headers).
#pragma once

#include <nvshmem_host.h>

#include <string>
#include <vector>

namespace freescale {

struct NvshmemApi {
  decltype(&nvshmemx_hostlib_init_attr) hostlib_init_attr = nullptr;  // host-only init; returns status
  decltype(&nvshmemx_hostlib_finalize) hostlib_finalize = nullptr;
  decltype(&nvshmemx_init_status) init_status = nullptr;  // NVSHMEM_STATUS_*
  decltype(&nvshmem_my_pe) my_pe = nullptr;
  decltype(&nvshmem_n_pes) n_pes = nullptr;
  decltype(&nvshmemx_get_uniqueid) get_uniqueid = nullptr;
  decltype(&nvshmemx_set_attr_uniqueid_args) set_attr_uniqueid_args = nullptr;
  decltype(&nvshmem_malloc) malloc = nullptr;
  decltype(&nvshmem_free) free = nullptr;
  decltype(&nvshmem_ptr) ptr = nullptr;
  decltype(&nvshmemx_putmem_signal_on_stream) putmem_signal_on_stream = nullptr;
  decltype(&nvshmemx_signal_op_on_stream) signal_op_on_stream = nullptr;
  decltype(&nvshmemx_quiet_on_stream) quiet_on_stream = nullptr;
  decltype(&nvshmemx_vendor_get_version_info) version_info = nullptr;
  std::string path;  // the library that was loaded (the file: realpath)

  // Loaded once per process from, in order: $FREESCALE_NVSHMEM_LIB, a copy already loaded in the
  // process (torch's, nvshmem4py's: one runtime, not two), the build's NVSHMEM, the
  // nvidia-nvshmem-cu13 wheel beside this package, the soname. Throws Error(kUnsupported)
  // naming what was tried and the fix when none loads or a symbol is missing.
  static const NvshmemApi& get();
};

// The files of every libnvshmem_host copy loaded in this process (realpaths, dl_iterate_phdr).
std::vector<std::string> loaded_nvshmem_libraries();

}  // namespace freescale

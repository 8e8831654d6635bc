// The CUDA device probe: the only CUDA entry point until the copy-engine transport lands.
// Plain C++ interface: callers never include CUDA headers.
#pragma once

namespace freescale {

// Number of visible CUDA devices; 0 when there is no driver or no GPU (never throws, never
// initializes anything beyond the runtime's device query).
int probe_cuda_device_count();

}  // namespace freescale

// Whether the calling thread is one of our communicators' own progress threads. Transports bind
// such a thread to their device for good (its CUDA state is ours alone); any other thread is a
// user's, whose own state they restore after their work (cuda/device_util.h: ProgressScope).
#pragma once

namespace freescale {

void mark_own_progress_thread();
bool on_own_progress_thread();

}  // namespace freescale

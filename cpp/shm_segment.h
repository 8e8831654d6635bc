// Shared memory between the ranks of one host: an anonymous memory file (memfd) that peers open
// through /proc/<owner pid>/fd/<fd> (nothing named anywhere: a crash, even during setup, leaves
// nothing behind); where memfd is missing, a POSIX segment created 0600 under an unguessable name
// and unlinked once every peer attached. Unmapped on destruction.
#pragma once

#include <cstddef>
#include <string>

namespace freescale {

class ShmSegment {
 public:
  ShmSegment() = default;
  // New zero-filled segment of `bytes`, every page reserved (SystemError if memory is short).
  static ShmSegment create(size_t bytes);
  // Maps a peer's segment by its name(); throws SystemError if it is gone or smaller than `bytes`.
  static ShmSegment attach(const std::string& name, size_t bytes);

  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  // Once every peer attached: drops the name / the descriptor peers opened it by (owner only;
  // idempotent). The mapping stays valid.
  void unlink();
  // Drops the name (unlink()) but keeps the mapping for the life of the process: for memory a
  // device may still read or write (registered with CUDA, a stuck copy queued on it).
  void leak();
  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  void release();
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_linked_ = false;  // we created a POSIX name and have not unlinked it yet
  int fd_ = -1;                // our memfd, open until unlink()
};

}  // namespace freescale

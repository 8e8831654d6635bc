// A POSIX shared-memory segment: created 0600 under an unguessable name, unlinked as soon as every
// peer has attached (so a crash leaves nothing in /dev/shm), unmapped on destruction.
#pragma once

#include <cstddef>
#include <string>

namespace freescale {

class ShmSegment {
 public:
  ShmSegment() = default;
  // New zero-filled segment of `bytes`; the name is random (128 bits from the OS).
  static ShmSegment create(size_t bytes);
  // Maps a peer's segment; throws SystemError if it is gone or smaller than `bytes`.
  static ShmSegment attach(const std::string& name, size_t bytes);

  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  // Removes the name (owner only; idempotent). The mapping stays valid.
  void unlink();
  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  void release();
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_linked_ = false;  // we created it and have not unlinked it yet
};

}  // namespace freescale

#include "cpp/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <random>
#include <utility>

#include "cpp/errors.h"

namespace freescale {
namespace {

// "/freescale-<creator pid>-<128 random bits>": the pid says whose a leftover is.
std::string random_name() {
  std::random_device rd;  // reads the OS entropy source
  char buf[80];
  std::snprintf(buf, sizeof(buf), "/freescale-%d-%08x%08x%08x%08x", static_cast<int>(getpid()), rd(), rd(), rd(), rd());
  return buf;
}

void* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    close(fd);
    throw SystemError("mmap of shared segment " + name, err);
  }
  close(fd);
  return p;
}

}  // namespace

ShmSegment ShmSegment::create(size_t bytes) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    std::string name = random_name();
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno == EEXIST) continue;
    if (fd < 0) throw SystemError("shm_open(" + name + ")", errno);
    ShmSegment seg;
    seg.name_ = name;
    seg.owner_linked_ = true;
    // ftruncate alone reserves nothing: a write past what /dev/shm holds would be a SIGBUS. Reserve
    // every page now, so a small /dev/shm (Docker's 64 MiB) fails here, on every rank, by name.
    int err = ftruncate(fd, static_cast<off_t>(bytes)) != 0 ? errno : posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (err != 0) {
      close(fd);
      shm_unlink(name.c_str());
      throw SystemError("reserving " + std::to_string(bytes) + " bytes of shared memory for " + name +
                            " (/dev/shm is too small or full: lower FREESCALE_ARENA_BYTES, or give the container "
                            "more /dev/shm, e.g. docker --shm-size)", err);
    }
    try {
      seg.data_ = map_fd(fd, bytes, name);
    } catch (...) {
      shm_unlink(name.c_str());
      throw;
    }
    seg.size_ = bytes;
    return seg;
  }
  throw Error(ErrorCode::kSystem, "could not find a free shared-memory name after 8 attempts");
}

ShmSegment ShmSegment::attach(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw SystemError("shm_open(" + name + ") of a peer's segment", errno);
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
    close(fd);
    throw Error(ErrorCode::kSystem, "peer segment " + name + " is smaller than the " + std::to_string(bytes) +
                                        " bytes its owner announced");
  }
  ShmSegment seg;
  seg.name_ = name;
  seg.data_ = map_fd(fd, bytes, name);
  seg.size_ = bytes;
  return seg;
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owner_linked_ = std::exchange(other.owner_linked_, false);
  }
  return *this;
}

ShmSegment::~ShmSegment() { release(); }

void ShmSegment::unlink() {
  if (owner_linked_) {
    shm_unlink(name_.c_str());
    owner_linked_ = false;
  }
}

void ShmSegment::release() {
  unlink();
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace freescale

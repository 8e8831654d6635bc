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

// Reserves every page of the file behind `fd` (a write past what the memory behind it holds would
// be a SIGBUS later); on failure closes `fd` and throws, naming `name`.
void reserve(int fd, size_t bytes, const std::string& name) {
  int err = ftruncate(fd, static_cast<off_t>(bytes)) != 0 ? errno : posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    close(fd);
    throw SystemError("reserving " + std::to_string(bytes) + " bytes of shared memory for " + name +
                          " (too little memory, or /dev/shm too small or full: lower FREESCALE_ARENA_BYTES, or give "
                          "the container more, e.g. docker --shm-size)", err);
  }
}

}  // namespace

ShmSegment ShmSegment::create(size_t bytes) {
  // Preferred: an anonymous memory file that peers open through /proc/<pid>/fd/<fd>. It has no
  // name anywhere, so nothing outlives this process, whenever it dies.
  int fd = memfd_create("freescale-arena", MFD_CLOEXEC);
  if (fd >= 0) {
    ShmSegment seg;
    seg.name_ = "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(fd);
    reserve(fd, bytes, "an arena");
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      close(fd);
      throw SystemError("mmap of a shared arena", err);
    }
    seg.data_ = p;
    seg.size_ = bytes;
    seg.fd_ = fd;  // open until every peer has opened it (unlink)
    return seg;
  }
  // No memfd (kernels before 3.17): a named POSIX segment, unlinked once every peer attached.
  for (int attempt = 0; attempt < 8; ++attempt) {
    std::string name = random_name();
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno == EEXIST) continue;
    if (fd < 0) throw SystemError("shm_open(" + name + ")", errno);
    ShmSegment seg;
    seg.name_ = name;
    seg.owner_linked_ = true;
    try {
      reserve(fd, bytes, name);
    } catch (...) {
      shm_unlink(name.c_str());
      throw;
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
  const bool by_fd = name.rfind("/proc/", 0) == 0;  // a peer's memfd, else a POSIX name
  int fd = by_fd ? open(name.c_str(), O_RDWR | O_CLOEXEC) : shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    throw SystemError((by_fd ? "open(" : "shm_open(") + name + ") of a peer's arena" +
                          (by_fd ? " (ranks must run as one user, with /proc mounted)" : ""),
                      errno);
  }
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
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

ShmSegment::~ShmSegment() { release(); }

void ShmSegment::unlink() {
  if (owner_linked_) {
    shm_unlink(name_.c_str());
    owner_linked_ = false;
  }
  if (fd_ >= 0) {  // peers hold their own descriptors or mappings now
    close(fd_);
    fd_ = -1;
  }
}

void ShmSegment::leak() {
  unlink();
  data_ = nullptr;  // never unmapped
  size_ = 0;
}

void ShmSegment::release() {
  unlink();
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace freescale

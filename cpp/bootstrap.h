// Out-of-band exchange of small byte blobs during communicator setup. Implemented over the
// torch Store / object collectives in Python, and over fork+pipes in GoogleTest.
#pragma once

#include <string>
#include <vector>

namespace freescale {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Collective: every rank contributes `mine`; returns all contributions indexed by rank.
  virtual std::vector<std::string> allgather(const std::string& mine) = 0;
  // Collective: returns once every rank has entered.
  virtual void barrier() { allgather(std::string()); }
};

}  // namespace freescale

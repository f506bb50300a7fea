#include "memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <vector>

namespace conduit {

namespace {
constexpr uintptr_t kHugePage = 2u << 20;
constexpr int kMadvCollapse = 25;  // Linux 6.1; older headers lack the name
}  // namespace

size_t advise_huge_pages(const uint8_t* p, size_t bytes, bool populated) {
  static const bool disabled = [] {
    const char* v = std::getenv("CONDUIT_HUGE_PAGES");
    return v != nullptr && std::strcmp(v, "0") == 0;
  }();
  if (disabled) return 0;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHugePage - 1);
  if (end <= begin) return 0;
  void* start = reinterpret_cast<void*>(begin);
  const size_t length = end - begin;
  if (populated && madvise(start, length, kMadvCollapse) == 0) return length;
  return madvise(start, length, MADV_HUGEPAGE) == 0 && !populated ? length : 0;
}

size_t release_pages(const uint8_t* p, size_t bytes) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(page - 1);
  if (end <= begin) return 0;
  return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED) == 0 ? end - begin : 0;
}

size_t resident_bytes(const uint8_t* p, size_t bytes) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(page - 1);
  if (end <= begin) return 0;
  std::vector<unsigned char> resident((end - begin) / page);
  if (mincore(reinterpret_cast<void*>(begin), end - begin, resident.data()) != 0) return 0;
  size_t pages = 0;
  for (unsigned char r : resident) pages += r & 1;
  return pages * page;
}

}  // namespace conduit

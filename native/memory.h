// Page-size advice for the large buffers the kernels stream. On this class of machine (a VM with nested paging) a
// TLB miss is expensive enough that streaming 4 KiB pages reaches about half the bandwidth of 2 MiB pages, and a
// decode step streams every weight once, so the weights are worth moving onto huge pages in place: the virtual
// addresses, and so the zero-copy views JavaScript owns, stay the same.
#pragma once

#include <cstddef>
#include <cstdint>

namespace conduit {

// Asks the kernel to back the 2 MiB-aligned interior of [p, p + bytes) with huge pages now (MADV_COLLAPSE, which
// copies populated pages) or, where that is unavailable, as they are faulted in (MADV_HUGEPAGE). Returns the
// bytes now on huge pages (0 if the range is too small or the kernel declined). Never fails. CONDUIT_HUGE_PAGES=0
// turns the advice off.
size_t advise_huge_pages(const uint8_t* p, size_t bytes, bool populated);

// Gives the pages wholly inside [p, p + bytes) back to the system (MADV_DONTNEED): private anonymous memory reads
// as zeros afterwards, so only for bytes nothing will read again. Returns the bytes released (0 if none or the
// kernel declined). Never fails.
size_t release_pages(const uint8_t* p, size_t bytes);

// Bytes of the pages wholly inside [p, p + bytes) that are resident in memory now (mincore); 0 if the kernel
// declined.
size_t resident_bytes(const uint8_t* p, size_t bytes);

}  // namespace conduit

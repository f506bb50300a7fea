// CRC-32C (Castagnoli, the iSCSI / ext4 polynomial 0x1EDC6F41, reflected) of a byte range: the checksum of each block
// run of a KV transfer between worker processes (src/cluster/kv-checksum.ts has the same function in TypeScript,
// for a process without the addon; both give the same values).
#pragma once

#include <cstddef>
#include <cstdint>

namespace conduit {

// The running CRC of `crc` (0 to start) extended by n bytes at p: crc32c(crc32c(0, a), b) == crc32c(0, a + b).
// The SSE4.2 crc32 instruction where the CPU has it, else slice-by-8 tables.
uint32_t crc32c(uint32_t crc, const uint8_t* p, size_t n);

// The table version on its own, for the test that compares the two.
uint32_t crc32c_portable(uint32_t crc, const uint8_t* p, size_t n);

// Copies n bytes from src to dst and returns crc32c(crc, src, n), in one pass over the bytes: each piece of a few
// KiB is checksummed and then copied while it is in the L1 cache, so the bytes come from memory once. A KV
// transfer's receiver lands the socket's bytes in a small reused buffer (hot in cache) and moves them into their
// block with this. dst and src must not overlap. uncached: the copy's stores bypass the cache (non-temporal, x86),
// for destinations larger than the cache that nothing reads soon: their lines are then neither read first nor evict
// the rest.
uint32_t crc32c_copy(uint32_t crc, const uint8_t* src, uint8_t* dst, size_t n, bool uncached = false);

}  // namespace conduit

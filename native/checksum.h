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

}  // namespace conduit

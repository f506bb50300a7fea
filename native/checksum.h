// CRC-32C (Castagnoli, the iSCSI / ext4 polynomial 0x1EDC6F41, reflected) of a byte range: the checksum of each block
// run of a KV transfer between worker processes (src/cluster/kv-checksum.ts has the same function in TypeScript,
// for a process without the addon; both give the same values).
#pragma once

#include <cstddef>
#include <cstdint>

namespace conduit {

// The running CRC of `crc` (0 to start) extended by n bytes at p: crc32c(crc32c(0, a), b) == crc32c(0, a + b).
// Computed by the path crc32c_path() names (all give the same values).
uint32_t crc32c(uint32_t crc, const uint8_t* p, size_t n);

// How crc32c and crc32c_copy compute it:
//   Table  slice-by-8 tables (any CPU);
//   Sse42  the crc32 instruction in three interleaved streams (x86 with SSE4.2);
//   Clmul256  the same folding on ymm registers, 32-byte blocks (AVX2 + VPCLMULQDQ, for CPUs without AVX-512);
//   Clmul  carry-less multiplication folding 64-byte blocks in zmm registers (AVX-512F + VPCLMULQDQ), the
//          remainder finished with the crc32 instruction; inputs under a few hundred bytes take the Sse42 path.
// The best one the CPU runs (the last it runs of this list) is chosen at the first call, unless the environment
// variable CONDUIT_CRC32C names one (table, sse42, clmul256 or clmul; read once) that it runs.
enum class Crc32cPath : int { Table = 0, Sse42 = 1, Clmul256 = 2, Clmul = 3 };
constexpr int kNumCrc32cPaths = 4;
const char* crc32c_path_name(Crc32cPath path);
bool crc32c_path_supported(Crc32cPath path);
Crc32cPath crc32c_path();
// Chooses the path for the whole process (tests and benchmarks compare them): false, and no change, for a name that
// is not a path or a path this CPU does not run.
bool crc32c_set_path(const char* name);

// The table version on its own, for the test that compares the two.
uint32_t crc32c_portable(uint32_t crc, const uint8_t* p, size_t n);

// Copies n bytes from src to dst and returns crc32c(crc, src, n), in one pass over the bytes: the folding paths store
// each block from the register they loaded it into for the fold, the others checksum a piece of a few KiB and then
// copy it while it is in the L1 cache, so the bytes come from memory once. A KV
// transfer's receiver lands the socket's bytes in a small reused buffer (hot in cache) and moves them into their
// block with this. dst and src must not overlap. uncached: the copy's stores bypass the cache (non-temporal, x86),
// for destinations larger than the cache that nothing reads soon: their lines are then neither read first nor evict
// the rest.
uint32_t crc32c_copy(uint32_t crc, const uint8_t* src, uint8_t* dst, size_t n, bool uncached = false);

}  // namespace conduit

// CRC-32C: see checksum.h. The Sse42 path feeds 8 bytes per crc32 instruction in three independent streams (the
// instruction's latency is three cycles, its throughput one per cycle) and joins the three CRCs with the
// shift-by-length operator below. The Clmul path folds 64-byte blocks with carry-less multiplication on zmm
// registers (two multiplies per 64 bytes where the crc32 instruction takes eight) and hands the crc32 instruction
// only the last 16 bytes of the fold and the tail. The tables serve CPUs with neither and the bytes that do not fill
// a word.
#include "checksum.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common.h"
#include "cpu.h"

#if CONDUIT_X86
#include <immintrin.h>
#endif

namespace conduit {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // 0x1EDC6F41 reflected

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
      for (int s = 1; s < 8; s++) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
  }
};

const Tables& tables() {
  static const Tables instance;
  return instance;
}

#if CONDUIT_X86
// Only the SSE4.2 path joins independent streams, and so needs these (an arm64 build would warn them unused).
// Multiplication of two bit-reflected polynomials modulo the CRC polynomial.
uint32_t gf2_multiply(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (int i = 0; i < 32; i++) {
    if (a & 0x80000000u) product ^= b;
    a <<= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^bits mod P, reflected (bit 31 is x^0).
uint32_t x_power_mod(uint64_t bits) {
  uint32_t result = 0x80000000u;  // x^0
  uint32_t power = 0x40000000u;   // x^1
  for (; bits > 0; bits >>= 1) {
    if (bits & 1) result = gf2_multiply(result, power);
    power = gf2_multiply(power, power);
  }
  return result;
}

// x^(8 * n) mod P: what extending a CRC by n zero bytes multiplies it by.
uint32_t shift_operator(size_t n) { return x_power_mod(8 * static_cast<uint64_t>(n)); }

// Extending a CRC by `lane` zero bytes, as a table: the operator is linear over GF(2), so it is the XOR of its value
// on each of the CRC's four bytes (4 lookups instead of a 32-step multiply).
struct ShiftTable {
  uint32_t t[4][256];
  explicit ShiftTable(size_t lane) {
    const uint32_t op = shift_operator(lane);
    for (int k = 0; k < 4; k++) {
      for (uint32_t v = 0; v < 256; v++) t[k][v] = gf2_multiply(v << (8 * k), op);
    }
  }
  uint32_t shift(uint32_t c) const {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
  }
};

// Three streams of `lane` bytes each, while 3 * lane bytes are left; c0 carries the running value in and out.
template <size_t kLane>
__attribute__((target("sse4.2"), always_inline)) inline void crc32c_three_streams(uint64_t& c0, const uint8_t*& p, size_t& n) {
  if (n < 3 * kLane) return;
  static const ShiftTable table(kLane);
  while (n >= 3 * kLane) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t* p1 = p + kLane;
    const uint8_t* p2 = p + 2 * kLane;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p1 + i, 8);
      std::memcpy(&w2, p2 + i, 8);
      c0 = _mm_crc32_u64(c0, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    // crc(A B C) = shift(shift(crc(A)) ^ crc'(B)) ^ crc'(C), the primed ones started from zero (no pre/post xor).
    c0 = table.shift(table.shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1)) ^ static_cast<uint32_t>(c2);
    p += 3 * kLane;
    n -= 3 * kLane;
  }
}

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c0 = crc ^ 0xFFFFFFFFu;
  // The instruction's latency is three cycles, its throughput one per cycle: three independent streams, joined
  // after, keep it busy. Lanes of 8 KiB for long inputs, then 1 KiB and 128 bytes for what is left, so a run of a few
  // KiB (a KV block's layer) also goes at the instruction's throughput rather than its latency.
  crc32c_three_streams<8192>(c0, p, n);
  crc32c_three_streams<1024>(c0, p, n);
  crc32c_three_streams<128>(c0, p, n);
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c0 = _mm_crc32_u64(c0, w);
  }
  uint32_t c = static_cast<uint32_t>(c0);
  for (; n > 0; p++, n--) c = _mm_crc32_u8(c, *p);
  return c ^ 0xFFFFFFFFu;
}

// Folding. A 16-byte block in a register, read as a polynomial the way the CRC reads bytes (the first byte's low
// bit is the highest power), stands for x^127 at bit 0 down to x^0 at bit 127; its low 8 bytes are the high half
// H, its high 8 bytes the low half L. Moving the block D bits later in the message multiplies it by x^D, and only
// its value mod P matters, so H * x^(D+64) + L * x^D may be replaced by H * (x^(D+64) mod P) + L * (x^D mod P): two
// 64 x 32-bit carry-less products, at most 96 bits, which XOR into the 16-byte block D bits on. The instruction
// multiplies two 64-bit reflected operands into a 127-bit product that lands one bit short of the register's top,
// and a 32-bit reflected constant in the low half of its operand stands for itself times x^32: together a factor
// x^33, taken out of the constants, which are x^(D+31) and x^(D-33) mod P.
struct FoldConstant {
  alignas(16) uint64_t k[2];  // k[0] multiplies the low 8 bytes (H), k[1] the high 8 (L)
  explicit FoldConstant(uint64_t bits) : k{x_power_mod(bits + 31), x_power_mod(bits - 33)} {}
};

struct FoldConstants {
  FoldConstant by2048{2048}, by1024{1024}, by512{512}, by256{256}, by128{128};
};

const FoldConstants& fold_constants() {
  static const FoldConstants instance;
  return instance;
}

// The folds start from four accumulators; shorter inputs take the Sse42 path (at a few hundred bytes the paths
// differ by less than a call from JavaScript costs).
constexpr size_t kClmulMinBytes = 256;

#define CONDUIT_CLMUL_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))
#define CONDUIT_CLMUL256_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))
// What both folds share, compiled for what both targets have so it inlines into either.
#define CONDUIT_PCLMUL_TARGET __attribute__((target("pclmul,sse4.2")))

CONDUIT_PCLMUL_TARGET inline __m128i fold128(__m128i acc, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(acc, k, 0x00), _mm_clmulepi64_si128(acc, k, 0x11)), next);
}

CONDUIT_PCLMUL_TARGET inline __m128i load_constant(const FoldConstant& c) {
  return _mm_load_si128(reinterpret_cast<const __m128i*>(c.k));
}

// The end of both folds: r, one 16-byte block congruent to everything read so far, takes in the remaining whole
// 16-byte blocks; then its CRC from zero (no pre-xor: the running value is already in) continues into the tail.
CONDUIT_PCLMUL_TARGET inline uint32_t finish_fold(__m128i r, const uint8_t* p, size_t n) {
  const __m128i k128 = load_constant(fold_constants().by128);
  for (; n >= 16; p += 16, n -= 16) r = fold128(r, k128, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(r)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(r, 1)));
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; p++, n--) c32 = _mm_crc32_u8(c32, *p);
  return c32 ^ 0xFFFFFFFFu;
}

CONDUIT_CLMUL_TARGET inline __m512i fold512(__m512i acc, __m512i k, __m512i next) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00), _mm512_clmulepi64_epi128(acc, k, 0x11),
                                   next, 0x96);  // a ^ b ^ c
}

// Loads 64 bytes of src and, for the copying variant, stores them to dst (kStream: non-temporal, dst 64-aligned).
template <bool kCopy, bool kStream>
CONDUIT_CLMUL_TARGET inline __m512i load_block(const uint8_t* src, uint8_t* dst) {
  const __m512i v = _mm512_loadu_si512(src);
  if (kCopy) {
    if (kStream) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
    else _mm512_storeu_si512(dst, v);
  }
  return v;
}

// n >= kClmulMinBytes. Copies the bytes to dst as it reads them when kCopy (dst must not overlap src), so each byte
// is loaded once for both.
template <bool kCopy, bool kStream>
CONDUIT_CLMUL_TARGET uint32_t crc32c_clmul_impl(uint32_t crc, const uint8_t* p, uint8_t* dst, size_t n) {
  const FoldConstants& k = fold_constants();
  // The running value XORs into the message's first four bytes: what the crc32 instruction does with its input.
  const __m512i initial = _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc ^ 0xFFFFFFFFu)));
  // Four accumulators of 64 bytes, each folded 256 bytes on per round: four independent chains keep the multiplier
  // busy through its latency.
  __m512i x0 = _mm512_xor_si512(load_block<kCopy, kStream>(p, dst), initial);
  __m512i x1 = load_block<kCopy, kStream>(p + 64, dst + 64);
  __m512i x2 = load_block<kCopy, kStream>(p + 128, dst + 128);
  __m512i x3 = load_block<kCopy, kStream>(p + 192, dst + 192);
  p += 256;
  dst += 256;
  n -= 256;
  const __m512i k2048 = _mm512_broadcast_i32x4(load_constant(k.by2048));
  for (; n >= 256; p += 256, dst += 256, n -= 256) {
    x0 = fold512(x0, k2048, load_block<kCopy, kStream>(p, dst));
    x1 = fold512(x1, k2048, load_block<kCopy, kStream>(p + 64, dst + 64));
    x2 = fold512(x2, k2048, load_block<kCopy, kStream>(p + 128, dst + 128));
    x3 = fold512(x3, k2048, load_block<kCopy, kStream>(p + 192, dst + 192));
  }
  const __m512i k512 = _mm512_broadcast_i32x4(load_constant(k.by512));
  x3 = fold512(fold512(fold512(x0, k512, x1), k512, x2), k512, x3);
  for (; n >= 64; p += 64, dst += 64, n -= 64) x3 = fold512(x3, k512, load_block<kCopy, kStream>(p, dst));
  if (kCopy) std::memcpy(dst, p, n);
  // The register's four 16-byte lanes into one.
  const __m128i k128 = load_constant(k.by128);
  __m128i r = fold128(_mm512_castsi512_si128(x3), k128, _mm512_extracti32x4_epi32(x3, 1));
  r = fold128(r, k128, _mm512_extracti32x4_epi32(x3, 2));
  r = fold128(r, k128, _mm512_extracti32x4_epi32(x3, 3));
  return finish_fold(r, p, n);
}

CONDUIT_CLMUL256_TARGET inline __m256i fold256(__m256i acc, __m256i k, __m256i next) {
  return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(acc, k, 0x00), _mm256_clmulepi64_epi128(acc, k, 0x11)),
                          next);
}

// load_block on 32 bytes (kStream: dst 32-aligned).
template <bool kCopy, bool kStream>
CONDUIT_CLMUL256_TARGET inline __m256i load_block256(const uint8_t* src, uint8_t* dst) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  if (kCopy) {
    if (kStream) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), v);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
  }
  return v;
}

// crc32c_clmul_impl on ymm registers: four accumulators of 32 bytes, folded 128 bytes on per round.
template <bool kCopy, bool kStream>
CONDUIT_CLMUL256_TARGET uint32_t crc32c_clmul256_impl(uint32_t crc, const uint8_t* p, uint8_t* dst, size_t n) {
  const FoldConstants& k = fold_constants();
  const __m256i initial = _mm256_zextsi128_si256(_mm_cvtsi32_si128(static_cast<int>(crc ^ 0xFFFFFFFFu)));
  __m256i x0 = _mm256_xor_si256(load_block256<kCopy, kStream>(p, dst), initial);
  __m256i x1 = load_block256<kCopy, kStream>(p + 32, dst + 32);
  __m256i x2 = load_block256<kCopy, kStream>(p + 64, dst + 64);
  __m256i x3 = load_block256<kCopy, kStream>(p + 96, dst + 96);
  p += 128;
  dst += 128;
  n -= 128;
  const __m256i k1024 = _mm256_broadcastsi128_si256(load_constant(k.by1024));
  for (; n >= 128; p += 128, dst += 128, n -= 128) {
    x0 = fold256(x0, k1024, load_block256<kCopy, kStream>(p, dst));
    x1 = fold256(x1, k1024, load_block256<kCopy, kStream>(p + 32, dst + 32));
    x2 = fold256(x2, k1024, load_block256<kCopy, kStream>(p + 64, dst + 64));
    x3 = fold256(x3, k1024, load_block256<kCopy, kStream>(p + 96, dst + 96));
  }
  const __m256i k256 = _mm256_broadcastsi128_si256(load_constant(k.by256));
  x3 = fold256(fold256(fold256(x0, k256, x1), k256, x2), k256, x3);
  for (; n >= 32; p += 32, dst += 32, n -= 32) x3 = fold256(x3, k256, load_block256<kCopy, kStream>(p, dst));
  if (kCopy) std::memcpy(dst, p, n);
  const __m128i r = fold128(_mm256_castsi256_si128(x3), load_constant(k.by128), _mm256_extracti128_si256(x3, 1));
  return finish_fold(r, p, n);
}

uint32_t crc32c_clmul(uint32_t crc, const uint8_t* p, size_t n) {
  if (n < kClmulMinBytes) return crc32c_sse42(crc, p, n);
  return crc32c_clmul_impl<false, false>(crc, p, nullptr, n);
}

uint32_t crc32c_clmul256(uint32_t crc, const uint8_t* p, size_t n) {
  if (n < kClmulMinBytes) return crc32c_sse42(crc, p, n);
  return crc32c_clmul256_impl<false, false>(crc, p, nullptr, n);
}
#endif

bool path_supported(Crc32cPath path) {
#if CONDUIT_X86
  const CpuFeatures& f = cpu_features();
  switch (path) {
    case Crc32cPath::Table: return true;
    case Crc32cPath::Sse42: return f.sse42;
    case Crc32cPath::Clmul256: return f.sse42 && f.pclmulqdq && f.vpclmulqdq && f.avx2;
    case Crc32cPath::Clmul: return f.sse42 && f.pclmulqdq && f.vpclmulqdq && f.avx512f;
  }
  return false;
#else
  return path == Crc32cPath::Table;
#endif
}

bool parse_path(const char* name, Crc32cPath* out) {
  for (int i = 0; i < kNumCrc32cPaths; i++) {
    if (std::strcmp(name, crc32c_path_name(static_cast<Crc32cPath>(i))) == 0) {
      *out = static_cast<Crc32cPath>(i);
      return true;
    }
  }
  return false;
}

Crc32cPath initial_path() {
  Crc32cPath best = Crc32cPath::Table;
  for (int i = 0; i < kNumCrc32cPaths; i++) {
    if (path_supported(static_cast<Crc32cPath>(i))) best = static_cast<Crc32cPath>(i);
  }
  const char* forced = std::getenv("CONDUIT_CRC32C");
  if (forced == nullptr || *forced == 0) return best;
  Crc32cPath chosen;
  if (!parse_path(forced, &chosen) || !path_supported(chosen)) {
    std::fprintf(stderr, "conduit: CONDUIT_CRC32C=%s is not a CRC-32C path this CPU runs (table, sse42, clmul256, clmul); "
                 "using %s\n", forced, crc32c_path_name(best));
    return best;
  }
  return chosen;
}

// Read on every call (a relaxed load): crc32c_set_path may change it while other threads checksum.
std::atomic<int>& current_path() {
  static std::atomic<int> path{static_cast<int>(initial_path())};
  return path;
}

}  // namespace

const char* crc32c_path_name(Crc32cPath path) {
  switch (path) {
    case Crc32cPath::Table: return "table";
    case Crc32cPath::Sse42: return "sse42";
    case Crc32cPath::Clmul256: return "clmul256";
    case Crc32cPath::Clmul: return "clmul";
  }
  return "unknown";
}

bool crc32c_path_supported(Crc32cPath path) { return path_supported(path); }

Crc32cPath crc32c_path() { return static_cast<Crc32cPath>(current_path().load(std::memory_order_relaxed)); }

bool crc32c_set_path(const char* name) {
  Crc32cPath path;
  if (!parse_path(name, &path) || !path_supported(path)) return false;
  current_path().store(static_cast<int>(path), std::memory_order_relaxed);
  return true;
}

uint32_t crc32c_portable(uint32_t crc, const uint8_t* p, size_t n) {
  const Tables& tb = tables();
  uint32_t c = crc ^ 0xFFFFFFFFu;
  for (; n >= 8; p += 8, n -= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;  // little-endian hosts (x86, arm64)
    c = tb.t[7][lo & 0xff] ^ tb.t[6][(lo >> 8) & 0xff] ^ tb.t[5][(lo >> 16) & 0xff] ^ tb.t[4][lo >> 24]
      ^ tb.t[3][hi & 0xff] ^ tb.t[2][(hi >> 8) & 0xff] ^ tb.t[1][(hi >> 16) & 0xff] ^ tb.t[0][hi >> 24];
  }
  for (; n > 0; p++, n--) c = (c >> 8) ^ tb.t[0][(c ^ *p) & 0xff];
  return c ^ 0xFFFFFFFFu;
}

uint32_t crc32c(uint32_t crc, const uint8_t* p, size_t n) {
#if CONDUIT_X86
  switch (crc32c_path()) {
    case Crc32cPath::Clmul: return crc32c_clmul(crc, p, n);
    case Crc32cPath::Clmul256: return crc32c_clmul256(crc, p, n);
    case Crc32cPath::Sse42: return crc32c_sse42(crc, p, n);
    case Crc32cPath::Table: break;
  }
#endif
  return crc32c_portable(crc, p, n);
}

namespace {

#if CONDUIT_X86
// memcpy with non-temporal stores (SSE2, every x86-64): the destination lines are not read first nor kept in cache.
void copy_streaming(uint8_t* dst, const uint8_t* src, size_t n) {
  size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  for (; n >= 64; dst += 64, src += 64, n -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
  }
  std::memcpy(dst, src, n);
}
#endif

}  // namespace

#if CONDUIT_X86
namespace {

// The Clmul and Clmul256 paths' checksum-and-copy: each block is stored from the register it was loaded into for
// the fold, so the bytes are read once. n >= kClmulMinBytes.
template <bool kWide>
uint32_t crc32c_copy_folding(uint32_t crc, const uint8_t* src, uint8_t* dst, size_t n, bool uncached) {
  if (!uncached) {
    return kWide ? crc32c_clmul_impl<true, false>(crc, src, dst, n) : crc32c_clmul256_impl<true, false>(crc, src, dst, n);
  }
  // Non-temporal stores of whole 64-byte lines need dst aligned: the bytes up to the first line go the short way.
  const size_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
  crc = crc32c_sse42(crc, src, head);
  std::memcpy(dst, src, head);
  src += head;
  dst += head;
  n -= head;
  if (n >= kClmulMinBytes) {
    crc = kWide ? crc32c_clmul_impl<true, true>(crc, src, dst, n) : crc32c_clmul256_impl<true, true>(crc, src, dst, n);
  } else {
    crc = crc32c_sse42(crc, src, n);
    std::memcpy(dst, src, n);
  }
  _mm_sfence();  // the streamed stores are ordered before whatever the caller does next
  return crc;
}

}  // namespace
#endif

uint32_t crc32c_copy(uint32_t crc, const uint8_t* src, uint8_t* dst, size_t n, bool uncached) {
#if CONDUIT_X86
  if (n >= kClmulMinBytes) {
    const Crc32cPath path = crc32c_path();
    if (path == Crc32cPath::Clmul) return crc32c_copy_folding<true>(crc, src, dst, n, uncached);
    if (path == Crc32cPath::Clmul256) return crc32c_copy_folding<false>(crc, src, dst, n, uncached);
  }
#endif
  // Pieces of three lanes of the SSE4.2 loop (24 KiB): checksummed, then copied from L1.
  constexpr size_t kPiece = 3 * 8192;
#if !CONDUIT_X86
  (void)uncached;  // no streaming stores here: a plain copy
#endif
  while (n > 0) {
    const size_t take = n < kPiece ? n : kPiece;
    crc = crc32c(crc, src, take);
#if CONDUIT_X86
    if (uncached) copy_streaming(dst, src, take);
    else
#endif
      std::memcpy(dst, src, take);
    src += take;
    dst += take;
    n -= take;
  }
#if CONDUIT_X86
  if (uncached) _mm_sfence();  // the streamed stores are ordered before whatever the caller does next
#endif
  return crc;
}

}  // namespace conduit

// CRC-32C: see checksum.h. The hardware path feeds 8 bytes per crc32 instruction in three independent streams
// (the instruction's latency is three cycles, its throughput one per cycle) and joins the three CRCs with the
// shift-by-length operator below; the tables serve CPUs without SSE4.2 and the bytes that do not fill a word.
#include "checksum.h"

#include <cstring>

#include "common.h"

#if CONDUIT_X86
#include <cpuid.h>
#include <emmintrin.h>
#include <nmmintrin.h>
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

// x^(8 * n) mod P, reflected: what extending a CRC by n zero bytes multiplies it by.
uint32_t shift_operator(size_t n) {
  uint32_t result = 0x80000000u;  // x^0
  uint32_t power = 0x00800000u;   // x^8: one byte
  for (; n > 0; n >>= 1) {
    if (n & 1) result = gf2_multiply(result, power);
    power = gf2_multiply(power, power);
  }
  return result;
}

bool has_sse42() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_SSE4_2) != 0;
  }();
  return has;
}

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
#endif

}  // namespace

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
  if (has_sse42()) return crc32c_sse42(crc, p, n);
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

uint32_t crc32c_copy(uint32_t crc, const uint8_t* src, uint8_t* dst, size_t n, bool uncached) {
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

// Shared definitions of the native kernels: ggml element types and block layouts, half-precision conversions,
// kernel variants. Plain C++17, no ISA-specific code (that lives in the *_avx2.cc / *_avx512.cc files).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

// x86-64 builds carry the avx2 / avx512 / amx kernels (binding.gyp compiles those files only there); every other
// architecture gets the generic kernels, and the x86 variants fall back to them (see kernel_table in cpu.cc).
#if defined(__x86_64__) || defined(__i386__)
#define CONDUIT_X86 1
#else
#define CONDUIT_X86 0
#endif

namespace conduit {

// ---------------------------------------------------------------------------------------------------------------
// Kernel variants. Generic .. Amx are ordered: a CPU that runs one runs every lower one, and the highest it runs is
// chosen. AmxModel stands outside that order: the amx kernels built over a software model of the tile instructions
// (amx_tile_model.h), so they can be checked on CPUs without AMX. It runs wherever avx512 runs, is slow, and is only
// ever used when asked for by name. Every variant above Avx512 is built on the avx512 kernels.
enum class Variant : int { Generic = 0, Avx2 = 1, Avx512 = 2, Amx = 3, AmxModel = 4 };
constexpr int kNumVariants = 5;
const char* variant_name(Variant v);
bool parse_variant(const char* name, Variant* out);

// ---------------------------------------------------------------------------------------------------------------
// ggml element types (ggml.h `enum ggml_type`) that the kernels compute with.
enum GgmlType : int {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBF16 = 30,
};

bool is_supported_type(int type);
const char* type_name(int type);
// Elements per block and bytes per block (1 element for the plain float types).
int type_block_elements(int type);
int type_block_bytes(int type);
// Bytes of one row of `elements` elements; the caller has checked that elements is a multiple of the block size.
inline size_t row_bytes(int type, int64_t elements) {
  return static_cast<size_t>(elements / type_block_elements(type)) * static_cast<size_t>(type_block_bytes(type));
}

// Block layouts as in ggml-common.h. All fields are 1- or 2-byte aligned, so the structs have no padding and can be
// read straight out of a GGUF file's bytes (which are only guaranteed to be 2-byte aligned per block).
constexpr int kQK8_0 = 32;
struct BlockQ8_0 {
  uint16_t d;  // f16 scale
  int8_t qs[kQK8_0];
};
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block is 34 bytes");

constexpr int kQK4_0 = 32;
struct BlockQ4_0 {
  uint16_t d;                // f16 scale
  uint8_t qs[kQK4_0 / 2];    // low nibbles: elements 0..15, high nibbles: 16..31; value = (q - 8) * d
};
static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block is 18 bytes");

struct BlockQ4_1 {
  uint16_t d;                // f16 scale
  uint16_t m;                // f16 offset
  uint8_t qs[kQK4_0 / 2];    // as Q4_0's nibbles; value = q * d + m
};
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block is 20 bytes");

struct BlockQ5_0 {
  uint16_t d;                // f16 scale
  uint8_t qh[4];             // bit j of the little-endian u32: fifth bit of element j
  uint8_t qs[kQK4_0 / 2];    // low 4 bits as Q4_0's nibbles; value = (q - 16) * d
};
static_assert(sizeof(BlockQ5_0) == 22, "Q5_0 block is 22 bytes");

struct BlockQ5_1 {
  uint16_t d;                // f16 scale
  uint16_t m;                // f16 offset
  uint8_t qh[4];             // as Q5_0
  uint8_t qs[kQK4_0 / 2];    // as Q5_0; value = q * d + m
};
static_assert(sizeof(BlockQ5_1) == 24, "Q5_1 block is 24 bytes");

// The 32 levels (0..31) of a Q5_0 / Q5_1 block, element order, from its qh and qs.
inline void q5_levels(const uint8_t* qh_bytes, const uint8_t* qs, int* q) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int i = 0; i < 16; ++i) {
    q[i] = (qs[i] & 0xF) | static_cast<int>(((qh >> i) & 1) << 4);
    q[i + 16] = (qs[i] >> 4) | static_cast<int>(((qh >> (i + 16)) & 1) << 4);
  }
}

constexpr int kQK_K = 256;
struct BlockQ4_K {
  uint16_t d;         // f16 super-block scale of the 6-bit sub-block scales
  uint16_t dmin;      // f16 super-block scale of the 6-bit sub-block mins
  uint8_t scales[12]; // 8 scales and 8 mins, 6 bits each
  uint8_t qs[kQK_K / 2];
};
static_assert(sizeof(BlockQ4_K) == 144, "Q4_K block is 144 bytes");

struct BlockQ5_K {
  uint16_t d;             // f16 super-block scale of the 6-bit sub-block scales
  uint16_t dmin;          // f16 super-block scale of the 6-bit sub-block mins
  uint8_t scales[12];     // as Q4_K
  uint8_t qh[kQK_K / 8];  // bit s of qh[l]: fifth bit of element l of sub-block s
  uint8_t qs[kQK_K / 2];  // low 4 bits, as Q4_K's nibbles
};
static_assert(sizeof(BlockQ5_K) == 176, "Q5_K block is 176 bytes");

// The fifth-bit plane of a Q4_K / Q5_K block: Q5_K is Q4_K plus this plane, so one decoder serves both, taking
// the plane when there is one (null for Q4_K).
inline const uint8_t* k4_high_bits(const BlockQ4_K&) { return nullptr; }
inline const uint8_t* k4_high_bits(const BlockQ5_K& b) { return b.qh; }

struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];      // low 4 bits
  uint8_t qh[kQK_K / 4];      // high 2 bits
  int8_t scales[kQK_K / 16];  // one 8-bit scale per 16 elements
  uint16_t d;                 // f16 super-block scale
};
static_assert(sizeof(BlockQ6_K) == 210, "Q6_K block is 210 bytes");

// Q4_K (and Q5_K) pack their eight 6-bit (scale, min) pairs into 12 bytes; j in 0..7.
inline void q4k_scale_min(int j, const uint8_t* q, uint8_t* scale, uint8_t* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Half precision. The scalar conversions are exact IEEE round-to-nearest-even, bit-identical to the F16C
// instructions the SIMD variants use, so every variant writes the same f16 KV cache.
inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F;
  const uint32_t mantissa = h & 0x3FF;
  if (exponent == 0x1F) {  // inf, or nan made quiet as F16C does
    return bits_to_float(sign | 0x7F800000 | (mantissa << 13) | (mantissa ? 0x400000u : 0u));
  }
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24, exact in f32.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

inline uint16_t fp32_to_fp16(float f) {
  const uint32_t x = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7FFFFFFF;
  if (abs >= 0x7F800000) {  // inf stays inf, nan stays a quiet nan with the top mantissa bits
    return static_cast<uint16_t>(sign | 0x7C00 | (abs > 0x7F800000 ? (0x200 | ((abs >> 13) & 0x3FF)) : 0));
  }
  if (abs >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // rounds to >= 65520: overflow to inf
  if (abs < 0x38800000) {
    // Result is subnormal (or zero): scale so the f16 subnormal step 2^-24 becomes 1 and round to nearest even.
    const float magnitude = bits_to_float(abs) * 16777216.0f;  // exact: a power-of-two scale of a small number
    const float rounded = std::nearbyint(magnitude);           // default rounding mode: nearest even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(rounded));
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even (a carry may bump the exponent,
  // which is the correct result).
  uint32_t h = (abs - 0x38000000) >> 13;
  const uint32_t dropped = abs & 0x1FFF;
  if (dropped > 0x1000 || (dropped == 0x1000 && (h & 1))) h += 1;
  return static_cast<uint16_t>(sign | h);
}

inline float bf16_to_fp32(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

// ---------------------------------------------------------------------------------------------------------------
// Small helpers.
inline int64_t div_ceil(int64_t a, int64_t b) { return (a + b - 1) / b; }

// a * b, or false when it does not fit in int64 (sizes computed from caller-given counts: a product that wrapped
// would pass a length check and let an index past the buffer through).
inline bool mul_fits(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

}  // namespace conduit

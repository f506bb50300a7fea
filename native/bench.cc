#include "bench.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "cpu.h"
#include "memory.h"

#if CONDUIT_X86
#include <immintrin.h>
#endif

namespace conduit {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// ---------------------------------------------------------------------------------------------------------------
// Memory

#if CONDUIT_X86
__attribute__((target("avx2"))) uint64_t read_sum_avx2(const uint8_t* p, size_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  return static_cast<uint64_t>(_mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 3));
}

__attribute__((target("avx512f"))) uint64_t read_sum_avx512(const uint8_t* p, size_t bytes) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(p + i + 192));
  }
  const __m512i sum = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(sum));
}
#endif

uint64_t read_sum_generic(const uint8_t* p, size_t bytes) {
  const uint64_t* q = reinterpret_cast<const uint64_t*>(p);
  uint64_t s = 0;
  for (size_t i = 0; i < bytes / 8; ++i) s += q[i];
  return s;
}

struct MemoryJob {
  MemoryKernel kind;
  uint8_t *a, *b, *c;
  size_t bytes;
  int threads;
  Variant variant;
  std::vector<uint64_t> sink;
};

void memory_job(void* p, int t) {
  MemoryJob& j = *static_cast<MemoryJob*>(p);
  // Each thread takes a contiguous, 4 KiB-aligned share.
  const size_t share = (j.bytes / j.threads) & ~static_cast<size_t>(4095);
  const size_t begin = share * t, len = t == j.threads - 1 ? j.bytes - begin : share;
  switch (j.kind) {
    case MemoryKernel::Read:
#if CONDUIT_X86
      j.sink[t] += j.variant >= Variant::Avx512 ? read_sum_avx512(j.a + begin, len)
                   : j.variant == Variant::Avx2   ? read_sum_avx2(j.a + begin, len)
                                                  : read_sum_generic(j.a + begin, len);
#else
      j.sink[t] += read_sum_generic(j.a + begin, len);
#endif
      break;
    case MemoryKernel::Copy:
      std::memcpy(j.c + begin, j.a + begin, len);
      break;
    case MemoryKernel::Triad: {
      float* a = reinterpret_cast<float*>(j.a + begin);
      const float* b = reinterpret_cast<const float*>(j.b + begin);
      const float* c = reinterpret_cast<const float*>(j.c + begin);
      for (size_t i = 0; i < len / 4; ++i) a[i] = b[i] + 3.0f * c[i];
      break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Compute peaks: 12 independent accumulators cover the latency x throughput of FMA / VPDPBUSD on current cores.

constexpr int64_t kPeakIterations = 4000000;

#if CONDUIT_X86
__attribute__((target("avx512f"))) float fma_loop_avx512(int64_t iters) {
  __m512 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j));
  const __m512 m = _mm512_set1_ps(0.999999f), a = _mm512_set1_ps(1e-6f);
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < 12; ++j) acc[j] = _mm512_fmadd_ps(acc[j], m, a);
  }
  float s = 0;
  for (int j = 0; j < 12; ++j) s += _mm512_reduce_add_ps(acc[j]);
  return s;
}

__attribute__((target("avx2,fma"))) float fma_loop_avx2(int64_t iters) {
  __m256 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm256_set1_ps(static_cast<float>(j));
  const __m256 m = _mm256_set1_ps(0.999999f), a = _mm256_set1_ps(1e-6f);
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_fmadd_ps(acc[j], m, a);
  }
  float out[8], s = 0;
  for (int j = 0; j < 12; ++j) {
    _mm256_storeu_ps(out, acc[j]);
    for (float v : out) s += v;
  }
  return s;
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) int32_t vnni_loop_avx512(int64_t iters) {
  __m512i acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm512_set1_epi32(j);
  const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-2);
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < 12; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], u, s);
  }
  int32_t sum = 0;
  for (int j = 0; j < 12; ++j) sum += _mm512_reduce_add_epi32(acc[j]);
  return sum;
}

// Without VNNI an int8 dot product is maddubs (u8 x s8 -> pairs of i16) + madd (-> i32) + add.
__attribute__((target("avx2"))) int32_t maddubs_loop_avx2(int64_t iters) {
  __m256i acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm256_set1_epi32(j);
  const __m256i u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < 12; ++j) {
      acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
    }
  }
  int32_t out[8], sum = 0;
  for (int j = 0; j < 12; ++j) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), acc[j]);
    for (int32_t v : out) sum += v;
  }
  return sum;
}

// The two factors are 1 and 2^-24: every sum changes (nothing to fold away) and stays finite.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) float dpbf16_loop_avx512(int64_t iters) {
  __m512 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j));
  const __m512i one = _mm512_set1_epi16(0x3F80), tiny = _mm512_set1_epi16(0x3380);
  __m512bh a, b;
  std::memcpy(&a, &one, sizeof a);
  std::memcpy(&b, &tiny, sizeof b);
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < 12; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  }
  float s = 0;
  for (int j = 0; j < 12; ++j) s += _mm512_reduce_add_ps(acc[j]);
  return s;
}

void dpbf16_peak_job(void* p, int t) {
  static_cast<std::vector<double>*>(p)->at(t) += dpbf16_loop_avx512(kPeakIterations);
}

struct PeakJob {
  bool int8;
  Variant variant;
  std::vector<double> sink;
};

void peak_job(void* p, int t) {
  PeakJob& j = *static_cast<PeakJob*>(p);
  if (j.int8) {
    j.sink[t] += j.variant >= Variant::Avx512 ? vnni_loop_avx512(kPeakIterations) : maddubs_loop_avx2(kPeakIterations);
  } else {
    j.sink[t] += j.variant >= Variant::Avx512 ? fma_loop_avx512(kPeakIterations) : fma_loop_avx2(kPeakIterations);
  }
}

#endif  // CONDUIT_X86

double peak(ThreadPool& pool, bool int8, Variant v) {
#if CONDUIT_X86
  if (v == Variant::Generic) return 0.0;  // no SIMD: the scalar peak is not a useful roofline
  PeakJob job{int8, v, std::vector<double>(pool.size())};
  const double ops_per_iteration = 12.0 * (v >= Variant::Avx512 ? 16 : 8) * 2.0 * (int8 ? 4 : 1);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto start = Clock::now();
    pool.run_on_all(peak_job, &job);
    const double ops = ops_per_iteration * kPeakIterations * pool.size();
    best = std::max(best, ops / seconds_since(start) / 1e9);
  }
  return best;
#else
  (void)pool, (void)int8, (void)v;
  return 0.0;  // generic kernels only: no SIMD peak to measure
#endif
}

}  // namespace

double memory_bandwidth_gbps(ThreadPool& pool, MemoryKernel kind, size_t bytes, int reps) {
  bytes = (bytes + (2 << 20) - 1) & ~static_cast<size_t>((2 << 20) - 1);
  auto alloc = [&] {
    uint8_t* p = static_cast<uint8_t*>(std::aligned_alloc(2 << 20, bytes));
    if (!p) throw std::bad_alloc();
    return p;
  };
  // Only the arrays the kernel touches: read uses a, copy a and c, triad all three.
  const int arrays_used = kind == MemoryKernel::Read ? 1 : kind == MemoryKernel::Copy ? 2 : 3;
  MemoryJob job{kind, alloc(), arrays_used == 3 ? alloc() : nullptr, arrays_used >= 2 ? alloc() : nullptr, bytes,
                pool.size(), best_supported_variant(), std::vector<uint64_t>(pool.size())};
  for (uint8_t* p : {job.a, job.b, job.c}) {
    if (!p) continue;
    std::memset(p, 1, bytes);
    advise_huge_pages(p, bytes, true);  // as the model's weights are (see memory.h)
  }
  const double arrays = arrays_used;
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const auto start = Clock::now();
    pool.run_on_all(memory_job, &job);
    best = std::max(best, arrays * static_cast<double>(bytes) / seconds_since(start) / 1e9);
  }
  for (uint8_t* p : {job.a, job.b, job.c}) std::free(p);  // free(nullptr) is a no-op
  return best;
}

double peak_f32_gflops(ThreadPool& pool, Variant variant) { return peak(pool, false, variant); }
double peak_int8_gops(ThreadPool& pool, Variant variant) { return peak(pool, true, variant); }

double peak_bf16_gflops(ThreadPool& pool, Variant variant) {
  if (static_cast<int>(variant) < static_cast<int>(Variant::Avx512) || !cpu_features().avx512bf16) return 0.0;
#if CONDUIT_X86
  std::vector<double> sink(pool.size());
  const double ops_per_iteration = 12.0 * 16 * 2 * 2;  // 12 instructions x 16 lanes x 2 multiply-adds x 2
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto start = Clock::now();
    pool.run_on_all(dpbf16_peak_job, &sink);
    best = std::max(best, ops_per_iteration * kPeakIterations * pool.size() / seconds_since(start) / 1e9);
  }
  return best;
#else
  (void)pool;
  return 0.0;
#endif
}

}  // namespace conduit

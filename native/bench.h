// Machine limits measured in the same run as the kernel benchmarks, for roofline percentages.
#pragma once

#include <cstddef>

#include "common.h"
#include "thread_pool.h"

namespace conduit {

// STREAM-like: `read` sums an array (what a weight-streaming GEMV does), `copy` is c = a, `triad` is
// a = b + s * c, over arrays on huge pages like the model's weights. Returns the best GB/s over `reps` passes;
// bytes counted as STREAM does (no write-allocate).
enum class MemoryKernel { Read, Copy, Triad };
double memory_bandwidth_gbps(ThreadPool& pool, MemoryKernel kind, size_t bytes_per_array, int reps);

// Independent fused multiply-adds (f32) or int8 dot-product instructions on every thread, with the instructions
// of `variant` (avx512: 512-bit FMA / VPDPBUSD; avx2: 256-bit FMA / VPMADDUBSW+VPMADDWD; generic: 0, no
// meaningful peak). GFLOP/s counting a multiply-add as 2 operations.
double peak_f32_gflops(ThreadPool& pool, Variant variant);
double peak_int8_gops(ThreadPool& pool, Variant variant);
// VDPBF16PS (32 bf16 multiply-adds into 16 f32 lanes) on every thread, for the variants from avx512 up on a CPU with
// AVX512-BF16; 0 elsewhere (no such instruction). GFLOP/s counting a multiply-add as 2 operations.
double peak_bf16_gflops(ThreadPool& pool, Variant variant);

}  // namespace conduit

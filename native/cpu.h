// What the CPU supports, read once with CPUID/XGETBV (the OS must also save the wider registers).
#pragma once

#include "common.h"

namespace conduit {

struct CpuFeatures {
  // CPUID's vendor is GenuineIntel. The int8 decode kernels' software prefetch is chosen by it (see
  // decode_prefetch_ahead): the evidence for and against it came from one Intel and one AMD machine.
  bool intel = false;
  bool sse42 = false, pclmulqdq = false;  // the crc32 and 128-bit carry-less multiply instructions (checksum.cc)
  bool vpclmulqdq = false;                // carry-less multiply on ymm (and, with avx512f, zmm) registers
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512vnni = false, avx512bf16 = false;
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;  // AMX-TILE + AMX-INT8 (with permission): amx variant
  // Linux lets a process use AMX tile data only after asking (arch_prctl); asked once at detection when the CPU
  // has AMX. amx_status says how that went ("no AMX on this CPU", "granted", or why not).
  bool amx_permitted = false;
  const char* amx_status = "no AMX on this CPU";
};

const CpuFeatures& cpu_features();

// Whether the avx512 decode kernels of packed Q8_0, Q4_0 and Q4_K weights (one or two activation rows) request the
// lines a few KiB ahead into L2 themselves. On a Xeon (Sapphire Rapids class, 2 vCPUs) that had left them to the
// hardware prefetchers, the requests made a 110M model's decode step 10-37% shorter (Q4_K_M and Q8_0, one or two
// threads, quiet), and a 1B model's by 29% (Q4_K_M, 645 MB) and 10% (Q8_0, 1.2 GB: mostly from DRAM). On an AMD EPYC
// the same requests made Q4_K decode from DRAM slower (16-18 GB/s against 21 on one thread), and Q8_0 streamed at
// the read rate without them. So: on Intel CPUs. (Q5_K and Q6_K, dearer per line, request them on every CPU.)
bool decode_prefetch_ahead();

// The highest variant this CPU runs: amx needs avx512's features plus AMX-TILE and AMX-INT8 with Linux's tile-data
// permission granted, avx512 needs F+BW+VL+VNNI, avx2 needs AVX2+FMA+F16C.
Variant best_supported_variant();

// Whether this CPU can run the variant: one of the ordered variants up to the best, or amx-model where avx512 runs.
bool variant_supported(Variant v);

}  // namespace conduit

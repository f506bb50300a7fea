// What the CPU supports, read once with CPUID/XGETBV (the OS must also save the wider registers).
#pragma once

#include "common.h"

namespace conduit {

struct CpuFeatures {
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

// The highest variant this CPU runs: amx needs avx512's features plus AMX-TILE and AMX-INT8 with Linux's tile-data
// permission granted, avx512 needs F+BW+VL+VNNI, avx2 needs AVX2+FMA+F16C.
Variant best_supported_variant();

// Whether this CPU can run the variant: one of the ordered variants up to the best, or amx-model where avx512 runs.
bool variant_supported(Variant v);

}  // namespace conduit

// Paged attention for AVX2: attention_simd.h over the Avx2 vector traits.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace conduit {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "simd_avx2.h"
#include "ops_simd.h"
#include "attention_simd.h"
#pragma GCC pop_options

}  // namespace

void register_attention_avx2(KernelTable& t) {
  t.attention_chunks = simd_attention_chunks<Avx2>;
  t.attention_merge = simd_attention_merge<Avx2>;
  t.names["attention"] = "avx2";
}

}  // namespace conduit

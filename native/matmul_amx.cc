// The amx variant: the Q8_0 / Q4_0 matmul of matmul_amx_impl.h on the real tile instructions (AMX-TILE +
// AMX-INT8), for 16 rows or more; fewer rows and every other kernel are the avx512 variant's. Chosen only on CPUs
// with AMX-INT8 whose Linux granted this process tile data (cpu.cc). The same kernel source runs over the software
// model in matmul_amx_model.cc, which is how it is tested on machines without AMX.
#include <immintrin.h>

#include "amx_tile_model.h"
#include "kernels.h"

namespace conduit {
namespace {

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

// The tile instructions. GCC's _tile_loadd / _tile_stored / _tile_zero / _tile_dpbsud macros paste their tile
// arguments into the assembly text, so they accept only literal numbers, not template parameters, and
// _tile_loadconfig declares only 8 of the 64 bytes it reads as an input; these emit the same instructions with the
// tile number as an immediate operand and the whole configuration as the memory input. Loads and stores clobber
// memory: the compiler must finish the stores a tile reads (the Q4_0 expansion, packed scratch) before it, and
// reload what a tile store wrote.
struct AmxTiles {
  static void load_config(const AmxTileConfig& config) { __asm__ volatile("ldtilecfg %0" ::"m"(config)); }
  template <int T>
  static void zero() {
    __asm__ volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int C, int A, int B>
  static void dpbsud() {
    __asm__ volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
  static void release() { _tile_release(); }
};

#include "matmul_amx_impl.h"

#pragma GCC pop_options

template <int Type>
MatmulKernel amx_kernel(const MatmulKernel& base) {
  amx_fallback[Type == kQ8_0 ? 0 : 1] = {base.tile, base.packed_tile, base.pack, base.packed_bytes, base.scratch_bytes};
  MatmulKernel k = base;  // the avx512 activation format, packed layout and packing
  k.scratch_bytes = amx_scratch_bytes<Type>;
  k.tile = amx_tile<AmxTiles, Type>;
  k.packed_tile = amx_packed_tile<AmxTiles, Type>;
  return k;
}

}  // namespace

void register_matmul_amx(KernelTable& t) {
  t.matmul[kQ8_0] = amx_kernel<kQ8_0>(t.matmul[kQ8_0]);
  t.matmul[kQ4_0] = amx_kernel<kQ4_0>(t.matmul[kQ4_0]);
  t.names["matmul_q8_0"] = "amx";
  t.names["matmul_q4_0"] = "amx";
}

}  // namespace conduit

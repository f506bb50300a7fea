// The amx-model variant: the amx kernel source (matmul_amx_impl.h) built over the software model of the tile
// instructions (amx_tile_model.h) instead of the instructions themselves. It runs on any CPU the avx512 variant
// runs on, so the kernel's use of the tiles (configurations, strides, operand layouts, the scaling after each
// block) is checked bit for bit against the avx512 kernels on machines without AMX. A verification aid: slow, and
// never chosen unless asked for by name.
#include <immintrin.h>

#include "amx_tile_model.h"
#include "kernels.h"

namespace conduit {
namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

// Each thread has its own tile state, as each logical processor does.
AmxTileModel& tile_state() {
  thread_local AmxTileModel state;
  return state;
}

struct AmxModelTiles {
  static void load_config(const AmxTileConfig& config) { tile_state().ldtilecfg(&config); }
  template <int T>
  static void zero() {
    tile_state().tilezero(T);
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
    tile_state().tileloadd(T, base, stride);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    tile_state().tilestored(T, base, stride);
  }
  template <int C, int A, int B>
  static void dpbsud() {
    tile_state().tdpbsud(C, A, B);
  }
  static void release() { tile_state().tilerelease(); }
};

#include "matmul_amx_impl.h"

#pragma GCC pop_options

template <int Type>
MatmulKernel amx_model_kernel(const MatmulKernel& base) {
  amx_fallback[Type == kQ8_0 ? 0 : 1] = {base.tile, base.packed_tile, base.pack, base.packed_bytes, base.scratch_bytes};
  MatmulKernel k = base;
  k.scratch_bytes = amx_scratch_bytes<Type>;
  k.tile = amx_tile<AmxModelTiles, Type>;
  k.packed_tile = amx_packed_tile<AmxModelTiles, Type>;
  return k;
}

}  // namespace

void register_matmul_amx_model(KernelTable& t) {
  t.matmul[kQ8_0] = amx_model_kernel<kQ8_0>(t.matmul[kQ8_0]);
  t.matmul[kQ4_0] = amx_model_kernel<kQ4_0>(t.matmul[kQ4_0]);
  t.names["matmul_q8_0"] = "amx-model";
  t.names["matmul_q4_0"] = "amx-model";
}

}  // namespace conduit
